#include "src/rpc/daemon.h"

#include <signal.h>

#include <cstdio>
#include <optional>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "src/common/flags.h"
#include "src/common/logging.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/version.h"
#include "src/rpc/systemd_notify.h"
#include "src/rpc/library_logs.h"
#include "src/rpc/security.h"

namespace odmoe::rpc {

absl::StatusOr<DaemonArgs> ParseDaemonArgs(const std::vector<std::string>& args, NodeRole role) {
  ODMOE_ASSIGN_OR_RETURN(
      Flags f, Flags::Parse(args,
                            {"config", "node", "model", "ablation-case", "prediction", "shadow-quant", "align-token",
                             "align-kv", "max-lead-tokens", "log-format", "keep-router", "keep-attention",
                             "hedge-margin"},
                            {}));
  ODMOE_ASSIGN_OR_RETURN(std::string config_path, f.Required("config"));
  ODMOE_ASSIGN_OR_RETURN(std::string node_name, f.Required("node"));
  logging::SetNode(node_name);
  DaemonArgs d;
  ODMOE_ASSIGN_OR_RETURN(d.cluster, LoadClusterConfig(config_path));
  const NodeConfig* self = d.cluster.Find(node_name);
  if (self == nullptr) {
    return absl::InvalidArgumentError(StrCat("--node: no node named '", node_name, "' in ", config_path));
  }
  if (self->role != role) {
    return absl::InvalidArgumentError(StrCat("--node: node '", node_name, "' in ", config_path, " has role ",
                                             NodeRoleName(self->role), ", not ", NodeRoleName(role)));
  }
  d.self = *self;
  ODMOE_ASSIGN_OR_RETURN(std::shared_ptr<const Security> security, Security::ForNode(d.cluster, d.self));
  InstallProcessSecurity(security);
  if (security->tls() || security->has_token()) {
    spdlog::info("node {}: {}{}", node_name, security->tls() ? "mutual TLS" : "plaintext",
                 security->has_token() ? ", client token required" : "");
  }
  ShadowOverrides overrides{f.Get("ablation-case"), f.Get("prediction"), f.Get("shadow-quant"),
                            f.Get("align-token"),   f.Get("align-kv"),   f.Get("max-lead-tokens"),
                            f.Get("keep-router"),   f.Get("keep-attention"), f.Get("hedge-margin")};
  ODMOE_RETURN_IF_ERROR(ApplyShadowOverrides(overrides, d.cluster.shadow() != nullptr, &d.cluster.shadow_settings));
  d.model_dir = f.Get("model").value_or(d.cluster.model.path);
  if (d.model_dir.empty() && !d.cluster.model.is_synthetic()) {
    return absl::InvalidArgumentError(
        StrCat("no model: give --model DIR or [model] path (or synthetic) in ", config_path));
  }
  return d;
}

namespace {
sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}
}  // namespace

void BlockShutdownSignals() {
  sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void ServeUntilSignal(Server& server, Readiness readiness, int64_t shutdown_timeout_ms,
                      const std::function<void(absl::Time deadline)>& on_signal) {
  const sigset_t set = ShutdownSignals();
  server.MarkLive(true);
  if (readiness == Readiness::kWhenListening) server.MarkReady(true);
  spdlog::info("node {} (odmoe {}) live on {}{}", server.node(), BuildVersion(), server.address(),
               readiness == Readiness::kWhenListening ? " and ready" : "");
  systemd::NotifyReady(StrCat("serving ", server.address()));
  const std::optional<absl::Duration> ping = systemd::WatchdogPingInterval();
  while (true) {
    int sig = 0;
    if (!ping.has_value()) {
      if (sigwait(&set, &sig) == 0) break;
      continue;
    }
    const timespec timeout = absl::ToTimespec(*ping);
    sig = sigtimedwait(&set, nullptr, &timeout);
    if (sig > 0) break;
    // Timed out (or interrupted): the loop is alive.
    systemd::NotifyWatchdog();
  }
  systemd::NotifyStopping();
  spdlog::info("node {}: shutting down; calls in flight get {} ms to finish", server.node(), shutdown_timeout_ms);
  if (on_signal) on_signal(absl::Now() + absl::Milliseconds(shutdown_timeout_ms));
  // NOT_SERVING for good and, right after, the port closed and new calls refused; then the drain.
  server.Shutdown(shutdown_timeout_ms);
}

int ExitWith(const std::string& program, const absl::Status& status) {
  if (status.ok()) return kExitOk;
  spdlog::error("{}: {}", program, std::string(status.message()));
  spdlog::default_logger()->flush();
  return ExitCodeFor(status);
}

int RunDaemon(const std::string& program, const std::vector<std::string>& args,
              const std::function<absl::Status(const std::vector<std::string>&)>& serve) {
  absl::StatusOr<logging::LogFormat> format = logging::LogFormatFromArgs(args);
  logging::Setup(program, format.ok() ? *format : logging::LogFormat::kText);
  if (!format.ok()) return ExitWith(program, format.status());
  RouteLibraryLogsToSpdlog();
  return ExitWith(program, serve(args));
}

void FillMembership(const ClusterConfig& cluster, const std::string& self, const std::string& fingerprint,
                    v1::Membership* out) {
  out->set_epoch(cluster.epoch);
  out->set_model_fingerprint(fingerprint);
  out->set_self(self);
  for (const NodeConfig& n : cluster.nodes) {
    v1::NodeInfo* info = out->add_nodes();
    info->set_name(n.name);
    info->set_role(std::string(NodeRoleName(n.role)));
    info->set_address(n.address);
    info->set_device(n.device);
    info->set_gpu_budget_bytes(n.gpu_budget_bytes);
  }
}

}  // namespace odmoe::rpc
