// Dense GEMV for a few tokens: GemvKernel<W>, one warp per output row (8 rows per 256-thread block). With
// aligned rows each lane streams 16-byte chunks of the weight row (Vec16: 4 fp32 or 8 fp16/bf16) and the
// matching fp32 activations of up to kGemvMaxTokens tokens (float4 loads, served from L1/L2), accumulating in
// fp32; the per-lane partial sums meet in a warp reduction. Unaligned shapes use a scalar strided loop.
#include "kernels/gemv.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::CeilDiv;
using internal::ToFloat;
using internal::Vec16;
using internal::WarpSum;

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;
constexpr int kMaxN = static_cast<int>(kGemvMaxTokens);

template <typename W>
__global__ void __launch_bounds__(kThreads)
    GemvKernel(const float* __restrict__ x, const W* __restrict__ w, const W* __restrict__ bias, int n, int64_t in,
               int64_t out, float* __restrict__ y, bool vec) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= out) return;
  const W* wr = w + row * in;
  float acc[kMaxN];
#pragma unroll
  for (int t = 0; t < kMaxN; ++t) acc[t] = 0.0f;
  if (vec) {
    constexpr int kV = Vec16<W>::kElems;
    const int64_t chunks = in / kV;
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += 32) {
      float wv[kV];
      Vec16<W>::Load(wr + c * kV, wv);
#pragma unroll
      for (int t = 0; t < kMaxN; ++t) {
        if (t < n) {
          float xv[kV];
#pragma unroll
          for (int q = 0; q < kV; q += 4) Vec16<float>::Load(x + t * in + c * kV + q, xv + q);
          float s = acc[t];
#pragma unroll
          for (int e = 0; e < kV; ++e) s += wv[e] * xv[e];
          acc[t] = s;
        }
      }
    }
  } else {
    for (int64_t k = lane; k < in; k += 32) {
      const float wv = ToFloat(wr[k]);
#pragma unroll
      for (int t = 0; t < kMaxN; ++t) {
        if (t < n) acc[t] += wv * x[t * in + k];
      }
    }
  }
  const float b = bias != nullptr ? ToFloat(bias[row]) : 0.0f;
#pragma unroll
  for (int t = 0; t < kMaxN; ++t) {
    if (t < n) {
      const float s = WarpSum(acc[t]);
      if (lane == 0) y[t * out + row] = s + b;
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

template <typename W>
cudaError_t LaunchGemv(const float* x, const W* w, const W* bias, int64_t n, int64_t in_dim, int64_t out_dim, float* y,
                       cudaStream_t stream) {
  if (n <= 0 || out_dim <= 0) return cudaSuccess;
  if (in_dim <= 0) return cudaErrorInvalidValue;
  const int64_t blocks = CeilDiv(out_dim, kRowsPerBlock);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const bool vec = in_dim % 8 == 0 && Aligned16(x) && Aligned16(w);
  for (int64_t t0 = 0; t0 < n; t0 += kMaxN) {
    const int cnt = static_cast<int>(std::min<int64_t>(kMaxN, n - t0));
    GemvKernel<W><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x + t0 * in_dim, w, bias, cnt, in_dim,
                                                                          out_dim, y + t0 * out_dim, vec);
  }
  return cudaGetLastError();
}

template cudaError_t LaunchGemv<float>(const float*, const float*, const float*, int64_t, int64_t, int64_t, float*,
                                       cudaStream_t);
template cudaError_t LaunchGemv<__half>(const float*, const __half*, const __half*, int64_t, int64_t, int64_t, float*,
                                        cudaStream_t);
template cudaError_t LaunchGemv<__nv_bfloat16>(const float*, const __nv_bfloat16*, const __nv_bfloat16*, int64_t,
                                               int64_t, int64_t, float*, cudaStream_t);

}  // namespace odmoe::kernels
