#include "src/engine/logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace odmoe {
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

float Finite(float l) { return std::isnan(l) ? kMinusInf : l; }

}  // namespace

PositionLogprobs LogprobsOf(std::span<const float> logits, int32_t id, int32_t top_n) {
  float max = kMinusInf;
  for (const float l : logits) max = std::max(max, Finite(l));
  const bool finite_max = std::isfinite(max);
  double log_sum = 0;
  if (finite_max) {
    // Each term in fp32 (exp of a value <= 0: at most 1, relative error an ulp), summed in double.
    double sum = 0;
    for (const float l : logits) sum += std::exp(Finite(l) - max);
    log_sum = std::log(sum);  // sum >= 1 (the maximum's own term)
  }
  auto logprob = [&](float l) -> float {
    if (!finite_max) return l == std::numeric_limits<float>::infinity() ? 0.0f : kLogprobFloor;
    const double lp = (static_cast<double>(l) - max) - log_sum;
    return lp < kLogprobFloor ? kLogprobFloor : static_cast<float>(lp);
  };

  PositionLogprobs out;
  out.token = {id, logprob(Finite(logits[static_cast<size_t>(id)]))};
  const size_t n = std::min(static_cast<size_t>(std::max(top_n, 0)), logits.size());
  if (n == 0) return out;
  // The n best by (logit descending, id ascending), in one pass: a later id enters only above the current n-th.
  std::vector<TokenLogprob> best;  // logprob holds the logit until the end
  best.reserve(n + 1);
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = Finite(logits[i]);
    if (best.size() == n && !(l > best.back().logprob)) continue;
    auto at = std::upper_bound(best.begin(), best.end(), l,
                               [](float value, const TokenLogprob& t) { return value > t.logprob; });
    best.insert(at, {static_cast<int32_t>(i), l});
    if (best.size() > n) best.pop_back();
  }
  for (TokenLogprob& t : best) t.logprob = logprob(t.logprob);
  out.top = std::move(best);
  return out;
}

}  // namespace odmoe
