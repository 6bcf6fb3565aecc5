// Dense GEMV and the INT8 / NF4 kernels: GEMV vs the CPU MatMul for every weight dtype (aligned and scalar
// paths, 1..17 tokens, odd sizes); every GEMV's rows bitwise independent of the token count; GPU quantizers and
// dequantizers bitwise equal to the CPU ones (src/backend/quantize.h); dequantizing GEMV / GEMM vs the CPU MatMul of
// the CPU-dequantized weights; round-trip error bounds. Skipped without a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/gemv.h"
#include "kernels/quant.h"
#include "src/backend/cpu_kernels.h"
#include "src/backend/quantize.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::DeviceArray;
using gpu_test::ExpectClose;
using gpu_test::ExpectWithin;
using gpu_test::GpuTest;
using gpu_test::RandomFloats;
using gpu_test::TestWeight;

std::string Shape(int64_t n, int64_t in, int64_t out) {
  return "n=" + std::to_string(n) + " in=" + std::to_string(in) + " out=" + std::to_string(out);
}

// w [rows, cols] quantized on the CPU to INT8 rows and to NF4 (src/backend/quantize.h), and both dequantized back.
struct CpuQuantized {
  CpuQuantized(const std::vector<float>& w, int64_t rows, int64_t cols)
      : rows(rows),
        cols(cols),
        q(w.size()),
        a8(static_cast<size_t>(rows)),
        codes(static_cast<size_t>(rows * Nf4RowBytes(cols))),
        a4(static_cast<size_t>(rows * Nf4BlocksPerRow(cols))),
        w8(w.size()),
        w4(w.size()) {
    QuantizeInt8Rows(w.data(), DType::kF32, rows, cols, q.data(), a8.data());
    QuantizeNf4(w.data(), DType::kF32, rows, cols, codes.data(), a4.data());
    DequantizeInt8Rows(q.data(), a8.data(), rows, cols, w8.data());
    DequantizeNf4(codes.data(), a4.data(), rows, cols, w4.data());
  }
  // The CPU products [n, rows] of n tokens of x [n, cols] with the INT8- and the NF4-dequantized weights.
  std::pair<std::vector<float>, std::vector<float>> Products(const std::vector<float>& x, int64_t n) const {
    std::vector<float> p8(static_cast<size_t>(n * rows)), p4(p8.size());
    cpu::MatMul(x.data(), WeightRef{w8.data(), DType::kF32}, WeightRef{}, n, cols, rows, p8.data());
    cpu::MatMul(x.data(), WeightRef{w4.data(), DType::kF32}, WeightRef{}, n, cols, rows, p4.data());
    return {std::move(p8), std::move(p4)};
  }
  int64_t rows, cols;
  std::vector<int8_t> q;       // INT8 codes
  std::vector<float> a8;       // their row absmax
  std::vector<uint8_t> codes;  // NF4 codes
  std::vector<float> a4;       // their block absmax
  std::vector<float> w8, w4;   // dequantized
};

// CpuQuantized's codes and scales on the device.
struct DeviceQuantized {
  explicit DeviceQuantized(const CpuQuantized& cq) : q(cq.q), a8(cq.a8), codes(cq.codes), a4(cq.a4) {}
  DeviceArray<int8_t> q;
  DeviceArray<float> a8;
  DeviceArray<uint8_t> codes;
  DeviceArray<float> a4;
};

class GemvKernelTest : public GpuTest {};

TEST_F(GemvKernelTest, MatchesCpuMatMul) {
  std::mt19937 rng(20);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},      {7, 5},     {64, 33}, {127, 64},
                                                           {1024, 300}, {4096, 40}, {136, 17}};
  for (DType dtype : gpu_test::kWeightTypes) {
    for (const auto& [in, out] : shapes) {
      TestWeight w(dtype, RandomFloats(static_cast<size_t>(in * out), rng));
      TestWeight bias(dtype, RandomFloats(static_cast<size_t>(out), rng));
      for (int64_t n : {1, 2, 3, 8, 9, 17}) {
        const std::string what = std::string(DTypeName(dtype)) + " " + Shape(n, in, out);
        const std::vector<float> x = RandomFloats(static_cast<size_t>(n * in), rng);
        std::vector<float> want(static_cast<size_t>(n * out));
        std::vector<float> want_bias(want.size());
        cpu::MatMul(x.data(), w.host_ref(), WeightRef{}, n, in, out, want.data());
        cpu::MatMul(x.data(), w.host_ref(), bias.host_ref(), n, in, out, want_bias.data());
        DeviceArray<float> dx(x);
        DeviceArray<float> ux(x.size(), 1);  // x one float off alignment: the scalar path
        ux.Upload(x, 1);
        DeviceArray<float> y(want.size()), yb(want.size()), yu(want.size());
        gpu_test::WithDeviceType(w, [&](auto* wp) {
          using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
          const W* bp = reinterpret_cast<const W*>(bias.device.get());
          ODMOE_ASSERT_CUDA(
              kernels::LaunchGemv(dx.get(), wp, static_cast<const W*>(nullptr), n, in, out, y.get(), stream_));
          ODMOE_ASSERT_CUDA(kernels::LaunchGemv(dx.get(), wp, bp, n, in, out, yb.get(), stream_));
          ODMOE_ASSERT_CUDA(kernels::LaunchGemv(ux.get() + 1, wp, bp, n, in, out, yu.get(), stream_));
        });
        Sync();
        const double atol = 1e-5 * std::sqrt(static_cast<double>(in));
        ExpectClose(y.Download(), want, atol, 1e-5, what);
        ExpectClose(yb.Download(), want_bias, atol, 1e-5, what + " bias");
        ExpectClose(yu.Download(), want_bias, atol, 1e-5, what + " bias, unaligned x");
      }
    }
  }
}

// Row t of an n-token GEMV equals, bit for bit, the one-token GEMV of token t (the n = 1 kernels and the n > 1
// ones sum every row in the same order), so batching never changes a request's arithmetic. Odd shapes: aligned
// rows (in a multiple of 16), rows that take the scalar path, NF4 rows ending in a partial block, a row count
// that leaves the last warp half used; token counts across the kGemvMaxTokens groups.
std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> bits(v.size());
  std::memcpy(bits.data(), v.data(), v.size() * sizeof(float));
  return bits;
}

// Runs `gemv(x, n, y)` for n tokens and for each token alone; expects each row of the first to equal the second.
template <typename Gemv>
void ExpectRowsIndependentOfTokenCount(int64_t in, int64_t out, std::mt19937& rng, const std::string& what,
                                       Gemv&& gemv) {
  for (int64_t n : {2, 3, 8, 9, 17}) {
    const std::vector<float> x = RandomFloats(static_cast<size_t>(n * in), rng);
    DeviceArray<float> dx(x);
    DeviceArray<float> batch(static_cast<size_t>(n * out));
    ODMOE_ASSERT_CUDA(gemv(dx.get(), n, batch.get()));
    const std::vector<uint32_t> batched = Bits(batch.Download());
    for (int64_t t = 0; t < n; ++t) {
      DeviceArray<float> one(static_cast<size_t>(out));
      ODMOE_ASSERT_CUDA(gemv(dx.get() + t * in, 1, one.get()));
      const std::vector<uint32_t> alone = Bits(one.Download());
      for (int64_t j = 0; j < out; ++j) {
        ASSERT_EQ(alone[static_cast<size_t>(j)], batched[static_cast<size_t>(t * out + j)])
            << what << " n=" << n << ": token " << t << ", row " << j << " alone differs from its row in the batch";
      }
    }
  }
}

TEST_F(GemvKernelTest, EveryRowIsBitwiseTheSameWhateverTheTokenCount) {
  std::mt19937 rng(24);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{272, 37}, {333, 19}, {100, 17}, {70, 9}};
  for (const auto& [in, out] : shapes) {
    const std::string shape = "in=" + std::to_string(in) + " out=" + std::to_string(out);
    for (DType dtype : gpu_test::kWeightTypes) {
      TestWeight w(dtype, RandomFloats(static_cast<size_t>(in * out), rng));
      TestWeight bias(dtype, RandomFloats(static_cast<size_t>(out), rng));
      gpu_test::WithDeviceType(w, [&](auto* wp) {
        using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
        const W* bp = reinterpret_cast<const W*>(bias.device.get());
        ExpectRowsIndependentOfTokenCount(in, out, rng, std::string(DTypeName(dtype)) + " " + shape,
                                          [&](const float* x, int64_t n, float* y) {
                                            return kernels::LaunchGemv(x, wp, bp, n, in, out, y, stream_);
                                          });
      });
    }
    const CpuQuantized cq(RandomFloats(static_cast<size_t>(in * out), rng), out, in);
    const DeviceQuantized dev(cq);
    ExpectRowsIndependentOfTokenCount(in, out, rng, "int8 " + shape, [&](const float* x, int64_t n, float* y) {
      return kernels::LaunchGemvInt8(x, dev.q.get(), dev.a8.get(), n, in, out, y, stream_);
    });
    ExpectRowsIndependentOfTokenCount(in, out, rng, "nf4 " + shape, [&](const float* x, int64_t n, float* y) {
      return kernels::LaunchGemvNf4(x, dev.codes.get(), dev.a4.get(), n, in, out, y, stream_);
    });
  }
}

// Weights with structure: Gaussian values, a zero row, a row of one repeated value, values on exact int8
// half steps, and (for bf16/f16) whatever rounding the dtype brings.
std::vector<float> QuantTestWeights(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (float& v : w) v = dist(rng);
  if (rows > 1) {
    for (int64_t j = 0; j < cols; ++j) w[static_cast<size_t>(cols + j)] = 0.0f;
  }
  if (rows > 2) {
    for (int64_t j = 0; j < cols; ++j) w[static_cast<size_t>(2 * cols + j)] = -0.25f;
  }
  if (rows > 3) {
    for (int64_t j = 0; j < cols; ++j) w[static_cast<size_t>(3 * cols + j)] = static_cast<float>(j % 255 - 127) / 2;
  }
  return w;
}

class QuantKernelTest : public GpuTest {};

TEST_F(QuantKernelTest, GpuQuantizersEqualCpuQuantizersBitwise) {
  std::mt19937 rng(21);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1}, {3, 63}, {5, 64}, {7, 131}, {4, 200}, {64, 4096}};
  for (DType dtype : gpu_test::kWeightTypes) {
    for (const auto& [rows, cols] : shapes) {
      const std::string what = std::string(DTypeName(dtype)) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      TestWeight w(dtype, QuantTestWeights(rows, cols, rng));
      // INT8.
      std::vector<int8_t> q(static_cast<size_t>(rows * cols));
      std::vector<float> absmax(static_cast<size_t>(rows));
      QuantizeInt8Rows(w.host.data(), dtype, rows, cols, q.data(), absmax.data());
      DeviceArray<int8_t> dq(q.size());
      DeviceArray<float> dabs(absmax.size());
      gpu_test::WithDeviceType(w, [&](auto* wp) {
        ODMOE_ASSERT_CUDA(kernels::LaunchQuantizeInt8Rows(wp, rows, cols, dq.get(), dabs.get(), stream_));
      });
      Sync();
      EXPECT_EQ(dq.Download(), q) << "int8 codes " << what;
      EXPECT_EQ(dabs.Download(), absmax) << "int8 absmax " << what;
      // NF4.
      const int64_t bpr = Nf4BlocksPerRow(cols);
      std::vector<uint8_t> codes(static_cast<size_t>(rows * Nf4RowBytes(cols)));
      std::vector<float> nabs(static_cast<size_t>(rows * bpr));
      QuantizeNf4(w.host.data(), dtype, rows, cols, codes.data(), nabs.data());
      DeviceArray<uint8_t> dcodes(codes.size());
      DeviceArray<float> dnabs(nabs.size());
      gpu_test::WithDeviceType(w, [&](auto* wp) {
        ODMOE_ASSERT_CUDA(kernels::LaunchQuantizeNf4(wp, rows, cols, dcodes.get(), dnabs.get(), stream_));
      });
      Sync();
      EXPECT_EQ(dcodes.Download(), codes) << "nf4 codes " << what;
      EXPECT_EQ(dnabs.Download(), nabs) << "nf4 absmax " << what;
      // Dequantizers, bitwise too.
      std::vector<float> back8(q.size()), back4(q.size());
      DequantizeInt8Rows(q.data(), absmax.data(), rows, cols, back8.data());
      DequantizeNf4(codes.data(), nabs.data(), rows, cols, back4.data());
      DeviceArray<float> d8(q.size()), d4(q.size());
      ODMOE_ASSERT_CUDA(kernels::LaunchDequantizeInt8Rows(dq.get(), dabs.get(), rows, cols, d8.get(), stream_));
      ODMOE_ASSERT_CUDA(kernels::LaunchDequantizeNf4(dcodes.get(), dnabs.get(), rows, cols, d4.get(), stream_));
      Sync();
      EXPECT_EQ(d8.Download(), back8) << "int8 dequantized " << what;
      EXPECT_EQ(d4.Download(), back4) << "nf4 dequantized " << what;
    }
  }
}

// Host-only: runs without a GPU too.
TEST(QuantKernelConstantsTest, CodeBookAndLayoutMatchTheCpuOnes) {
  for (int i = 0; i < 16; ++i) EXPECT_EQ(kernels::kNf4CodeBook[i], kNf4CodeBook[i]) << i;
  for (int64_t cols : {1, 63, 64, 65, 70, 4096}) {
    EXPECT_EQ(kernels::Nf4RowBytes(cols), Nf4RowBytes(cols));
    EXPECT_EQ(kernels::Nf4BlocksPerRow(cols), Nf4BlocksPerRow(cols));
  }
}

TEST_F(QuantKernelTest, RoundTripErrorBounds) {
  std::mt19937 rng(22);
  const int64_t rows = 96;
  const int64_t cols = 1000;
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (float& v : w) v = dist(rng);
  DeviceArray<float> dw(w);
  DeviceArray<int8_t> q(w.size());
  DeviceArray<float> a8(static_cast<size_t>(rows));
  DeviceArray<uint8_t> codes(static_cast<size_t>(rows * kernels::Nf4RowBytes(cols)));
  DeviceArray<float> a4(static_cast<size_t>(rows * kernels::Nf4BlocksPerRow(cols)));
  DeviceArray<float> back8(w.size()), back4(w.size());
  ODMOE_ASSERT_CUDA(kernels::LaunchQuantizeInt8Rows(dw.get(), rows, cols, q.get(), a8.get(), stream_));
  ODMOE_ASSERT_CUDA(kernels::LaunchQuantizeNf4(dw.get(), rows, cols, codes.get(), a4.get(), stream_));
  ODMOE_ASSERT_CUDA(kernels::LaunchDequantizeInt8Rows(q.get(), a8.get(), rows, cols, back8.get(), stream_));
  ODMOE_ASSERT_CUDA(kernels::LaunchDequantizeNf4(codes.get(), a4.get(), rows, cols, back4.get(), stream_));
  Sync();
  const auto r8 = back8.Download(), r4 = back4.Download(), abs8 = a8.Download(), abs4 = a4.Download();
  double e8 = 0.0, e4 = 0.0, ref = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      const size_t i = static_cast<size_t>(r * cols + j);
      ASSERT_LE(std::fabs(r8[i] - w[i]), abs8[static_cast<size_t>(r)] / 127.0f * 0.5f * 1.0001f) << "int8 " << i;
      ASSERT_LE(std::fabs(r4[i] - w[i]), abs4[static_cast<size_t>(r * 16 + j / 64)] * 0.152f) << "nf4 " << i;
      e8 += (r8[i] - w[i]) * static_cast<double>(r8[i] - w[i]);
      e4 += (r4[i] - w[i]) * static_cast<double>(r4[i] - w[i]);
      ref += static_cast<double>(w[i]) * w[i];
    }
  }
  EXPECT_LT(std::sqrt(e8 / ref), 0.02) << "int8 relative RMS error";
  EXPECT_LT(std::sqrt(e4 / ref), 0.15) << "nf4 relative RMS error";
}

TEST_F(QuantKernelTest, DequantizingGemvAndGemmMatchCpuMatMul) {
  std::mt19937 rng(23);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},     {64, 33},   {70, 65},  {127, 5},
                                                           {256, 300}, {1000, 64}, {4096, 17}};
  for (const auto& [cols, rows] : shapes) {
    const std::vector<float> w = QuantTestWeights(rows, cols, rng);
    const CpuQuantized cq(w, rows, cols);
    const DeviceQuantized dev(cq);
    for (int64_t n : {1, 3, 8, 9, 70, 130}) {
      const std::string what = Shape(n, cols, rows);
      const std::vector<float> x = RandomFloats(static_cast<size_t>(n * cols), rng);
      const auto [want8, want4] = cq.Products(x, n);
      DeviceArray<float> dx(x);
      DeviceArray<float> ux(x.size(), 1);
      ux.Upload(x, 1);
      DeviceArray<float> g8(want8.size()), g4(want8.size()), m8(want8.size()), m4(want8.size()), u4(want8.size());
      ODMOE_ASSERT_CUDA(kernels::LaunchGemvInt8(dx.get(), dev.q.get(), dev.a8.get(), n, cols, rows, g8.get(), stream_));
      ODMOE_ASSERT_CUDA(
          kernels::LaunchGemvNf4(dx.get(), dev.codes.get(), dev.a4.get(), n, cols, rows, g4.get(), stream_));
      ODMOE_ASSERT_CUDA(
          kernels::LaunchGemvNf4(ux.get() + 1, dev.codes.get(), dev.a4.get(), n, cols, rows, u4.get(), stream_));
      ODMOE_ASSERT_CUDA(kernels::LaunchGemmInt8(dx.get(), dev.q.get(), dev.a8.get(), n, cols, rows, m8.get(), stream_));
      ODMOE_ASSERT_CUDA(
          kernels::LaunchGemmNf4(dx.get(), dev.codes.get(), dev.a4.get(), n, cols, rows, m4.get(), stream_));
      Sync();
      // Scales are applied to partial sums instead of to each weight: fp32 rounding differences only, bounded
      // relative to sum |x * w| (row 3's large weights of both signs cancel in the sum).
      const std::vector<double> tol8 = gpu_test::MatMulTolerances(x, cq.w8, n, cols, rows);
      const std::vector<double> tol4 = gpu_test::MatMulTolerances(x, cq.w4, n, cols, rows);
      ExpectWithin(g8.Download(), want8, tol8, "int8 gemv " + what);
      ExpectWithin(g4.Download(), want4, tol4, "nf4 gemv " + what);
      ExpectWithin(u4.Download(), want4, tol4, "nf4 gemv unaligned x " + what);
      ExpectWithin(m8.Download(), want8, tol8, "int8 gemm " + what);
      ExpectWithin(m4.Download(), want4, tol4, "nf4 gemm " + what);
    }
  }
}

// The one-token kernels take 4 rows per warp from 8192 rows on, 2 from 1024: shapes on those paths, with a row
// count that leaves the last warp partly used, NF4 rows of 64k + 32 columns (a last block half past the row) and
// INT8 rows that are not a multiple of 8 (the scalar path). Each of n = 1..8 tokens alone equals its row of the
// 8-token product bitwise, and all are within tolerance of the CPU product of the dequantized weights.
TEST_F(QuantKernelTest, GemvRowsPerWarpShapesMatchCpuAndAreBitwiseTheSameWhateverTheTokenCount) {
  std::mt19937 rng(25);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{96, 8195}, {160, 1027}, {100, 1030}};
  constexpr int64_t kN = 8;
  for (const auto& [cols, rows] : shapes) {
    const std::string what = "in=" + std::to_string(cols) + " out=" + std::to_string(rows);
    const std::vector<float> w = QuantTestWeights(rows, cols, rng);
    const CpuQuantized cq(w, rows, cols);
    const std::vector<float> x = RandomFloats(static_cast<size_t>(kN * cols), rng);
    const auto [want8, want4] = cq.Products(x, kN);
    const std::vector<double> tol8 = gpu_test::MatMulTolerances(x, cq.w8, kN, cols, rows);
    const std::vector<double> tol4 = gpu_test::MatMulTolerances(x, cq.w4, kN, cols, rows);
    const DeviceQuantized dev(cq);
    DeviceArray<float> dx(x);
    DeviceArray<float> g8(want8.size()), g4(want8.size());
    ODMOE_ASSERT_CUDA(kernels::LaunchGemvInt8(dx.get(), dev.q.get(), dev.a8.get(), kN, cols, rows, g8.get(), stream_));
    ODMOE_ASSERT_CUDA(
        kernels::LaunchGemvNf4(dx.get(), dev.codes.get(), dev.a4.get(), kN, cols, rows, g4.get(), stream_));
    Sync();
    const std::vector<float> batch8 = g8.Download(), batch4 = g4.Download();
    ExpectWithin(batch8, want8, tol8, "int8 gemv n=8 " + what);
    ExpectWithin(batch4, want4, tol4, "nf4 gemv n=8 " + what);
    const std::vector<uint32_t> bits8 = Bits(batch8), bits4 = Bits(batch4);
    for (int64_t t = 0; t < kN; ++t) {
      DeviceArray<float> one8(static_cast<size_t>(rows)), one4(static_cast<size_t>(rows));
      ODMOE_ASSERT_CUDA(
          kernels::LaunchGemvInt8(dx.get() + t * cols, dev.q.get(), dev.a8.get(), 1, cols, rows, one8.get(), stream_));
      ODMOE_ASSERT_CUDA(kernels::LaunchGemvNf4(dx.get() + t * cols, dev.codes.get(), dev.a4.get(), 1, cols, rows,
                                               one4.get(), stream_));
      Sync();
      const std::vector<uint32_t> alone8 = Bits(one8.Download()), alone4 = Bits(one4.Download());
      for (int64_t j = 0; j < rows; ++j) {
        const size_t b = static_cast<size_t>(t * rows + j);
        ASSERT_EQ(alone8[static_cast<size_t>(j)], bits8[b]) << "int8 " << what << ": token " << t << ", row " << j;
        ASSERT_EQ(alone4[static_cast<size_t>(j)], bits4[b]) << "nf4 " << what << ": token " << t << ", row " << j;
      }
    }
    // Fewer tokens: the first rows of the 8-token product, bitwise.
    for (int64_t n : {2, 3, 5, 7}) {
      DeviceArray<float> some8(static_cast<size_t>(n * rows)), some4(static_cast<size_t>(n * rows));
      ODMOE_ASSERT_CUDA(
          kernels::LaunchGemvInt8(dx.get(), dev.q.get(), dev.a8.get(), n, cols, rows, some8.get(), stream_));
      ODMOE_ASSERT_CUDA(
          kernels::LaunchGemvNf4(dx.get(), dev.codes.get(), dev.a4.get(), n, cols, rows, some4.get(), stream_));
      Sync();
      const std::vector<uint32_t> s8 = Bits(some8.Download()), s4 = Bits(some4.Download());
      EXPECT_EQ(s8, std::vector<uint32_t>(bits8.begin(), bits8.begin() + n * rows)) << "int8 " << what << " n=" << n;
      EXPECT_EQ(s4, std::vector<uint32_t>(bits4.begin(), bits4.begin() + n * rows)) << "nf4 " << what << " n=" << n;
    }
  }
}

// The one-token kernels' rings wrap at every rows-per-warp shape: 4 rows per warp (INT8 depth 2, NF4 4) over
// 1096 columns is 5 steps of 256; 1 row per warp (INT8 depth 16, NF4 4) over 2312 columns is 10 steps (NF4's ring
// wraps, INT8's is never full) and over 4200 columns 17 steps. So each ring is refilled and its last pass is partial,
// the last step is partly past the row (and NF4's last block partly past it too: none of the widths is a multiple of
// 64), and the row counts leave the last warp partly used. The one-token result is within tolerance of the CPU product
// of the dequantized weights and bitwise the first row of a two-token product (one row per warp, depth 4).
TEST_F(QuantKernelTest, OneTokenGemvRingsWrapAtEveryRowsPerWarp) {
  std::mt19937 rng(26);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1096, 8195}, {2312, 1027}, {4200, 100}};
  constexpr int64_t kN = 2;
  for (const auto& [cols, rows] : shapes) {
    const std::string what = "in=" + std::to_string(cols) + " out=" + std::to_string(rows);
    const std::vector<float> w = QuantTestWeights(rows, cols, rng);
    const CpuQuantized cq(w, rows, cols);
    const std::vector<float> x = RandomFloats(static_cast<size_t>(kN * cols), rng);
    const std::vector<float> x0(x.begin(), x.begin() + cols);
    const auto [want8, want4] = cq.Products(x0, 1);
    const DeviceQuantized dev(cq);
    DeviceArray<float> dx(x);
    DeviceArray<float> one8(want8.size()), one4(want8.size());
    DeviceArray<float> two8(static_cast<size_t>(kN * rows)), two4(static_cast<size_t>(kN * rows));
    ODMOE_ASSERT_CUDA(kernels::LaunchGemvInt8(dx.get(), dev.q.get(), dev.a8.get(), 1, cols, rows, one8.get(), stream_));
    ODMOE_ASSERT_CUDA(
        kernels::LaunchGemvNf4(dx.get(), dev.codes.get(), dev.a4.get(), 1, cols, rows, one4.get(), stream_));
    ODMOE_ASSERT_CUDA(
        kernels::LaunchGemvInt8(dx.get(), dev.q.get(), dev.a8.get(), kN, cols, rows, two8.get(), stream_));
    ODMOE_ASSERT_CUDA(
        kernels::LaunchGemvNf4(dx.get(), dev.codes.get(), dev.a4.get(), kN, cols, rows, two4.get(), stream_));
    Sync();
    const std::vector<float> got8 = one8.Download(), got4 = one4.Download();
    ExpectWithin(got8, want8, gpu_test::MatMulTolerances(x0, cq.w8, 1, cols, rows), "int8 gemv n=1 " + what);
    ExpectWithin(got4, want4, gpu_test::MatMulTolerances(x0, cq.w4, 1, cols, rows), "nf4 gemv n=1 " + what);
    const std::vector<uint32_t> batch8 = Bits(two8.Download()), batch4 = Bits(two4.Download());
    EXPECT_EQ(Bits(got8), std::vector<uint32_t>(batch8.begin(), batch8.begin() + rows)) << "int8 " << what;
    EXPECT_EQ(Bits(got4), std::vector<uint32_t>(batch4.begin(), batch4.begin() + rows)) << "nf4 " << what;
  }
}

// The candidate one-token GEMVs (codes in 16-byte loads, x in shared memory; bench/gemv_sweep times them) are within
// tolerance of the CPU product of the dequantized weights at both of their rows-per-warp shapes: where their rings
// wrap (1 row per warp over 4208 columns: INT8 9 steps of 512 columns at depth 8, NF4 5 steps of 1024 at depth 4),
// where the last step is partly past the row, NF4's last block too (no width is a multiple of 64), and where the
// last warp is partly used. They refuse what they REQUIRE, and every quantized GEMV rows of 2^30 columns or more.
TEST_F(QuantKernelTest, WideGemvsMatchCpu) {
  std::mt19937 rng(27);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1104, 8195}, {4208, 100}, {2320, 1027}};
  for (const auto& [cols, rows] : shapes) {
    const std::string what = "in=" + std::to_string(cols) + " out=" + std::to_string(rows);
    const std::vector<float> w = QuantTestWeights(rows, cols, rng);
    const CpuQuantized cq(w, rows, cols);
    const std::vector<float> x = RandomFloats(static_cast<size_t>(cols), rng);
    const auto [want8, want4] = cq.Products(x, 1);
    const DeviceQuantized dev(cq);
    DeviceArray<float> dx(x);
    DeviceArray<float> got8(want8.size()), got4(want4.size());
    ODMOE_ASSERT_CUDA(
        kernels::LaunchGemvInt8Wide(dx.get(), dev.q.get(), dev.a8.get(), cols, rows, got8.get(), stream_));
    ODMOE_ASSERT_CUDA(
        kernels::LaunchGemvNf4Wide(dx.get(), dev.codes.get(), dev.a4.get(), cols, rows, got4.get(), stream_));
    Sync();
    ExpectWithin(got8.Download(), want8, gpu_test::MatMulTolerances(x, cq.w8, 1, cols, rows), "int8 wide " + what);
    ExpectWithin(got4.Download(), want4, gpu_test::MatMulTolerances(x, cq.w4, 1, cols, rows), "nf4 wide " + what);
  }
  const std::vector<float> w = QuantTestWeights(8, 68, rng);
  const CpuQuantized cq(w, 8, 68);
  const DeviceQuantized dev(cq);
  DeviceArray<float> dx(RandomFloats(72, rng));
  DeviceArray<float> y(8);
  EXPECT_EQ(kernels::LaunchGemvInt8Wide(dx.get(), dev.q.get(), dev.a8.get(), 68, 8, y.get(), stream_),
            cudaErrorInvalidValue);  // cols % 16 != 0
  EXPECT_EQ(kernels::LaunchGemvNf4Wide(dx.get(), dev.codes.get(), dev.a4.get(), 66, 8, y.get(), stream_),
            cudaErrorInvalidValue);  // cols % 4 != 0
  EXPECT_EQ(kernels::LaunchGemvNf4Wide(dx.get() + 1, dev.codes.get(), dev.a4.get(), 68, 8, y.get(), stream_),
            cudaErrorInvalidValue);  // x not 16-byte aligned
  EXPECT_EQ(kernels::LaunchGemvNf4Wide(dx.get(), dev.codes.get(), dev.a4.get(), 68, 0, y.get(), stream_), cudaSuccess);
  // Rows of 2^30 columns or more (the kernels count a row's steps in an int): refused before anything is read.
  constexpr int64_t kHuge = int64_t{1} << 30;
  EXPECT_EQ(kernels::LaunchGemvInt8(dx.get(), dev.q.get(), dev.a8.get(), 1, kHuge, 8, y.get(), stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchGemvNf4(dx.get(), dev.codes.get(), dev.a4.get(), 1, kHuge, 8, y.get(), stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchGemvNf4Wide(dx.get(), dev.codes.get(), dev.a4.get(), kHuge, 8, y.get(), stream_),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace odmoe
