// Picks the next token from a logits vector: greedy (argmax, ties to the lowest id) or seeded sampling with
// temperature, top-k and top-p. Deterministic: the same seed and logits give the same tokens on every machine
// (the random numbers come from std::mt19937_64, whose output the standard fixes).
#pragma once

#include <cstdint>
#include <random>
#include <span>

#include "absl/status/status.h"

namespace odmoe {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no top-k filter
  double top_p = 1.0;        // 1: no nucleus filter
  uint64_t seed = 0;

  // InvalidArgument naming the option when a value is out of range.
  absl::Status Validate() const;
};

// Index of the largest value; the lowest index among equal maxima. NaN never wins.
int32_t ArgMax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {}
  int32_t Next(std::span<const float> logits);

 private:
  double Uniform();  // [0, 1)
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace odmoe
