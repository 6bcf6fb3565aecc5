// Creates a Device from a command-line spec.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "src/backend/device.h"

namespace odmoe {

// Specs:
//   "cpu"                   CpuDevice (no capacity limit)
//   "mock-gpu"              MockGpuDevice with the default MockGpuOptions
//   "mock-gpu:CAPACITY_MB"  MockGpuDevice with a capacity of CAPACITY_MB MiB (CAPACITY_MB * 2^20 bytes, > 0)
//   "cuda"                  the CUDA backend (only in builds with ODMOE_HAVE_CUDA)
// InvalidArgument for an unknown spec (naming it and the choices), a malformed capacity, or "cuda" in a build
// without CUDA.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec);

// A daemon's device: `spec` as above, with its memory capped at `capacity_bytes` where that is non-zero (a
// worker's GPU budget): a CpuDevice with that capacity; a MockGpuDevice with the smaller of it and the spec's,
// no timeline (a daemon runs for long) and pageable host-to-device copies at MockGpuOptions::kPageableFraction
// of the pinned rate; a CUDA device with the capacity rounded up to whole MiB, so that the backend itself
// refuses to allocate past it. Errors as CreateDevice(spec).
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec, uint64_t capacity_bytes);

}  // namespace odmoe
