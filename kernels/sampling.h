// Token selection from logits on the device: argmax, per-logit changes before a pick (LaunchChangeLogits), and
// per-row greedy or sampling choices (temperature, top-k, top-p, min-p and a given uniform) by the rule of
// kernels/sampling_rule.h, which the CPU reference (cpu::SelectTokens) follows too: both pick the same ids. One block
// of 1024 threads per row; the sums are of integers, so the result depends neither on timing nor on the order of
// additions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/sampling_rule.h"

namespace odmoe::kernels {

// The argmax of each row (ties: the lowest id; NaN never wins, a row of NaN gives 0).
// logits: [rows, vocab]; out_ids: [rows].
cudaError_t LaunchArgmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out_ids, cudaStream_t stream);

// out_ids[r] = the token sampling_rule.h picks from logits[r, :] by choices[r]. logits: [rows, vocab];
// choices, out_ids: [rows], device memory. cudaErrorInvalidValue for vocab outside [1, kSampleMaxVocab].
cudaError_t LaunchSelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices,
                               int32_t* out_ids, cudaStream_t stream);

// logits[c.index] = ChangedLogit(logits[c.index], c.penalty, c.delta) for each of the n changes (device memory), one
// thread each. REQUIRES: the indices are distinct and inside `logits`.
cudaError_t LaunchChangeLogits(float* logits, const LogitChange* changes, int64_t n, cudaStream_t stream);

}  // namespace odmoe::kernels
