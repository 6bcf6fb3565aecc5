#include "src/rpc/prefetch_sender.h"

#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "spdlog/spdlog.h"
#include "src/common/strings.h"
#include "src/rpc/request_id.h"
#include "src/rpc/rpc_util.h"

namespace odmoe::rpc {

struct PrefetchSender::Call {
  grpc::ClientContext context;
  v1::PrefetchRequest request;
  v1::PrefetchResponse response;
  int32_t worker = 0;
  uint64_t sequence = 0;  // its place in the order of sending (Drain)
};

PrefetchSender::PrefetchSender(const std::vector<std::string>& workers, Placement placement,
                               PrefetchSenderOptions options)
    : base_(placement), options_(std::move(options)), placement_(placement), queues_(workers.size()) {
  for (const std::string& address : workers) stubs_.push_back(v1::Worker::NewStub(MakeChannel(address)));
}

absl::Status PrefetchSender::SetMembership(const MembershipView& view) {
  absl::MutexLock lock(&mu_);
  if (view.epoch <= view_.epoch && view_.epoch != 0) return absl::OkStatus();  // not newer
  absl::StatusOr<Placement> placement = base_.Without(view.absent);
  if (!placement.ok()) {
    return absl::InvalidArgumentError(StrCat("membership epoch ", view.epoch, ": ", placement.status().message()));
  }
  placement_ = *std::move(placement);
  view_ = view;
  return absl::OkStatus();
}

Placement PrefetchSender::placement() const {
  absl::MutexLock lock(&mu_);
  return placement_;
}

PrefetchSender::~PrefetchSender() { Drain(); }

void PrefetchSender::Send(uint64_t request_id, int64_t position, int64_t layer, int64_t sparse_index,
                          std::span<const int32_t> experts, const std::string& trace_id,
                          std::span<const int32_t> hedges) {
  std::vector<int32_t> all(experts.begin(), experts.end());
  all.insert(all.end(), hedges.begin(), hedges.end());
  // Per worker, its predicted experts and its hedged ones, each in ascending order.
  std::map<int32_t, std::pair<std::vector<int32_t>, std::vector<int32_t>>> by_worker;
  std::optional<Placement> placement;
  MembershipView view;
  {
    absl::MutexLock lock(&mu_);
    placement = placement_;
    view = view_;
  }
  for (const Assignment& a : placement->Assign(sparse_index, all)) {
    const bool hedge = std::find(hedges.begin(), hedges.end(), a.expert) != hedges.end();
    (hedge ? by_worker[a.worker].second : by_worker[a.worker].first).push_back(a.expert);
  }
  for (const bool hedge : {false, true}) {
    for (auto& [worker, lists] : by_worker) {
      const std::vector<int32_t>& list = hedge ? lists.second : lists.first;
      if (list.empty() || worker < 0 || worker >= static_cast<int32_t>(stubs_.size())) continue;
      auto call = std::make_unique<Call>();
      call->worker = worker;
      FillHeader(call->request.mutable_header(), options_.epoch, options_.fingerprint, options_.sender, request_id,
                 view.epoch != 0 ? &view : nullptr);
      call->request.set_layer(static_cast<int32_t>(layer));
      call->request.set_position(position);
      call->request.set_hedge(hedge);
      for (int32_t e : list) call->request.add_experts(e);
      AttachRequestId(call->context, trace_id);
      Call* start = nullptr;
      {
        absl::MutexLock lock(&mu_);
        call->sequence = next_sequence_++;
        in_flight_.insert(call->sequence);
        WorkerQueue& queue = queues_[static_cast<size_t>(worker)];
        if (queue.in_flight < std::max(1, options_.max_in_flight)) {
          start = TakeSlot(queue, std::move(call));
        } else {
          queue.waiting.push_back(std::move(call));
          if (queue.waiting.size() > static_cast<size_t>(std::max(0, options_.max_queued))) {
            std::unique_ptr<Call> oldest = std::move(queue.waiting.front());
            queue.waiting.pop_front();
            spdlog::debug("prefetch queue of worker {} full: dropped the prediction of layer {} position {}", worker,
                          oldest->request.layer(), oldest->request.position());
            Drop(std::move(oldest));
          }
        }
      }
      if (start != nullptr) Start(start);
    }
  }
}

PrefetchSender::Call* PrefetchSender::TakeSlot(WorkerQueue& queue, std::unique_ptr<Call> call) {
  ++queue.in_flight;
  ++stats_.calls;
  if (call->request.hedge()) ++stats_.hedge_calls;
  return call.release();
}

void PrefetchSender::Start(Call* call) {
  // The deadline runs from the start, not from the queueing.
  SetDeadline(call->context, options_.rpc_timeout_ms);
  auto done = [this, call](grpc::Status status) {
    Call* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      next = Complete(call, status);
    }
    // `next` is still in in_flight_, so Drain (and the destructor) wait for it to be started and complete.
    if (next != nullptr) Start(next);
  };
  stubs_[static_cast<size_t>(call->worker)]->async()->Prefetch(&call->context, &call->request, &call->response,
                                                               std::move(done));
}

PrefetchSender::Call* PrefetchSender::Complete(Call* call, const grpc::Status& status) {
  if (!status.ok()) {
    spdlog::debug("prefetch to worker {} failed: {}", call->worker, status.error_message());
    ++stats_.failures;
  }
  if (status.ok() && call->response.late()) ++stats_.late;
  if (status.ok() && call->request.hedge()) {
    stats_.hedge_loads += static_cast<uint64_t>(std::max(0, call->response.accepted()));
  }
  WorkerQueue& queue = queues_[static_cast<size_t>(call->worker)];
  --queue.in_flight;
  // A worker that is gone or did not answer in time would keep each queued call until its deadline; one that
  // refused this call (no room, an older epoch) may take the next.
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    while (!queue.waiting.empty()) {
      Drop(std::move(queue.waiting.front()));
      queue.waiting.pop_front();
    }
  }
  Call* next = nullptr;
  if (!queue.waiting.empty()) {
    next = TakeSlot(queue, std::move(queue.waiting.front()));
    queue.waiting.pop_front();
  }
  in_flight_.erase(call->sequence);
  // Freed under the lock: Drain cannot return (and the sender die) before this call is gone.
  delete call;
  return next;
}

void PrefetchSender::Drop(std::unique_ptr<Call> call) {
  ++stats_.dropped;
  in_flight_.erase(call->sequence);
}

void PrefetchSender::Drain() {
  absl::MutexLock lock(&mu_);
  const uint64_t sent = next_sequence_;  // calls sent later (by other threads) are not waited for
  auto done = [this, sent]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_.empty() || *in_flight_.begin() >= sent; };
  mu_.Await(absl::Condition(&done));
}

PrefetchSenderStats PrefetchSender::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace odmoe::rpc
