#include "src/main_node/drain.h"

namespace odmoe {

RequestDrain::Pass::~Pass() {
  if (drain_ == nullptr) return;
  absl::MutexLock lock(&drain_->mu_);
  --drain_->out_;
}

std::optional<RequestDrain::Pass> RequestDrain::Enter() {
  absl::MutexLock lock(&mu_);
  if (closed_) return std::nullopt;
  ++out_;
  return Pass(this);
}

void RequestDrain::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

int64_t RequestDrain::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return out_ == 0; };
  mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  return out_;
}

int64_t RequestDrain::in_flight() const {
  absl::MutexLock lock(&mu_);
  return out_;
}

}  // namespace odmoe
