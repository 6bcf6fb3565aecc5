// Force-included (-include simt/prelude.h) into every .cu file after rewrite_cu.py, so that CUDA source compiles
// as host C++: CUDA's own headers (host mode) give the types and the half/bfloat16 conversions; the CUDA keywords
// are erased; the built-in variables and device intrinsics become the emulator's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simt/simt.h"

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __shared__
#undef __constant__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static  // rewrite_cu.py adds the per-block bookkeeping after each declaration
#define __constant__

#define threadIdx (static_cast<const uint3&>(::simt::detail::tls_thread_idx))
#define blockIdx (static_cast<const uint3&>(::simt::detail::tls_block_idx))
#define blockDim (static_cast<const dim3&>(::simt::detail::tls_block_dim))
#define gridDim (static_cast<const dim3&>(::simt::detail::tls_grid_dim))
#ifndef warpSize
#define warpSize 32
#endif

#define __syncthreads() ::simt::detail::SyncThreads(__FILE__, __LINE__)
#define __syncwarp(...) ::simt::detail::SyncWarpAt(__FILE__, __LINE__ __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_sync(mask, v, lane, ...)                                                                           \
  ::simt::detail::Shuffle(::simt::detail::CollectiveOp::kShfl, mask, v, lane, ::simt::detail::Width(__VA_ARGS__), \
                          __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, lane_mask, ...)                                      \
  ::simt::detail::Shuffle(::simt::detail::CollectiveOp::kShflXor, mask, v, lane_mask, \
                          ::simt::detail::Width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, delta, ...)                                                                          \
  ::simt::detail::Shuffle(::simt::detail::CollectiveOp::kShflUp, mask, v, delta, ::simt::detail::Width(__VA_ARGS__), \
                          __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, delta, ...)                                                                          \
  ::simt::detail::Shuffle(::simt::detail::CollectiveOp::kShflDown, mask, v, delta, ::simt::detail::Width(__VA_ARGS__), \
                          __FILE__, __LINE__)
#define atomicMin(p, v) ::simt::detail::AtomicMin(p, v, __FILE__, __LINE__)
#define atomicMax(p, v) ::simt::detail::AtomicMax(p, v, __FILE__, __LINE__)
#define atomicAdd(p, v) ::simt::detail::AtomicAdd(p, v, __FILE__, __LINE__)

namespace simt::detail {
inline void SyncWarpAt(const char* file, int line, unsigned mask = 0xffffffffu) {
  WarpCollective(CollectiveOp::kSyncWarp, mask, 0, 0, 32, file, line);
}
inline int Width(int width = 32) { return width; }

template <typename T, typename U>
__attribute__((no_sanitize("thread"))) T AtomicMin(T* p, U v, const char* file, int line) {
  NoteAtomic(p, sizeof(T), file, line);
  const T old = *p;
  if (static_cast<T>(v) < old) *p = static_cast<T>(v);
  return old;
}
template <typename T, typename U>
__attribute__((no_sanitize("thread"))) T AtomicMax(T* p, U v, const char* file, int line) {
  NoteAtomic(p, sizeof(T), file, line);
  const T old = *p;
  if (static_cast<T>(v) > old) *p = static_cast<T>(v);
  return old;
}
template <typename T, typename U>
__attribute__((no_sanitize("thread"))) T AtomicAdd(T* p, U v, const char* file, int line) {
  NoteAtomic(p, sizeof(T), file, line);
  const T old = *p;
  *p = static_cast<T>(old + static_cast<T>(v));
  return old;
}
}  // namespace simt::detail

// Loads through the read-only cache: a plain load, whose alignment is checked here because the compiler may
// narrow a 16-byte vector load to the fields used (the hardware loads all 16 bytes and faults when misaligned).
// Noted whole (sizeof(T) bytes, this call site) for the counts of warp load requests, for the same reason.
#define __ldg(p) ::simt::detail::Ldg(p, __FILE__, __LINE__)
// The evict-first load (ld.global.cs): the hint changes only what the caches keep, so it is the same load here,
// counted with the read-only ones.
#define __ldcs(p) ::simt::detail::Ldg(p, __FILE__, __LINE__)
namespace simt::detail {
template <typename T>
inline T Ldg(const T* p, const char* file, int line) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) ReportMisaligned(p, sizeof(T), file, line);
  NoteReadOnlyLoad(p, sizeof(T), file, line);
  return *p;
}
}  // namespace simt::detail

// Round-to-nearest arithmetic that must not be contracted into an FMA: kernel files are compiled with
// -ffp-contract=off, and these go through volatile so no optimisation can fuse them either.
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline float __fdiv_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float __expf(float x) { return std::exp(x); }
// prmt: byte n of the result is byte (s >> 4n) & 7 of the eight bytes {x (bytes 0-3), y (bytes 4-7)}; the upper
// 16 bits of s are not used.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<unsigned>((bytes >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
using std::max;
using std::min;
// Device code calls the classification functions unqualified (global in CUDA's math API).
using std::isfinite;
using std::isinf;
using std::isnan;

// cuda_runtime.h declares this overload for nvcc only.
template <typename T>
inline cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}
