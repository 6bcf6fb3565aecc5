#include "src/worker_node/staging_slots.h"

#include <algorithm>
#include <utility>

#include "src/common/status.h"

namespace odmoe {
namespace {

uint64_t HiddenBytes(int64_t max_rows, int64_t hidden) {
  return static_cast<uint64_t>(max_rows * hidden) * sizeof(float);
}
uint64_t RowBytes(int64_t max_rows, int64_t num_experts) {
  return static_cast<uint64_t>(max_rows * std::max<int64_t>(1, num_experts)) * sizeof(int32_t);
}

}  // namespace

uint64_t StagingSlots::Bytes(int64_t max_rows, int64_t hidden, int64_t num_experts) {
  return kSlots * (HiddenBytes(max_rows, hidden) + RowBytes(max_rows, num_experts));
}

absl::Status StagingSlots::Allocate(GpuBudget& budget, int64_t max_rows, int64_t hidden, int64_t num_experts) {
  for (Slot& slot : slots_) {
    ODMOE_ASSIGN_OR_RETURN(slot.hidden, budget.Allocate(HiddenBytes(max_rows, hidden), "worker hidden state"));
    ODMOE_ASSIGN_OR_RETURN(slot.rows, budget.Allocate(RowBytes(max_rows, num_experts), "worker row indices"));
    slot.stream = device_.CreateStream();
    slot.uploaded = device_.CreateEvent();
  }
  return absl::OkStatus();
}

int StagingSlots::Acquire() {
  absl::MutexLock lock(&mu_);
  auto free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::find(held_.begin(), held_.end(), false) != held_.end();
  };
  mu_.Await(absl::Condition(&free));
  const auto it = std::find(held_.begin(), held_.end(), false);
  *it = true;
  return static_cast<int>(it - held_.begin());
}

void StagingSlots::Upload(int index, std::vector<float> hidden, std::vector<int32_t> rows) {
  Slot& s = slot(index);
  s.host_hidden = std::move(hidden);
  s.host_rows = std::move(rows);
  Stream* stream = s.stream.get();
  device_.CopyToDevice(s.hidden->data(), s.host_hidden.data(), s.host_hidden.size() * sizeof(float), stream);
  device_.CopyToDevice(s.rows->data(), s.host_rows.data(), s.host_rows.size() * sizeof(int32_t), stream);
  device_.RecordEvent(*s.uploaded, stream);
}

void StagingSlots::Release(int index) {
  device_.SynchronizeEvent(*slot(index).uploaded);  // the uploads read the host vectors
  absl::MutexLock lock(&mu_);
  held_[static_cast<size_t>(index)] = false;
}

}  // namespace odmoe
