// UTF-8 validity, for text that crosses a boundary which requires it (protobuf string fields, JSON logs).
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

#include "absl/status/status.h"

namespace odmoe {

// The length (1..4) of the well-formed UTF-8 sequence that starts at byte `at` of `s`, or 0 when the bytes
// there are not one (a stray continuation byte, a truncated sequence, an overlong form, a surrogate, or a code
// point above U+10FFFF). REQUIRES: at < s.size().
size_t Utf8SequenceLength(std::string_view s, size_t at);

// The byte offset of the first byte of `s` that does not start a well-formed UTF-8 sequence; nullopt when all
// of `s` is valid UTF-8.
std::optional<size_t> FirstInvalidUtf8(std::string_view s);

// OK for valid UTF-8; otherwise InvalidArgument "WHAT is not valid UTF-8: byte 0xNN at offset N ..." (`what`
// names the flag or field).
absl::Status CheckUtf8(std::string_view s, std::string_view what);

}  // namespace odmoe
