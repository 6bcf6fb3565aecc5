// RMSNorm: one block of 256 threads per row; the sum of squares is a deterministic block reduction in fp32,
// then every thread scales its elements. Thread t's elements are t, t + 256, t + 512, ..., its sum of squares
// adds them in that order: the one order of both kernels below, which therefore give the same bits. x and out
// may alias: each element is read and written by the same thread, after the reduction.
//  - RmsNormHeldKernel<W, kPerThread> (rows of up to 256 x kPerThread; kernels/norm_row.cuh's HeldRowNorm): a
//    thread loads its elements and their weights at once, before the reduction, and keeps them in registers for
//    the scaling; the row's memory latency is paid once. One row of a decode step (n = 1) is one block, so this
//    latency is the kernel's time.
//  - RmsNormKernel (longer rows): each thread takes its elements kBatch at a time, all loads of a batch issued
//    before any use (with x and out possibly aliased the compiler cannot hoist a load above the previous
//    element's store; a load at a time cost a memory latency per element, about 10 us for 4096 values on an
//    H200, under Nsight Compute), and reads x again for the scaling.
#include "kernels/norm.h"

#include "kernels/common.cuh"
#include "kernels/elementwise.h"
#include "kernels/norm_row.cuh"

namespace odmoe::kernels {
namespace {

using internal::BlockSum;
using internal::HeldRowNorm;
using internal::RmsInverse;
using internal::ToFloat;

constexpr int kThreads = internal::kNormThreads;
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
  const float inv = RmsInverse(ss, dim, eps);
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

// delta != nullptr (AddRmsNorm): x[i] + delta[i] is the element normed, and stored back into x (sum == x).
template <typename W, int kPerThread>
__global__ void __launch_bounds__(kThreads)
    RmsNormHeldKernel(const float* x, const float* delta, float* sum, const W* __restrict__ weight, int64_t dim,
                      float eps, float* out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * dim;
  float y[kPerThread];
  HeldRowNorm<W, kPerThread>(x + row, delta != nullptr ? delta + row : nullptr, sum != nullptr ? sum + row : nullptr,
                             weight, dim, eps, out + row, y);
}

// Launches the held kernel for rows of `dim` (x, delta, sum as RmsNormHeldKernel takes them); false past 8192.
template <typename W>
bool LaunchHeld(const float* x, const float* delta, float* sum, const W* weight, int64_t rows, int64_t dim, float eps,
                float* out, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(rows);
  if (dim <= kThreads) {  // per-head q/k norms
    RmsNormHeldKernel<W, 1><<<blocks, kThreads, 0, stream>>>(x, delta, sum, weight, dim, eps, out);
  } else if (dim <= kThreads * 8) {
    RmsNormHeldKernel<W, 8><<<blocks, kThreads, 0, stream>>>(x, delta, sum, weight, dim, eps, out);
  } else if (dim <= kThreads * 16) {
    RmsNormHeldKernel<W, 16><<<blocks, kThreads, 0, stream>>>(x, delta, sum, weight, dim, eps, out);
  } else if (dim <= kThreads * 32) {
    RmsNormHeldKernel<W, 32><<<blocks, kThreads, 0, stream>>>(x, delta, sum, weight, dim, eps, out);
  } else {
    return false;
  }
  return true;
}

}  // namespace

template <typename W>
cudaError_t LaunchRmsNorm(const float* x, const W* weight, int64_t rows, int64_t dim, float eps, float* out,
                          cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (!LaunchHeld(x, nullptr, nullptr, weight, rows, dim, eps, out, stream)) {
    RmsNormKernel<W><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, dim, eps, out);
  }
  return cudaGetLastError();
}

template <typename W>
cudaError_t LaunchAddRmsNorm(const float* delta, float* x, const W* weight, int64_t rows, int64_t dim, float eps,
                             float* out, cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (LaunchHeld(x, delta, x, weight, rows, dim, eps, out, stream)) return cudaGetLastError();
  const cudaError_t added = LaunchAdd(delta, rows * dim, x, stream);
  return added != cudaSuccess ? added : LaunchRmsNorm(x, weight, rows, dim, eps, out, stream);
}

template cudaError_t LaunchRmsNorm<float>(const float*, const float*, int64_t, int64_t, float, float*, cudaStream_t);
template cudaError_t LaunchRmsNorm<__half>(const float*, const __half*, int64_t, int64_t, float, float*, cudaStream_t);
template cudaError_t LaunchRmsNorm<__nv_bfloat16>(const float*, const __nv_bfloat16*, int64_t, int64_t, float, float*,
                                                  cudaStream_t);
template cudaError_t LaunchAddRmsNorm<float>(const float*, float*, const float*, int64_t, int64_t, float, float*,
                                             cudaStream_t);
template cudaError_t LaunchAddRmsNorm<__half>(const float*, float*, const __half*, int64_t, int64_t, float, float*,
                                              cudaStream_t);
template cudaError_t LaunchAddRmsNorm<__nv_bfloat16>(const float*, float*, const __nv_bfloat16*, int64_t, int64_t,
                                                     float, float*, cudaStream_t);

}  // namespace odmoe::kernels
