// Log-probabilities of generated and prompt tokens (OpenAI's `logprobs` / `top_logprobs`, `echo`): each token's
// log-probability under the model's own distribution at its position, log_softmax of the raw logits (temperature
// 1, before any top-k or top-p cut, as vLLM reports them by default), and the most likely tokens there. Computed
// on the host from the logits row of the position, which the engine copies back only for requests that ask
// (Engine's BatchInput::logits and row_logits).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace odmoe {

// The most alternatives a request may ask for per token (OpenAI's limit for top_logprobs).
inline constexpr int32_t kMaxTopLogprobs = 20;

// A log-probability reported for -inf (a token of probability 0, or a NaN logit), as OpenAI reports it: JSON
// has no infinity.
inline constexpr float kLogprobFloor = -9999.0f;

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;  // in [kLogprobFloor, 0]
  bool operator==(const TokenLogprob&) const = default;
};

// One generated token's log-probability and its position's `top` alternatives.
struct PositionLogprobs {
  TokenLogprob token;
  std::vector<TokenLogprob> top;  // the most likely first, ties to the lowest id
  bool operator==(const PositionLogprobs&) const = default;
};

// log_softmax(logits)[id] for `id` and the `top_n` largest (min(top_n, vocab) of them). The exponentials (fp32) are
// summed in double in index order, so the same row gives the same values everywhere. NaN logits count as -inf.
// A row without a finite maximum (all -inf or NaN, or a +inf) gives the +inf entries 0 and every other kLogprobFloor.
// REQUIRES: logits not empty, 0 <= id < logits.size(), 0 <= top_n.
PositionLogprobs LogprobsOf(std::span<const float> logits, int32_t id, int32_t top_n);

}  // namespace odmoe
