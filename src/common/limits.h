// Limits every node must agree on, in one place.
#pragma once

#include <cstdint>

namespace odmoe {

// The most token rows one step moves at once: the engine's forward chunk (EngineOptions::max_tokens_per_forward,
// so a prefill is processed in chunks of at most this many tokens) and one ComputeExperts call to a worker (the
// first dimension of ComputeExpertsRequest.hidden; main splits larger batches into several calls). One value, so
// that main's prefill chunks fit one call.
inline constexpr int64_t kMaxTokenRows = 256;

}  // namespace odmoe
