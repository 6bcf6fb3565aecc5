// RMSNorm of fp32 activations with a weight in its storage dtype.
//
// Host launchers enqueue on `stream` and return the launch status (cudaGetLastError); they do not synchronize.
// W is float, __half or __nv_bfloat16 (explicitly instantiated in norm.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// out[r, :] = (x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps))) * weight[:], fp32 accumulation, one block per row.
// x, out: [rows, dim] (may alias); weight: [dim].
template <typename W>
cudaError_t LaunchRmsNorm(const float* x, const W* weight, int64_t rows, int64_t dim, float eps, float* out,
                          cudaStream_t stream);

}  // namespace odmoe::kernels
