#include "src/engine/sampler.h"

#include <cmath>
#include <limits>

#include "src/backend/cpu_kernels.h"
#include "src/common/strings.h"

namespace odmoe {

absl::Status SamplingOptions::Validate() const {
  if (!(temperature >= 0) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(StrCat("sampling.temperature must be a number >= 0, got ", temperature));
  }
  if (top_k < 0) return absl::InvalidArgumentError(StrCat("sampling.top_k must be >= 0, got ", top_k));
  if (!(top_p > 0 && top_p <= 1)) {
    return absl::InvalidArgumentError(StrCat("sampling.top_p must be in (0, 1], got ", top_p));
  }
  return absl::OkStatus();
}

TokenChoice ToTokenChoice(const SamplingOptions& options, float uniform) {
  TokenChoice c;
  c.temperature = static_cast<float>(options.temperature);
  c.top_k = options.top_k > std::numeric_limits<int32_t>::max() ? 0 : static_cast<int32_t>(options.top_k);
  c.top_p = static_cast<float>(options.top_p);
  c.uniform = uniform;
  return c;
}

int32_t ArgMax(std::span<const float> logits) {
  return cpu::ArgMax(logits.data(), static_cast<int64_t>(logits.size()));
}

float Sampler::Uniform() { return static_cast<float>(rng_() >> 40) * 0x1.0p-24f; }

TokenChoice Sampler::NextChoice() {
  TokenChoice c = ToTokenChoice(options_, 0.0f);
  if (!kernels::IsGreedy(c)) c.uniform = Uniform();
  return c;
}

int32_t Sampler::Next(std::span<const float> logits) {
  const TokenChoice c = NextChoice();
  int32_t id = 0;
  cpu::SelectTokens(logits.data(), 1, static_cast<int64_t>(logits.size()), &c, &id);
  return id;
}

}  // namespace odmoe
