// Causal multi-head attention with grouped-query heads, fp32 arithmetic over a KV cache stored as KV: float, or
// __half / __nv_bfloat16 (the model's compute dtype: half the bytes; each value read as fp32).
//
// Shapes (row-major): q, out: [n, heads, head_dim]; k_cache, v_cache: [past + n, kv_heads, head_dim], the n new
// tokens at rows past .. past + n - 1. Query token t (position past + t) attends to cache rows 0 .. past + t.
// Query head h reads kv head h / (heads / kv_heads). Scores are scale * dot(q, k); softmax in fp32 with the
// running maximum subtracted (online softmax). head_dim <= kMaxHeadDim.
//
// Two kernels:
//  - decode: one block per (token, kv head, split) for all the query heads of that kv head (each K/V element
//    read once per token, in 16-byte loads; a scalar per-head fallback for unaligned caches or a head_dim not a
//    multiple of 16 bytes). With more than one split the partial (max, sum, acc) go to a workspace and a second
//    kernel combines them ("flash decoding"), so that a single token against a long context still fills the GPU.
//    The number of splits depends on n, past and heads only. Meant for n <= a few tokens.
//  - prefill: one block per (head, 16 consecutive query tokens); K/V tiles of 32 keys are staged in shared
//    memory and shared by the 16 queries (4 per warp, one key per lane). Meant for prompts.
// Both compute the same function; either may be used for any n.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace odmoe::kernels {

inline constexpr int64_t kMaxHeadDim = 256;

// Floats of workspace LaunchAttentionDecode uses to split the sequence as it prefers for these sizes (0: it
// would not split). Passing a smaller workspace reduces the number of splits (none when it is 0 or null).
size_t AttentionDecodeWorkspaceFloats(int64_t n, int64_t past, int64_t heads, int64_t head_dim);

// Floats of workspace LaunchAttentionDecodeAt needs to split as LaunchAttentionDecode prefers for every
// past <= max_past: AttentionDecodeWorkspaceFloats(n, max_past, ...), which does not decrease with past.
size_t AttentionDecodeAtWorkspaceFloats(int64_t n, int64_t max_past, int64_t heads, int64_t head_dim);

// KV: float, __half or __nv_bfloat16 (explicitly instantiated in attention.cu).
template <typename KV>
cudaError_t LaunchAttentionDecode(const float* q, const KV* k_cache, const KV* v_cache, int64_t n, int64_t past,
                                  int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out,
                                  float* workspace, size_t workspace_floats, cudaStream_t stream);

// LaunchAttentionDecode with the decode position read from device memory when the kernels run: past is *past
// (one int32 on the device), so that one enqueued launch (e.g. captured in a CUDA graph and replayed at every
// token) serves every position up to max_past; only *past changes between runs.
// REQUIRES: 0 <= *past <= max_past when the kernels run (another value gives unspecified output but no access
//           outside rows [0, max_past + n) of the caches); past not null.
// For every such *past the output is bit for bit LaunchAttentionDecode's with past = *past and a workspace of at
// least AttentionDecodeWorkspaceFloats(n, *past, heads, head_dim) floats: the kernels split the sequence by the
// same rule, from *past. workspace_floats >= AttentionDecodeAtWorkspaceFloats(n, max_past, heads, head_dim) gives
// that for every *past; a smaller workspace reduces the splits as it does for LaunchAttentionDecode (the two agree
// bit for bit for the same workspace). The grid is sized for max_past: blocks for splits the actual past does not
// have exit at once.
template <typename KV>
cudaError_t LaunchAttentionDecodeAt(const float* q, const KV* k_cache, const KV* v_cache, int64_t n,
                                    const int32_t* past, int64_t max_past, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, float scale, float* out, float* workspace,
                                    size_t workspace_floats, cudaStream_t stream);

template <typename KV>
cudaError_t LaunchAttentionPrefill(const float* q, const KV* k_cache, const KV* v_cache, int64_t n, int64_t past,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out,
                                   cudaStream_t stream);

// Writes n rows of K and n rows of V (kv_size floats each) into their caches of `capacity` rows of kv_size
// elements: row i of k_rows becomes k_cache row positions[i], row i of v_rows v_cache row positions[i], converted
// to KV with round-to-nearest-even (the bits LaunchConvert gives; float rows are copied). positions (n int32) are
// in device memory, read when the kernel runs; a position outside [0, capacity) writes nothing. One launch for
// both caches.
// REQUIRES: the in-range positions distinct; no row overlaps a cache, and the caches do not overlap.
template <typename KV>
cudaError_t LaunchKvStore(const float* k_rows, const float* v_rows, const int32_t* positions, int64_t n,
                          int64_t kv_size, KV* k_cache, KV* v_cache, int64_t capacity, cudaStream_t stream);

}  // namespace odmoe::kernels
