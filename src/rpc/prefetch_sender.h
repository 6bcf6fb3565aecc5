// Fire-and-forget Prefetch calls to the workers: the shadow (and main, for random prediction) tells the workers
// of a layer's group which experts to load, without waiting for the loads. Each prediction becomes one Prefetch
// per worker of the group that gets an expert (Placement::Assign over main's membership, the same function main
// uses), sent with the gRPC callback API so the sender never blocks on a worker.
//
// Thread safety: Send may be called from several threads; Drain waits for every call sent so far. The
// destructor drains.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/common/placement.h"

namespace odmoe::rpc {

struct PrefetchSenderOptions {
  uint64_t epoch = 1;
  std::string fingerprint;
  std::string sender;
  int64_t rpc_timeout_ms = 30000;
};

struct PrefetchSenderStats {
  uint64_t calls = 0;        // Prefetch calls sent
  uint64_t failures = 0;     // of which failed (worker unreachable, refused for want of room, ...)
  uint64_t late = 0;         // of which the worker found late (main had already asked for the layer)
  uint64_t hedge_calls = 0;  // of `calls`, calls carrying hedged experts (PrefetchRequest.hedge)
  uint64_t hedge_loads = 0;  // loads the workers started for those (their `accepted`, once the call completed)
};

class PrefetchSender {
 public:
  // `workers`: addresses in worker-index order (the cluster file's order).
  PrefetchSender(const std::vector<std::string>& workers, Placement placement, PrefetchSenderOptions options);
  ~PrefetchSender();

  // Sends the prediction `experts` of model layer `layer` (sparse layer `sparse_index`) at decode `position`
  // of request `request_id` to the workers that will serve them, with `trace_id` (the client's request id,
  // rpc/request_id.h; "" for none) as x-request-id metadata. `hedges` (disjoint from `experts`): experts also
  // to load though not predicted (hedged prefetch). The union is placed on the group by Placement::Assign (the
  // rule main's Resolve uses); each worker gets one call for its predicted experts and a second, flagged hedge,
  // for its hedged ones (sent after the first).
  void Send(uint64_t request_id, int64_t position, int64_t layer, int64_t sparse_index,
            std::span<const int32_t> experts, const std::string& trace_id = "", std::span<const int32_t> hedges = {});
  // Waits until every call sent before it was called has completed (calls other threads send meanwhile are not
  // waited for, so a steady stream of predictions cannot hold it up).
  void Drain();
  PrefetchSenderStats stats() const;
  // Main's membership of the workers as the sender last heard it (src/main_node/membership.h): predictions are
  // placed over its members and carry its view, so a worker that has seen a newer epoch refuses them. A view
  // older than the one held is ignored. InvalidArgument for a worker index outside the cluster.
  absl::Status SetMembership(const MembershipView& view);
  // The placement predictions are sent by now.
  Placement placement() const;

 private:
  struct Call;

  const Placement base_;  // every worker a member
  const PrefetchSenderOptions options_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;

  mutable absl::Mutex mu_;
  Placement placement_ ABSL_GUARDED_BY(mu_);
  MembershipView view_ ABSL_GUARDED_BY(mu_);  // epoch 0 until main's first view
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> in_flight_ ABSL_GUARDED_BY(mu_);  // the sequence numbers of the calls not yet completed
  PrefetchSenderStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odmoe::rpc
