#include "src/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

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

int32_t ArgMax(std::span<const float> logits) {
  int32_t best = 0;
  bool found = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (!found || logits[i] > logits[static_cast<size_t>(best)]) {
      best = static_cast<int32_t>(i);
      found = true;
    }
  }
  return best;
}

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::Next(std::span<const float> logits) {
  if (options_.temperature == 0.0) return ArgMax(logits);
  // Candidates sorted by logit, highest first (ties: lower id first), after the top-k cut.
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    if (la != lb) return la > lb;
    return a < b;
  };
  size_t keep = order.size();
  if (options_.top_k > 0) keep = std::min(keep, static_cast<size_t>(options_.top_k));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(), better);
  order.resize(keep);

  // Softmax of logits / T in double precision.
  std::vector<double> p(keep);
  const double max_logit = logits[static_cast<size_t>(order[0])];
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((logits[static_cast<size_t>(order[i])] - max_logit) / options_.temperature);
    sum += p[i];
  }
  for (double& v : p) v /= sum;
  // Nucleus: the smallest prefix whose probability reaches top_p (at least one token).
  if (options_.top_p < 1.0) {
    double cum = 0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += p[i];
      if (cum >= options_.top_p) {
        cut = i + 1;
        break;
      }
    }
    p.resize(cut);
    order.resize(cut);
    const double total = std::accumulate(p.begin(), p.end(), 0.0);
    for (double& v : p) v /= total;
  }
  const double u = Uniform();
  double cum = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    cum += p[i];
    if (u < cum) return order[i];
  }
  return order.back();
}

}  // namespace odmoe
