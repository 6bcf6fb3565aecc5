// Main's readiness (grpc.health.v1 service "odmoe.ready"): main can answer a request only when, under the
// current placement (src/common/placement.h), every sparse layer's experts have an owner it can reach. For
// each sparse layer the owners are the workers a request may send it to: every worker of its decode group
// (an expert set is spread one-to-one over the group) and, for prefill, worker (e mod N_W) of every expert e.
// Liveness is not this: main serves (and answers health checks) while it waits for its workers.
//
// ReadinessWatch follows main's verdict on each worker (PeerHealth) and reports each change of readiness to a
// callback (main.cc marks its health service and tells systemd's STATUS=), so main turns NOT_SERVING within
// PeerHealth's detection time when a worker dies, hangs or is cut off, and SERVING again when it returns, by
// itself.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/common/cluster_config.h"
#include "src/common/placement.h"
#include "src/main_node/peer_health.h"
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

// Follows main's PeerHealth (src/main_node/peer_health.h: health checks, keepalive, the outcome of every
// expert call) and judges readiness again at each change of a worker's state, reporting every change of the
// verdict to a callback, and the first verdict once every worker has one.
//
// Thread safety: the report runs on the thread that delivered the PeerHealth event (or the constructor's), one
// at a time; ready()/reason() may be called from any thread.
class ReadinessWatch {
 public:
  using Report = std::function<void(const ReadinessVerdict&)>;

  // Main's watch for a cluster file and model: owners from the cluster's placement, worker i = peer i of
  // `health`. Errors are Placement::ForCluster's.
  static absl::StatusOr<std::unique_ptr<ReadinessWatch>> ForCluster(const ClusterConfig& cluster,
                                                                    const ModelConfig& model, PeerHealth& health,
                                                                    Report report);
  // REQUIRES: every owner index < names.size() <= health.size(); `health` outlives the watch.
  ReadinessWatch(std::vector<std::vector<int32_t>> owners, std::vector<std::string> names, PeerHealth& health,
                 Report report);
  ~ReadinessWatch();
  ReadinessWatch(const ReadinessWatch&) = delete;
  ReadinessWatch& operator=(const ReadinessWatch&) = delete;

  bool ready() const;
  std::string reason() const;

 private:
  void Judge();

  const std::vector<std::vector<int32_t>> owners_;
  const std::vector<std::string> names_;
  PeerHealth& health_;
  const Report report_;
  int64_t subscription_ = 0;

  absl::Mutex judge_mu_;  // one judgement and report at a time; before mu_
  mutable absl::Mutex mu_;
  bool reported_ ABSL_GUARDED_BY(mu_) = false;  // a verdict was reported
  ReadinessVerdict verdict_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odmoe
