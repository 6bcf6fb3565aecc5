#include "src/common/utf8.h"

#include <cstdint>
#include <cstdio>

#include "src/common/strings.h"

namespace odmoe {

Utf8Unit NextUtf8Unit(std::string_view s, size_t at) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t lead = byte(at);
  if (lead < 0x80) return {Utf8Unit::kChar, 1};
  size_t length = 0;
  uint8_t min_second = 0x80, max_second = 0xBF;  // the second byte's range (RFC 3629, table 3-7 of Unicode)
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) min_second = 0xA0;  // overlong
    if (lead == 0xED) max_second = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) min_second = 0x90;  // overlong
    if (lead == 0xF4) max_second = 0x8F;  // above U+10FFFF
  } else {
    return {Utf8Unit::kInvalid, 1};  // a continuation byte, C0/C1 (overlong) or F5..FF
  }
  for (size_t i = 1; i < length; ++i) {
    if (at + i == s.size()) return {Utf8Unit::kTruncated, i};
    const uint8_t b = byte(at + i);
    const bool fits = i == 1 ? (b >= min_second && b <= max_second) : (b & 0xC0) == 0x80;
    if (!fits) return {Utf8Unit::kInvalid, i};
  }
  return {Utf8Unit::kChar, length};
}

size_t Utf8SequenceLength(std::string_view s, size_t at) {
  const Utf8Unit unit = NextUtf8Unit(s, at);
  return unit.kind == Utf8Unit::kChar ? unit.length : 0;
}

std::string EncodeUtf8(uint32_t code_point) {
  std::string out;
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
  return out;
}

bool DecodeUtf8(std::string_view s, std::vector<uint32_t>* out) {
  for (size_t at = 0; at < s.size();) {
    const size_t length = Utf8SequenceLength(s, at);
    if (length == 0) return false;
    const auto byte = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(s[at + i])); };
    uint32_t cp = length == 1 ? byte(0) : byte(0) & (0x7Fu >> length);
    for (size_t i = 1; i < length; ++i) cp = (cp << 6) | (byte(i) & 0x3F);
    out->push_back(cp);
    at += length;
  }
  return true;
}

size_t Utf8CodePoints(std::string_view s) {
  size_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

std::string Utf8Lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t at = 0; at < s.size();) {
    const Utf8Unit unit = NextUtf8Unit(s, at);
    if (unit.kind == Utf8Unit::kChar) {
      out.append(s.substr(at, unit.length));
    } else {
      out.append(kUtf8ReplacementChar);
    }
    at += unit.length;
  }
  return out;
}

std::optional<size_t> FirstInvalidUtf8(std::string_view s) {
  for (size_t at = 0; at < s.size();) {
    const size_t n = Utf8SequenceLength(s, at);
    if (n == 0) return at;
    at += n;
  }
  return std::nullopt;
}

absl::Status CheckUtf8(std::string_view s, std::string_view what) {
  const std::optional<size_t> bad = FirstInvalidUtf8(s);
  if (!bad.has_value()) return absl::OkStatus();
  char byte[8];
  std::snprintf(byte, sizeof(byte), "0x%02x", static_cast<unsigned>(static_cast<uint8_t>(s[*bad])));
  return absl::InvalidArgumentError(StrCat(what, " is not valid UTF-8: byte ", byte, " at offset ", *bad, " of ",
                                           s.size(), " does not start a well-formed UTF-8 sequence"));
}

}  // namespace odmoe
