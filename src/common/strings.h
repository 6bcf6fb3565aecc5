// String helpers that accept std::string_view.
//
// Debian's Abseil is built with its own absl::string_view (not an alias of std::string_view), so absl::StrCat
// and friends do not take a std::string_view. odmoe code uses std::string_view throughout and builds messages
// with odmoe::StrCat, which forwards to absl::StrCat after converting any std::string_view argument.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace odmoe {
namespace strings_internal {

inline absl::string_view ToAbsl(std::string_view v) { return absl::string_view(v.data(), v.size()); }
template <typename T>
  requires(!std::is_convertible_v<const T&, std::string_view>)
const T& ToAbsl(const T& v) {
  return v;
}
inline absl::string_view ToAbsl(const std::string& v) { return absl::string_view(v); }
inline absl::string_view ToAbsl(const char* v) { return absl::string_view(v); }

}  // namespace strings_internal

template <typename... Args>
std::string StrCat(const Args&... args) {
  return absl::StrCat(strings_internal::ToAbsl(args)...);
}

inline absl::string_view ToAbslView(std::string_view v) { return absl::string_view(v.data(), v.size()); }
inline std::string_view ToStdView(absl::string_view v) { return std::string_view(v.data(), v.size()); }

}  // namespace odmoe
