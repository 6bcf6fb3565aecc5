// Main's pick rule for one request, replayed over the tokens the shadow's replica runs, so that the replica's
// guess of each next token is picked as main picks it: the same temperature, top-k, top-p and min-p, the same
// seeded draw for the same generated token, and the same logit changes (repetition, presence and frequency
// penalties, logit bias, min_tokens' ban, a structured output's grammar) over the same tokens. Where the replica's
// logits are close to main's, its guess is then main's token for a sampled or penalized request too; a greedy guess
// would match only where main's pick happens to be the likeliest token.
//
// The state is that of main's Sampler (RequestSampler) after the generated tokens given so far: choice() and
// deltas() are for the pick of the token that follows them, as main makes it.
//
// Thread safety: none (the shadow's loop thread owns it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "src/engine/generator.h"
#include "src/engine/sampler.h"
#include "src/model/model_config.h"

namespace odmoe {

class PickReplay {
 public:
  // REQUIRES: options.Validate(config.vocab_size) is OK and every prompt id is in the vocabulary (as Sampler).
  PickReplay(const ModelConfig& config, GenerateOptions options, std::span<const int32_t> prompt);

  // How the pick of generated token tokens().size() is made: the rule, with its draw when it samples.
  const TokenChoice& choice() const { return choice_; }
  // The changes to that pick's logits (Sampler::Deltas). Valid until the next Push or Truncate.
  std::span<const LogitDelta> deltas() const { return sampler_.Deltas(); }

  // Generated token `id` comes next (the replica ran it, or took main's K/V for it).
  void Push(int32_t id);
  // Keeps the first `n` generated tokens (a roll back): the rule is replayed over them from the start, since a
  // draw once taken cannot be given back.
  void Truncate(size_t n);
  // The generated tokens given so far: the one the replica ran at each decode position (index position - prompt).
  const std::vector<int32_t>& tokens() const { return tokens_; }

 private:
  ModelConfig config_;
  GenerateOptions options_;
  std::vector<int32_t> prompt_;
  Sampler sampler_;
  TokenChoice choice_;
  std::vector<int32_t> tokens_;
};

}  // namespace odmoe
