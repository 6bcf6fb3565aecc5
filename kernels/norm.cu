// RMSNorm: one block of 256 threads per row; the sum of squares is a deterministic block reduction in fp32,
// then every thread scales its strided elements. x and out may alias: each element is read and written by the
// same thread, after the reduction.
#include "kernels/norm.h"

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::BlockSum;
using internal::ToFloat;

constexpr int kThreads = 256;

template <typename W>
__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const float* x, const W* __restrict__ weight, int64_t dim, float eps, float* out) {
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * dim;
  float* yr = out + static_cast<int64_t>(blockIdx.x) * dim;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float v = xr[i];
    ss += v * v;
  }
  ss = BlockSum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) yr[i] = (xr[i] * inv) * ToFloat(weight[i]);
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
