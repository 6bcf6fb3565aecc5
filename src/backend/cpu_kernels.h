// The fp32 reference kernels: one plain function per op of Device, on host pointers, single-threaded and
// deterministic (the summation order of every result is fixed by the shapes alone). CpuDevice and
// MockGpuDevice compute with these, and every CUDA kernel is tested against them.
//
// Numerics follow HF Transformers (eager, fp32):
//  - Weights are read in their storage dtype (F32, F16 or BF16) and widened to fp32; accumulation is fp32.
//    MatMul also takes weight-only quantized weights (INT8 rows, NF4), dequantized to fp32 as quantize.h does.
//  - RmsNorm: var = mean(x^2) (fp32), x * rsqrt(var + eps), then * weight.
//  - Rope ("rotate_half", non-interleaved): inv_freq[i] = 1 / theta^(2i/d) computed in fp32 as torch does,
//    angle = float(pos) * inv_freq[i] in fp32, out[i] = x[i]*cos - x[i+d/2]*sin, out[i+d/2] =
//    x[i+d/2]*cos + x[i]*sin.
//  - Attention: softmax(q.k * scale) over the causal window, max-subtracted, then the weighted sum of v.
//  - RouterTopK: fp32 softmax over all experts, top-k by probability (ties: lower id first), best first.
//  - SelectTokens and ChangeLogits: the rules of kernels/sampling_rule.h, which the CUDA kernels follow too (the same
//    ids and bits).
//
// Shapes are in the comments as [rows, cols], row-major; the contracts are those of the Device op with the
// same name (src/backend/device.h). Programming errors (null pointers, negative sizes, ids < 0) abort
// through ODMOE_CHECK.
#pragma once

#include <cstdint>

#include "src/backend/device.h"

namespace odmoe::cpu {

// Widens `count` elements of `w`, starting at element `first`, to fp32 into out[0..count).
// REQUIRES: w.dtype is F32, F16 or BF16.
void WidenWeights(WeightRef w, int64_t first, int64_t count, float* out);
// One element of `w` as fp32 (slow; for tests and small reads).
float WeightAt(WeightRef w, int64_t index);

// out[i, :] = table[ids[i], :]. ids: [n], table: [vocab, dim], out: [n, dim]. REQUIRES: ids[i] >= 0 (the
// caller checks ids < vocab).
void Embedding(const int32_t* ids, int64_t n, WeightRef table, int64_t dim, float* out);

// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight. x, out: [rows, dim] (may alias), weight: [dim].
void RmsNorm(const float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out);

// y = x * w^T (+ bias). x: [n, in_dim], w: [out_dim, in_dim], bias: [out_dim] or empty, y: [n, out_dim].
// REQUIRES: y does not alias x. Each weight row is widened once and dotted with all n rows of x; y[t, o] is
// the same for every n (the dot's summation order depends on in_dim only). A quantized w (kI8 / kU8, the
// layouts of quantize.h, w.scales set) is dequantized a tile of rows at a time with DequantizeInt8Rows /
// DequantizeNf4, so y is bitwise the result for w dequantized to fp32. bias must be dense.
void MatMul(const float* x, WeightRef w, WeightRef bias, int64_t n, int64_t in_dim, int64_t out_dim, float* y);

// The fp32 inverse frequencies of RoPE: inv_freq[i] = 1 / theta^(float(2i) / float(head_dim)), i < head_dim/2.
void RopeInvFreq(int64_t head_dim, double theta, float* inv_freq);

// In place. x: [n, heads, head_dim], positions: [n]. REQUIRES: head_dim even.
void Rope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta);

// q, out: [n, heads, head_dim]; k_cache, v_cache: [past + n, kv_heads, head_dim]. New token i (absolute
// position past + i) attends to cache rows 0..past+i. Query head h reads kv head h / (heads / kv_heads).
// REQUIRES: heads % kv_heads == 0; out does not alias k_cache or v_cache. out may alias q (each query row is
// read in full before its output row is written).
void Attention(const float* q, const float* k_cache, const float* v_cache, int64_t n, int64_t past, int64_t heads,
               int64_t kv_heads, int64_t head_dim, float scale, float* out);

// logits: [n, num_experts]; ids, weights: [n, k]. REQUIRES: 1 <= k <= num_experts. NaN logits sort last.
void RouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize, int32_t* ids,
                float* weights);

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]. out may alias gate or up.
void SwiGlu(const float* gate, const float* up, int64_t count, float* out);

// y[i] += x[i].
void Add(const float* x, int64_t count, float* y);

// dst[i] = src[i] for `count` values from src_dtype to dst_dtype: F32 to F16 / BF16 (round to nearest even) or
// back (exact), or a copy for the same dtype. REQUIRES: dtypes F32, F16 or BF16, one of them F32 unless equal;
// src and dst do not overlap.
void Convert(const void* src, DType src_dtype, int64_t count, void* dst, DType dst_dtype);

// dst[i, :] = src[rows[i], :]. src: [*, dim], rows: [n], dst: [n, dim]. REQUIRES: dst does not overlap src.
void GatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst);

// dst[rows[i], :] += f(scale[i]) * src[i, :] for i = 0, 1, ..., n-1 in order; f is the identity, or the
// sigmoid when `sigmoid_scale`. src: [n, dim], rows, scale: [n], dst: [*, dim]. REQUIRES: dst does not overlap
// src.
void ScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                      bool sigmoid_scale, float* dst);

// The index of the largest of logits[0, vocab): the lowest among equal maxima; NaN never wins (all NaN: 0).
// REQUIRES: vocab >= 1.
int32_t ArgMax(const float* logits, int64_t vocab);

// logits[c.index] = kernels::ChangedLogit(logits[c.index], c.penalty, c.delta) for each of changes[0, n).
void ChangeLogits(float* logits, const LogitChange* changes, int64_t n);

// ids[r] = the token kernels/sampling_rule.h picks from logits[r, :] by choices[r]. logits: [rows, vocab];
// choices, ids: [rows]. REQUIRES: 1 <= vocab <= kernels::kSampleMaxVocab.
void SelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices, int32_t* ids);

}  // namespace odmoe::cpu
