// Weight-only quantization: INT8 with one absmax per output row, NF4 with one absmax per block of 64 along the
// input dimension; quantizers (bitwise equal to the CPU ones in src/backend/quantize.h), dequantizers, and
// dequantizing GEMV (few tokens) / GEMM (many tokens) with fp32 activations and accumulation.
//
// Layouts, for a weight w: [rows, cols] (rows = output features, cols = input features):
//  INT8: q: int8 [rows, cols]; absmax: float [rows] = max_j |w[r, j]|.
//        q[r, j] = rint(w[r, j] / absmax[r] * 127) in fp32 (division, then product, round half to even);
//        0 when absmax[r] == 0. Dequantized: q * (absmax[r] / 127).
//  NF4:  blocks of 64 columns per row, the last one partial when cols % 64 != 0: bpr = ceil(cols / 64).
//        absmax: float [rows, bpr] = max |w| over the block.
//        codes: uint8 [rows, bpr * 32]: byte b of a row holds column 2b in its high nibble and column 2b + 1 in
//        its low nibble (the bitsandbytes order); nibbles past `cols` hold 7 (the code of 0.0).
//        code = index into kNf4CodeBook nearest to w * (1.0f / absmax) (fp32), by the bitsandbytes decision
//        thresholds (midpoints, a value on a midpoint goes to the lower code); absmax == 0 gives code 7.
//        Dequantized: kNf4CodeBook[code] * absmax.
// W is float, __half or __nv_bfloat16 for the quantizers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/nf4_codebook.h"

namespace odmoe::kernels {

// kNf4BlockSize, kNf4CodeBook, Nf4BlocksPerRow, Nf4RowBytes: kernels/nf4_codebook.h.

// ---- quantizers and dequantizers ---------------------------------------------------------------------------
// One block per row.
template <typename W>
cudaError_t LaunchQuantizeInt8Rows(const W* w, int64_t rows, int64_t cols, int8_t* q, float* absmax,
                                   cudaStream_t stream);
// One warp per block of 64.
template <typename W>
cudaError_t LaunchQuantizeNf4(const W* w, int64_t rows, int64_t cols, uint8_t* codes, float* absmax,
                              cudaStream_t stream);
// w: [rows, cols] fp32.
cudaError_t LaunchDequantizeInt8Rows(const int8_t* q, const float* absmax, int64_t rows, int64_t cols, float* w,
                                     cudaStream_t stream);
cudaError_t LaunchDequantizeNf4(const uint8_t* codes, const float* absmax, int64_t rows, int64_t cols, float* w,
                                cudaStream_t stream);

// ---- products: y[n, rows] = x[n, cols] * dequant(w)^T ------------------------------------------------------
// GEMV: per lane, units of 8 weights, INT8 in an 8-byte load and NF4 in a 4-byte load (NF4 decoded by warp shuffles
// from the code book held in registers), the next loads in flight while one is summed, up to kGemvMaxTokens (gemv.h)
// tokens per pass over the weights (one token: a kernel of its own, 4, 2 or 1 output rows per warp by the row count;
// more: one row per warp); the row (INT8) or block (NF4) scale is applied to each partial sum. As for LaunchGemv, row
// t of y is bitwise what a call with token t alone gives. GEMM: 64x64 output tiles, 32-deep k steps, the weight tile
// dequantized into shared memory, 4x4 outputs per thread, fp32 FMA. y must not alias x.
cudaError_t LaunchGemvInt8(const float* x, const int8_t* q, const float* absmax, int64_t n, int64_t cols, int64_t rows,
                           float* y, cudaStream_t stream);
cudaError_t LaunchGemvNf4(const float* x, const uint8_t* codes, const float* absmax, int64_t n, int64_t cols,
                          int64_t rows, float* y, cudaStream_t stream);
// Candidate one-token GEMVs (y[rows] = x[cols] * dequant(w)^T) that bench/gemv_sweep times against LaunchGemvInt8's
// and LaunchGemvNf4's: codes in 16-byte loads (16 INT8 / 32 NF4 columns a lane), x staged in shared memory. They sum
// a row in another order than those, so the backend must not mix the two kinds; it uses LaunchGemvInt8 /
// LaunchGemvNf4 until a GPU's figures say otherwise. InvalidValue unless x and the codes are 16-byte aligned and
// cols % 16 == 0 (INT8) / cols % 4 == 0 (NF4), or when the shared memory of x (5 / 4.5 bytes a column) is more than
// the GPU gives a block.
cudaError_t LaunchGemvInt8Wide(const float* x, const int8_t* q, const float* absmax, int64_t cols, int64_t rows,
                               float* y, cudaStream_t stream);
cudaError_t LaunchGemvNf4Wide(const float* x, const uint8_t* codes, const float* absmax, int64_t cols, int64_t rows,
                              float* y, cudaStream_t stream);
cudaError_t LaunchGemmInt8(const float* x, const int8_t* q, const float* absmax, int64_t n, int64_t cols, int64_t rows,
                           float* y, cudaStream_t stream);
cudaError_t LaunchGemmNf4(const float* x, const uint8_t* codes, const float* absmax, int64_t n, int64_t cols,
                          int64_t rows, float* y, cudaStream_t stream);

}  // namespace odmoe::kernels
