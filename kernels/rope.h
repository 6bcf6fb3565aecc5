// Rotary position embedding in the Hugging Face "rotate_half" layout.
//
// The angle of pair i (i < head_dim / 2) for a token at position p is float(p) * inv_freq[i], with
// inv_freq[i] = 1.0f / float(theta ** (float(2 i) / float(head_dim))) computed in float32 the way torch does
// (the power rounded once to float32), and cos/sin taken in float32. Then, in place,
//   x[i]        = x[i] * cos - x[i + half] * sin
//   x[i + half] = x[i + half] * cos + x[i] * sin.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// x: [n, heads, head_dim] fp32, rotated in place; positions: [n] int32 (device memory). head_dim even.
// inv_freq: [head_dim / 2] (device memory) to use a table computed elsewhere (e.g. by the CPU reference, so
// that both backends rotate by bitwise the same frequencies), or null to compute it as above.
// One block per token; the block computes the cos/sin table of its position once for all heads.
cudaError_t LaunchRope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                       const float* inv_freq, cudaStream_t stream);

// LaunchRope of q ([n, heads, head_dim]) and of k ([n, kv_heads, head_dim]), then LaunchKvStore of k's rotated rows
// and of v's rows ([n, kv_heads * head_dim]) into the caches (capacity rows of kv_heads * head_dim elements, row
// positions[i] for token i; a position outside [0, capacity) stores nothing), in one launch: bitwise what those
// three launches give, q and k rotated in place as LaunchRope leaves them. KV: float, __half or __nv_bfloat16.
// REQUIRES: q, k, v and the caches do not overlap (q and k may be adjacent); the in-range positions distinct.
// Bad sizes or a missing pointer: cudaErrorInvalidValue.
template <typename KV>
cudaError_t LaunchRopeKvStore(float* q, float* k, const float* v, const int32_t* positions, int64_t n, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, double theta, const float* inv_freq, KV* k_cache,
                              KV* v_cache, int64_t capacity, cudaStream_t stream);

// Qwen3's per-head norms, then the rotation, in one launch, in place: each head of q ([n, heads, head_dim]) becomes
// its RMSNorm (over head_dim) times q_weight, each head of k ([n, kv_heads, head_dim]) likewise with k_weight, and
// then both are rotated as LaunchRope rotates them (positions, inv_freq as there). Bitwise what LaunchRmsNorm over
// q's n x heads rows and k's n x kv_heads rows, then LaunchRope of q and of k, give. q and k may be adjacent but
// must not overlap. W: float, __half or __nv_bfloat16. REQUIRES: head_dim even and at most kHeadNormRopeMaxHeadDim
// (otherwise cudaErrorInvalidValue: take the norms and the rotation apart).
inline constexpr int64_t kHeadNormRopeMaxHeadDim = 256;
template <typename W>
cudaError_t LaunchHeadNormRope(float* q, float* k, const W* q_weight, const W* k_weight, const int32_t* positions,
                               int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, double theta,
                               const float* inv_freq, cudaStream_t stream);

// LaunchHeadNormRope, then LaunchKvStore of k's normed and rotated rows and of v's rows into the caches, in one
// launch: what LaunchRopeKvStore is to LaunchRope (the same rules for v, the caches, capacity and positions).
// W: the norms' dtype; KV: the caches'.
template <typename W, typename KV>
cudaError_t LaunchHeadNormRopeKvStore(float* q, float* k, const float* v, const W* q_weight, const W* k_weight,
                                      const int32_t* positions, int64_t n, int64_t heads, int64_t kv_heads,
                                      int64_t head_dim, float eps, double theta, const float* inv_freq, KV* k_cache,
                                      KV* v_cache, int64_t capacity, cudaStream_t stream);

}  // namespace odmoe::kernels
