// MoE router: softmax over the expert logits of each token, then the top k experts.
//
// One warp per token. Probabilities p = exp(l - max) / sum in fp32; the k largest probabilities are chosen
// best first, ties to the lower expert id. weights[i, j] = p of the j-th chosen expert, divided by the sum of
// the k chosen probabilities when `renormalize`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// logits: [n, num_experts]; ids, weights: [n, k]. 1 <= k <= num_experts <= 8192.
cudaError_t LaunchRouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize,
                             int32_t* ids, float* weights, cudaStream_t stream);

// The post-attention norm and the router of a sparse layer in one launch, for up to kAddRmsNormRouterMaxExperts
// experts (the router's GEMV alone would be one block): for each of the `rows` tokens, x += delta and h =
// RmsNorm(x) by norm_weight (as LaunchAddRmsNorm), logits = h . router^T (as LaunchGemv with no bias, for any
// rows <= kGemvMaxTokens), and ids / weights the top k of their softmax (as LaunchRouterTopK); bitwise what those
// three launches give. delta, x, h: [rows, dim], h aliasing neither; router: [num_experts, dim]; logits:
// [rows, num_experts]; ids, weights: [rows, k]. W: float, __half or __nv_bfloat16. cudaErrorInvalidValue past
// kAddRmsNormRouterMaxDim or kAddRmsNormRouterMaxExperts (take the three launches).
inline constexpr int64_t kAddRmsNormRouterMaxExperts = 8;  // a warp per expert in the norm's 256-thread block
inline constexpr int64_t kAddRmsNormRouterMaxDim = 8192;   // the held norm's longest row
template <typename W>
cudaError_t LaunchAddRmsNormRouter(const float* delta, float* x, const W* norm_weight, int64_t rows, int64_t dim,
                                   float eps, float* h, const W* router, int64_t num_experts, int64_t k,
                                   bool renormalize, float* logits, int32_t* ids, float* weights, cudaStream_t stream);

}  // namespace odmoe::kernels
