// Fire-and-forget Prefetch calls to the workers: the shadow (and main, for random prediction) tells the workers
// of a layer's group which experts to load, without waiting for the loads. Each prediction becomes one Prefetch
// per worker of the group that gets an expert (Placement::Assign over main's membership, the same function main
// uses), sent with the gRPC callback API so the sender never blocks on a worker.
//
// Bounds: a worker serves each Prefetch on one of its few RPC threads, held while the call waits for the loads
// before it (the worker loads one prediction at a time), and a worker out of threads refuses main's
// ComputeExperts too. So each worker has at most `max_in_flight` calls of this sender outstanding; further
// calls wait in the worker's queue of at most `max_queued`, sent in order as earlier ones complete. Full, it
// drops its oldest call (the prediction main will reach first, the likeliest to be late); a call that found the
// worker unreachable or timed out drops the calls queued behind it (each would wait out its deadline too), one
// the worker refused (no room yet, an older epoch) does not.
// Dropped calls were never sent: main loads those experts on demand.
//
// Thread safety: Send may be called from several threads; Drain waits for every call sent or queued so far.
// The destructor drains.
#pragma once

#include <cstdint>
#include <deque>
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
  // Per worker: calls outstanding at once, and calls waiting behind them. Two in flight keep a worker's next
  // prediction waiting at the worker while it loads the current one.
  int max_in_flight = 2;
  int max_queued = 32;
};

struct PrefetchSenderStats {
  uint64_t calls = 0;        // Prefetch calls sent
  uint64_t failures = 0;     // of which failed (worker unreachable, refused for want of room, ...)
  uint64_t late = 0;         // of which the worker found late (main had already asked for the layer)
  uint64_t hedge_calls = 0;  // of `calls`, calls carrying hedged experts (PrefetchRequest.hedge)
  uint64_t hedge_loads = 0;  // loads the workers started for those (their `accepted`, once the call completed)
  uint64_t dropped = 0;      // calls never sent: dropped from a full queue, or queued behind an unanswered call
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
  // Waits until every call sent (or queued) before it was called has completed or been dropped (calls other
  // threads send meanwhile are not waited for, so a steady stream of predictions cannot hold it up).
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
  struct WorkerQueue {
    int in_flight = 0;                          // calls started and not yet completed
    std::deque<std::unique_ptr<Call>> waiting;  // calls not yet started, in order of sending
  };

  // `call` takes one of its worker's slots (counted as sent); the caller starts it once mu_ is released.
  Call* TakeSlot(WorkerQueue& queue, std::unique_ptr<Call> call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Issues `call`, which holds a slot (taken over; freed when it completes).
  void Start(Call* call);
  // The completion of `call`: its stats, then the worker's next queued call (returned, to be started by the
  // caller once mu_ is released), or, when the worker did not answer, the queued calls dropped.
  Call* Complete(Call* call, const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets a call that will never be sent.
  void Drop(std::unique_ptr<Call> call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Placement base_;  // every worker a member
  const PrefetchSenderOptions options_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;

  mutable absl::Mutex mu_;
  Placement placement_ ABSL_GUARDED_BY(mu_);
  MembershipView view_ ABSL_GUARDED_BY(mu_);  // epoch 0 until main's first view
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> in_flight_ ABSL_GUARDED_BY(mu_);     // the sequence numbers of the calls queued or outstanding
  std::vector<WorkerQueue> queues_ ABSL_GUARDED_BY(mu_);  // per worker
  PrefetchSenderStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odmoe::rpc
