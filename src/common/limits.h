// Limits every node must agree on, in one place.
#pragma once

#include <cstdint>

namespace odmoe {

// The most token rows one step moves at once: the engine's forward chunk (EngineOptions::max_tokens_per_forward,
// so a prefill is processed in chunks of at most this many tokens) and one ComputeExperts call to a worker (the
// first dimension of ComputeExpertsRequest.hidden; main splits larger batches into several calls). One value, so
// that main's prefill chunks fit one call.
inline constexpr int64_t kMaxTokenRows = 256;

// How many times slower this build runs than a plain one. Sanitizer builds (scripts/sanitize.sh) stretch the
// timeouts that judge a peer dead (main's failure detection), so that instrumentation overhead on a busy node is
// not taken for a hang; tests that time detection scale their limits alike. 1 in every other build.
#if defined(__has_feature)
#define ODMOE_HAS_FEATURE(x) __has_feature(x)
#else
#define ODMOE_HAS_FEATURE(x) 0
#endif
#if defined(__SANITIZE_THREAD__) || ODMOE_HAS_FEATURE(thread_sanitizer)
inline constexpr int kBuildSlowdown = 3;
#elif defined(__SANITIZE_ADDRESS__) || ODMOE_HAS_FEATURE(address_sanitizer)
inline constexpr int kBuildSlowdown = 2;
#else
inline constexpr int kBuildSlowdown = 1;
#endif
#undef ODMOE_HAS_FEATURE

}  // namespace odmoe
