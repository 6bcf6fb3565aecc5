#include "src/shadow_node/hedge.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace odmoe {

std::vector<double> RouterProbabilities(std::span<const float> logits) {
  std::vector<double> p(logits.size());
  if (logits.empty()) return p;
  const double top = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp(static_cast<double>(logits[i]) - top);
    sum += p[i];
  }
  for (double& v : p) v /= sum;
  return p;
}

std::vector<int32_t> HedgeExperts(std::span<const float> logits, std::span<const int32_t> chosen, double margin) {
  const size_t k = chosen.size();
  if (margin <= 0 || k == 0 || logits.size() <= k) return {};
  const std::vector<double> p = RouterProbabilities(logits);
  std::vector<int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)]; });
  const double p_k = p[static_cast<size_t>(order[k - 1])];
  const double p_next = p[static_cast<size_t>(order[k])];
  if (p_k - p_next >= margin) return {};
  // Normally order[k]; the first outside `chosen` should the engine have broken a tie the other way.
  for (int32_t e : order) {
    if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) return {e};
  }
  return {};
}

}  // namespace odmoe
