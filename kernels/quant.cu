// INT8 / NF4 weight quantizers and dequantizers (layouts in quant.h).
//  - QuantizeInt8RowsKernel: one 256-thread block per row: absmax by block reduction, then
//    q = rint((w / absmax) * 127) with explicitly rounded division and product, clamped to [-127, 127].
//  - QuantizeNf4Kernel: one warp per block of 64 (lane j owns columns 2j, 2j + 1 and writes byte j): absmax
//    by warp reduction, v = w * (1 / absmax) (rounded division and product), code by the bitsandbytes
//    midpoint thresholds.
//  - Dequantize*Kernel: grid-stride elementwise.
// The arithmetic is spelled with __fdiv_rn / __fmul_rn so that no contraction or approximation can make the
// result differ from the CPU quantizer (src/backend/quantize.cc), which performs the same fp32 operations.
#include "kernels/quant.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::BlockMax;
using internal::CeilDiv;
using internal::ToFloat;
using internal::WarpMax;

constexpr int kThreads = 256;

__constant__ float kCodeBookDevice[16] = {ODMOE_NF4_CODEBOOK};

// The bitsandbytes dQuantizeNF4 decision tree, written as a count of the midpoints below v (the same result:
// the midpoints ascend). NaN compares false everywhere and gives 0, as in the tree.
__device__ __forceinline__ uint32_t Nf4Code(float v) {
  constexpr float kMidpoints[15] = {ODMOE_NF4_MIDPOINTS};
  uint32_t code = 0;
#pragma unroll
  for (int i = 0; i < 15; ++i) code += v > kMidpoints[i];
  return code;
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    QuantizeInt8RowsKernel(const W* __restrict__ w, int64_t cols, int8_t* __restrict__ q, float* __restrict__ absmax) {
  const int64_t row = blockIdx.x;
  const W* wr = w + row * cols;
  float m = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) m = fmaxf(m, fabsf(ToFloat(wr[j])));
  m = BlockMax(m);
  if (threadIdx.x == 0) absmax[row] = m;
  int8_t* qr = q + row * cols;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    float r = 0.0f;
    if (m > 0.0f) r = rintf(__fmul_rn(__fdiv_rn(ToFloat(wr[j]), m), 127.0f));
    r = fminf(fmaxf(r, -127.0f), 127.0f);
    qr[j] = static_cast<int8_t>(r);
  }
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    QuantizeNf4Kernel(const W* __restrict__ w, int64_t rows, int64_t cols, int64_t bpr, uint8_t* __restrict__ codes,
                      float* __restrict__ absmax) {
  const int lane = threadIdx.x & 31;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (block >= rows * bpr) return;
  const int64_t row = block / bpr;
  const int64_t c0 = (block - row * bpr) * kNf4BlockSize + 2 * lane;
  const W* wr = w + row * cols;
  const float v0 = c0 < cols ? ToFloat(wr[c0]) : 0.0f;
  const float v1 = c0 + 1 < cols ? ToFloat(wr[c0 + 1]) : 0.0f;
  const float m = WarpMax(fmaxf(fabsf(v0), fabsf(v1)));
  if (lane == 0) absmax[block] = m;
  const float inv = m > 0.0f ? __fdiv_rn(1.0f, m) : 0.0f;
  const uint32_t q0 = c0 < cols ? Nf4Code(__fmul_rn(v0, inv)) : 7u;
  const uint32_t q1 = c0 + 1 < cols ? Nf4Code(__fmul_rn(v1, inv)) : 7u;
  codes[block * (kNf4BlockSize / 2) + lane] = static_cast<uint8_t>((q0 << 4) | q1);
}

__global__ void DequantizeInt8RowsKernel(const int8_t* __restrict__ q, const float* __restrict__ absmax, int64_t rows,
                                         int64_t cols, float* __restrict__ w) {
  const int64_t count = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    w[i] = static_cast<float>(q[i]) * (absmax[i / cols] / 127.0f);
  }
}

__global__ void DequantizeNf4Kernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax, int64_t rows,
                                    int64_t cols, int64_t bpr, float* __restrict__ w) {
  const int64_t count = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    const uint8_t byte = codes[r * bpr * (kNf4BlockSize / 2) + c / 2];
    const uint32_t code = (c & 1) ? (byte & 15u) : (byte >> 4);
    w[i] = kCodeBookDevice[code] * absmax[r * bpr + c / kNf4BlockSize];
  }
}

unsigned GridFor(int64_t count) {
  return static_cast<unsigned>(std::clamp<int64_t>(CeilDiv(count, kThreads), 1, 65536));
}

}  // namespace

template <typename W>
cudaError_t LaunchQuantizeInt8Rows(const W* w, int64_t rows, int64_t cols, int8_t* q, float* absmax,
                                   cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  QuantizeInt8RowsKernel<W><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(w, cols, q, absmax);
  return cudaGetLastError();
}

template <typename W>
cudaError_t LaunchQuantizeNf4(const W* w, int64_t rows, int64_t cols, uint8_t* codes, float* absmax,
                              cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t bpr = Nf4BlocksPerRow(cols);
  const int64_t blocks = CeilDiv(rows * bpr, kThreads / 32);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  QuantizeNf4Kernel<W><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, rows, cols, bpr, codes, absmax);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeInt8Rows(const int8_t* q, const float* absmax, int64_t rows, int64_t cols, float* w,
                                     cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  DequantizeInt8RowsKernel<<<GridFor(rows * cols), kThreads, 0, stream>>>(q, absmax, rows, cols, w);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeNf4(const uint8_t* codes, const float* absmax, int64_t rows, int64_t cols, float* w,
                                cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  DequantizeNf4Kernel<<<GridFor(rows * cols), kThreads, 0, stream>>>(codes, absmax, rows, cols, Nf4BlocksPerRow(cols),
                                                                     w);
  return cudaGetLastError();
}

#define ODMOE_INSTANTIATE_W(W)                                                                               \
  template cudaError_t LaunchQuantizeInt8Rows<W>(const W*, int64_t, int64_t, int8_t*, float*, cudaStream_t); \
  template cudaError_t LaunchQuantizeNf4<W>(const W*, int64_t, int64_t, uint8_t*, float*, cudaStream_t);
ODMOE_INSTANTIATE_W(float)
ODMOE_INSTANTIATE_W(__half)
ODMOE_INSTANTIATE_W(__nv_bfloat16)
#undef ODMOE_INSTANTIATE_W

}  // namespace odmoe::kernels
