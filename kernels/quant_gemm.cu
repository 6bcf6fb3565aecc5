// Dequantizing products with INT8 / NF4 weights (layouts in quant.h), fp32 activations and accumulation.
//  - GemvInt8Kernel / GemvNf4Kernel: one warp per output row, 8 rows per 256-thread block, up to
//    kGemvMaxTokens tokens per pass. A lane loads 16 bytes of codes at a time (16 INT8 weights, or 32 NF4
//    weights = half a block, decoded through a code book in shared memory) and the matching activations with
//    float4 loads; INT8 applies absmax / 127 once per row, NF4 the block absmax to each 32-weight partial sum.
//    Shapes that break 16-byte alignment take scalar loads for the affected operand.
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
constexpr int kRowsPerBlock = kThreads / 32;
constexpr int kMaxN = static_cast<int>(kGemvMaxTokens);
constexpr int kHalfBlock = static_cast<int>(kNf4BlockSize / 2);  // bytes per NF4 block, weights per 16 bytes

__constant__ float kCodeBookDevice[16] = {ODMOE_NF4_CODEBOOK};

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

__global__ void __launch_bounds__(kThreads)
    GemvInt8Kernel(const float* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ absmax, int n,
                   int64_t cols, int64_t rows, float* __restrict__ y, bool vec) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int8_t* qr = q + row * cols;
  float acc[kMaxN];
#pragma unroll
  for (int t = 0; t < kMaxN; ++t) acc[t] = 0.0f;
  if (vec) {
    const int64_t chunks = cols / 16;
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += 32) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(qr + c * 16));
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      float wv[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        wv[i] = static_cast<float>(static_cast<int32_t>(words[i / 4] << (24 - 8 * (i % 4))) >> 24);
      }
#pragma unroll
      for (int t = 0; t < kMaxN; ++t) {
        if (t < n) {
          float xv[16];
#pragma unroll
          for (int e = 0; e < 16; e += 4) Vec16<float>::Load(x + t * cols + c * 16 + e, xv + e);
          float s = acc[t];
#pragma unroll
          for (int e = 0; e < 16; ++e) s += wv[e] * xv[e];
          acc[t] = s;
        }
      }
    }
  } else {
    for (int64_t k = lane; k < cols; k += 32) {
      const float wv = static_cast<float>(qr[k]);
#pragma unroll
      for (int t = 0; t < kMaxN; ++t) {
        if (t < n) acc[t] += wv * x[t * cols + k];
      }
    }
  }
  const float scale = absmax[row] / 127.0f;
#pragma unroll
  for (int t = 0; t < kMaxN; ++t) {
    if (t < n) {
      const float s = WarpSum(acc[t]);
      if (lane == 0) y[t * rows + row] = s * scale;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    GemvNf4Kernel(const float* __restrict__ x, const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                  int n, int64_t cols, int64_t rows, float* __restrict__ y, bool codes_vec, bool x_vec) {
  __shared__ float cb[16];
  if (threadIdx.x < 16) cb[threadIdx.x] = kCodeBookDevice[threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t bpr = (cols + kNf4BlockSize - 1) / kNf4BlockSize;
  const uint8_t* cr = codes + row * bpr * kHalfBlock;
  const float* ar = absmax + row * bpr;
  float acc[kMaxN];
#pragma unroll
  for (int t = 0; t < kMaxN; ++t) acc[t] = 0.0f;
  const int64_t chunks = bpr * 2;  // 16 bytes = 32 weights each
  for (int64_t c = lane; c < chunks; c += 32) {
    const uint4 raw = Load16(cr + c * 16, codes_vec);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float wv[32];
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      const uint32_t byte = (words[b / 4] >> (8 * (b % 4))) & 0xffu;
      wv[2 * b] = cb[byte >> 4];
      wv[2 * b + 1] = cb[byte & 15u];
    }
    const float scale = ar[c / 2];
    const int64_t col0 = c * 32;
    if (x_vec && col0 + 32 <= cols) {
#pragma unroll
      for (int t = 0; t < kMaxN; ++t) {
        if (t < n) {
          const float* xp = x + t * cols + col0;
          float s = 0.0f;
#pragma unroll
          for (int e = 0; e < 32; e += 4) {
            float xv[4];
            Vec16<float>::Load(xp + e, xv);
            s += wv[e] * xv[0] + wv[e + 1] * xv[1] + wv[e + 2] * xv[2] + wv[e + 3] * xv[3];
          }
          acc[t] += s * scale;
        }
      }
    } else {
      const int valid = static_cast<int>(min(static_cast<int64_t>(32), cols - col0));
#pragma unroll
      for (int t = 0; t < kMaxN; ++t) {
        if (t < n) {
          const float* xp = x + t * cols + col0;
          float s = 0.0f;
#pragma unroll
          for (int e = 0; e < 32; ++e) {
            if (e < valid) s += wv[e] * xp[e];
          }
          acc[t] += s * scale;
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kMaxN; ++t) {
    if (t < n) {
      const float s = WarpSum(acc[t]);
      if (lane == 0) y[t * rows + row] = s;
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
  const int64_t blocks = CeilDiv(rows, kRowsPerBlock);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const bool vec = cols % 16 == 0 && Aligned16(x) && Aligned16(q);
  for (int64_t t0 = 0; t0 < n; t0 += kMaxN) {
    const int cnt = static_cast<int>(std::min<int64_t>(kMaxN, n - t0));
    GemvInt8Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x + t0 * cols, q, absmax, cnt, cols, rows,
                                                                           y + t0 * rows, vec);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGemvNf4(const float* x, const uint8_t* codes, const float* absmax, int64_t n, int64_t cols,
                          int64_t rows, float* y, cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return cudaSuccess;
  if (cols <= 0) return cudaErrorInvalidValue;
  const int64_t blocks = CeilDiv(rows, kRowsPerBlock);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const bool codes_vec = Aligned16(codes);  // rows are 32-byte multiples
  const bool x_vec = cols % 4 == 0 && Aligned16(x);
  for (int64_t t0 = 0; t0 < n; t0 += kMaxN) {
    const int cnt = static_cast<int>(std::min<int64_t>(kMaxN, n - t0));
    GemvNf4Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x + t0 * cols, codes, absmax, cnt, cols, rows,
                                                                          y + t0 * rows, codes_vec, x_vec);
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
