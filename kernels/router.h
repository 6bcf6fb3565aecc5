// MoE router: softmax over the expert logits of each token, then the top k experts.
//
// One warp per token. Probabilities p = exp(l - max) / sum in fp32; the k largest probabilities are chosen
// best first, ties to the lower expert id. weights[i, j] = p of the j-th chosen expert, divided by the sum of
// the k chosen probabilities when `renormalize`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// logits: [n, num_experts]; ids, weights: [n, k]. 1 <= k <= num_experts <= 8192.
cudaError_t LaunchRouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize,
                             int32_t* ids, float* weights, cudaStream_t stream);

}  // namespace odmoe::kernels
