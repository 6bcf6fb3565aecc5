// RMSNorm: one block of 256 threads per row; the sum of squares is a deterministic block reduction in fp32,
// then every thread scales its strided elements. x and out may alias: each element is read and written by the
// same thread, after the reduction. Each thread handles its elements kBatch at a time, all loads of a batch
// issued before any use: with x and out possibly aliased the compiler cannot hoist a load above the previous
// element's store, and one row of a decode step (n = 1) is one block, so a load at a time costs a memory
// latency per element (about 10 us for 4096 values on an H200, under Nsight Compute). The order of the
// additions is that of the one-element loop.
#include "kernels/norm.h"

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::BlockSum;
using internal::ToFloat;

constexpr int kThreads = 256;
constexpr int kBatch = 8;

template <typename W>
__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const float* x, const W* __restrict__ weight, int64_t dim, float eps, float* out) {
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * dim;
  float* yr = out + static_cast<int64_t>(blockIdx.x) * dim;
  float ss = 0.0f;
  for (int64_t i0 = threadIdx.x; i0 < dim; i0 += kThreads * kBatch) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = i0 + j * kThreads;
      v[j] = i < dim ? xr[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (i0 + j * kThreads < dim) ss += v[j] * v[j];
    }
  }
  ss = BlockSum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i0 = threadIdx.x; i0 < dim; i0 += kThreads * kBatch) {
    float v[kBatch];
    float w[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = i0 + j * kThreads;
      v[j] = i < dim ? xr[i] : 0.0f;
      w[j] = i < dim ? ToFloat(weight[i]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = i0 + j * kThreads;
      if (i < dim) yr[i] = (v[j] * inv) * w[j];
    }
  }
}

}  // namespace

template <typename W>
cudaError_t LaunchRmsNorm(const float* x, const W* weight, int64_t rows, int64_t dim, float eps, float* out,
                          cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  RmsNormKernel<W><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, dim, eps, out);
  return cudaGetLastError();
}

template cudaError_t LaunchRmsNorm<float>(const float*, const float*, int64_t, int64_t, float, float*, cudaStream_t);
template cudaError_t LaunchRmsNorm<__half>(const float*, const __half*, int64_t, int64_t, float, float*, cudaStream_t);
template cudaError_t LaunchRmsNorm<__nv_bfloat16>(const float*, const __nv_bfloat16*, int64_t, int64_t, float, float*,
                                                  cudaStream_t);

}  // namespace odmoe::kernels
