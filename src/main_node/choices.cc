#include "src/main_node/choices.h"

#include <utility>

#include "src/common/status.h"

namespace odmoe {

ParallelChoices::ParallelChoices(int64_t count, std::vector<Admission::Ticket> tickets)
    : count_(count), tickets_(std::move(tickets)) {
  ODMOE_CHECK(!tickets_.empty() && static_cast<int64_t>(tickets_.size()) <= count_);
}

void ParallelChoices::Start(Job job, std::function<void()> on_finished) {
  ODMOE_CHECK(threads_.empty() && job_ == nullptr);
  job_ = std::move(job);
  on_finished_ = std::move(on_finished);
  {
    absl::MutexLock lock(&mu_);
    working_ = static_cast<int64_t>(tickets_.size());
  }
  threads_.reserve(tickets_.size());
  for (Admission::Ticket& ticket : tickets_) threads_.emplace_back([this, t = &ticket] { Work(t); });
}

ParallelChoices::~ParallelChoices() { Wait().IgnoreError(); }

void ParallelChoices::Work(Admission::Ticket* ticket) {
  for (;;) {
    int64_t index = 0;
    {
      absl::MutexLock lock(&mu_);
      if (next_ >= count_ || !first_error_.ok()) break;
      index = next_++;
    }
    absl::Status status = job_(index, ticket->held() ? ticket : nullptr);
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      if (first_error_.ok()) first_error_ = std::move(status);
      failed_.store(true);
    }
  }
  ticket->Leave();  // no job left for it: later arrivals need not wait behind it
  bool last = false;
  {
    absl::MutexLock lock(&mu_);
    last = --working_ == 0;
  }
  if (last && on_finished_ != nullptr) on_finished_();
}

bool ParallelChoices::WaitFor(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return working_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
}

absl::Status ParallelChoices::Wait() {
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  absl::MutexLock lock(&mu_);
  return first_error_;
}

bool EventQueue::Push(std::string event) {
  absl::MutexLock lock(&mu_);
  auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reader_closed_ || events_.size() < capacity_; };
  mu_.Await(absl::Condition(&room));
  if (reader_closed_) return false;
  events_.push_back(std::move(event));
  return true;
}

void EventQueue::FinishWriting() {
  absl::MutexLock lock(&mu_);
  writing_done_ = true;
}

void EventQueue::CloseReader() {
  absl::MutexLock lock(&mu_);
  reader_closed_ = true;
  events_.clear();
}

EventQueue::Next EventQueue::Pop(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !events_.empty() || writing_done_; };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  Next next;
  if (!events_.empty()) {
    next.event = std::move(events_.front());
    events_.pop_front();
  } else {
    next.finished = writing_done_;
  }
  return next;
}

}  // namespace odmoe
