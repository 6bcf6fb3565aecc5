#include "src/main_node/admission.h"

#include <algorithm>

#include "absl/time/clock.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
Admission::Admission(int32_t max_queued, int32_t max_running) : max_queued_(max_queued), max_running_(max_running) {
  ODMOE_CHECK(max_queued >= 0);
  ODMOE_CHECK(max_running >= 1);
}

absl::StatusOr<Admission::Ticket> Admission::Arrive() {
  absl::MutexLock lock(&mu_);
  // Every waiter ahead of the newcomer takes a free running place before it does, so the newcomer has a place
  // only when running + waiting < max_running; past that it must queue, and max_queued may.
  // A yielded ticket counts as waiting: it queues again without this check.
  const int64_t running = static_cast<int64_t>(running_.size());
  const int64_t waiting = static_cast<int64_t>(waiting_.size() + yielded_.size());
  if (running + waiting >= int64_t{max_running_} + max_queued_) {
    return ServerBusyError(StrCat("the server is busy: ", running, running == 1 ? " request" : " requests",
                                  " running (max_running = ", max_running_, ") and ", waiting,
                                  " queued (max_queued = ", max_queued_, "); retry later"));
  }
  const uint64_t id = next_id_++;
  waiting_.push_back(id);
  return Ticket(this, id);
}

int32_t Admission::running() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(running_.size());
}

int32_t Admission::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(waiting_.size());
}

int32_t Admission::yielded() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(yielded_.size());
}

int32_t Admission::tickets() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(running_.size() + waiting_.size() + yielded_.size());
}

void Admission::Leave(uint64_t id) {
  absl::MutexLock lock(&mu_);
  for (std::vector<uint64_t>* list : {&running_, &yielded_}) {
    if (auto it = std::find(list->begin(), list->end(), id); it != list->end()) {
      list->erase(it);
      return;
    }
  }
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
}

void Admission::Yield(uint64_t id) {
  absl::MutexLock lock(&mu_);
  if (auto it = std::find(running_.begin(), running_.end(), id); it != running_.end()) {
    running_.erase(it);
    yielded_.push_back(id);
  }
}

Admission::Ticket::~Ticket() { Leave(); }

void Admission::Ticket::Leave() {
  if (admission_ != nullptr) admission_->Leave(id_);
  admission_ = nullptr;
}

void Admission::Ticket::Yield() {
  if (admission_ != nullptr) admission_->Yield(id_);
}

absl::Status Admission::Ticket::WaitTurn(const StopCheck& stop, absl::Time deadline) {
  ODMOE_CHECK(admission_ != nullptr);
  Admission& a = *admission_;
  {
    absl::MutexLock lock(&a.mu_);
    ODMOE_CHECK(std::find(a.running_.begin(), a.running_.end(), id_) == a.running_.end());
    if (auto it = std::find(a.yielded_.begin(), a.yielded_.end(), id_); it != a.yielded_.end()) {
      a.yielded_.erase(it);
      a.waiting_.push_back(id_);  // at the back: those that arrived meanwhile go first
    }
  }
  for (;;) {
    {
      absl::MutexLock lock(&a.mu_);
      auto my_turn = [&a, this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(a.mu_) {
        return static_cast<int32_t>(a.running_.size()) < a.max_running_ && !a.waiting_.empty() &&
               a.waiting_.front() == id_;
      };
      // Poll the client's state now and then; wake at once when the turn comes.
      const absl::Time until = std::min(deadline, absl::Now() + absl::Milliseconds(20));
      if (a.mu_.AwaitWithDeadline(absl::Condition(&my_turn), until)) {
        a.waiting_.pop_front();
        a.running_.push_back(id_);
        return absl::OkStatus();
      }
    }
    if (absl::Status why = stop ? stop() : absl::OkStatus(); !why.ok()) {
      Leave();
      return absl::Status(why.code(), StrCat(why.message(), " while the request was queued"));
    }
    if (absl::Now() >= deadline) {
      Leave();
      return absl::DeadlineExceededError("the request's deadline passed while it was queued");
    }
  }
}

}  // namespace odmoe
