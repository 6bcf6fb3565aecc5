// UTF-8 validity, for text that crosses a boundary which requires it (protobuf string fields, JSON logs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace odmoe {

// U+FFFD REPLACEMENT CHARACTER, in UTF-8.
inline constexpr std::string_view kUtf8ReplacementChar = "\xef\xbf\xbd";

// What the bytes of `s` at `at` begin with: a well-formed character of `length` bytes (kChar); the first `length`
// bytes of one, cut off by the end of `s` (kTruncated: more bytes may complete it); or an ill-formed sequence whose
// longest well-formed prefix ("maximal subpart", Unicode chapter 3) is `length` >= 1 bytes (kInvalid).
// REQUIRES: at < s.size().
struct Utf8Unit {
  enum Kind { kChar, kTruncated, kInvalid } kind;
  size_t length;
};
Utf8Unit NextUtf8Unit(std::string_view s, size_t at);

// `s` with each ill-formed unit (kInvalid or kTruncated above) replaced by one U+FFFD: Unicode's recommended
// practice, and what Rust's String::from_utf8_lossy (Hugging Face tokenizers' decoders) and WHATWG's TextDecoder do.
std::string Utf8Lossy(std::string_view s);

// The characters (code points) of valid UTF-8 `s`: its bytes that are not continuation bytes.
size_t Utf8CodePoints(std::string_view s);

// The length (1..4) of the well-formed UTF-8 sequence that starts at byte `at` of `s`, or 0 when the bytes
// there are not one (a stray continuation byte, a truncated sequence, an overlong form, a surrogate, or a code
// point above U+10FFFF). REQUIRES: at < s.size().
size_t Utf8SequenceLength(std::string_view s, size_t at);

// The byte offset of the first byte of `s` that does not start a well-formed UTF-8 sequence; nullopt when all
// of `s` is valid UTF-8.
std::optional<size_t> FirstInvalidUtf8(std::string_view s);

// The UTF-8 encoding of `code_point`. REQUIRES: code_point <= 0x10FFFF (a surrogate is encoded as CESU would).
std::string EncodeUtf8(uint32_t code_point);

// The code points of `s` appended to `out`; false (with `out` partly filled) when `s` is not valid UTF-8.
bool DecodeUtf8(std::string_view s, std::vector<uint32_t>* out);

// OK for valid UTF-8; otherwise InvalidArgument "WHAT is not valid UTF-8: byte 0xNN at offset N ..." (`what`
// names the flag or field).
absl::Status CheckUtf8(std::string_view s, std::string_view what);

}  // namespace odmoe
