// The start-up every daemon shares: `--config FILE --node NAME [--model DIR]`, the cluster file read and the
// node found in it, and serving until SIGINT/SIGTERM (with systemd's notify protocol and watchdog).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/common/cluster_config.h"
#include "src/rpc/rpc_util.h"

namespace odmoe::rpc {

struct DaemonArgs {
  ClusterConfig cluster;
  NodeConfig self;
  std::string model_dir;  // --model, else the cluster file's [model] path
};

// Parses the daemon flags and loads the cluster file. `role` is the role the node must have in the file.
// Installs the node's credentials as the process's (rpc::Security::ForNode: [tls], [auth]), so every channel
// and server made afterwards uses them.
// InvalidArgument (usage) / NotFound / DataLoss with a message naming the flag, file or field.
absl::StatusOr<DaemonArgs> ParseDaemonArgs(const std::vector<std::string>& args, NodeRole role);

// Blocks SIGINT and SIGTERM in the calling thread and every thread it starts later. Call it first in main(),
// before any gRPC object exists, so that the signals reach ServeUntilSignal and nowhere else.
void BlockShutdownSignals();

// Who decides the daemon's readiness (grpc.health.v1 "odmoe.ready").
enum class Readiness {
  kWhenListening,     // ready as soon as it serves: its weights are loaded before its server starts
  kReportedByDaemon,  // the daemon marks it itself (main: src/main_node/readiness.h)
};

// The serving loop: marks the server live (and ready, for kWhenListening), tells systemd READY=1 (this daemon
// has loaded its weights and listens, whatever the rest of the cluster does), pings systemd's watchdog at half
// its WatchdogSec while it waits for SIGINT or SIGTERM. Then, at once: readiness and liveness NOT_SERVING,
// systemd STOPPING=1, the listening port closed and new calls refused (UNAVAILABLE, or CANCELLED by gRPC on a
// connection opened before); calls in flight get `shutdown_timeout_ms` ([cluster] shutdown_timeout_ms) to
// finish, after which they are cancelled. `on_signal` (optional) runs first, with the drain's deadline, for what
// else the daemon serves (main's HTTP API closes its port there and drains after this returns, to the same
// deadline). Returns when the server has stopped (the daemon then exits 0). Outside systemd the notifications do
// nothing.
// REQUIRES: BlockShutdownSignals() was called before any thread was started.
void ServeUntilSignal(Server& server, Readiness readiness = Readiness::kWhenListening,
                      int64_t shutdown_timeout_ms = 10000,
                      const std::function<void(absl::Time deadline)>& on_signal = nullptr);

// Turns a failure into one log line "PROGRAM: message" (through the default logger, so in the daemon's log
// format) and returns the exit code of the status (0 for OK).
int ExitWith(const std::string& program, const absl::Status& status);

// A daemon's main() after BlockShutdownSignals: sets up its logger (`--log-format text|json` in `args`, text by
// default; a bad value exits with usage), routes libprotobuf's and gRPC's logs into it, runs `serve(args)` and
// returns ExitWith's code. ParseDaemonArgs accepts --log-format and names the node in the log (json "node").
int RunDaemon(const std::string& program, const std::vector<std::string>& args,
              const std::function<absl::Status(const std::vector<std::string>&)>& serve);

// Fills `out` with the cluster's membership as node `self` sees it (every daemon's GetMembership).
void FillMembership(const ClusterConfig& cluster, const std::string& self, const std::string& fingerprint,
                    v1::Membership* out);

}  // namespace odmoe::rpc
