// Element types and the bf16/f16 <-> f32 conversions: exact values, round-to-nearest-even, NaN, infinities,
// signed zeros and subnormals, and an independent reference (double arithmetic) over many random inputs.
#include "src/common/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

namespace odmoe {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint32_t ToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

bool IsBf16NaN(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }
bool IsF16NaN(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// Reference: the f16 nearest to |x| (ties to even), computed in double, for finite x.
uint16_t RefF32ToF16(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a < std::ldexp(1.0, -14)) {  // subnormal range: units of 2^-24; 1024 units is the smallest normal
    const double q = std::nearbyint(a * std::ldexp(1.0, 24));
    return sign | static_cast<uint16_t>(q);
  }
  int e;
  const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  double q = std::nearbyint((m * 2 - 1) * 1024);
  int exp = e - 1;
  if (q == 1024) {
    q = 0;
    ++exp;
  }
  if (exp + 15 >= 31) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((exp + 15) << 10) | static_cast<int>(q));
}

// Reference: the bf16 nearest to x (ties to even), for finite x; the result may be an infinity.
uint16_t RefF32ToBf16(float x) {
  const uint32_t bits = ToBits(x);
  const uint32_t lo = bits & 0xffff0000u;  // truncated towards zero
  const double dlo = FromBits(lo);
  const double dx = x;
  const uint32_t hi_bits = lo + 0x10000u;  // next bf16 away from zero (may be inf)
  const double dhi = (hi_bits & 0x7fffffffu) >= 0x7f800000u ? std::copysign(std::ldexp(1.0, 128), dx)
                                                            : static_cast<double>(FromBits(hi_bits));
  const double dist_lo = std::fabs(dx - dlo), dist_hi = std::fabs(dhi - dx);
  if (dist_lo < dist_hi) return static_cast<uint16_t>(lo >> 16);
  if (dist_hi < dist_lo) return static_cast<uint16_t>(hi_bits >> 16);
  return ((lo >> 16) & 1u) ? static_cast<uint16_t>(hi_bits >> 16) : static_cast<uint16_t>(lo >> 16);
}

TEST(DTypeTest, SizesNamesAndParsing) {
  struct Case {
    DType dtype;
    size_t size;
    const char* name;
  };
  const Case cases[] = {{DType::kF32, 4, "F32"}, {DType::kF16, 2, "F16"}, {DType::kBF16, 2, "BF16"},
                        {DType::kI32, 4, "I32"}, {DType::kI8, 1, "I8"},   {DType::kU8, 1, "U8"}};
  for (const Case& c : cases) {
    EXPECT_EQ(DTypeSize(c.dtype), c.size) << c.name;
    EXPECT_EQ(DTypeName(c.dtype), c.name);
    ASSERT_TRUE(ParseDType(c.name).has_value()) << c.name;
    EXPECT_EQ(*ParseDType(c.name), c.dtype);
  }
  // Valid safetensors dtypes that odmoe does not compute with, and spellings that are not dtypes at all.
  for (const char* name : {"F64", "I64", "U16", "F8_E4M3", "BOOL", "bf16", "f32", "", "BF16 "}) {
    EXPECT_FALSE(ParseDType(name).has_value()) << "'" << name << "'";
  }
}

TEST(DTypeTest, Bf16ToF32ExactValues) {
  EXPECT_EQ(Bf16ToF32(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToF32(0xc000), -2.0f);
  EXPECT_EQ(Bf16ToF32(0x3fc0), 1.5f);
  EXPECT_EQ(Bf16ToF32(0x7f7f), FromBits(0x7f7f0000u));  // the largest finite bf16
  EXPECT_EQ(Bf16ToF32(0x0080), std::numeric_limits<float>::min());
  EXPECT_EQ(Bf16ToF32(0x0001), std::ldexp(1.0f, -133));  // the smallest subnormal bf16
  EXPECT_EQ(Bf16ToF32(0x7f80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Bf16ToF32(0xff80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Bf16ToF32(0x7fc0)));
  EXPECT_TRUE(std::isnan(Bf16ToF32(0xffc1)));
  EXPECT_EQ(Bf16ToF32(0x0000), 0.0f);
  EXPECT_FALSE(std::signbit(Bf16ToF32(0x0000)));
  EXPECT_TRUE(std::signbit(Bf16ToF32(0x8000)));
}

TEST(DTypeTest, F32ToBf16RoundsToNearestEven) {
  // Representable values are exact.
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBf16(-2.0f), 0xc000);
  // 1 + 2^-8 lies halfway between 0x3f80 (even) and 0x3f81: ties go to the even one.
  EXPECT_EQ(F32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 0x3f81 and 0x3f82 (even).
  EXPECT_EQ(F32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  // Just above and below the halfway point.
  EXPECT_EQ(F32ToBf16(FromBits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(F32ToBf16(FromBits(0x3f807fffu)), 0x3f80);
  // A carry out of the mantissa bumps the exponent: 0x3fffffff -> 2.0.
  EXPECT_EQ(F32ToBf16(FromBits(0x3fffffffu)), 0x4000);
  // The largest float rounds up to infinity; infinities stay infinite.
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(F32ToBf16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(F32ToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // Signed zeros and subnormals.
  EXPECT_EQ(F32ToBf16(0.0f), 0x0000);
  EXPECT_EQ(F32ToBf16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToBf16(FromBits(0x00010000u)), 0x0001);
  EXPECT_EQ(F32ToBf16(FromBits(0x00008000u)), 0x0000);  // half of the smallest subnormal bf16: tie to even 0
  EXPECT_EQ(F32ToBf16(FromBits(0x00018000u)), 0x0002);  // 1.5 units: tie to even 2
  EXPECT_EQ(F32ToBf16(FromBits(0x80000001u)), 0x8000);  // tiny negative: -0
}

TEST(DTypeTest, F32ToBf16KeepsNaN) {
  // A NaN whose payload sits only in the low 16 bits would truncate to infinity without care.
  for (uint32_t bits : {0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0xff800001u, 0xffc00000u, 0x7f80ffffu}) {
    const uint16_t h = F32ToBf16(FromBits(bits));
    EXPECT_TRUE(IsBf16NaN(h)) << std::hex << bits << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (bits >> 16) & 0x8000u) << "sign of " << std::hex << bits;
  }
}

TEST(DTypeTest, Bf16RoundTripsEveryValue) {
  int nans = 0;
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Bf16ToF32(static_cast<uint16_t>(h));
    if (IsBf16NaN(static_cast<uint16_t>(h))) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(IsBf16NaN(F32ToBf16(f))) << std::hex << h;
      ++nans;
      continue;
    }
    ASSERT_EQ(F32ToBf16(f), h) << std::hex << h;
  }
  EXPECT_EQ(nans, 2 * 127);
}

TEST(DTypeTest, F32ToBf16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  int compared = 0;
  for (int i = 0; i < 500000; ++i) {
    const float x = FromBits(bits(rng));
    if (!std::isfinite(x)) continue;
    ASSERT_EQ(F32ToBf16(x), RefF32ToBf16(x)) << std::hex << ToBits(x);
    ++compared;
  }
  EXPECT_GT(compared, 490000);
}

TEST(DTypeTest, F16ToF32ExactValues) {
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0xc000), -2.0f);
  EXPECT_EQ(F16ToF32(0x3555), 0.333251953125f);  // (1 + 0x155 / 1024) * 2^-2
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0400), std::ldexp(1.0f, -14));         // smallest normal
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));         // smallest subnormal
  EXPECT_EQ(F16ToF32(0x03ff), 1023 * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(F16ToF32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToF32(0x0200), std::ldexp(1.0f, -15));
  EXPECT_EQ(F16ToF32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToF32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(F16ToF32(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7c01)));
  EXPECT_TRUE(std::isnan(F16ToF32(0xfe00)));
  EXPECT_EQ(F16ToF32(0x0000), 0.0f);
  EXPECT_FALSE(std::signbit(F16ToF32(0x0000)));
  EXPECT_TRUE(std::signbit(F16ToF32(0x8000)));
}

TEST(DTypeTest, F32ToF16RoundsSaturatesAndHandlesSubnormals) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  // Ties to even in the normal range: 1 + 2^-11 is halfway between 0x3c00 (even) and 0x3c01.
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(F32ToF16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Overflow: 65504 is the largest half; everything from 65520 (the midpoint to 65536) up is infinity.
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);
  EXPECT_EQ(F32ToF16(1e6f), 0x7c00);
  EXPECT_EQ(F32ToF16(-1e6f), 0xfc00);
  EXPECT_EQ(F32ToF16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(F32ToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(F32ToF16(-std::numeric_limits<float>::infinity()), 0xfc00);
  // Subnormals: units of 2^-24, ties to even.
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // half a unit: tie to even 0
  EXPECT_EQ(F32ToF16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(F32ToF16(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 units: tie to even 2
  EXPECT_EQ(F32ToF16(5 * std::ldexp(1.0f, -25)), 0x0002);  // 2.5 units: tie to even 2
  EXPECT_EQ(F32ToF16(1023 * std::ldexp(1.0f, -24)), 0x03ff);
  // Halfway between the largest subnormal and the smallest normal: rounds up into the normal range.
  EXPECT_EQ(F32ToF16(1023.5f * std::ldexp(1.0f, -24)), 0x0400);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(F32ToF16(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(F32ToF16(-std::ldexp(1.0f, -30)), 0x8000);
  EXPECT_EQ(F32ToF16(FromBits(0x00000001u)), 0x0000);  // a float subnormal
  EXPECT_EQ(F32ToF16(0.0f), 0x0000);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  // NaN stays NaN with its sign.
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7fffffffu}) {
    const uint16_t h = F32ToF16(FromBits(bits));
    EXPECT_TRUE(IsF16NaN(h)) << std::hex << bits << " -> " << h;
    EXPECT_EQ(h & 0x8000u, (bits >> 16) & 0x8000u);
  }
}

TEST(DTypeTest, F16RoundTripsEveryValue) {
  int nans = 0;
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (IsF16NaN(static_cast<uint16_t>(h))) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(IsF16NaN(F32ToF16(f))) << std::hex << h;
      ++nans;
      continue;
    }
    ASSERT_EQ(F32ToF16(f), h) << std::hex << h;
    if (std::isfinite(f)) {
      ASSERT_EQ(RefF32ToF16(f), h) << "reference disagrees at " << std::hex << h;
    }
  }
  EXPECT_EQ(nans, 2 * 1023);
}

TEST(DTypeTest, F32ToF16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(42);
  // Exponents around the f16 range (2^-27 .. 2^17) so that subnormals, normals and overflow are all hit.
  std::uniform_int_distribution<uint32_t> exp(100, 144), mant(0, 0x7fffff), sign(0, 1);
  int compared = 0;
  for (int i = 0; i < 500000; ++i) {
    const float x = FromBits((sign(rng) << 31) | (exp(rng) << 23) | mant(rng));
    ASSERT_EQ(F32ToF16(x), RefF32ToF16(x)) << x << " bits " << std::hex << ToBits(x);
    ++compared;
  }
  EXPECT_EQ(compared, 500000);
}

}  // namespace
}  // namespace odmoe
