// CreateDevice: the one place that turns a device spec into a Device. A library of its own so that the CUDA
// backend, which builds on odmoe_backend, can be linked in where the toolchain exists.
#include "src/backend/device_factory.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string_view>

#include "absl/strings/numbers.h"
#include "src/backend/cpu_device.h"
#include "src/backend/mock_gpu_device.h"
#include "src/common/status.h"
#include "src/common/strings.h"

#ifdef ODMOE_HAVE_CUDA
#include "src/backend/cuda_device.h"
#endif

namespace odmoe {

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec) {
  constexpr std::string_view kChoices = "cpu, mock-gpu, mock-gpu:CAPACITY_MB, cuda, cuda:CAPACITY_MB";
  if (spec == "cpu") return std::unique_ptr<Device>(new CpuDevice());
  if (spec == "mock-gpu") return std::unique_ptr<Device>(new MockGpuDevice());
  constexpr std::string_view kMockPrefix = "mock-gpu:";
  if (spec.starts_with(kMockPrefix)) {
    const std::string_view mb_text = spec.substr(kMockPrefix.size());
    uint64_t mb = 0;
    if (!absl::SimpleAtoi(ToAbslView(mb_text), &mb) || mb == 0 ||
        mb > std::numeric_limits<uint64_t>::max() / (uint64_t{1} << 20)) {
      return absl::InvalidArgumentError(
          StrCat("device '", spec,
                 "': the capacity after 'mock-gpu:' must be a positive number of MiB, e.g. "
                 "mock-gpu:8192"));
    }
    MockGpuOptions options;
    options.capacity_bytes = mb << 20;
    return std::unique_ptr<Device>(new MockGpuDevice(options));
  }
  if (spec == "cuda" || spec.starts_with("cuda:")) {
    uint64_t mb = 0;
    if (spec != "cuda") {
      const std::string_view mb_text = spec.substr(5);
      if (!absl::SimpleAtoi(ToAbslView(mb_text), &mb) || mb == 0 ||
          mb > std::numeric_limits<uint64_t>::max() / (uint64_t{1} << 20)) {
        return absl::InvalidArgumentError(
            StrCat("device '", spec, "': the capacity after 'cuda:' must be a positive number of MiB, e.g. cuda:1024"));
      }
    }
#ifdef ODMOE_HAVE_CUDA
    // The CUDA backend (src/backend/cuda_device.h): GPU 0; its whole memory, or the given budget.
    return CreateCudaDevice(/*ordinal=*/0, /*capacity_bytes=*/mb << 20);
#else
    return absl::InvalidArgumentError(
        StrCat("device '", spec, "': this build has no CUDA backend (configure with ODMOE_CUDA=ON where nvcc is)"));
#endif
  }
  return absl::InvalidArgumentError(StrCat("unknown device '", spec, "'; choose one of: ", kChoices));
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec, uint64_t capacity_bytes) {
  if (spec == "cpu") return std::unique_ptr<Device>(new CpuDevice(capacity_bytes));
  if (spec.starts_with("mock-gpu")) {
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> probe, CreateDevice(spec));  // validates "mock-gpu[:MB]"
    MockGpuOptions options;
    options.record_timeline = false;
    const uint64_t spec_capacity = probe->memory_info().capacity;
    options.capacity_bytes = capacity_bytes == 0 ? spec_capacity : std::min(capacity_bytes, spec_capacity);
    // Copies from host memory the daemon did not register run at pageable speed.
    options.h2d_pageable_bytes_per_s = options.h2d_bytes_per_s * MockGpuOptions::kPageableFraction;
    return std::unique_ptr<Device>(new MockGpuDevice(options));
  }
  if (spec == "cuda" && capacity_bytes != 0) {
    return CreateDevice(StrCat("cuda:", (capacity_bytes + (uint64_t{1} << 20) - 1) >> 20));
  }
  return CreateDevice(spec);
}

}  // namespace odmoe
