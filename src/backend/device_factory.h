// Creates a Device from a command-line spec.
#pragma once

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

}  // namespace odmoe
