// Hedged prefetch ([shadow] hedge_margin): when the shadow's router is nearly undecided between its k-th and its
// (k+1)-th expert, the shadow prefetches the (k+1)-th as well, so that a small difference between its quantized
// replica and main's model costs an extra load instead of an on-demand load after routing.
//
// The margin is measured on the router's softmax over all experts (before any top-k renormalisation), ranked
// best first (ties: the lower id first): the (k+1)-th expert is hedged when p_k - p_(k+1) < margin.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace odmoe {

// Softmax of one row of router logits, in double precision.
std::vector<double> RouterProbabilities(std::span<const float> logits);

// The experts to hedge for one (position, layer): empty when margin <= 0, when there are no more experts than
// `chosen` holds, or when p_k - p_(k+1) >= margin; else the best-ranked expert outside `chosen` (the router's
// top-k, best first, as the engine chose them). k = chosen.size().
std::vector<int32_t> HedgeExperts(std::span<const float> logits, std::span<const int32_t> chosen, double margin);

}  // namespace odmoe
