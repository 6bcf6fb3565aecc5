// Dense GEMV for a few tokens: GemvKernel<W, kTokens>, 8 warps per 256-thread block, each warp kRows output rows.
//  - kTokens = 1 (decode of one sequence): one accumulator per row and, for outputs of kFourRowsFrom rows or more,
//    four rows per warp, so each lane has the rows' weights of 4 steps in flight (the 4x unroll) and the
//    activations it loads for a step serve all four; one row per warp below that (four times the warps).
//  - kTokens = kGemvMaxTokens: up to that many tokens (n at run time), one row per warp, the weights read once
//    for all of them.
// With aligned rows each lane streams 4 fp32 or 8 fp16/bf16 weights of the row per step in loads of 4 weights, and
// the matching fp32 activations in float4 loads (from L1/L2), each load contiguous across the warp; unaligned
// shapes take a scalar strided loop. Every variant accumulates a row in the same order (RowDot: the lane's columns
// of each step, each element by an explicit FMA, then the butterfly WarpSum; kernels/gemv_row.cuh), so a row's
// result is bitwise the same whatever the number of tokens.
#include "kernels/gemv.h"

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/gemv_row.cuh"

namespace odmoe::kernels {
namespace {

using internal::Aligned16;
using internal::CeilDiv;
using internal::RowDot;
using internal::ToFloat;
using internal::WarpSum;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxN = static_cast<int>(kGemvMaxTokens);

// Output rows per warp: for one token four (x reused, more loads in flight) where the rows are many, one where
// they are few (below kFourRowsFrom: the k / v projections' 1024 rows make 128 blocks, the q / o projections' 4096
// make 512, each warp streaming its row); one for several tokens (their accumulators take the registers). The
// number does not change a row's order of additions. On an H200 (bench/gemv_sweep, 2026-12-04), of the copy
// bandwidth at 1 / 2 / 4 rows per warp: 14336x4096 76.9 / 72.3 / 89.9%, 32000x4096 95.6 / 96.4 / 98.4%, but
// 4096x14336 77.6 / 63.3 / 70.6% and 6144x4096 73.6 / 66.8 / 70.2%.
constexpr int64_t kFourRowsFrom = 8192;

template <typename W, int kTokens, int kRows>
__global__ void __launch_bounds__(kThreads)
    GemvKernel(const float* __restrict__ x, const W* __restrict__ w, const W* __restrict__ bias, int n, int64_t in,
               int64_t out, float* __restrict__ y, bool vec) {
  const int lane = threadIdx.x & 31;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRows;
  if (row0 >= out) return;
  // A row past the end (the last warp's) reads the last row, and its result is not stored.
  const W* rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) rows[r] = w + min(row0 + r, out - 1) * in;
  float acc[kRows][kTokens];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[r][t] = 0.0f;
  }
  RowDot<W, kRows, kTokens>(x, rows, n, in, vec, lane, acc);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row >= out) break;  // the same for the whole warp
    const float b = bias != nullptr ? ToFloat(bias[row]) : 0.0f;
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (kTokens == 1 || t < n) {
        const float s = WarpSum(acc[r][t]);
        if (lane == 0) y[t * out + row] = s + b;
      }
    }
  }
}

template <typename W, int kTokens, int kRows>
void LaunchGemvTokens(const float* x, const W* w, const W* bias, int n, int64_t in_dim, int64_t out_dim, float* y,
                      bool vec, cudaStream_t stream) {
  const int64_t blocks = CeilDiv(out_dim, kWarps * kRows);
  GemvKernel<W, kTokens, kRows>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, w, bias, n, in_dim, out_dim, y, vec);
}

}  // namespace

template <typename W>
cudaError_t LaunchGemv(const float* x, const W* w, const W* bias, int64_t n, int64_t in_dim, int64_t out_dim, float* y,
                       cudaStream_t stream) {
  if (n <= 0 || out_dim <= 0) return cudaSuccess;
  if (in_dim <= 0) return cudaErrorInvalidValue;
  if (CeilDiv(out_dim, kWarps) > 0x7fffffff) return cudaErrorInvalidValue;
  const bool vec = in_dim % 8 == 0 && Aligned16(x) && Aligned16(w);
  for (int64_t t0 = 0; t0 < n; t0 += kMaxN) {
    const int cnt = static_cast<int>(std::min<int64_t>(kMaxN, n - t0));
    const float* xc = x + t0 * in_dim;
    float* yc = y + t0 * out_dim;
    if (cnt > 1) {
      LaunchGemvTokens<W, kMaxN, 1>(xc, w, bias, cnt, in_dim, out_dim, yc, vec, stream);
    } else if (out_dim >= kFourRowsFrom) {
      LaunchGemvTokens<W, 1, 4>(xc, w, bias, cnt, in_dim, out_dim, yc, vec, stream);
    } else {
      LaunchGemvTokens<W, 1, 1>(xc, w, bias, cnt, in_dim, out_dim, yc, vec, stream);
    }
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
