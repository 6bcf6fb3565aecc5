// The one summation order of the dense GEMVs (kernels/gemv.cu) as device functions, shared by every kernel that
// must give bitwise the GEMV's dot products (kernels/moe_grouped.cu, kernels/router.cu); ChunkDot is also the
// quantized GEMVs' order within a chunk (kernels/quant_gemm.cu). Internal: included by .cu files of this directory
// only.
#pragma once

#include "kernels/common.cuh"

namespace odmoe::kernels::internal {

// acc + sum_e w[e] * x[e], one fused multiply-add per element in order: the one summation order of every GEMV.
template <int kElems>
__device__ __forceinline__ float ChunkDot(const float* w, const float* x, float acc) {
#pragma unroll
  for (int e = 0; e < kElems; ++e) acc = fmaf(w[e], x[e], acc);
  return acc;
}

// acc[r][t] = this lane's partial dot product of weight row `rows[r]` with token t's activations. kTokens = 1:
// exactly one token; otherwise n <= kTokens tokens. Each accumulator's chain of FMAs is the same whatever kRows and
// kTokens, so a row's dot product (after WarpSum) is bitwise the same whichever rows share the warp.
//  - vec: the row is walked in steps of 32 * Vec16<W>::kElems columns, each kElems / 4 slices of 128; lane l takes
//    columns 4l..4l+3 of every slice (those inside the row), so a warp's loads of a slice's weights and of its
//    activations are contiguous: 256 bytes of 16-bit weights or 512 of fp32 ones, 512 of x. (One 16-byte chunk of
//    8 columns a lane made the x loads stride 32 bytes: 1 KB over 8 cache lines per 512 bytes, against 4.) The
//    lane sums its columns in step order, slice by slice.
//  - !vec: lane-strided elements.
// kSharedX: x is in shared memory (plain loads, not the read-only cache's; the same values, so the same sums).
// REQUIRES for vec: in % 8 == 0, x and every row 16-byte aligned.
template <typename W, int kRows, int kTokens, bool kSharedX = false>
__device__ __forceinline__ void RowDot(const float* __restrict__ x, const W* const (&rows)[kRows], int n, int64_t in,
                                       bool vec, int lane, float (&acc)[kRows][kTokens]) {
  if (vec) {
    constexpr int kV = Vec16<W>::kElems;  // columns a lane takes per step
    constexpr int kSlices = kV / 4;
    constexpr int64_t kSlice = 128;
    constexpr int64_t kStep = kSlices * kSlice;
    // One token: 4 steps of kRows * kV weights in flight per lane (the down projection's 4096 rows make only 256
    // blocks, about two per SM, so each warp must keep more bytes in flight); more tokens: 2 (registers).
    [[maybe_unused]] constexpr int kUnroll = kTokens == 1 ? 4 : 2;  // unused where #pragma unroll is not known
#pragma unroll kUnroll
    for (int64_t col0 = 4 * lane; col0 < in; col0 += kStep) {
      // A slice past the row (in the last step only; slice 0 never, as col0 < in) weighs 0: in % 8 == 0, so each
      // is wholly inside or past it.
      bool inside[kSlices];
#pragma unroll
      for (int p = 0; p < kSlices; ++p) inside[p] = p == 0 || col0 + p * kSlice < in;
      float wv[kRows][kV];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int p = 0; p < kSlices; ++p) {
          if (inside[p]) {
            Load4Streaming(rows[r] + col0 + p * kSlice, wv[r] + 4 * p);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) wv[r][4 * p + e] = 0.0f;
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (kTokens == 1 || t < n) {
          float xv[kV];
#pragma unroll
          for (int p = 0; p < kSlices; ++p) {
            const float* xq = x + t * in + col0 + p * kSlice;
            if (!inside[p]) {
#pragma unroll
              for (int e = 0; e < 4; ++e) xv[4 * p + e] = 0.0f;
            } else if constexpr (kSharedX) {
              Vec16<float>::Unpack(*reinterpret_cast<const uint4*>(xq), xv + 4 * p);
            } else {
              Load4(xq, xv + 4 * p);
            }
          }
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[r][t] = ChunkDot<kV>(wv[r], xv, acc[r][t]);
        }
      }
    }
  } else {
    for (int64_t k = lane; k < in; k += 32) {
      float wv[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[r] = ToFloat(rows[r][k]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (kTokens == 1 || t < n) {
          const float xv = x[t * in + k];
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[r][t] = fmaf(wv[r], xv, acc[r][t]);
        }
      }
    }
  }
}

// Whether a GEMV over rows of `in` weights at `w` with activations at `x` takes RowDot's vector path: what
// LaunchGemv decides on the host, decided the same way on the device.
__device__ __forceinline__ bool GemvVectorized(const float* x, const void* w, int64_t in) {
  return in % 8 == 0 && Aligned16(x) && Aligned16(w);
}

}  // namespace odmoe::kernels::internal
