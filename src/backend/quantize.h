// Weight-only quantization on the CPU: INT8 with one absmax per output row, and NF4 (QLoRA's 4-bit normal
// float) with one absmax per block of 64 along the input dimension. The CUDA quantizers (kernels/quant.h)
// produce the same bytes bit for bit: both perform exactly the fp32 operations written below.
//
// Layouts, for a weight w: [rows, cols] (rows = output features, cols = input features), row-major:
//  INT8  q:      int8  [rows, cols]
//        absmax: float [rows]           absmax[r] = max_j |w[r, j]|
//        q[r, j] = nearbyint((w[r, j] / absmax[r]) * 127.0f), fp32 division then product, rounding half to
//        even, clamped to [-127, 127]; 0 where absmax[r] == 0.
//        Dequantized: q[r, j] * (absmax[r] / 127.0f).
//  NF4   bpr = Nf4BlocksPerRow(cols) = ceil(cols / 64) blocks per row; the last one is partial when
//        cols % 64 != 0 (it is padded, never merged with the next row).
//        absmax: float [rows, bpr]      the max |w| over the block
//        codes:  uint8 [rows, bpr * 32] (Nf4RowBytes(cols) per row): byte b of a row holds column 2b in its
//        high nibble and column 2b + 1 in its low nibble (the bitsandbytes order); nibbles of padding columns
//        hold 7, the code of 0.0.
//        code = Nf4Code(w * (1.0f / absmax)) (fp32 reciprocal then product, as bitsandbytes does); the
//        nearest code book entry, decided by the midpoints between entries (a value exactly on a midpoint
//        takes the lower code); absmax == 0 gives code 7.
//        Dequantized: kNf4CodeBook[code] * absmax.
// Weights must be finite (a NaN goes to -127 / code 0; an infinite absmax makes its row or block NaN-coded).
#pragma once

#include <cstdint>

#include "kernels/nf4_codebook.h"
#include "src/common/dtype.h"

namespace odmoe {

// The NF4 block size, code book (ascending; kNf4CodeBook[7] == 0.0f), midpoints and row sizes: written once,
// in kernels/nf4_codebook.h, for the CUDA kernels and these CPU quantizers.
using kernels::kNf4BlockSize;
using kernels::kNf4CodeBook;
using kernels::kNf4Midpoints;
using kernels::Nf4BlocksPerRow;
using kernels::Nf4RowBytes;

// The 4-bit code of a value normalised to [-1, 1] (the bitsandbytes dQuantizeNF4 decision).
uint8_t Nf4Code(float v);

// w: [rows, cols] in `dtype` (F32, F16 or BF16); q: [rows, cols]; absmax: [rows].
void QuantizeInt8Rows(const void* w, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* absmax);
// w: [rows, cols] fp32.
void DequantizeInt8Rows(const int8_t* q, const float* absmax, int64_t rows, int64_t cols, float* w);

// w: [rows, cols] in `dtype` (F32, F16 or BF16); codes: [rows, Nf4RowBytes(cols)]; absmax: [rows, bpr].
void QuantizeNf4(const void* w, DType dtype, int64_t rows, int64_t cols, uint8_t* codes, float* absmax);
// w: [rows, cols] fp32.
void DequantizeNf4(const uint8_t* codes, const float* absmax, int64_t rows, int64_t cols, float* w);

}  // namespace odmoe
