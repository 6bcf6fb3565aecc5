// Picks the next token of a request: greedy (argmax, ties to the lowest id) or seeded sampling with temperature,
// top-k and top-p. A Sampler owns the request's random stream (std::mt19937_64, whose output the standard fixes)
// and turns its options into one TokenChoice per token (NextChoice); the pick itself follows the one rule of
// kernels/sampling_rule.h, made either next to the logits by Device::SelectTokens (a decode step then brings back
// only the id) or on the host by Next, with the same result. Deterministic: the same seed and logits give the same
// tokens on every machine and backend.
#pragma once

#include <cstdint>
#include <random>
#include <span>

#include "absl/status/status.h"
#include "kernels/sampling_rule.h"

namespace odmoe {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no top-k filter
  double top_p = 1.0;        // 1: no nucleus filter
  uint64_t seed = 0;

  // InvalidArgument naming the option when a value is out of range.
  absl::Status Validate() const;
};

// The options as the rule reads them, in fp32 (a temperature that rounds to 0 is greedy, a top_p that rounds to 1
// cuts nothing, a top_k beyond int32 cuts nothing), with `uniform` as the draw.
TokenChoice ToTokenChoice(const SamplingOptions& options, float uniform);

// Index of the largest value; the lowest index among equal maxima. NaN never wins. REQUIRES: not empty.
int32_t ArgMax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {}
  // How the next token is to be picked: the options and, when they sample, the next draw of the seeded stream
  // (greedy draws none). Called once per token, by whoever makes the pick.
  TokenChoice NextChoice();
  // The next token picked on the host from its logits ([vocab]): cpu::SelectTokens by NextChoice().
  int32_t Next(std::span<const float> logits);

 private:
  float Uniform();  // [0, 1), a multiple of 2^-24 (exact in fp32)
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace odmoe
