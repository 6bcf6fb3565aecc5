// Token selection from logits: argmax, and sampling with temperature, top-k and top-p from a given uniform
// random number. One block of 1024 threads per row; deterministic (fixed reduction order) for given inputs.
//
// Sampling, for a row of logits l[0 .. vocab) and a uniform u in [0, 1):
//  1. temperature <= 0 or top_k == 1: the argmax (ties: the lowest id).
//  2. z = l / temperature (fp32). Tokens are ordered by (z descending, id ascending).
//  3. top-k (0 < top_k < vocab): keep the first top_k tokens of that order.
//  4. e = exp(z - max z); Z = sum of e over the kept tokens.
//  5. top-p (top_p < 1): keep the shortest prefix of the kept tokens, in that order, whose e sum to at least
//     top_p * Z.
//  6. Pick the first kept token in ascending id order whose inclusive running sum of e exceeds u * (sum of e
//     over the kept tokens); the last kept token if rounding leaves none.
// The kept set is the usual top-k/top-p nucleus; walking it in id order (instead of probability order) gives
// the same distribution and needs no sort. The nucleus is found by a radix select over the float bits
// (4 bits per pass), so it is exact for any vocabulary size.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// logits: [rows, vocab]; out_ids: [rows].
cudaError_t LaunchArgmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out_ids, cudaStream_t stream);

// uniforms: [rows] in [0, 1) (device memory); top_k <= 0 means no top-k; top_p >= 1 means no top-p;
// top_p <= 0 is the argmax. vocab <= 2^24 (counts are exact in fp32). Logits must not be NaN.
cudaError_t LaunchSample(const float* logits, int64_t rows, int64_t vocab, float temperature, int64_t top_k,
                         float top_p, const float* uniforms, int32_t* out_ids, cudaStream_t stream);

}  // namespace odmoe::kernels
