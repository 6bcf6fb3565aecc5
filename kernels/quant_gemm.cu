// Dequantizing products with INT8 / NF4 weights (layouts in quant.h), fp32 activations and accumulation.
//  - GemvInt8Kernel / GemvNf4Kernel<kTokens, kRows, kDepth, kVec>: one body (QuantGemvRows over a format: Int8Format,
//    Nf4Format), 4 warps per 128-thread block, kRows output rows per warp (one token: 4 or 1 by the row count, the
//    activations a lane loads serving every row; up to kGemvMaxTokens tokens: 1). A row is walked in steps of 256
//    columns, a lane taking two pieces of 4 columns in each (INT8: lane l at 4l of both halves of the step, the
//    dense GEMV's walk, RowDot in gemv_row.cuh; NF4: 8 lanes per 64-column block, so that a lane's 8 weights share
//    its block scale), placed so that a warp's activation loads touch 4 cache lines per 512 bytes. A ring of kDepth
//    register buffers keeps the next steps' codes in flight while one is summed. INT8 becomes fp32 with PRMT + FADD
//    (no I2F) and takes absmax / 127 once per row; NF4 codes become fp32 by a warp shuffle from the lane holding
//    that code book entry (one SHFL per weight, no divergent constant-memory reads), and each step's 8-weight
//    partial sum takes its block absmax. Every variant sums a row in the same order (explicit FMAs in column order
//    per step, steps in ascending order, the butterfly WarpSum), so a row's result is bitwise the same whatever the
//    number of tokens, kRows or kDepth. Shapes that break 16-byte alignment take scalar loads (kVec = false).
//  - GemvWideKernel<Format, kRows, kDepth>: candidates for one token (LaunchGemvInt8Wide / LaunchGemvNf4Wide, timed
//    by bench/gemv_sweep, not used by the backend): a lane loads 16 bytes of codes a step, x staged in shared memory.
//  - DequantGemmKernel<Tile>: C tile of 64 tokens x 64 output rows per 256-thread block, k in steps of 32; the
//    activation tile and the weight tile (dequantized on the fly by Tile::Value) are staged in shared memory
//    and each thread accumulates a 4x4 sub-tile with fp32 FMA.
#include "kernels/quant.h"

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/gemv.h"
#include "kernels/gemv_row.cuh"

namespace odmoe::kernels {
namespace {

using internal::Aligned16;
using internal::AllowDynamicShared;
using internal::CeilDiv;
using internal::ChunkDot;
using internal::Load4;
using internal::Unpack4;
using internal::WarpSum;

constexpr int kThreads = 256;  // the GEMM's block
constexpr int kMaxN = static_cast<int>(kGemvMaxTokens);
constexpr int kHalfBlock = static_cast<int>(kNf4BlockSize / 2);  // bytes per NF4 block, weights per 16 bytes

// The GEMVs' blocks: 4 warps (small blocks spread a one-wave grid evenly over the SMs).
constexpr int kGemvThreads = 128;
constexpr int kGemvWarps = kGemvThreads / 32;

__constant__ float kCodeBookDevice[16] = {ODMOE_NF4_CODEBOOK};

// The 8 int8 weights of 8 bytes, exactly, without I2F (a quarter-rate conversion on sm_90): byte b ^ 0x80 is placed
// in the low mantissa bits of 2^23 (one PRMT) and 2^23 + 128 subtracted (one FADD).
__device__ __forceinline__ void DecodeInt8x8(uint2 raw, float (&w)[8]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t biased = (i == 0 ? raw.x : raw.y) ^ 0x80808080u;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      // Bytes: biased.b, 0, 0, 0x4b (2^23 as fp32 is 0x4b000000).
      const uint32_t bits = __byte_perm(biased, 0x4b000000u, 0x7440u | static_cast<uint32_t>(b));
      w[4 * i + b] = __uint_as_float(bits) - 8388736.0f;  // 2^23 + 128
    }
  }
}

// The 8 NF4 weights of one 32-bit word of codes in column order (byte b: column 2b in its high nibble, 2b + 1 in its
// low nibble), exactly. `book` is kNf4CodeBook[lane % 16]; a shuffle reads lane (word >> 4k) % 32, i.e. the code plus
// 16 times the next code's low bit, which holds the same entry: one shift and one SHFL per weight, no divergent
// constant-memory reads. REQUIRES: all 32 lanes of the warp call it together.
__device__ __forceinline__ void DecodeNf4x8(uint32_t word, float book, float (&w)[8]) {
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    w[2 * b] = __shfl_sync(0xffffffffu, book, static_cast<int>(word >> (8 * b + 4)));
    w[2 * b + 1] = __shfl_sync(0xffffffffu, book, static_cast<int>(word >> (8 * b)));
  }
}

// ---- GEMVs -----------------------------------------------------------------------------------------------------
// The 4 bytes at p (any alignment) as a little-endian word, bytes from `valid` on (0..4) read as 0 and not loaded.
__device__ __forceinline__ uint32_t LoadWordBytes(const void* p, int64_t valid) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i < valid) word |= static_cast<uint32_t>(__ldg(b + i)) << (8 * i);
  }
  return word;
}

// A row is walked in steps of kStepCols columns. In each, a lane takes two pieces of 4 consecutive columns: piece 0
// at column step * kStepCols + Format::LaneCol(lane), piece 1 Format::kPiece1 columns after it; a piece from
// Format::Width(cols) on is not loaded and weighs 0 (QuantGemvRows loads a lane's step only where piece 0 is inside
// the width; Format::Load decides piece 1). Both formats place the pieces so that a warp's loads of piece
// 0's activations (and of piece 1's) touch 4 cache lines for 512 bytes. (With one unit of 8 consecutive columns a
// lane, a warp's float4 loads of activations spread over 1 KB in 8 lines; before that, 16 bytes of codes a lane
// spread them over 4 KB in 32 lines (NF4), and the NF4 GEMV ran at 20% of the copy bandwidth with L1/TEX 81% busy,
// DRAM 14%, stalled on MIO: Nsight Compute on the H200.)
constexpr int64_t kStepCols = 256;

// The two formats as QuantGemvRows sees them: a Unit is a lane's codes of one step (its two pieces), decoded to 8
// weights in column order, piece 0's then piece 1's.
struct Int8Format {
  using Code = int8_t;
  using Unit = uint2;                          // piece 0's 4 bytes, piece 1's
  static constexpr bool kBlockScales = false;  // one scale per row, applied to the row's sum
  // Lane l at 4l of both halves of the step: a warp's codes of a piece are 128 contiguous bytes.
  static constexpr int kPiece1 = kStepCols / 2;
  static constexpr int kStepBytes = kStepCols;  // of codes, per row
  __device__ static int LaneCol(int lane) { return 4 * lane; }
  __device__ static int LaneByte(int lane) { return 4 * lane; }  // of piece 0's codes within the step
  __host__ __device__ static int64_t Width(int64_t cols) { return cols; }
  __device__ static int64_t RowBytes(int64_t cols) { return cols; }
  __device__ static int64_t ScalesPerRow(int64_t) { return 1; }
  static constexpr int kStepScales = 0;  // no block scales
  __device__ static int LaneScale(int) { return 0; }
  __device__ static float Book(int) { return 0.0f; }
  // The pieces whose piece 0 starts at p0, inside the width (= cols); `piece1`: piece 1 is inside it too. !vec: the
  // row has `left` columns from piece 0 on, and bytes past them read as code 0, i.e. 0.0 (vec ignores it).
  __device__ static Unit Load(const Code* p0, bool piece1, int64_t left, bool vec) {
    const Code* p1 = p0 + kPiece1;
    if (vec) {  // cols % 8 == 0: each piece wholly inside the row or past it
      return make_uint2(__ldcs(reinterpret_cast<const unsigned int*>(p0)),  // evict-first: see Load4Streaming
                        piece1 ? __ldcs(reinterpret_cast<const unsigned int*>(p1)) : 0u);
    }
    return make_uint2(LoadWordBytes(p0, left), LoadWordBytes(p1, left - kPiece1));
  }
  __device__ static void Decode(const Unit& raw, float, float (&w)[8]) { DecodeInt8x8(raw, w); }
  // GemvWideKernel's: 16 bytes of codes are 16 columns; group g (0, 1) of 8 weights is bytes 8g..8g+7.
  static constexpr int64_t kWideChunk = 16;
  static constexpr int kWideStepScales = 0;
  __device__ static int WideLaneScale(int) { return 0; }
  __device__ static void DecodeWide(const uint4& raw, int g, float, float (&w)[8]) {
    DecodeInt8x8(g == 0 ? make_uint2(raw.x, raw.y) : make_uint2(raw.z, raw.w), w);
  }
  __device__ static float Finish(float sum, const float* row_scales) { return sum * (row_scales[0] / 127.0f); }
};

struct Nf4Format {
  using Code = uint8_t;
  using Unit = uint32_t;                      // piece 0's 2 bytes in the low half, piece 1's in the high
  static constexpr bool kBlockScales = true;  // each step's 8-weight partial sum takes its block's absmax
  // Block g of the step's 4 to lanes 8g..8g+7, lane 8g + j at 4j of both 32-column halves of the block: a lane's 8
  // columns share one block scale, and a warp's codes of a piece lie in 4 runs of 16 bytes within 128.
  static constexpr int kPiece1 = kNf4BlockSize / 2;
  static constexpr int kStepBytes = kStepCols / 2;
  __device__ static int LaneCol(int lane) { return (lane >> 3) * kNf4BlockSize + 4 * (lane & 7); }
  __device__ static int LaneByte(int lane) { return LaneCol(lane) / 2; }
  // Every column of the row's blocks: a last block's columns past `cols` hold code 7 (0.0). Both pieces of a lane
  // are in one block, so both are inside the width or past it.
  __host__ __device__ static int64_t Width(int64_t cols) { return Blocks(cols) * kNf4BlockSize; }
  __host__ __device__ static int64_t Blocks(int64_t cols) { return (cols + kNf4BlockSize - 1) / kNf4BlockSize; }
  __device__ static int64_t RowBytes(int64_t cols) { return Blocks(cols) * kHalfBlock; }
  __device__ static int64_t ScalesPerRow(int64_t cols) { return Blocks(cols); }
  // A lane's block of a step: the step's (lane / 8)-th.
  static constexpr int kStepScales = kStepCols / kNf4BlockSize;
  __device__ static int LaneScale(int lane) { return lane >> 3; }
  __device__ static float Book(int lane) { return kCodeBookDevice[lane & 15]; }
  // The pieces whose piece 0 starts at p0, inside the width (then both are inside it).
  __device__ static Unit Load(const Code* p0, bool, int64_t, bool vec) {
    const Code* p1 = p0 + kPiece1 / 2;
    if (vec) {
      return static_cast<uint32_t>(__ldcs(reinterpret_cast<const unsigned short*>(p0))) |  // evict-first
             static_cast<uint32_t>(__ldcs(reinterpret_cast<const unsigned short*>(p1))) << 16;
    }
    return LoadWordBytes(p0, 2) | LoadWordBytes(p1, 2) << 16;
  }
  // REQUIRES: the whole warp (DecodeNf4x8).
  __device__ static void Decode(const Unit& raw, float book, float (&w)[8]) { DecodeNf4x8(raw, book, w); }
  // GemvWideKernel's: 16 bytes of codes are 32 columns (half a block); group g (0..3) of 8 weights is word g.
  // REQUIRES: the whole warp.
  static constexpr int64_t kWideChunk = 32;
  // Chunk c's block is c / 2: lane l's, l / 2 in each step of 32 chunks, 16 blocks on.
  static constexpr int kWideStepScales = 32 * kWideChunk / kNf4BlockSize;
  __device__ static int WideLaneScale(int lane) {
    return lane * static_cast<int>(kWideChunk) / static_cast<int>(kNf4BlockSize);
  }
  __device__ static void DecodeWide(const uint4& raw, int g, float book, float (&w)[8]) {
    DecodeNf4x8(g == 0 ? raw.x : g == 1 ? raw.y : g == 2 ? raw.z : raw.w, book, w);
  }
  __device__ static float Finish(float sum, const float*) { return sum; }
};

// One step's codes (and, NF4 only, block scales) for every row of the warp.
template <class Format, int kRows>
struct Step {
  typename Format::Unit raw[kRows];
  float scale[kRows];
};

// The 4 activations at p (16-byte aligned) when `inside`, else 0 (p is not read).
__device__ __forceinline__ void LoadX4If(const float* p, bool inside, float* xv) {
  if (inside) {
    Load4(p, xv);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) xv[e] = 0.0f;
  }
}

// The 4 activations of token row `xt` from column `col` (a multiple of 4), 0 past `cols`. kVec: one float4 load,
// wholly inside or wholly past the row (REQUIRES cols % 4 == 0 and xt 16-byte aligned); otherwise one float at a time.
template <bool kVec>
__device__ __forceinline__ void LoadX4(const float* xt, int64_t col, int64_t cols, float* xv) {
  if (kVec) {
    LoadX4If(xt + col, col < cols, xv);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) xv[e] = col + e < cols ? xt[col + e] : 0.0f;
  }
}

// A lane's cursors into a warp's kRows rows from row0 (a row past the end gets the last row's: read, its result not
// stored): its first codes of each row (`lane_byte` bytes in) and its first block scale (`lane_scale` scales in).
template <class Format, int kRows>
__device__ __forceinline__ void WarpRowCursors(const typename Format::Code* q, const float* absmax, int64_t cols,
                                               int64_t rows, int64_t row0, int lane_byte, int lane_scale,
                                               const typename Format::Code* (&qc)[kRows], const float* (&sc)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = min(row0 + r, rows - 1);
    qc[r] = q + row * Format::RowBytes(cols) + lane_byte;
    sc[r] = absmax + row * Format::ScalesPerRow(cols) + lane_scale;
  }
}

// The GEMVs' rows have fewer than 2^30 columns (their launchers refuse more), so that step and column counts within
// a row fit an int and the kernels' per-step index math is 32-bit (their pointers advance by constants).
constexpr int64_t kQuantGemvMaxCols = int64_t{1} << 30;

// The steps s >= 0 of `step` columns whose column s * step + col is below `limit` (0 when col >= limit).
// REQUIRES: limit < kQuantGemvMaxCols.
__device__ __forceinline__ int StepsBelow(int64_t limit, int64_t col, int64_t step) {
  return limit > col ? static_cast<int>((limit - col + step - 1) / step) : 0;
}

// The body of both formats' GEMV kernels. A warp takes kRows consecutive output rows from row0 (a row past the end
// reads the last row; its result is not stored) and walks them in steps of kStepCols columns, a lane taking its
// two pieces of each (see kStepCols). The codes of the next kDepth - 1 steps are loaded before a step is computed
// (a ring of kDepth register buffers, refilled as each is consumed), so every lane keeps up to kRows * kDepth steps
// of codes in flight. The step count is the same for the whole warp (the NF4 shuffles need every lane); a lane with
// no columns in a step adds nothing. A step's 8 products are summed in column order by explicit FMAs (ChunkDot):
// onto the row's accumulator (INT8), or from zero and then added times the block scale (NF4); a lane sums its steps
// in ascending order and the warp its lanes with WarpSum. So a row's result depends neither on kRows, kDepth nor
// the number of tokens (kTokens = 1: exactly one token; otherwise n <= kTokens).
// Index math: each lane counts once how many steps its pieces' codes and activations are inside the row, and keeps
// cursors (codes and block scales per row, activations) that advance by kDepth steps per pass of the ring, the ring's
// loads at constant offsets from them: a one-token step's index math is a few 32-bit compares. Every lane decodes
// (the shuffles) and multiplies every step; a lane past the width keeps its accumulators. REQUIRES: cols <
// kQuantGemvMaxCols.
template <class Format, int kTokens, int kRows, int kDepth, bool kVec>
__device__ __forceinline__ void QuantGemvRows(const float* __restrict__ x, const typename Format::Code* __restrict__ q,
                                              const float* __restrict__ absmax, int n, int64_t cols, int64_t rows,
                                              int64_t row0, float* __restrict__ y) {
  static_assert(kTokens == 1 || kRows == 1, "several tokens take one row per warp");
  const int lane = threadIdx.x & 31;
  const float book = Format::Book(lane);
  const int64_t width = Format::Width(cols);
  const int steps = StepsBelow(width, 0, kStepCols);
  const int lane_col = Format::LaneCol(lane);
  // This lane's steps with codes (piece 0 inside the width), with piece 1's codes, with piece 0's and piece 1's
  // activations (inside cols).
  const int code_steps = StepsBelow(width, lane_col, kStepCols);
  const int code1_steps = StepsBelow(width, lane_col + Format::kPiece1, kStepCols);
  const int x0_steps = StepsBelow(cols, lane_col, kStepCols);
  const int x1_steps = StepsBelow(cols, lane_col + Format::kPiece1, kStepCols);
  // The cursors, at step s0 of the loop below.
  const typename Format::Code* qc[kRows];
  const float* sc[kRows];
  WarpRowCursors<Format>(q, absmax, cols, rows, row0, Format::LaneByte(lane), Format::LaneScale(lane), qc, sc);
  const float* xc = x + lane_col;
  float acc[kRows][kTokens];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[r][t] = 0.0f;
  }
  // Step s, `ahead` steps past the cursors' (a constant once unrolled). A lane whose piece 0 is past the width (a
  // step past the last, too) loads nothing.
  auto load = [&](int s, int ahead, Step<Format, kRows>& dst) {
    const bool inside = s < code_steps;
    const bool piece1 = s < code1_steps;
    const int64_t left = kVec ? 0 : width - (static_cast<int64_t>(s) * kStepCols + lane_col);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      dst.raw[r] = inside ? Format::Load(qc[r] + ahead * Format::kStepBytes, piece1, left, kVec)
                          : typename Format::Unit{};
      if constexpr (Format::kBlockScales) {
        dst.scale[r] = inside ? __ldg(sc[r] + ahead * Format::kStepScales) : 0.0f;
      }
    }
  };
  Step<Format, kRows> ring[kDepth];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) load(d, d, ring[d]);
  for (int s0 = 0; s0 < steps; s0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int s = s0 + d;
      if (s >= steps) break;  // the same for the whole warp
      // This step's activations of token t (0 past the row; lanes past the width read none).
      auto load_x = [&](int t, float (&xv)[8]) {
        if constexpr (kVec) {
          const float* xt = xc + t * cols + d * kStepCols;
          LoadX4If(xt, s < x0_steps, xv);
          LoadX4If(xt + Format::kPiece1, s < x1_steps, xv + 4);
        } else {
          const int64_t col0 = static_cast<int64_t>(s) * kStepCols + lane_col;
          LoadX4<false>(x + t * cols, col0, cols, xv);
          LoadX4<false>(x + t * cols, col0 + Format::kPiece1, cols, xv + 4);
        }
      };
      // The step's 8 products of row r and token t onto the row's accumulator (only where the lane has codes).
      const bool inside = s < code_steps;
      auto accumulate = [&](int r, int t, const float (&wv)[8], const float (&xv)[8]) {
        if constexpr (Format::kBlockScales) {
          const float part = ChunkDot<8>(wv, xv, 0.0f);
          if (inside) acc[r][t] = fmaf(part, ring[d].scale[r], acc[r][t]);
        } else {
          const float next = ChunkDot<8>(wv, xv, acc[r][t]);
          if (inside) acc[r][t] = next;
        }
      };
      if constexpr (kTokens == 1) {
        // One token: its activations serve every row, each row's weights decoded just before its products.
        float xv[8];
        load_x(0, xv);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float wv[8];
          Format::Decode(ring[d].raw[r], book, wv);
          accumulate(r, 0, wv, xv);
        }
      } else {
        // Several tokens, one row (static_assert above): its weights decoded once serve every token.
        float wv[8];
        Format::Decode(ring[d].raw[0], book, wv);
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
          if (t < n) {
            float xv[8];
            load_x(t, xv);
            accumulate(0, t, wv, xv);
          }
        }
      }
      load(s + kDepth, d + kDepth, ring[d]);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      qc[r] += kDepth * Format::kStepBytes;
      sc[r] += kDepth * Format::kStepScales;
    }
    xc += kDepth * kStepCols;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row >= rows) break;  // the same for the whole warp
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (kTokens == 1 || t < n) {
        const float sum = WarpSum(acc[r][t]);
        if (lane == 0) y[t * rows + row] = Format::Finish(sum, absmax + row * Format::ScalesPerRow(cols));
      }
    }
  }
}

// The first row of this warp's kRows (the launch has kGemvWarps warps per block).
template <int kRows>
__device__ __forceinline__ int64_t WarpRow0() {
  return (static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5)) * kRows;
}

// Two kernels, so that profilers and the emulator's counters tell the formats apart.
// kVec: q and x 16-byte aligned and cols % 8 == 0.
template <int kTokens, int kRows, int kDepth, bool kVec>
__global__ void __launch_bounds__(kGemvThreads)
    GemvInt8Kernel(const float* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ absmax, int n,
                   int64_t cols, int64_t rows, float* __restrict__ y) {
  const int64_t row0 = WarpRow0<kRows>();
  if (row0 >= rows) return;  // the same for the whole warp
  QuantGemvRows<Int8Format, kTokens, kRows, kDepth, kVec>(x, q, absmax, n, cols, rows, row0, y);
}

// kVec: codes and x 16-byte aligned and cols % 4 == 0.
template <int kTokens, int kRows, int kDepth, bool kVec>
__global__ void __launch_bounds__(kGemvThreads)
    GemvNf4Kernel(const float* __restrict__ x, const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                  int n, int64_t cols, int64_t rows, float* __restrict__ y) {
  const int64_t row0 = WarpRow0<kRows>();
  if (row0 >= rows) return;  // the same for the whole warp
  QuantGemvRows<Nf4Format, kTokens, kRows, kDepth, kVec>(x, codes, absmax, n, cols, rows, row0, y);
}

// ---- tiled GEMM ----------------------------------------------------------------------------------------------
constexpr int kBM = 64;  // tokens per tile
constexpr int kBN = 64;  // output rows per tile
constexpr int kBK = 32;

struct Int8Tile {
  const int8_t* q;
  const float* absmax;
  int64_t cols;
  __device__ float Value(int64_t r, int64_t k, const float*) const { return static_cast<float>(q[r * cols + k]); }
  __device__ float RowScale(int64_t r) const { return absmax[r] / 127.0f; }
};

struct Nf4Tile {
  const uint8_t* codes;
  const float* absmax;
  int64_t cols;
  int64_t bpr;
  __device__ float Value(int64_t r, int64_t k, const float* cb) const {
    const uint32_t byte = codes[r * bpr * kHalfBlock + (k >> 1)];
    const uint32_t code = (k & 1) ? (byte & 15u) : (byte >> 4);
    return cb[code] * absmax[r * bpr + k / kNf4BlockSize];
  }
  __device__ float RowScale(int64_t) const { return 1.0f; }
};

template <class Tile>
__global__ void __launch_bounds__(kThreads) DequantGemmKernel(const float* __restrict__ x, Tile tile, int64_t n,
                                                              int64_t cols, int64_t rows, float* __restrict__ y) {
  __shared__ float cb[16];
  __shared__ __align__(16) float xs[kBK][kBM + 4];
  __shared__ __align__(16) float ws[kBK][kBN + 4];
  const int tid = threadIdx.x;
  if (tid < 16) cb[tid] = kCodeBookDevice[tid];
  const int tx = tid % 16;  // output rows tx * 4 .. + 3
  const int ty = tid / 16;  // tokens ty * 4 .. + 3
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBM;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < cols; k0 += kBK) {
    __syncthreads();  // the previous tile is consumed (and the code book is visible)
#pragma unroll
    for (int i = 0; i < (kBM * kBK) / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int a = idx / kBK;
      const int kk = idx % kBK;
      const int64_t gk = k0 + kk;
      const int64_t gm = m0 + a;
      const int64_t gr = r0 + a;
      xs[kk][a] = (gm < n && gk < cols) ? x[gm * cols + gk] : 0.0f;
      ws[kk][a] = (gr < rows && gk < cols) ? tile.Value(gr, gk, cb) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kBK; ++kk) {
      const float4 av = *reinterpret_cast<const float4*>(&xs[kk][ty * 4]);
      const float4 bv = *reinterpret_cast<const float4*>(&ws[kk][tx * 4]);
      const float a4[4] = {av.x, av.y, av.z, av.w};
      const float b4[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += a4[i] * b4[j];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t gm = m0 + ty * 4 + i;
    if (gm >= n) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t gr = r0 + tx * 4 + j;
      if (gr < rows) y[gm * rows + gr] = acc[i][j] * tile.RowScale(gr);
    }
  }
}

template <class Tile>
cudaError_t LaunchDequantGemm(const float* x, Tile tile, int64_t n, int64_t cols, int64_t rows, float* y,
                              cudaStream_t stream) {
  const int64_t gx = CeilDiv(rows, kBN);
  const int64_t gy = CeilDiv(n, kBM);
  if (gx > 0x7fffffff || gy > 65535) return cudaErrorInvalidValue;
  DequantGemmKernel<Tile>
      <<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0, stream>>>(x, tile, n, cols, rows, y);
  return cudaGetLastError();
}

// Rows per warp of the one-token GEMVs, from the row count only (never from n: a row's summation order does not
// depend on them anyway). Four rows per warp when there are rows enough to fill the GPU with warps (the x a lane
// loads for a unit serves four rows: for NF4 the x traffic through L1 would otherwise be 8 times the codes'), one
// when there are fewer. On an H200 (bench/gemv_sweep, 2026-12-04), 4096x14336 at 1 / 2 / 4 rows per warp (best
// depth of each) gave INT8 40.1 / 25.2 / 36.0% of the copy bandwidth and NF4 19.3 / 14.2 / 15.0%; 14336x4096
// INT8 44.3 / 45.0 / 65.8% and NF4 23.3 / 25.6 / 23.8%.
enum class GemvShape { kRows4, kRows1 };
GemvShape OneTokenShape(int64_t rows) { return rows >= 8192 ? GemvShape::kRows4 : GemvShape::kRows1; }

// The blocks of a GEMV over `rows` with kRows rows per warp.
template <int kRows>
unsigned GemvBlocks(int64_t rows) {
  return static_cast<unsigned>(CeilDiv(rows, kGemvWarps * kRows));
}

// The INT8 and NF4 GEMVs, for QuantGemv's dispatch: Launch<kTokens, kRows, kDepth, kVec> launches the format's
// kernel of those parameters over `rows`; kDepth* are its ring depths for one aligned token at 4 and 1 rows per warp,
// and for several tokens.
struct Int8Gemv {
  using Code = int8_t;
  // 8 bytes of codes a step: 64 in flight per lane at 4 rows, 128 at 1. On an H200 with evict-first code loads:
  // 14336x4096 at 4 rows 67.3% of the copy bandwidth at depth 2, 64.7% at 4; 4096x14336 at 1 row 58.4% at depth
  // 16, 44.7% at 4, 45.2% at 8, 29.7% at 24.
  static constexpr int kDepthRows4 = 2, kDepthRows1 = 16, kDepthTokens = 4;
  template <int kTokens, int kRows, int kDepth, bool kVec>
  static void Launch(const float* x, const Code* q, const float* absmax, int n, int64_t cols, int64_t rows, float* y,
                     cudaStream_t stream) {
    GemvInt8Kernel<kTokens, kRows, kDepth, kVec>
        <<<GemvBlocks<kRows>(rows), kGemvThreads, 0, stream>>>(x, q, absmax, n, cols, rows, y);
  }
};
struct Nf4Gemv {
  using Code = uint8_t;
  // 4 bytes of codes a step (and a block scale, mostly an L1 hit): 64 in flight per lane at 4 rows, 16 at 1 (deeper
  // rings at 1 row ran slower on an H200: 4096x14336 19.3% of the copy bandwidth at depth 4, 14.9% at 8, 9.2% at
  // 16).
  static constexpr int kDepthRows4 = 4, kDepthRows1 = 4, kDepthTokens = 4;
  template <int kTokens, int kRows, int kDepth, bool kVec>
  static void Launch(const float* x, const Code* q, const float* absmax, int n, int64_t cols, int64_t rows, float* y,
                     cudaStream_t stream) {
    GemvNf4Kernel<kTokens, kRows, kDepth, kVec>
        <<<GemvBlocks<kRows>(rows), kGemvThreads, 0, stream>>>(x, q, absmax, n, cols, rows, y);
  }
};

// The one choice of kernel variant for both formats: kGemvMaxTokens tokens at a time; one row per warp for several
// tokens or an unaligned shape; for one aligned token, OneTokenShape's rows per warp. `vec`: the format's kVec
// condition, decided by the caller.
template <class Format>
cudaError_t QuantGemv(const float* x, const typename Format::Code* q, const float* absmax, int64_t n, int64_t cols,
                      int64_t rows, bool vec, float* y, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  if (cols <= 0 || cols >= kQuantGemvMaxCols) return cudaErrorInvalidValue;
  if (CeilDiv(rows, kGemvWarps) > 0x7fffffff) return cudaErrorInvalidValue;
  for (int64_t t0 = 0; t0 < n; t0 += kMaxN) {
    const int cnt = static_cast<int>(std::min<int64_t>(kMaxN, n - t0));
    const float* xc = x + t0 * cols;
    float* yc = y + t0 * rows;
    if (!vec) {
      if (cnt > 1) {
        Format::template Launch<kMaxN, 1, 2, false>(xc, q, absmax, cnt, cols, rows, yc, stream);
      } else {
        Format::template Launch<1, 1, 2, false>(xc, q, absmax, cnt, cols, rows, yc, stream);
      }
    } else if (cnt > 1) {
      Format::template Launch<kMaxN, 1, Format::kDepthTokens, true>(xc, q, absmax, cnt, cols, rows, yc, stream);
    } else {
      switch (OneTokenShape(rows)) {
        case GemvShape::kRows4:
          Format::template Launch<1, 4, Format::kDepthRows4, true>(xc, q, absmax, cnt, cols, rows, yc, stream);
          break;
        case GemvShape::kRows1:
          Format::template Launch<1, 1, Format::kDepthRows1, true>(xc, q, absmax, cnt, cols, rows, yc, stream);
          break;
      }
    }
  }
  return cudaGetLastError();
}

// ---- one-token GEMVs with 16-byte code loads (candidates: LaunchGemvInt8Wide, LaunchGemvNf4Wide) ---------------
// A lane takes the Format::kWideChunk consecutive columns of 16 bytes of codes (one load; NF4: half a block, so one
// block scale) in each step of 32 such chunks, so that a warp's code loads of a row are 512 contiguous bytes (the
// GEMVs above load 8 (INT8) or 4 (NF4) bytes a lane in two loads). x (one token) is staged once per block in shared
// memory, each chunk at a pitch of kWideChunk + 4 floats: a lane reads its chunk in 16-byte reads, and the 8 lanes of
// a quarter warp then hit 8 different groups of 4 banks (read from global memory, each such warp read touched 32
// cache lines).
template <class Format>
constexpr int64_t kWidePitch = Format::kWideChunk + 4;

// The shared memory of x for rows of `cols` columns: every chunk of the row's width, padded.
template <class Format>
size_t WideSharedBytes(int64_t cols) {
  return static_cast<size_t>(Format::Width(cols) / Format::kWideChunk * kWidePitch<Format>) * sizeof(float);
}

// A warp takes kRows consecutive rows from row0 (a row past the end reads the last row; its result is not stored).
// The codes (and NF4's block scales) of the next kDepth - 1 steps are in flight while one is summed. A lane sums its
// chunk of a step 8 columns at a time (ChunkDot, column order): onto the row's accumulator (INT8), or from zero and
// then added times the block scale (NF4); steps in ascending order; the warp sums its lanes with WarpSum.
// REQUIRES: x and q 16-byte aligned, Format::Width(cols) % Format::kWideChunk == 0 (INT8: cols % 16 == 0; NF4:
// cols % 4 == 0 for x's loads), launched with kGemvThreads threads and WideSharedBytes<Format>(cols) of dynamic
// shared memory.
template <class Format, int kRows, int kDepth>
__global__ void __launch_bounds__(kGemvThreads)
    GemvWideKernel(const float* __restrict__ x, const typename Format::Code* __restrict__ q,
                   const float* __restrict__ absmax, int64_t cols, int64_t rows, float* __restrict__ y) {
  extern __shared__ float4 xs[];  // chunk c's float4 f at xs[c * kPitch4 + f]
  constexpr int64_t kChunk = Format::kWideChunk;
  constexpr int64_t kPitch4 = kWidePitch<Format> / 4;
  constexpr int kGroups = static_cast<int>(kChunk / 8);  // of 8 weights
  const int chunks = static_cast<int>(Format::Width(cols) / kChunk);
  for (int i = static_cast<int>(threadIdx.x); i < chunks * static_cast<int>(kChunk / 4); i += kGemvThreads) {
    float v[4];
    LoadX4<true>(x, 4 * i, cols, v);  // 0 past cols
    xs[i / (kChunk / 4) * kPitch4 + i % (kChunk / 4)] = make_float4(v[0], v[1], v[2], v[3]);
  }
  __syncthreads();
  const int64_t row0 = WarpRow0<kRows>();
  if (row0 >= rows) return;  // the same for the whole warp, after the block's barrier
  const int lane = threadIdx.x & 31;
  const float book = Format::Book(lane);
  const int steps = StepsBelow(chunks, 0, 32);
  const int lane_steps = StepsBelow(chunks, lane, 32);  // with this lane's chunk inside the row
  // Cursors at step s0 of the loop below: this lane's chunk of each row (16 bytes of codes a chunk), and its block
  // scale.
  constexpr int kChunkBytes = static_cast<int>(sizeof(uint4));
  const typename Format::Code* qc[kRows];
  const float* sc[kRows];
  WarpRowCursors<Format>(q, absmax, cols, rows, row0, lane * kChunkBytes, Format::WideLaneScale(lane), qc, sc);
  struct WideStep {
    uint4 raw[kRows];
    float scale[kRows];
  };
  // Step s, `ahead` steps past the cursors' (a constant once unrolled). A lane whose chunk is past the row (a step
  // past the last, too) loads nothing.
  auto load = [&](int s, int ahead, WideStep& dst) {
    const bool inside = s < lane_steps;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      // evict-first: see Load4Streaming
      dst.raw[r] = inside ? __ldcs(reinterpret_cast<const uint4*>(qc[r]) + 32 * ahead) : make_uint4(0, 0, 0, 0);
      if constexpr (Format::kBlockScales) {
        dst.scale[r] = inside ? __ldg(sc[r] + ahead * Format::kWideStepScales) : 0.0f;
      }
    }
  };
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
  WideStep ring[kDepth];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) load(d, d, ring[d]);
  for (int s0 = 0; s0 < steps; s0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int s = s0 + d;
      if (s >= steps) break;  // the same for the whole warp
      const int chunk = s * 32 + lane;
      const bool inside = s < lane_steps;
      float part[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) part[r] = Format::kBlockScales ? 0.0f : acc[r];
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        float xv[8];
        if (inside) {
          Unpack4(xs[chunk * kPitch4 + 2 * g], xv);
          Unpack4(xs[chunk * kPitch4 + 2 * g + 1], xv + 4);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) xv[e] = 0.0f;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float wv[8];
          Format::DecodeWide(ring[d].raw[r], g, book, wv);  // NF4: the whole warp
          part[r] = ChunkDot<8>(wv, xv, part[r]);
        }
      }
      if (inside) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          acc[r] = Format::kBlockScales ? fmaf(part[r], ring[d].scale[r], acc[r]) : part[r];
        }
      }
      load(s + kDepth, d + kDepth, ring[d]);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      qc[r] += kDepth * 32 * kChunkBytes;
      sc[r] += kDepth * Format::kWideStepScales;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row >= rows) break;  // the same for the whole warp
    const float sum = WarpSum(acc[r]);
    if (lane == 0) y[row] = Format::Finish(sum, absmax + row * Format::ScalesPerRow(cols));
  }
}

// A candidate's launch: kRows rows per warp, kDepth steps in flight, as GemvWideKernel REQUIRES.
template <class Format, int kRows, int kDepth>
cudaError_t LaunchWide(const float* x, const typename Format::Code* q, const float* absmax, int64_t cols, int64_t rows,
                       float* y, cudaStream_t stream) {
  const size_t smem = WideSharedBytes<Format>(cols);
  if (const cudaError_t err = AllowDynamicShared(GemvWideKernel<Format, kRows, kDepth>, smem); err != cudaSuccess) {
    return err;
  }
  GemvWideKernel<Format, kRows, kDepth>
      <<<GemvBlocks<kRows>(rows), kGemvThreads, smem, stream>>>(x, q, absmax, cols, rows, y);
  return cudaGetLastError();
}

// The candidates' one choice: rows per warp by OneTokenShape, ring depths kDepthRows4 / kDepthRows1. `valid`: the
// format's REQUIRES of GemvWideKernel, decided by the caller.
template <class Format, int kDepthRows4, int kDepthRows1>
cudaError_t QuantGemvWide(const float* x, const typename Format::Code* q, const float* absmax, int64_t cols,
                          int64_t rows, bool valid, float* y, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (cols <= 0 || cols >= kQuantGemvMaxCols || !valid || CeilDiv(rows, kGemvWarps) > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  switch (OneTokenShape(rows)) {
    case GemvShape::kRows4:
      return LaunchWide<Format, 4, kDepthRows4>(x, q, absmax, cols, rows, y, stream);
    case GemvShape::kRows1:
      return LaunchWide<Format, 1, kDepthRows1>(x, q, absmax, cols, rows, y, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchGemvInt8(const float* x, const int8_t* q, const float* absmax, int64_t n, int64_t cols, int64_t rows,
                           float* y, cudaStream_t stream) {
  const bool vec = cols % 8 == 0 && Aligned16(x) && Aligned16(q);
  return QuantGemv<Int8Gemv>(x, q, absmax, n, cols, rows, vec, y, stream);
}

cudaError_t LaunchGemvNf4(const float* x, const uint8_t* codes, const float* absmax, int64_t n, int64_t cols,
                          int64_t rows, float* y, cudaStream_t stream) {
  // Rows are 32-byte multiples: aligned codes keep every row aligned.
  const bool vec = Aligned16(codes) && cols % 4 == 0 && Aligned16(x);
  return QuantGemv<Nf4Gemv>(x, codes, absmax, n, cols, rows, vec, y, stream);
}

cudaError_t LaunchGemvInt8Wide(const float* x, const int8_t* q, const float* absmax, int64_t cols, int64_t rows,
                               float* y, cudaStream_t stream) {
  const bool valid = cols % 16 == 0 && Aligned16(x) && Aligned16(q);
  return QuantGemvWide<Int8Format, 2, 8>(x, q, absmax, cols, rows, valid, y, stream);
}

cudaError_t LaunchGemvNf4Wide(const float* x, const uint8_t* codes, const float* absmax, int64_t cols, int64_t rows,
                              float* y, cudaStream_t stream) {
  const bool valid = cols % 4 == 0 && Aligned16(x) && Aligned16(codes);
  return QuantGemvWide<Nf4Format, 2, 4>(x, codes, absmax, cols, rows, valid, y, stream);
}

cudaError_t LaunchGemmInt8(const float* x, const int8_t* q, const float* absmax, int64_t n, int64_t cols, int64_t rows,
                           float* y, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  if (cols <= 0) return cudaErrorInvalidValue;
  return LaunchDequantGemm(x, Int8Tile{q, absmax, cols}, n, cols, rows, y, stream);
}

cudaError_t LaunchGemmNf4(const float* x, const uint8_t* codes, const float* absmax, int64_t n, int64_t cols,
                          int64_t rows, float* y, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  if (cols <= 0) return cudaErrorInvalidValue;
  return LaunchDequantGemm(x, Nf4Tile{codes, absmax, cols, Nf4BlocksPerRow(cols)}, n, cols, rows, y, stream);
}

}  // namespace odmoe::kernels
