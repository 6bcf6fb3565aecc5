// GpuBudget: the device memory a worker keeps to, and the one place that decides what fits in it.
//
// The limit is the node's gpu_budget_bytes capped by the device's capacity (either alone when the other is 0;
// 0 when both are: no limit). What counts against it is the device's own memory_info().in_use: the workspace,
// the library workspace of a prepared stream (cuBLAS), and every resident expert. Allocate makes the check and
// the allocation one step, so two threads never both take the last room.
//
// The "budget too small" errors name the node, the budget, what is in use, the fixed workspace and one expert's
// size, so an operator knows which number to raise.
//
// Thread safety: every method may be called concurrently; `mu_` (a leaf lock) serializes Allocate. Fits and
// Excess read the device without it: a concurrent allocation may change the answer, and callers that must not
// exceed the budget allocate through Allocate.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "src/backend/device.h"

namespace odmoe {

class GpuBudget {
 public:
  // `node_budget_bytes`: the node's gpu_budget_bytes (0: the device's capacity). `node` names the worker in
  // errors, `cluster_file` where to raise the budget. `expert_bytes`: the device bytes of the largest expert.
  GpuBudget(Device& device, uint64_t node_budget_bytes, uint64_t expert_bytes, std::string node,
            std::string cluster_file);

  // The limit in bytes (0: none).
  uint64_t limit() const { return limit_; }
  uint64_t expert_bytes() const { return expert_bytes_; }
  // The bytes held for the worker's whole life (set once at start by CheckWorkspace).
  uint64_t workspace_bytes() const { return workspace_bytes_; }

  // True when `bytes` more fit next to what is in use now.
  bool Fits(uint64_t bytes) const;
  // How many bytes must be freed before `bytes` more fit (0: they fit).
  uint64_t Excess(uint64_t bytes) const;
  // Allocates `bytes` on the device if they fit: ResourceExhausted naming `tag` (Error) otherwise.
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes, std::string_view tag);
  // ResourceExhausted: `what` needs `bytes`, with the budget, what is in use, the workspace and one expert.
  absl::Status Error(std::string_view what, uint64_t bytes) const;

  // At start, before the workspace is allocated: OK when the budget holds `workspace_bytes` (for `rows` rows per
  // call), the library workspace already allocated on the device, and one expert; else ResourceExhausted
  // naming gpu_budget_mb and the cluster file. `prepared` is the outcome of preparing the compute stream; its
  // error is reported the same way. On success records the workspace (library workspace included).
  absl::Status CheckWorkspace(uint64_t workspace_bytes, int64_t rows, const absl::Status& prepared);

 private:
  Device& device_;
  const uint64_t limit_;
  const uint64_t expert_bytes_;
  const std::string node_;
  const std::string cluster_file_;
  uint64_t workspace_bytes_ = 0;  // set by CheckWorkspace at start, constant after
  absl::Mutex mu_;                // makes Allocate's check and allocation one step
};

}  // namespace odmoe
