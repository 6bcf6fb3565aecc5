#include "src/worker_node/gpu_budget.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

std::string Mib(uint64_t bytes) { return absl::StrFormat("%.2f MiB", static_cast<double>(bytes) / (1 << 20)); }

uint64_t Limit(uint64_t capacity, uint64_t node_budget) {
  if (node_budget == 0) return capacity;
  if (capacity == 0) return node_budget;
  return std::min(capacity, node_budget);
}

}  // namespace

GpuBudget::GpuBudget(Device& device, uint64_t node_budget_bytes, uint64_t expert_bytes, std::string node,
                     std::string cluster_file)
    : device_(device),
      limit_(Limit(device.memory_info().capacity, node_budget_bytes)),
      expert_bytes_(expert_bytes),
      node_(std::move(node)),
      cluster_file_(std::move(cluster_file)) {}

uint64_t GpuBudget::Excess(uint64_t bytes) const {
  if (limit_ == 0) return 0;
  const uint64_t in_use = device_.memory_info().in_use;
  if (in_use <= limit_ && bytes <= limit_ - in_use) return 0;
  return in_use + bytes - limit_;
}

bool GpuBudget::Fits(uint64_t bytes) const { return Excess(bytes) == 0; }

absl::StatusOr<std::unique_ptr<Buffer>> GpuBudget::Allocate(size_t bytes, std::string_view tag) {
  absl::MutexLock lock(&mu_);
  if (!Fits(bytes)) return Error(tag, bytes);
  return device_.Allocate(bytes, tag);
}

absl::Status GpuBudget::Error(std::string_view what, uint64_t bytes) const {
  return absl::ResourceExhaustedError(StrCat("worker '", node_, "': ", what, " needs ", Mib(bytes),
                                             " but its GPU budget of ", Mib(limit_), " has ",
                                             Mib(device_.memory_info().in_use), " in use (workspace ",
                                             Mib(workspace_bytes_), ", one expert ", Mib(expert_bytes_), ")"));
}

absl::Status GpuBudget::CheckWorkspace(uint64_t workspace_bytes, int64_t rows, const absl::Status& prepared) {
  const uint64_t library_bytes = device_.memory_info().in_use;
  if (prepared.ok() && (limit_ == 0 || workspace_bytes + library_bytes + expert_bytes_ <= limit_)) {
    workspace_bytes_ = workspace_bytes + library_bytes;
    return absl::OkStatus();
  }
  const std::string library = library_bytes > 0 ? StrCat(", plus ", Mib(library_bytes), " of library workspace") : "";
  const std::string detail = prepared.ok() ? "" : StrCat(" (", prepared.message(), ")");
  return absl::ResourceExhaustedError(StrCat("worker '", node_, "': its GPU budget of ", Mib(limit_),
                                             " cannot hold the workspace (", Mib(workspace_bytes), " for ", rows,
                                             " rows per call", library, ") plus one expert (", Mib(expert_bytes_),
                                             "); raise gpu_budget_mb in ", cluster_file_, detail));
}

}  // namespace odmoe
