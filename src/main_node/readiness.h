// Main's readiness (grpc.health.v1 service "odmoe.ready"): main can answer a request only when every sparse
// layer has an owner it can reach. With failover (src/main_node/membership.h, Placement::Without) any worker
// can take any layer's experts, so a layer's owners are every worker, and main stays ready, degraded, while at
// least one worker answers; it turns NOT_SERVING when none does, naming the layers and the workers.
// Liveness is not this: main serves (and answers health checks) while it waits for its workers.
//
// At start-up main waits for the whole cluster: it is not ready until every peer (each worker and the shadow)
// has answered (so `odmoe cluster up` returns a complete cluster whose first requests are followed), or until
// the start-up grace (the cluster's startup_timeout_ms) has passed with at least one worker up; from then on
// it serves degraded.
//
// ReadinessWatch follows main's verdict on each worker (PeerHealth) and reports each change of readiness (or of
// the set of unreachable workers) to a callback (main.cc marks its health service and tells systemd's
// STATUS=), within PeerHealth's detection time, and back again by itself.
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
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "src/common/cluster_config.h"
#include "src/common/placement.h"
#include "src/main_node/peer_health.h"
#include "src/model/model_config.h"

namespace odmoe {

struct ReadinessVerdict {
  bool ready = false;
  // One line: "every sparse layer has a reachable owner (N workers)" (with ", M unreachable: w1 (...)" when
  // degraded) or which layers cannot be served and which workers were not reached, with why ("sparse layers
  // 0-3 have no reachable owner: w1 (...); w2 (...)").
  std::string reason;
  std::vector<int32_t> unreachable;  // workers not reached (or not ready), ascending
};
// The verdict for one probe round: `owners[s]` are the workers that can serve sparse layer s; `probes[w]` is
// OK when worker w answered ready. A layer is served while one of its owners is.
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

  // Main's watch for a cluster file and model: every worker owns every sparse layer (failover), worker i =
  // peer i of `health`. Errors are Placement::ForCluster's (the cluster's layout is checked).
  static absl::StatusOr<std::unique_ptr<ReadinessWatch>> ForCluster(const ClusterConfig& cluster,
                                                                    const ModelConfig& model, PeerHealth& health,
                                                                    Report report);
  // REQUIRES: every owner index < names.size() <= health.size(); `health` outlives the watch. `startup_grace`:
  // how long main waits for every worker before it serves without some (zero: it never waits).
  ReadinessWatch(std::vector<std::vector<int32_t>> owners, std::vector<std::string> names, PeerHealth& health,
                 Report report, absl::Duration startup_grace = absl::ZeroDuration());
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
  const absl::Time grace_ends_;
  int64_t subscription_ = 0;
  // Judges once more when the start-up grace ends (no PeerHealth event may come then).
  absl::Notification stop_;
  std::thread grace_timer_;

  absl::Mutex judge_mu_;  // one judgement and report at a time; before mu_
  mutable absl::Mutex mu_;
  bool reported_ ABSL_GUARDED_BY(mu_) = false;  // a verdict was reported
  bool whole_once_ ABSL_GUARDED_BY(mu_) = false;  // every worker has been up at once (start-up is over)
  ReadinessVerdict verdict_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odmoe
