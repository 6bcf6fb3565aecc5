// StagingSlots: where a ComputeExperts call's inputs go on the device as soon as the call arrives, before it is
// computed (prefill mini-batches, OD-MoE fig. 7): per slot, buffers for the call's hidden rows and for every
// task's row indices, a stream the uploads (and the experts the call loads ahead) go on, and an event recorded
// after the uploads. Two slots, so one call can be staged while another computes.
//
// A slot is held by one call from Acquire to Release; the holder alone touches the slot's buffers, host copies
// and stream. Release waits for the slot's uploads (they read its host copies) before giving it back.
//
// Thread safety: Acquire and Release may be called concurrently; `mu_` guards which slots are held. Allocate is
// called once, before any other method.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "src/backend/device.h"
#include "src/worker_node/gpu_budget.h"

namespace odmoe {

class StagingSlots {
 public:
  static constexpr int kSlots = 2;

  struct Slot {
    std::unique_ptr<Buffer> hidden;   // [max_rows, hidden] f32
    std::unique_ptr<Buffer> rows;     // [max_rows * num_experts] int32: every task's rows, back to back
    std::unique_ptr<Stream> stream;   // uploads, and the loads its call starts ahead
    std::unique_ptr<Event> uploaded;  // recorded after the uploads
    std::vector<float> host_hidden;   // what the uploads read, alive until `uploaded` has completed
    std::vector<int32_t> host_rows;
  };

  // Device bytes of the slots for `max_rows` rows of `hidden` floats and `num_experts` tasks.
  static uint64_t Bytes(int64_t max_rows, int64_t hidden, int64_t num_experts);

  explicit StagingSlots(Device& device) : device_(device) {}
  // Allocates every slot's buffers within `budget`, and its stream and event.
  absl::Status Allocate(GpuBudget& budget, int64_t max_rows, int64_t hidden, int64_t num_experts);

  // Waits for a free slot, takes it and returns its index.
  int Acquire();
  // The slot `index` (REQUIRES: held by the caller).
  Slot& slot(int index) { return slots_[static_cast<size_t>(index)]; }
  // Enqueues the upload of `hidden` and `rows` (moved into the slot) on its stream and records `uploaded`;
  // does not block the host. REQUIRES: `index` held by the caller; the sizes fit the buffers.
  void Upload(int index, std::vector<float> hidden, std::vector<int32_t> rows);
  // Waits for the slot's uploads and gives it back.
  void Release(int index);

 private:
  Device& device_;
  std::array<Slot, kSlots> slots_;  // each touched only by the call holding it
  absl::Mutex mu_;
  std::array<bool, kSlots> held_ ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace odmoe
