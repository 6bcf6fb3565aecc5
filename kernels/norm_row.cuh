// The held RMSNorm of one row (kernels/norm.cu's RmsNormHeldKernel) as a device function, shared by every kernel
// that must give bitwise its result (kernels/router.cu's AddRmsNormRouterKernel). Internal: included by .cu files
// of this directory only.
#pragma once

#include "kernels/common.cuh"

namespace odmoe::kernels::internal {

constexpr int kNormThreads = 256;  // the held norm's block

// One block of kNormThreads threads norms one row of `dim` <= kNormThreads * kPerThread elements: thread t holds
// elements t, t + 256, ... (and their weights) in registers, sums their squares in that order, and BlockSum gives
// the row's. delta != nullptr (AddRmsNorm): x[i] + delta[i] is the element normed, and stored into sum[i]. out[i] =
// (x[i] * RmsInverse) * weight[i]; the thread's outputs are also left in y (0 past dim). x and out may alias (each
// element is read and written by one thread, after the reduction). REQUIRES: every thread of the block calls it.
template <typename W, int kPerThread>
__device__ __forceinline__ void HeldRowNorm(const float* x, const float* delta, float* sum,
                                            const W* __restrict__ weight, int64_t dim, float eps, float* out,
                                            float (&y)[kPerThread]) {
  float v[kPerThread];
  float w[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    v[j] = i < dim ? x[i] : 0.0f;
    if (delta != nullptr && i < dim) v[j] += delta[i];  // Add's y += x, the same single rounding
    w[j] = i < dim ? ToFloat(weight[i]) : 0.0f;
  }
  if (delta != nullptr) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
      if (i < dim) sum[i] = v[j];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    if (threadIdx.x + static_cast<int64_t>(j) * kNormThreads < dim) ss += v[j] * v[j];
  }
  ss = BlockSum(ss);
  const float inv = RmsInverse(ss, dim, eps);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    y[j] = i < dim ? (v[j] * inv) * w[j] : 0.0f;
    if (i < dim) out[i] = y[j];
  }
}

}  // namespace odmoe::kernels::internal
