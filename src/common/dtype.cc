#include "src/common/dtype.h"

#include <cmath>

namespace odmoe {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI8:
    case DType::kU8:
      return 1;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kI8:
      return "I8";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

std::optional<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I32") return DType::kI32;
  if (name == "I8") return DType::kI8;
  if (name == "U8") return DType::kU8;
  return std::nullopt;
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                         // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return sign;            // < 2^-25 rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp)
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

}  // namespace odmoe
