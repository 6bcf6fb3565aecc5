// Device helpers shared by the kernels of this directory: dtype conversion, 16-byte vector loads, warp and
// block reductions. Internal: included by the .cu files here only, never by a public header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels::internal {

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

// fp32 to W rounding to nearest even (what HF's .to(dtype) does; float: copied): the one conversion of
// LaunchConvert and of every kernel that writes a KV cache (kernels/attention.cu, kernels/rope.cu), so that they
// store the same bits.
__device__ __forceinline__ void StoreAs(float v, float* out) { *out = v; }
__device__ __forceinline__ void StoreAs(float v, __half* out) { *out = __float2half_rn(v); }
__device__ __forceinline__ void StoreAs(float v, __nv_bfloat16* out) { *out = __float2bfloat16_rn(v); }

// The two 16-bit values of a 32-bit word as floats (element 0 in the low half: little-endian order).
__device__ __forceinline__ void Unpack2(uint32_t word, float* out, const __nv_bfloat16*) {
  out[0] = __uint_as_float(word << 16);
  out[1] = __uint_as_float(word & 0xffff0000u);
}
__device__ __forceinline__ void Unpack2(uint32_t word, float* out, const __half*) {
  out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu)));
  out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
}

// The 4 elements of type W of one load (float4 for float, uint2 for the 16-bit types) as floats.
__device__ __forceinline__ void Unpack4(const float4& v, float* out) {
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
template <typename W>
__device__ __forceinline__ void Unpack4(const uint2& raw, float* out, const W* tag) {
  Unpack2(raw.x, out, tag);
  Unpack2(raw.y, out + 2, tag);
}

// The 4 elements of type W at p as floats, in one load through the read-only cache (16 bytes for float, 8 for the
// 16-bit types). REQUIRES: p aligned to 4 * sizeof(W).
__device__ __forceinline__ void Load4(const float* p, float* out) {
  Unpack4(__ldg(reinterpret_cast<const float4*>(p)), out);
}
template <typename W>
__device__ __forceinline__ void Load4(const W* p, float* out) {
  Unpack4(__ldg(reinterpret_cast<const uint2*>(p)), out, p);
}

// Load4 of weights that a launch reads once, with the evict-first hint (__ldcs): the stream of weights then leaves
// in L1 the activations every warp re-reads. On an H200 (bench/gemv_sweep, 2026-12-04) this took the bf16 GEMV
// 4096x14336 from 77.6% to 86.7% of the copy bandwidth and the INT8 one (codes, QuantGemvRows) from 40.4% to 58.4%.
__device__ __forceinline__ void Load4Streaming(const float* p, float* out) {
  Unpack4(__ldcs(reinterpret_cast<const float4*>(p)), out);
}
template <typename W>
__device__ __forceinline__ void Load4Streaming(const W* p, float* out) {
  Unpack4(__ldcs(reinterpret_cast<const uint2*>(p)), out, p);
}

// 16-byte vector loads through the read-only cache: Vec16<W>::kElems elements of type W, as floats.
// REQUIRES: p 16-byte aligned.
// Unpack converts 16 bytes already loaded (e.g. staged raw in shared memory) the same way.
template <typename W>
struct Vec16 {
  static constexpr int kElems = 8;  // __half and __nv_bfloat16
  __device__ __forceinline__ static void Unpack(const uint4& raw, float* out) {
    const W* tag = nullptr;
    Unpack2(raw.x, out + 0, tag);
    Unpack2(raw.y, out + 2, tag);
    Unpack2(raw.z, out + 4, tag);
    Unpack2(raw.w, out + 6, tag);
  }
  __device__ __forceinline__ static void Load(const W* p, float* out) {
    Unpack(__ldg(reinterpret_cast<const uint4*>(p)), out);
  }
};
template <>
struct Vec16<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void Unpack(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  }
  __device__ __forceinline__ static void Load(const float* p, float* out) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  }
};

// Whether p is 16-byte aligned (the vector loads' requirement), on the host (the launchers' choice) or the device.
__host__ __device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Lets `kernel` launch with `bytes` of dynamic shared memory: past the default 48 KiB a kernel must opt in (the
// error when the GPU gives a block less).
template <typename Kernel>
inline cudaError_t AllowDynamicShared(Kernel* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block, returned to every thread; the order of additions is fixed (deterministic).
// REQUIRES: every thread of the block calls it; blockDim.x a multiple of 32.
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // earlier users of `partial` are done
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = lane < warps ? partial[lane] : 0.0f;
  return WarpSum(total);
}

// The RMSNorm's 1 / rms of a row of `dim` elements from its sum of squares: the one expression of every norm
// (kernels/norm.cu's RmsNormKernel, kernels/norm_row.cuh's HeldRowNorm), so that they give the same bits.
__device__ __forceinline__ float RmsInverse(float sum_of_squares, int64_t dim, float eps) {
  return 1.0f / sqrtf(sum_of_squares / static_cast<float>(dim) + eps);
}

__device__ __forceinline__ float BlockMax(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = lane < warps ? partial[lane] : -INFINITY;
  return WarpMax(total);
}

}  // namespace odmoe::kernels::internal
