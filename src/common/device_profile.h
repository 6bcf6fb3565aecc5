// A device profile: the figures of a GPU (or other accelerator) that a timed device charges its work at
// (src/backend/timed_device.h). Profiles are `[[device_profile]]` tables of the cluster file, or of the profile
// files its `[cluster] device_profiles` lists (configs/profiles/); a node uses one with device = "timed:NAME".
//
//   [[device_profile]]
//   name = "rtx3090"
//   memory_gib = 24               # device memory, GiB
//   memory_gb_per_s = 936         # device memory bandwidth, GB/s (1e9 bytes)
//   h2d_pinned_gb_per_s = 25      # host-to-device copies from pinned (registered) host memory, GB/s
//   h2d_pageable_gb_per_s = 12    # ... from pageable host memory, GB/s
//   d2h_gb_per_s = 25             # device-to-host copies, GB/s
//   launch_latency_us = 5         # fixed cost of every op (kernel launch and tail), microseconds
//   copy_latency_us = 10          # fixed cost of every host<->device copy, microseconds
//   tflops = { fp32 = 35.6, bf16 = 71, fp16 = 71, int8 = 284 }   # dense peak per dtype, TFLOP/s (int8: TOP/s)
//
// Every field is required and positive; a misspelt or unknown field is an error.
#pragma once

#include <cstdint>
#include <string>

#include "src/common/dtype.h"

namespace odmoe {

struct DeviceProfile {
  std::string name;
  std::string defined_in;  // the file that defined it (for messages)
  uint64_t memory_bytes = 0;
  double memory_bytes_per_s = 0;
  double h2d_pinned_bytes_per_s = 0;
  double h2d_pageable_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double launch_latency_s = 0;
  double copy_latency_s = 0;
  double fp32_flops_per_s = 0;
  double bf16_flops_per_s = 0;
  double fp16_flops_per_s = 0;
  double int8_ops_per_s = 0;

  // The arithmetic rate for a matrix product with weights of `dtype`: F32 fp32, BF16 bf16, F16 fp16, I8 int8;
  // NF4 (U8) weights are dequantized to fp16 in the kernel, so fp16; I32 (never a weight) fp32.
  double FlopsPerS(DType dtype) const {
    switch (dtype) {
      case DType::kBF16:
        return bf16_flops_per_s;
      case DType::kF16:
      case DType::kU8:
        return fp16_flops_per_s;
      case DType::kI8:
        return int8_ops_per_s;
      case DType::kF32:
      case DType::kI32:
        return fp32_flops_per_s;
    }
    return fp32_flops_per_s;
  }
};

}  // namespace odmoe
