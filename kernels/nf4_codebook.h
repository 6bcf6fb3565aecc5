// The NF4 code book of QLoRA / bitsandbytes, written once for the CUDA kernels (kernels/quant*.cu) and the CPU
// quantizer (src/backend/quantize.cc). A plain header: no CUDA, nothing from src/.
//
// The values are also given as macros because a __constant__ array can only be initialised from a braced
// list of literals; use the constexpr arrays everywhere else.
#pragma once

#include <cstdint>

// The 16 normal-float quantiles, ascending, 0.0 at index 7.
#define ODMOE_NF4_CODEBOOK                                                                                       \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,              \
      -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,           \
      0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,                    \
      0.7229568362236023f, 1.0f

// The 15 midpoints between consecutive entries, as bitsandbytes writes them (its dQuantizeNF4 thresholds): the
// code of v is the number of midpoints below v (a value on a midpoint goes to the lower code; NaN gives 0).
#define ODMOE_NF4_MIDPOINTS                                                                                      \
  -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,                     \
      -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,               \
      0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f, 0.5016634166240692f,  \
      0.6427869200706482f, 0.8614784181118011f

namespace odmoe::kernels {

inline constexpr int64_t kNf4BlockSize = 64;  // weights per absmax, along a row
inline constexpr float kNf4CodeBook[16] = {ODMOE_NF4_CODEBOOK};
inline constexpr float kNf4Midpoints[15] = {ODMOE_NF4_MIDPOINTS};
// NF4 layout of a row of `cols` weights: ceil(cols / 64) blocks, 32 code bytes each.
inline int64_t Nf4BlocksPerRow(int64_t cols) { return (cols + kNf4BlockSize - 1) / kNf4BlockSize; }
inline int64_t Nf4RowBytes(int64_t cols) { return Nf4BlocksPerRow(cols) * (kNf4BlockSize / 2); }

}  // namespace odmoe::kernels
