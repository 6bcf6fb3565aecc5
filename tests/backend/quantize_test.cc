// The CPU quantizers (src/backend/quantize.h): the NF4 code book and decision thresholds, the packing layout
// (nibble order, padding of partial blocks, row stride), INT8 / NF4 round-trip error bounds over odd shapes,
// and F16 / BF16 inputs quantizing exactly like their fp32 widening.
#include "src/backend/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/dtype.h"

namespace odmoe {
namespace {

std::vector<float> NormalWeights(int64_t count, uint32_t seed, float stddev = 0.02f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> w(static_cast<size_t>(count));
  for (float& v : w) v = dist(rng);
  return w;
}

TEST(Nf4CodeBook, IsTheQloraCodeBook) {
  // QLoRA / bitsandbytes NF4 (create_normal_map with offset 0.9677, as printed by bitsandbytes).
  const double expected[16] = {-1.0,
                               -0.6961928009986877,
                               -0.5250730514526367,
                               -0.39491748809814453,
                               -0.28444138169288635,
                               -0.18477343022823334,
                               -0.09105003625154495,
                               0.0,
                               0.07958029955625534,
                               0.16093020141124725,
                               0.24611230194568634,
                               0.33791524171829224,
                               0.44070982933044434,
                               0.5626170039176941,
                               0.7229568362236023,
                               1.0};
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(kNf4CodeBook[i], static_cast<float>(expected[i])) << "entry " << i;
    if (i > 0) {
      EXPECT_LT(kNf4CodeBook[i - 1], kNf4CodeBook[i]);
    }
  }
  EXPECT_EQ(kNf4CodeBook[7], 0.0f);
}

TEST(Nf4Code, PicksTheNearestEntryAndTheLowerOneOnAMidpoint) {
  for (int i = 0; i < 16; ++i) EXPECT_EQ(Nf4Code(kNf4CodeBook[i]), i) << "entry " << i;
  for (int i = 0; i + 1 < 16; ++i) {
    // bitsandbytes' thresholds are the midpoints rounded to float; on the threshold the lower code wins.
    const float mid = static_cast<float>((static_cast<double>(kNf4CodeBook[i]) + kNf4CodeBook[i + 1]) / 2);
    const float below = std::nextafter(mid, -2.0f);
    const float above = std::nextafter(std::nextafter(mid, 2.0f), 2.0f);
    EXPECT_EQ(Nf4Code(below), i) << "just below midpoint " << i;
    EXPECT_EQ(Nf4Code(above), i + 1) << "above midpoint " << i;
  }
  // Brute force: the chosen entry is (one of) the nearest, everywhere on a fine grid.
  for (int step = -2000; step <= 2000; ++step) {
    const float v = static_cast<float>(step) / 2000.0f;
    const int code = Nf4Code(v);
    const float d = std::fabs(v - kNf4CodeBook[code]);
    for (int j = 0; j < 16; ++j) ASSERT_LE(d, std::fabs(v - kNf4CodeBook[j]) + 1e-6f) << "v=" << v;
  }
  EXPECT_EQ(Nf4Code(-5.0f), 0);
  EXPECT_EQ(Nf4Code(5.0f), 15);
  EXPECT_EQ(Nf4Code(NAN), 0);  // as bitsandbytes' decision tree
}

TEST(Nf4Layout, NibbleOrderPaddingAndRowStride) {
  EXPECT_EQ(Nf4BlocksPerRow(1), 1);
  EXPECT_EQ(Nf4BlocksPerRow(64), 1);
  EXPECT_EQ(Nf4BlocksPerRow(65), 2);
  EXPECT_EQ(Nf4RowBytes(3), 32);
  EXPECT_EQ(Nf4RowBytes(70), 64);

  // Two rows of 3 columns: each row is one partial block of 32 bytes.
  const std::vector<float> w = {1.0f, -1.0f, 0.0f,     // absmax 1: codes 15, 0, 7
                                0.0f, 0.5f,  -0.25f};  // absmax 0.5: codes 7, 15, 0.5 * -0.25/0.5 -> -0.5
  std::vector<uint8_t> codes(64, 0xee);
  std::vector<float> absmax(2, -1.0f);
  QuantizeNf4(w.data(), DType::kF32, 2, 3, codes.data(), absmax.data());
  EXPECT_EQ(absmax[0], 1.0f);
  EXPECT_EQ(absmax[1], 0.5f);
  EXPECT_EQ(codes[0], 0xF0);  // column 0 high nibble, column 1 low nibble
  EXPECT_EQ(codes[1], 0x77);  // column 2 (0.0 -> 7), then a padding nibble (7)
  for (int b = 2; b < 32; ++b) EXPECT_EQ(codes[static_cast<size_t>(b)], 0x77) << "padding byte " << b;
  EXPECT_EQ(codes[32], 0x7F);
  EXPECT_EQ(codes[33] >> 4, Nf4Code(-0.5f));
  EXPECT_EQ(codes[33] & 15, 7);

  // 70 columns: two blocks per row (64 + 6), 64 bytes per row, one absmax per block.
  const int64_t cols = 70;
  std::vector<float> w2(static_cast<size_t>(2 * cols), 0.0f);
  w2[0] = 3.0f;          // row 0 block 0
  w2[64] = -2.0f;        // row 0 block 1
  w2[cols + 69] = 4.0f;  // row 1 block 1, last column
  std::vector<uint8_t> codes2(static_cast<size_t>(2 * Nf4RowBytes(cols)));
  std::vector<float> absmax2(4);
  QuantizeNf4(w2.data(), DType::kF32, 2, cols, codes2.data(), absmax2.data());
  EXPECT_EQ(absmax2, (std::vector<float>{3.0f, 2.0f, 0.0f, 4.0f}));
  EXPECT_EQ(codes2[0], 0xF7);
  EXPECT_EQ(codes2[32], 0x07);       // row 0, column 64 = -1 -> code 0 (high), column 65 = 0 -> 7
  EXPECT_EQ(codes2[64 + 34], 0x7F);  // row 1, columns 68 (0) and 69 (4/4 = 1 -> 15)
  EXPECT_EQ(codes2[64 + 35], 0x77);  // padding

  std::vector<float> back(static_cast<size_t>(2 * cols));
  DequantizeNf4(codes2.data(), absmax2.data(), 2, cols, back.data());
  EXPECT_EQ(back[0], 3.0f);
  EXPECT_EQ(back[64], -2.0f);
  EXPECT_EQ(back[static_cast<size_t>(cols + 69)], 4.0f);
  EXPECT_EQ(back[1], 0.0f);
}

TEST(QuantizeNf4, RoundTripIsTheNearestCodeWithinBounds) {
  for (const auto& [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 63}, {5, 64}, {7, 131}, {16, 256}}) {
    const std::vector<float> w = NormalWeights(rows * cols, static_cast<uint32_t>(rows * 1000 + cols));
    const int64_t bpr = Nf4BlocksPerRow(cols);
    std::vector<uint8_t> codes(static_cast<size_t>(rows * Nf4RowBytes(cols)));
    std::vector<float> absmax(static_cast<size_t>(rows * bpr));
    QuantizeNf4(w.data(), DType::kF32, rows, cols, codes.data(), absmax.data());
    std::vector<float> back(w.size());
    DequantizeNf4(codes.data(), absmax.data(), rows, cols, back.data());
    double max_gap = 0.0;
    for (int k = 0; k + 1 < 16; ++k) max_gap = std::max<double>(max_gap, kNf4CodeBook[k + 1] - kNf4CodeBook[k]);
    double err2 = 0.0;
    double ref2 = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < cols; ++j) {
        const size_t i = static_cast<size_t>(r * cols + j);
        const float a = absmax[static_cast<size_t>(r * bpr + j / 64)];
        ASSERT_GT(a, 0.0f);
        ASSERT_LE(std::fabs(w[i]), a);
        // The nearest entry: no code book value is closer to w / absmax (up to rounding of the division).
        const double v = w[i] / a;
        const double got = back[i] / a;
        for (int k = 0; k < 16; ++k) ASSERT_LE(std::fabs(v - got), std::fabs(v - kNf4CodeBook[k]) + 1e-6);
        // At most half the widest gap of the code book (-1 .. -0.696) times the block's absmax.
        ASSERT_LE(std::fabs(back[i] - w[i]), 0.5 * max_gap * a + 1e-7);
        err2 += (back[i] - w[i]) * static_cast<double>(back[i] - w[i]);
        ref2 += static_cast<double>(w[i]) * w[i];
      }
    }
    // Gaussian weights: NF4 keeps the RMS error around 10% of the RMS weight (blocks of 64).
    if (rows * cols >= 256) {
      EXPECT_LT(std::sqrt(err2 / ref2), 0.15) << rows << "x" << cols;
    }
  }
}

TEST(QuantizeInt8Rows, RoundTripWithinHalfAStep) {
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 17}, {7, 131}, {4, 4096}}) {
    const std::vector<float> w = NormalWeights(rows * cols, static_cast<uint32_t>(rows * 7 + cols));
    std::vector<int8_t> q(w.size());
    std::vector<float> absmax(static_cast<size_t>(rows));
    QuantizeInt8Rows(w.data(), DType::kF32, rows, cols, q.data(), absmax.data());
    std::vector<float> back(w.size());
    DequantizeInt8Rows(q.data(), absmax.data(), rows, cols, back.data());
    for (int64_t r = 0; r < rows; ++r) {
      float m = 0.0f;
      bool has_extreme = false;
      for (int64_t j = 0; j < cols; ++j) m = std::max(m, std::fabs(w[static_cast<size_t>(r * cols + j)]));
      ASSERT_EQ(absmax[static_cast<size_t>(r)], m);
      const double step = m / 127.0;
      for (int64_t j = 0; j < cols; ++j) {
        const size_t i = static_cast<size_t>(r * cols + j);
        ASSERT_GE(q[i], -127);
        ASSERT_LE(q[i], 127);
        has_extreme |= q[i] == 127 || q[i] == -127;
        ASSERT_LE(std::fabs(static_cast<double>(back[i]) - w[i]), 0.5 * step * (1 + 1e-5)) << r << "," << j;
        ASSERT_EQ(q[i], static_cast<int8_t>(std::nearbyint(static_cast<double>(w[i]) / m * 127.0)))
            << "the fp32 rounding should agree with the exact one away from ties";
      }
      EXPECT_TRUE(has_extreme) << "the absmax element maps to +-127";
    }
  }
}

TEST(QuantizeInt8Rows, ZeroRowsGiveZeroCodes) {
  const std::vector<float> w = {0.0f, 0.0f, 0.0f, 1.0f, -0.5f, 0.25f};
  std::vector<int8_t> q(6, 99);
  std::vector<float> absmax(2);
  QuantizeInt8Rows(w.data(), DType::kF32, 2, 3, q.data(), absmax.data());
  EXPECT_EQ(absmax[0], 0.0f);
  EXPECT_EQ(absmax[1], 1.0f);
  EXPECT_EQ(q, (std::vector<int8_t>{0, 0, 0, 127, -64, 32}));  // -63.5 -> -64, 31.75 -> 32
  std::vector<uint8_t> codes(32);
  std::vector<float> nf4_absmax(1);
  QuantizeNf4(w.data(), DType::kF32, 1, 3, codes.data(), nf4_absmax.data());
  EXPECT_EQ(nf4_absmax[0], 0.0f);
  for (uint8_t b : codes) EXPECT_EQ(b, 0x77);
}

TEST(QuantizeInt8Rows, RoundsHalfToEven) {
  // A weight whose fp32 w / 1 * 127 is exactly 62.5 rounds to 62 (half to even, like torch.round), not 63.
  float w = 62.5f / 127.0f;
  for (int i = 0; i < 64 && w * 127.0f != 62.5f; ++i) w = std::nextafter(w, w * 127.0f < 62.5f ? 1.0f : 0.0f);
  ASSERT_EQ(w * 127.0f, 62.5f);
  const std::vector<float> row = {1.0f, w, -w};
  std::vector<int8_t> q(3);
  float absmax = 0.0f;
  QuantizeInt8Rows(row.data(), DType::kF32, 1, 3, q.data(), &absmax);
  EXPECT_EQ(q, (std::vector<int8_t>{127, 62, -62}));
}

TEST(Quantize, HalfAndBFloatInputsQuantizeLikeTheirFp32Values) {
  const int64_t rows = 5;
  const int64_t cols = 97;
  const std::vector<float> w = NormalWeights(rows * cols, 11, 0.5f);
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> bits(w.size());
    std::vector<float> widened(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      bits[i] = dtype == DType::kF16 ? F32ToF16(w[i]) : F32ToBf16(w[i]);
      widened[i] = dtype == DType::kF16 ? F16ToF32(bits[i]) : Bf16ToF32(bits[i]);
    }
    std::vector<int8_t> q16(w.size()), q32(w.size());
    std::vector<float> a16(static_cast<size_t>(rows)), a32(static_cast<size_t>(rows));
    QuantizeInt8Rows(bits.data(), dtype, rows, cols, q16.data(), a16.data());
    QuantizeInt8Rows(widened.data(), DType::kF32, rows, cols, q32.data(), a32.data());
    EXPECT_EQ(q16, q32);
    EXPECT_EQ(a16, a32);
    const size_t nbytes = static_cast<size_t>(rows * Nf4RowBytes(cols));
    const size_t nblocks = static_cast<size_t>(rows * Nf4BlocksPerRow(cols));
    std::vector<uint8_t> c16(nbytes), c32(nbytes);
    std::vector<float> b16(nblocks), b32(nblocks);
    QuantizeNf4(bits.data(), dtype, rows, cols, c16.data(), b16.data());
    QuantizeNf4(widened.data(), DType::kF32, rows, cols, c32.data(), b32.data());
    EXPECT_EQ(c16, c32);
    EXPECT_EQ(b16, b32);
  }
}

}  // namespace
}  // namespace odmoe
