// Elementwise and row-movement kernels:
//  - EmbeddingKernel: grid (ceil(dim / 256), n); one token row per blockIdx.y, converted to fp32.
//  - SwiGluKernel, AddKernel: grid-stride loops; Add uses float4 when both pointers are 16-byte aligned.
//  - AddBiasKernel: y[i, j] += bias[j], grid-stride over n * dim.
//  - GatherRowsKernel: grid (ceil(dim / 256), n).
//  - ScatterAddScaledKernel: one thread per column walking the n source rows in order, 8 at a time: the loads
//    of a group are issued together, rows repeated inside the group are chained in registers, and the stores
//    go out in order, so the result equals the sequential loop bit for bit.
//  - SplitToPairKernel: one block per row, x -> (hi, lo) 16-bit pair for tensor-core GEMMs with near-fp32
//    activations, a row with values past fp16's range scaled down by a power of two (ScaleRowsKernel undoes it).
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/elementwise.h"

namespace odmoe::kernels {
namespace {

using internal::CeilDiv;
using internal::StoreAs;
using internal::ToFloat;

constexpr int kThreads = 256;

unsigned GridFor(int64_t count) {
  return static_cast<unsigned>(std::clamp<int64_t>(CeilDiv(count, kThreads), 1, 65536));
}

template <typename W>
__global__ void EmbeddingKernel(const int32_t* __restrict__ ids, const W* __restrict__ table, int64_t dim,
                                float* __restrict__ out) {
  const int64_t i = blockIdx.y;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (d >= dim) return;
  const int64_t id = ids[i];
  out[i * dim + d] = ToFloat(table[id * dim + d]);
}

__global__ void SwiGluKernel(const float* gate, const float* up, int64_t count, float* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void AddKernel(const float* __restrict__ x, int64_t count, float* __restrict__ y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (internal::Aligned16(x) && internal::Aligned16(y)) {
    const int64_t vecs = count / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* y4 = reinterpret_cast<float4*>(y);
    for (int64_t i = first; i < vecs; i += stride) {
      const float4 a = x4[i];
      float4 b = y4[i];
      b.x += a.x;
      b.y += a.y;
      b.z += a.z;
      b.w += a.w;
      y4[i] = b;
    }
    for (int64_t i = vecs * 4 + first; i < count; i += stride) y[i] += x[i];
  } else {
    for (int64_t i = first; i < count; i += stride) y[i] += x[i];
  }
}

template <typename W>
__global__ void AddBiasKernel(const W* __restrict__ bias, int64_t count, int64_t dim, float* __restrict__ y) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    y[i] += ToFloat(bias[i % dim]);
  }
}

__global__ void GatherRowsKernel(const float* __restrict__ src, const int32_t* __restrict__ rows, int64_t dim,
                                 float* __restrict__ dst) {
  const int64_t i = blockIdx.y;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (d >= dim) return;
  dst[i * dim + d] = src[static_cast<int64_t>(rows[i]) * dim + d];
}

constexpr int kScatterGroup = 8;
constexpr int kScatterThreads = 128;

__global__ void __launch_bounds__(kScatterThreads)
    ScatterAddScaledKernel(const float* __restrict__ src, const int32_t* __restrict__ rows,
                           const float* __restrict__ scale, int64_t n, int64_t dim, bool sigmoid_scale, float* dst) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kScatterThreads + threadIdx.x;
  if (d >= dim) return;
  for (int64_t i0 = 0; i0 < n; i0 += kScatterGroup) {
    const int cnt = static_cast<int>(min(static_cast<int64_t>(kScatterGroup), n - i0));
    int64_t r[kScatterGroup];
    float add[kScatterGroup];
    float v[kScatterGroup];
#pragma unroll
    for (int j = 0; j < kScatterGroup; ++j) {
      if (j < cnt) {
        r[j] = rows[i0 + j];
        float s = scale[i0 + j];
        if (sigmoid_scale) s = 1.0f / (1.0f + expf(-s));
        add[j] = __fmul_rn(s, src[(i0 + j) * dim + d]);
        v[j] = dst[r[j] * dim + d];
      }
    }
#pragma unroll
    for (int j = 0; j < kScatterGroup; ++j) {
      if (j < cnt) {
#pragma unroll
        for (int k = 0; k < j; ++k) {
          if (r[k] == r[j]) v[j] = v[k];  // the latest earlier update of the same row
        }
        v[j] = __fadd_rn(v[j], add[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kScatterGroup; ++j) {
      if (j < cnt) dst[r[j] * dim + d] = v[j];
    }
  }
}

__device__ __forceinline__ void SplitOne(float x, __half* hi, __half* lo) {
  const __half h = __float2half_rn(x);
  *hi = h;
  *lo = __float2half_rn(x - __half2float(h));
}
__device__ __forceinline__ void SplitOne(float x, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  *hi = h;
  *lo = __float2bfloat16_rn(x - __bfloat162float(h));
}

// The largest power-of-two exponent a row may keep unscaled: fp16's largest finite value is 65504, so a row
// whose |x| reaches past 2^15 is scaled down; bf16 has fp32's range and never is.
template <typename T>
constexpr int kSplitMaxExponent = 127;
template <>
constexpr int kSplitMaxExponent<__half> = 15;

// One block per row: the row's largest |x| picks the power of two 2^-e (e >= 0) that brings it within T's
// range; the row is split scaled by it, and row_scale[row] = 2^e undoes it on the GEMM's output.
template <typename T>
__global__ void SplitToPairKernel(const float* __restrict__ x, int64_t cols, T* __restrict__ hi, T* __restrict__ lo,
                                  float* __restrict__ row_scale) {
  const int64_t row = blockIdx.x;
  const float* xr = x + row * cols;
  float biggest = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) biggest = fmaxf(biggest, fabsf(xr[c]));
  biggest = internal::BlockMax(biggest);
  int e = 0;
  if (isfinite(biggest) && biggest > 0.0f) {
    int exponent = 0;  // biggest = m * 2^exponent, 0.5 <= m < 1
    (void)frexpf(biggest, &exponent);
    e = exponent > kSplitMaxExponent<T> ? exponent - kSplitMaxExponent<T> : 0;
  }
  const float down = ldexpf(1.0f, -e);  // exact: a power of two
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
    SplitOne(xr[c] * down, hi + row * cols + c, lo + row * cols + c);
  }
  if (threadIdx.x == 0) row_scale[row] = ldexpf(1.0f, e);
}

template <typename S, typename D>
__global__ void ConvertKernel(const S* __restrict__ src, int64_t count, D* __restrict__ dst) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < count) StoreAs(ToFloat(src[i]), dst + i);  // to fp32 exactly, from it rounded
}

__global__ void ScaleRowsKernel(float* __restrict__ y, int64_t cols, const float* __restrict__ scale) {
  const int64_t row = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c < cols) y[row * cols + c] *= scale[row];
}

}  // namespace

template <typename W>
cudaError_t LaunchEmbedding(const int32_t* ids, int64_t n, const W* table, int64_t dim, float* out,
                            cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  if (n > 65535) {  // grid.y limit: split into chunks of tokens
    for (int64_t i = 0; i < n; i += 65535) {
      const cudaError_t err =
          LaunchEmbedding(ids + i, std::min<int64_t>(65535, n - i), table, dim, out + i * dim, stream);
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(dim, kThreads)), static_cast<unsigned>(n));
  EmbeddingKernel<W><<<grid, kThreads, 0, stream>>>(ids, table, dim, out);
  return cudaGetLastError();
}

cudaError_t LaunchSwiGlu(const float* gate, const float* up, int64_t count, float* out, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  SwiGluKernel<<<GridFor(count), kThreads, 0, stream>>>(gate, up, count, out);
  return cudaGetLastError();
}

cudaError_t LaunchAdd(const float* x, int64_t count, float* y, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  AddKernel<<<GridFor(CeilDiv(count, 4)), kThreads, 0, stream>>>(x, count, y);
  return cudaGetLastError();
}

template <typename W>
cudaError_t LaunchAddBias(const W* bias, int64_t n, int64_t dim, float* y, cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  AddBiasKernel<W><<<GridFor(n * dim), kThreads, 0, stream>>>(bias, n * dim, dim, y);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst,
                             cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  for (int64_t i = 0; i < n; i += 65535) {
    const int64_t cnt = std::min<int64_t>(65535, n - i);
    const dim3 grid(static_cast<unsigned>(CeilDiv(dim, kThreads)), static_cast<unsigned>(cnt));
    GatherRowsKernel<<<grid, kThreads, 0, stream>>>(src, rows + i, dim, dst + i * dim);
  }
  return cudaGetLastError();
}

cudaError_t LaunchScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                                   bool sigmoid_scale, float* dst, cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  const int64_t blocks = CeilDiv(dim, kScatterThreads);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  ScatterAddScaledKernel<<<static_cast<unsigned>(blocks), kScatterThreads, 0, stream>>>(src, rows, scale, n, dim,
                                                                                        sigmoid_scale, dst);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchSplitToPair(const float* x, int64_t rows, int64_t cols, T* hi, T* lo, float* row_scale,
                              cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  SplitToPairKernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, cols, hi, lo, row_scale);
  return cudaGetLastError();
}

cudaError_t LaunchScaleRows(float* y, int64_t rows, int64_t cols, const float* scale, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t col_blocks = CeilDiv(cols, kThreads);
  if (col_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  for (int64_t r0 = 0; r0 < rows; r0 += 65535) {  // grid.y limit
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(std::min<int64_t>(65535, rows - r0)));
    ScaleRowsKernel<<<grid, kThreads, 0, stream>>>(y + r0 * cols, cols, scale + r0);
  }
  return cudaGetLastError();
}

template <typename S, typename D>
cudaError_t LaunchConvert(const S* src, int64_t count, D* dst, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int64_t blocks = CeilDiv(count, kThreads);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  ConvertKernel<S, D><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(src, count, dst);
  return cudaGetLastError();
}

#define ODMOE_INSTANTIATE_W(W)                                                                               \
  template cudaError_t LaunchEmbedding<W>(const int32_t*, int64_t, const W*, int64_t, float*, cudaStream_t); \
  template cudaError_t LaunchAddBias<W>(const W*, int64_t, int64_t, float*, cudaStream_t);
ODMOE_INSTANTIATE_W(float)
ODMOE_INSTANTIATE_W(__half)
ODMOE_INSTANTIATE_W(__nv_bfloat16)
#undef ODMOE_INSTANTIATE_W

template cudaError_t LaunchSplitToPair<__half>(const float*, int64_t, int64_t, __half*, __half*, float*, cudaStream_t);
template cudaError_t LaunchSplitToPair<__nv_bfloat16>(const float*, int64_t, int64_t, __nv_bfloat16*, __nv_bfloat16*,
                                                      float*, cudaStream_t);

template cudaError_t LaunchConvert<float, __half>(const float*, int64_t, __half*, cudaStream_t);
template cudaError_t LaunchConvert<float, __nv_bfloat16>(const float*, int64_t, __nv_bfloat16*, cudaStream_t);
template cudaError_t LaunchConvert<__half, float>(const __half*, int64_t, float*, cudaStream_t);
template cudaError_t LaunchConvert<__nv_bfloat16, float>(const __nv_bfloat16*, int64_t, float*, cudaStream_t);

}  // namespace odmoe::kernels
