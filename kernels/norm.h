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

// x[r, :] += delta[r, :], then out[r, :] = the RMSNorm of the new x[r, :] (as LaunchRmsNorm): a residual addition
// and the norm after it in one pass over the row (rows of up to 8192; longer rows take LaunchAdd's and
// LaunchRmsNorm's kernels), bitwise what those two give. x, delta, out: [rows, dim]; out must alias neither.
template <typename W>
cudaError_t LaunchAddRmsNorm(const float* delta, float* x, const W* weight, int64_t rows, int64_t dim, float eps,
                             float* out, cudaStream_t stream);

}  // namespace odmoe::kernels
