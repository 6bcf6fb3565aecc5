// Finding a marker (a tag such as "<think>") in text that arrives in pieces.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace odmoe {

// How many bytes at the end of `text` may be the start of `marker` (a proper prefix of it): what a reader of
// streamed text holds back until the next piece says whether the marker is there. 0 when none.
inline size_t MarkerPrefixAtEnd(std::string_view text, std::string_view marker) {
  if (marker.empty()) return 0;
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace odmoe
