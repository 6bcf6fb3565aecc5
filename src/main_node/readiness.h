// Main's readiness (grpc.health.v1 service "odmoe.ready"): main can answer a request only when, under the
// current placement (src/common/placement.h), every sparse layer's experts have an owner it can reach. For
// each sparse layer the owners are the workers a request may send it to: every worker of its decode group
// (an expert set is spread one-to-one over the group) and, for prefill, worker (e mod N_W) of every expert e.
// Liveness is not this: main serves (and answers health checks) while it waits for its workers.
//
// ReadinessProber checks the workers in the background, period after period, and reports each change to a
// callback (main.cc marks its health service and tells systemd's STATUS=), so main turns NOT_SERVING when a
// worker dies and SERVING again when it returns, by itself. The default probe asks each worker's own
// "odmoe.ready" over grpc.health.v1, all workers at once with a short deadline, on channels made once
// (rpc::MakeChannel: the same connections as main's expert calls).
//
// Thread safety: the prober owns one thread, started by Start and joined by Stop (or the destructor); the
// probe and the report run on it. ready()/reason() may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/common/cluster_config.h"
#include "src/common/placement.h"
#include "src/model/model_config.h"

namespace odmoe {

// For each sparse layer (0..num_sparse-1), the workers it may need under `placement`, ascending.
std::vector<std::vector<int32_t>> SparseLayerOwners(const Placement& placement, int64_t num_sparse,
                                                    int64_t num_experts);

struct ReadinessVerdict {
  bool ready = false;
  // One line: "every sparse layer has a reachable owner (N workers)" or which layers cannot be served and
  // which workers were not reached, with why ("sparse layers 0-3 have an unreachable owner: w1 (...)").
  std::string reason;
  std::vector<int32_t> unreachable;  // workers not reached (or not ready), ascending
};
// The verdict for one probe round: `probes[w]` is OK when worker w answered ready.
// REQUIRES: probes.size() == names.size(); every owner index < probes.size().
ReadinessVerdict JudgeReadiness(const std::vector<std::vector<int32_t>>& owners, const std::vector<std::string>& names,
                                const std::vector<absl::Status>& probes);

struct ReadinessOptions {
  absl::Duration period = absl::Seconds(1);  // between the starts of two rounds
  // Each worker's health check. Generous: a busy host (a worker loading experts, a sanitizer build) must not
  // make main flap to NOT_SERVING; a dead worker still fails at once (connection refused).
  int64_t probe_timeout_ms = 2000;
};

class ReadinessProber {
 public:
  // One round's probes: a status per worker (index = worker index), OK when the worker is ready.
  using Probe = std::function<std::vector<absl::Status>()>;
  // Called with every change of the verdict, and once after the first round.
  using Report = std::function<void(const ReadinessVerdict&)>;

  // Main's prober for a cluster file and model: owners from the cluster's placement, probes over
  // grpc.health.v1 to each worker's address. Errors are Placement::ForCluster's.
  static absl::StatusOr<std::unique_ptr<ReadinessProber>> ForCluster(const ClusterConfig& cluster,
                                                                     const ModelConfig& model, Report report,
                                                                     ReadinessOptions options = {});
  // A prober over any probe (tests). REQUIRES: every owner index < names.size().
  ReadinessProber(std::vector<std::vector<int32_t>> owners, std::vector<std::string> names, Probe probe, Report report,
                  ReadinessOptions options);
  ~ReadinessProber();
  ReadinessProber(const ReadinessProber&) = delete;
  ReadinessProber& operator=(const ReadinessProber&) = delete;

  // Starts the background thread (the first round runs at once). REQUIRES: not started before.
  void Start();
  // Stops and joins the thread; the report is not called after Stop returns. Idempotent.
  void Stop();

  bool ready() const;
  std::string reason() const;

 private:
  void Loop();
  void RunRound();

  const std::vector<std::vector<int32_t>> owners_;
  const std::vector<std::string> names_;
  const Probe probe_;
  const Report report_;
  const ReadinessOptions options_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool reported_ ABSL_GUARDED_BY(mu_) = false;  // a verdict was reported
  ReadinessVerdict verdict_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odmoe
