// Dequantizing products with INT8 / NF4 weights (layouts in quant.h), fp32 activations and accumulation.
//  - GemvInt8Kernel<kTokens> / GemvNf4Kernel<kTokens>: 8 warps per 256-thread block; kTokens = 1 (one token, two
//    output rows per warp: one accumulator per row, the activations a lane loads serve both rows, two 16-byte code
//    loads in flight) or kGemvMaxTokens (up to that many tokens, one row per warp). A lane loads 16 bytes of codes
//    at a time (16 INT8 weights, or 32 NF4 weights = half a block) and the matching activations with float4
//    loads. INT8 applies absmax / 127 once per row; NF4 decodes its codes in registers (the code book as byte
//    planes, looked up with __byte_perm: no shared memory) and applies the block absmax to each 32-weight partial
//    sum. Every variant sums a row in the same order (explicit FMAs in column order per chunk, lane-strided chunks,
//    the butterfly WarpSum), so a row's result is bitwise the same whatever the number of tokens. Shapes that
//    break 16-byte alignment take scalar loads for the affected operand.
//  - DequantGemmKernel<Tile>: C tile of 64 tokens x 64 output rows per 256-thread block, k in steps of 32; the
//    activation tile and the weight tile (dequantized on the fly by Tile::Value) are staged in shared memory
//    and each thread accumulates a 4x4 sub-tile with fp32 FMA.
#include "kernels/quant.h"

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/gemv.h"

namespace odmoe::kernels {
namespace {

using internal::CeilDiv;
using internal::Vec16;
using internal::WarpSum;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxN = static_cast<int>(kGemvMaxTokens);
constexpr int kHalfBlock = static_cast<int>(kNf4BlockSize / 2);  // bytes per NF4 block, weights per 16 bytes

__constant__ float kCodeBookDevice[16] = {ODMOE_NF4_CODEBOOK};

// Output rows per warp of the GEMVs: two for one token (the activations a lane loads serve both rows, and twice
// the weight loads are in flight), one for several (their accumulators take the registers).
__host__ __device__ constexpr int RowsPerWarp(int tokens) { return tokens == 1 ? 2 : 1; }

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 16 bytes at p (any alignment when !vec).
__device__ __forceinline__ uint4 Load16(const void* p, bool vec) {
  if (vec) return __ldg(reinterpret_cast<const uint4*>(p));
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = static_cast<uint32_t>(__ldg(b + 4 * i)) | (static_cast<uint32_t>(__ldg(b + 4 * i + 1)) << 8) |
           (static_cast<uint32_t>(__ldg(b + 4 * i + 2)) << 16) | (static_cast<uint32_t>(__ldg(b + 4 * i + 3)) << 24);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// acc + sum_e w[e] * x[e], one fused multiply-add per element in order: the summation order of every GEMV here,
// whatever its number of tokens.
template <int kElems>
__device__ __forceinline__ float ChunkDot(const float* w, const float* x, float acc) {
#pragma unroll
  for (int e = 0; e < kElems; ++e) acc = fmaf(w[e], x[e], acc);
  return acc;
}

// out[p] = byte p of each of a, b, c, d: out[p] = [a.p, b.p, c.p, d.p] (byte 0 first).
__device__ __forceinline__ void TransposeBytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&out)[4]) {
  const uint32_t ab01 = __byte_perm(a, b, 0x5140);  // a.0 b.0 a.1 b.1
  const uint32_t cd01 = __byte_perm(c, d, 0x5140);
  const uint32_t ab23 = __byte_perm(a, b, 0x7362);  // a.2 b.2 a.3 b.3
  const uint32_t cd23 = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab01, cd01, 0x5410);
  out[1] = __byte_perm(ab01, cd01, 0x7632);
  out[2] = __byte_perm(ab23, cd23, 0x5410);
  out[3] = __byte_perm(ab23, cd23, 0x7632);
}

// The NF4 code book in registers, as byte planes for __byte_perm lookups: byte j of plane[p][k] is byte p of the
// fp32 bits of kNf4CodeBook[4k + j] (16 registers, built once per thread from constant memory).
struct Nf4Planes {
  uint32_t plane[4][4];
  __device__ __forceinline__ void Load() {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t bytes[4];
      TransposeBytes(__float_as_uint(kCodeBookDevice[4 * k]), __float_as_uint(kCodeBookDevice[4 * k + 1]),
                     __float_as_uint(kCodeBookDevice[4 * k + 2]), __float_as_uint(kCodeBookDevice[4 * k + 3]), bytes);
#pragma unroll
      for (int p = 0; p < 4; ++p) plane[p][k] = bytes[p];
    }
  }
  // The code book values of the four codes in the low 16 bits of h (code i in bits 4i..4i+3), exactly.
  __device__ __forceinline__ void LookUp4(uint32_t h, float (&v)[4]) const {
    const uint32_t sel = h & 0x7777u;                      // entry within its half of the book (bytes 0-7)
    const uint32_t half = 0x3210u | ((h >> 1) & 0x4444u);  // byte i from the low half (i) or the high half (4 + i)
    uint32_t b[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      b[p] = __byte_perm(__byte_perm(plane[p][0], plane[p][1], sel), __byte_perm(plane[p][2], plane[p][3], sel), half);
    }
    uint32_t bits[4];
    TransposeBytes(b[0], b[1], b[2], b[3], bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(bits[i]);
  }
  // The 8 weights of one 32-bit word of codes in column order (byte b: column 2b in its high nibble, 2b + 1 in
  // its low nibble).
  __device__ __forceinline__ void Decode8(uint32_t word, float (&w)[8]) const {
    float lo[4];
    float hi[4];
    LookUp4(word, lo);        // columns 1, 0, 3, 2
    LookUp4(word >> 16, hi);  // columns 5, 4, 7, 6
    w[0] = lo[1];
    w[1] = lo[0];
    w[2] = lo[3];
    w[3] = lo[2];
    w[4] = hi[1];
    w[5] = hi[0];
    w[6] = hi[3];
    w[7] = hi[2];
  }
};

__device__ __forceinline__ void DecodeInt8x16(uint4 raw, float (&w)[16]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 16; ++i)
    w[i] = static_cast<float>(static_cast<int32_t>(words[i / 4] << (24 - 8 * (i % 4))) >> 24);
}

// kTokens = 1: exactly one token; kMaxN: n <= kMaxN tokens (n at run time). kRows output rows per warp.
template <int kTokens>
__global__ void __launch_bounds__(kThreads)
    GemvInt8Kernel(const float* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ absmax, int n,
                   int64_t cols, int64_t rows, float* __restrict__ y, bool vec) {
  constexpr int kRows = RowsPerWarp(kTokens);
  const int lane = threadIdx.x & 31;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRows;
  if (row0 >= rows) return;
  const int8_t* qr[kRows];  // a row past the end reads the last row; its result is not stored
#pragma unroll
  for (int r = 0; r < kRows; ++r) qr[r] = q + min(row0 + r, rows - 1) * cols;
  float acc[kRows][kTokens];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[r][t] = 0.0f;
  }
  if (vec) {
    const int64_t chunks = cols / 16;
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += 32) {
      uint4 raw[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) raw[r] = __ldg(reinterpret_cast<const uint4*>(qr[r] + c * 16));
      float wv[kRows][16];
#pragma unroll
      for (int r = 0; r < kRows; ++r) DecodeInt8x16(raw[r], wv[r]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (kTokens == 1 || t < n) {
          float xv[16];
#pragma unroll
          for (int e = 0; e < 16; e += 4) Vec16<float>::Load(x + t * cols + c * 16 + e, xv + e);
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[r][t] = ChunkDot<16>(wv[r], xv, acc[r][t]);
        }
      }
    }
  } else {
    for (int64_t k = lane; k < cols; k += 32) {
      float wv[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[r] = static_cast<float>(qr[r][k]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (kTokens == 1 || t < n) {
          const float xv = x[t * cols + k];
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[r][t] = fmaf(wv[r], xv, acc[r][t]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row >= rows) break;  // the same for the whole warp
    const float scale = absmax[row] / 127.0f;
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (kTokens == 1 || t < n) {
        const float s = WarpSum(acc[r][t]);
        if (lane == 0) y[t * rows + row] = s * scale;
      }
    }
  }
}

// Each 16-byte chunk is half an NF4 block (32 weights, one scale): per row and token its products are summed in
// column order (s), then acc = fma(s, block scale, acc). The codes are decoded in registers (Nf4Planes), 8 at a
// time, each 8 used for every token before the next are decoded.
template <int kTokens>
__global__ void __launch_bounds__(kThreads)
    GemvNf4Kernel(const float* __restrict__ x, const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                  int n, int64_t cols, int64_t rows, float* __restrict__ y, bool codes_vec, bool x_vec) {
  constexpr int kRows = RowsPerWarp(kTokens);
  const int lane = threadIdx.x & 31;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRows;
  if (row0 >= rows) return;
  Nf4Planes book;
  book.Load();
  const int64_t bpr = (cols + kNf4BlockSize - 1) / kNf4BlockSize;
  const uint8_t* cr[kRows];  // a row past the end reads the last row; its result is not stored
  const float* ar[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = min(row0 + r, rows - 1);
    cr[r] = codes + row * bpr * kHalfBlock;
    ar[r] = absmax + row * bpr;
  }
  float acc[kRows][kTokens];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[r][t] = 0.0f;
  }
  const int64_t chunks = bpr * 2;  // 16 bytes = 32 weights each
  for (int64_t c = lane; c < chunks; c += 32) {
    uint4 raw[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) raw[r] = Load16(cr[r] + c * 16, codes_vec);
    const int64_t col0 = c * 32;
    const bool full = x_vec && col0 + 32 <= cols;
    const int valid = static_cast<int>(min(static_cast<int64_t>(32), cols - col0));
    float s[kRows][kTokens];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int t = 0; t < kTokens; ++t) s[r][t] = 0.0f;
    }
    // The chunk's four 32-bit words, 8 weights each, one at a time (not unrolled: the decoded weights of one word
    // are all that is live); raw[r].x is word i.
#pragma unroll 1
    for (int i = 0; i < 4; ++i) {
      float wv[kRows][8];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        book.Decode8(raw[r].x, wv[r]);
        raw[r] = make_uint4(raw[r].y, raw[r].z, raw[r].w, 0u);
      }
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (kTokens == 1 || t < n) {
          const float* xp = x + t * cols + col0 + 8 * i;
          if (full) {
            float xv[8];
            Vec16<float>::Load(xp, xv);
            Vec16<float>::Load(xp + 4, xv + 4);
#pragma unroll
            for (int r = 0; r < kRows; ++r) s[r][t] = ChunkDot<8>(wv[r], xv, s[r][t]);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              if (8 * i + e < valid) {
                const float xv = xp[e];
#pragma unroll
                for (int r = 0; r < kRows; ++r) s[r][t] = fmaf(wv[r][e], xv, s[r][t]);
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float scale = ar[r][c / 2];
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (kTokens == 1 || t < n) acc[r][t] = fmaf(s[r][t], scale, acc[r][t]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row >= rows) break;  // the same for the whole warp
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (kTokens == 1 || t < n) {
        const float sum = WarpSum(acc[r][t]);
        if (lane == 0) y[t * rows + row] = sum;
      }
    }
  }
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

}  // namespace

cudaError_t LaunchGemvInt8(const float* x, const int8_t* q, const float* absmax, int64_t n, int64_t cols, int64_t rows,
                           float* y, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  if (cols <= 0) return cudaErrorInvalidValue;
  if (CeilDiv(rows, kWarps) > 0x7fffffff) return cudaErrorInvalidValue;
  const bool vec = cols % 16 == 0 && Aligned16(x) && Aligned16(q);
  for (int64_t t0 = 0; t0 < n; t0 += kMaxN) {
    const int cnt = static_cast<int>(std::min<int64_t>(kMaxN, n - t0));
    const float* xc = x + t0 * cols;
    float* yc = y + t0 * rows;
    if (cnt == 1) {
      const auto blocks = static_cast<unsigned>(CeilDiv(rows, kWarps * RowsPerWarp(1)));
      GemvInt8Kernel<1><<<blocks, kThreads, 0, stream>>>(xc, q, absmax, cnt, cols, rows, yc, vec);
    } else {
      const auto blocks = static_cast<unsigned>(CeilDiv(rows, kWarps * RowsPerWarp(kMaxN)));
      GemvInt8Kernel<kMaxN><<<blocks, kThreads, 0, stream>>>(xc, q, absmax, cnt, cols, rows, yc, vec);
    }
  }
  return cudaGetLastError();
}

cudaError_t LaunchGemvNf4(const float* x, const uint8_t* codes, const float* absmax, int64_t n, int64_t cols,
                          int64_t rows, float* y, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  if (cols <= 0) return cudaErrorInvalidValue;
  if (CeilDiv(rows, kWarps) > 0x7fffffff) return cudaErrorInvalidValue;
  const bool codes_vec = Aligned16(codes);  // rows are 32-byte multiples
  const bool x_vec = cols % 4 == 0 && Aligned16(x);
  for (int64_t t0 = 0; t0 < n; t0 += kMaxN) {
    const int cnt = static_cast<int>(std::min<int64_t>(kMaxN, n - t0));
    const float* xc = x + t0 * cols;
    float* yc = y + t0 * rows;
    if (cnt == 1) {
      const auto blocks = static_cast<unsigned>(CeilDiv(rows, kWarps * RowsPerWarp(1)));
      GemvNf4Kernel<1><<<blocks, kThreads, 0, stream>>>(xc, codes, absmax, cnt, cols, rows, yc, codes_vec, x_vec);
    } else {
      const auto blocks = static_cast<unsigned>(CeilDiv(rows, kWarps * RowsPerWarp(kMaxN)));
      GemvNf4Kernel<kMaxN><<<blocks, kThreads, 0, stream>>>(xc, codes, absmax, cnt, cols, rows, yc, codes_vec, x_vec);
    }
  }
  return cudaGetLastError();
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
