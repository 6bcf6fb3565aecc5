// Test helpers that write safetensors files byte by byte, so tests can build valid files and every kind of
// broken one: an 8-byte little-endian header length, the JSON header, then the data section.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "src/common/json.h"

namespace odmoe::testing {

// Bits per element of the safetensors dtypes the tests use (0 for a name the format does not define).
inline uint64_t SafetensorsDTypeBits(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64" || dtype == "C64") return 64;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 32;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 16;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype.starts_with("F8_")) return 8;
  return 0;
}

// Serialises `header` (as given: offsets are not checked) followed by `data`. The header is padded with spaces
// to a multiple of 8 bytes, as the reference writer does. `length_override` replaces the length field.
inline std::string SerializeSafetensors(const Json& header, std::string_view data,
                                        std::optional<uint64_t> length_override = std::nullopt) {
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';
  const uint64_t len = length_override.value_or(text.size());
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  out += text;
  out.append(data.data(), data.size());
  return out;
}

struct StTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string data;  // empty: filled with a deterministic byte pattern of the right size
};

inline uint64_t StTensorBytes(const StTensor& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  const uint64_t bits = SafetensorsDTypeBits(t.dtype);
  if (bits == 0) throw std::invalid_argument("no size known for dtype " + t.dtype + "; give the data");
  return (n * bits + 7) / 8;
}

// A file holding `tensors` back to back, in order, with `metadata` under __metadata__ (if not null).
inline std::string BuildSafetensors(const std::vector<StTensor>& tensors, const Json& metadata = Json()) {
  Json header = Json::object();
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::string data;
  for (const StTensor& t : tensors) {
    std::string bytes = t.data;
    if (bytes.empty()) {
      bytes.resize(StTensorBytes(t));
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 31 + t.name.size()) & 0xff);
    }
    const uint64_t begin = data.size();
    data += bytes;
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  return SerializeSafetensors(header, data);
}

// A safetensors file split into its parsed header and its data section, for tests that edit real files.
struct SafetensorsImage {
  Json header;
  std::string data;
};

inline SafetensorsImage SplitSafetensors(const std::string& file) {
  if (file.size() < 8) throw std::invalid_argument("not a safetensors file");
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(file[i]);
  if (len > file.size() - 8) throw std::invalid_argument("not a safetensors file");
  SafetensorsImage image;
  image.header = Json::parse(file.substr(8, len));
  image.data = file.substr(8 + len);
  return image;
}

inline std::string JoinSafetensors(const SafetensorsImage& image) {
  return SerializeSafetensors(image.header, image.data);
}

}  // namespace odmoe::testing
