// Element types of tensors in checkpoints and on devices, and scalar conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace odmoe {

enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kI32,
  kI8,
  kU8,
};

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors spelling ("F32", "BF16", ...).
std::string_view DTypeName(DType dtype);
// Parses a safetensors dtype name this project computes with; nullopt for anything else.
std::optional<DType> ParseDType(std::string_view name);

inline float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);  // round to nearest even, saturating to +-inf

}  // namespace odmoe
