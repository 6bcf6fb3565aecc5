// The reference kernels against naive double-precision computations written independently here, over odd
// shapes (1 token, sizes that are not multiples of 8, GQA ratios 1/2/4, head_dim 32/48/64/128, past > 0) and
// F32/F16/BF16 weights. Floats are compared with atol + rtol*|ref| (NaN/Inf always fail); ids exactly.
#include "src/backend/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/dtype.h"

namespace odmoe {
namespace {

// ---- independent helpers ---------------------------------------------------------------------------------------

// IEEE half -> double, written from the format's definition (not with dtype.h).
double HalfValue(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
  if (exp == 31) return mant == 0 ? sign * INFINITY : NAN;
  return sign * std::ldexp(1.0 + mant / 1024.0, exp - 15);
}

double BFloatValue(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A weight tensor in a given dtype plus the exact values it holds (as double).
struct TestWeight {
  DType dtype = DType::kF32;
  std::vector<uint8_t> bytes;
  std::vector<double> values;
  WeightRef ref() const { return WeightRef{bytes.data(), dtype}; }
};

TestWeight MakeWeight(DType dtype, size_t count, std::mt19937& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  TestWeight w;
  w.dtype = dtype;
  w.bytes.resize(count * DTypeSize(dtype));
  w.values.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const float v = dist(rng);
    if (dtype == DType::kF32) {
      std::memcpy(w.bytes.data() + 4 * i, &v, 4);
      w.values[i] = v;
    } else {
      const uint16_t h = dtype == DType::kBF16 ? F32ToBf16(v) : F32ToF16(v);
      std::memcpy(w.bytes.data() + 2 * i, &h, 2);
      w.values[i] = dtype == DType::kBF16 ? BFloatValue(h) : HalfValue(h);
    }
  }
  return w;
}

std::vector<float> RandomFloats(size_t count, std::mt19937& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

// Every element within atol + rtol*|ref|; NaN or Inf in either fails.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want, double atol, double rtol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool finite = std::isfinite(got[i]) && std::isfinite(want[i]);
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!finite || err > atol + rtol * std::abs(want[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", want " << want[i] << " (error " << err
                    << ", allowed " << atol + rtol * std::abs(want[i]) << ")";
      if (++reported == 5) return;
    }
  }
}

const DType kWeightTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

std::string Name(DType dtype) { return std::string(DTypeName(dtype)); }

// ---- weights ---------------------------------------------------------------------------------------------------

TEST(CpuKernelsTest, WidenWeightsDecodesEveryHalfBitPattern) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(65536);
  cpu::WidenWeights(WeightRef{all.data(), DType::kF16}, 0, 65536, out.data());
  for (uint32_t i = 0; i < 65536; ++i) {
    const double want = HalfValue(static_cast<uint16_t>(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[i])) << "f16 bits " << i;
    } else {
      EXPECT_EQ(static_cast<double>(out[i]), want) << "f16 bits " << i;
    }
  }
}

TEST(CpuKernelsTest, WidenWeightsReadsBf16AndF32AtAnOffset) {
  std::mt19937 rng(1);
  for (DType dtype : kWeightTypes) {
    const TestWeight w = MakeWeight(dtype, 37, rng);
    std::vector<float> out(20);
    cpu::WidenWeights(w.ref(), 13, 20, out.data());
    for (int i = 0; i < 20; ++i) EXPECT_EQ(static_cast<double>(out[i]), w.values[13 + i]) << Name(dtype) << " " << i;
    EXPECT_EQ(static_cast<double>(cpu::WeightAt(w.ref(), 36)), w.values[36]);
  }
}

// ---- Embedding -------------------------------------------------------------------------------------------------

TEST(CpuKernelsTest, EmbeddingCopiesRowsExactly) {
  std::mt19937 rng(2);
  for (DType dtype : kWeightTypes) {
    for (int64_t dim : {1, 7, 33}) {
      const int64_t vocab = 11;
      const TestWeight table = MakeWeight(dtype, vocab * dim, rng);
      const std::vector<int32_t> ids = {3, 0, 10, 3, 7};
      std::vector<float> out(ids.size() * dim, -1.0f);
      cpu::Embedding(ids.data(), static_cast<int64_t>(ids.size()), table.ref(), dim, out.data());
      for (size_t i = 0; i < ids.size(); ++i) {
        for (int64_t c = 0; c < dim; ++c) {
          ASSERT_EQ(static_cast<double>(out[i * dim + c]), table.values[ids[i] * dim + c])
              << Name(dtype) << " dim " << dim << " token " << i;
        }
      }
    }
  }
}

// ---- RmsNorm ---------------------------------------------------------------------------------------------------

std::vector<double> RmsNormRef(const std::vector<float>& x, const std::vector<double>& w, int64_t rows, int64_t dim,
                               double eps) {
  std::vector<double> out(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < dim; ++c) ss += static_cast<double>(x[r * dim + c]) * x[r * dim + c];
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int64_t c = 0; c < dim; ++c) out[r * dim + c] = x[r * dim + c] * inv * w[c];
  }
  return out;
}

TEST(CpuKernelsTest, RmsNormMatchesDoubleReference) {
  std::mt19937 rng(3);
  for (DType dtype : kWeightTypes) {
    for (int64_t rows : {1, 3}) {
      for (int64_t dim : {1, 7, 33, 1000}) {
        for (float eps : {1e-6f, 1e-5f}) {
          const TestWeight w = MakeWeight(dtype, dim, rng, 2.0f);
          const std::vector<float> x = RandomFloats(rows * dim, rng, 3.0f);
          std::vector<float> out(rows * dim);
          cpu::RmsNorm(x.data(), w.ref(), rows, dim, eps, out.data());
          ExpectClose(out, RmsNormRef(x, w.values, rows, dim, eps), 1e-6, 1e-5,
                      "RmsNorm " + Name(dtype) + " rows " + std::to_string(rows) + " dim " + std::to_string(dim));
          // In place gives the same bits.
          std::vector<float> inplace = x;
          cpu::RmsNorm(inplace.data(), w.ref(), rows, dim, eps, inplace.data());
          EXPECT_EQ(inplace, out);
        }
      }
    }
  }
}

TEST(CpuKernelsTest, RmsNormOfZerosIsZeroNotNan) {
  const std::vector<float> w = {1, 2, 3};
  const std::vector<float> x = {0, 0, 0};
  std::vector<float> out(3, 7.0f);
  cpu::RmsNorm(x.data(), WeightRef{w.data(), DType::kF32}, 1, 3, 1e-6f, out.data());
  EXPECT_EQ(out, std::vector<float>({0, 0, 0}));
}

// ---- MatMul ----------------------------------------------------------------------------------------------------

std::vector<double> MatMulRef(const std::vector<float>& x, const std::vector<double>& w, const std::vector<double>* b,
                              int64_t n, int64_t in, int64_t out) {
  std::vector<double> y(n * out);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (int64_t k = 0; k < in; ++k) s += static_cast<double>(x[t * in + k]) * w[o * in + k];
      y[t * out + o] = s;
    }
  }
  return y;
}

struct MatMulShape {
  int64_t n, in, out;
};

TEST(CpuKernelsTest, MatMulMatchesDoubleReference) {
  std::mt19937 rng(4);
  const MatMulShape shapes[] = {{1, 1, 1}, {1, 7, 5}, {3, 33, 17}, {5, 64, 9}, {17, 100, 31}, {2, 1000, 3}, {4, 9, 4}};
  for (DType dtype : kWeightTypes) {
    for (const MatMulShape& s : shapes) {
      for (bool with_bias : {false, true}) {
        const TestWeight w = MakeWeight(dtype, s.out * s.in, rng);
        const TestWeight b = MakeWeight(dtype == DType::kF32 ? DType::kBF16 : DType::kF32, s.out, rng);
        const std::vector<float> x = RandomFloats(s.n * s.in, rng);
        std::vector<float> y(s.n * s.out, NAN);
        cpu::MatMul(x.data(), w.ref(), with_bias ? b.ref() : WeightRef{}, s.n, s.in, s.out, y.data());
        const double scale = std::sqrt(static_cast<double>(s.in));
        ExpectClose(y, MatMulRef(x, w.values, with_bias ? &b.values : nullptr, s.n, s.in, s.out), 2e-6 * scale, 1e-5,
                    "MatMul " + Name(dtype) + " n " + std::to_string(s.n) + " in " + std::to_string(s.in) + " out " +
                        std::to_string(s.out) + (with_bias ? " +bias" : ""));
      }
    }
  }
}

TEST(CpuKernelsTest, MatMulRowDoesNotDependOnBatchOrAlignment) {
  std::mt19937 rng(5);
  const int64_t n = 6, in = 203, out = 11;
  const TestWeight w = MakeWeight(DType::kF32, out * in, rng);
  const std::vector<float> x = RandomFloats(n * in, rng);
  std::vector<float> batch(n * out);
  cpu::MatMul(x.data(), w.ref(), WeightRef{}, n, in, out, batch.data());
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> single(out);
    cpu::MatMul(x.data() + t * in, w.ref(), WeightRef{}, 1, in, out, single.data());
    EXPECT_EQ(0, std::memcmp(single.data(), batch.data() + t * out, out * sizeof(float))) << "token " << t;
  }
  // F32 weights at an address that is not 4-byte aligned are widened, not read in place: same bits.
  std::vector<uint8_t> shifted(w.bytes.size() + 2);
  std::memcpy(shifted.data() + 2, w.bytes.data(), w.bytes.size());
  std::vector<float> unaligned(n * out);
  cpu::MatMul(x.data(), WeightRef{shifted.data() + 2, DType::kF32}, WeightRef{}, n, in, out, unaligned.data());
  EXPECT_EQ(unaligned, batch);
}

// ---- Rope ------------------------------------------------------------------------------------------------------

TEST(CpuKernelsTest, RopeLayoutIsRotateHalf) {
  // head_dim 4, theta 10000: inv_freq = {1, 0.01}. x = e0 rotates into the second half (index 2).
  std::vector<float> x = {1, 0, 0, 0, /*head 1*/ 0, 0, 1, 0};
  const int32_t pos = 1;
  cpu::Rope(x.data(), &pos, 1, 2, 4, 10000.0);
  const std::vector<double> want = {std::cos(1.0), 0, std::sin(1.0), 0, -std::sin(1.0), 0, std::cos(1.0), 0};
  ExpectClose(x, want, 1e-7, 0, "rope layout");
}

TEST(CpuKernelsTest, RopeAtPositionZeroIsIdentity) {
  std::mt19937 rng(6);
  std::vector<float> x = RandomFloats(3 * 48, rng);
  const std::vector<float> before = x;
  const int32_t pos = 0;
  cpu::Rope(x.data(), &pos, 1, 3, 48, 10000.0);
  EXPECT_EQ(x, before);
}

// Reference rotation of one [heads, d] token with the given per-frequency angles (double trigonometry).
std::vector<double> RotateRef(const float* x, int64_t heads, int64_t d, const std::vector<double>& angle) {
  std::vector<double> out(heads * d);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d / 2; ++i) {
      const double a = x[h * d + i], b = x[h * d + i + d / 2];
      out[h * d + i] = a * std::cos(angle[i]) - b * std::sin(angle[i]);
      out[h * d + i + d / 2] = b * std::cos(angle[i]) + a * std::sin(angle[i]);
    }
  }
  return out;
}

TEST(CpuKernelsTest, RopeMatchesTorchFloat32Angles) {
  // HF computes inv_freq and angle = pos * inv_freq in float32; trigonometry here is in double.
  std::mt19937 rng(7);
  const std::vector<int32_t> positions = {0, 1, 7, 100, 4095, 32767};
  for (int64_t d : {32, 48, 64, 128}) {
    for (double theta : {10000.0, 1000000.0}) {
      const int64_t heads = 3, n = static_cast<int64_t>(positions.size());
      std::vector<float> x = RandomFloats(n * heads * d, rng);
      const std::vector<float> in = x;
      cpu::Rope(x.data(), positions.data(), n, heads, d, theta);
      std::vector<double> want;
      for (int64_t t = 0; t < n; ++t) {
        std::vector<double> angle(d / 2);
        for (int64_t i = 0; i < d / 2; ++i) {
          const float inv =
              1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(d));
          angle[i] = static_cast<double>(static_cast<float>(positions[t]) * inv);
        }
        const std::vector<double> r = RotateRef(in.data() + t * heads * d, heads, d, angle);
        want.insert(want.end(), r.begin(), r.end());
      }
      ExpectClose(x, want, 2e-6, 1e-5, "rope d " + std::to_string(d) + " theta " + std::to_string(theta));
    }
  }
}

TEST(CpuKernelsTest, RopeMatchesExactFormulaWithinFloat32AngleError) {
  // The direct formula in double: angle = pos / theta^(2i/d). The fp32 angle differs by at most a few ulps of
  // pos, so the tolerance grows with the position.
  std::mt19937 rng(8);
  const std::vector<int32_t> positions = {0, 3, 17, 250, 2047};
  for (int64_t d : {32, 64, 128}) {
    const int64_t heads = 2;
    for (size_t t = 0; t < positions.size(); ++t) {
      std::vector<float> x = RandomFloats(heads * d, rng);
      const std::vector<float> in = x;
      cpu::Rope(x.data(), &positions[t], 1, heads, d, 10000.0);
      std::vector<double> angle(d / 2);
      for (int64_t i = 0; i < d / 2; ++i) angle[i] = positions[t] / std::pow(10000.0, 2.0 * i / d);
      ExpectClose(x, RotateRef(in.data(), heads, d, angle), 1e-6 + 1e-6 * positions[t], 0,
                  "rope exact d " + std::to_string(d) + " pos " + std::to_string(positions[t]));
    }
  }
}

TEST(CpuKernelsTest, RopeInvFreqIsFloat32PowerOfTheta) {
  std::vector<float> inv(64);
  cpu::RopeInvFreq(128, 500000.0, inv.data());
  EXPECT_EQ(inv[0], 1.0f);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(inv[i], std::pow(500000.0, -2.0 * i / 128), 1e-6 * inv[i]) << i;
}

// ---- Attention -------------------------------------------------------------------------------------------------

std::vector<double> AttentionRef(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                 int64_t n, int64_t past, int64_t heads, int64_t kv_heads, int64_t d, double scale) {
  std::vector<double> out(n * heads * d, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h * kv_heads / heads;  // written differently from the kernel on purpose
      std::vector<double> s;
      for (int64_t j = 0; j <= past + i; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c)
          dot += static_cast<double>(q[(i * heads + h) * d + c]) * k[(j * kv_heads + g) * d + c];
        s.push_back(dot * scale);
      }
      const double m = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (double& e : s) z += (e = std::exp(e - m));
      for (int64_t j = 0; j <= past + i; ++j) {
        for (int64_t c = 0; c < d; ++c) out[(i * heads + h) * d + c] += s[j] / z * v[(j * kv_heads + g) * d + c];
      }
    }
  }
  return out;
}

struct AttentionShape {
  int64_t n, past, heads, kv_heads, head_dim;
};

TEST(CpuKernelsTest, AttentionMatchesDoubleReference) {
  std::mt19937 rng(9);
  const AttentionShape shapes[] = {
      {1, 0, 1, 1, 32}, {1, 5, 4, 2, 48},  {3, 0, 4, 4, 64}, {4, 7, 8, 2, 128},
      {5, 3, 4, 1, 32}, {1, 40, 8, 2, 64}, {7, 0, 2, 2, 48}, {2, 9, 12, 3, 128},
  };
  for (const AttentionShape& s : shapes) {
    const int64_t rows = s.past + s.n;
    const std::vector<float> q = RandomFloats(s.n * s.heads * s.head_dim, rng, 2.0f);
    const std::vector<float> k = RandomFloats(rows * s.kv_heads * s.head_dim, rng, 2.0f);
    const std::vector<float> v = RandomFloats(rows * s.kv_heads * s.head_dim, rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    std::vector<float> out(q.size(), NAN);
    cpu::Attention(q.data(), k.data(), v.data(), s.n, s.past, s.heads, s.kv_heads, s.head_dim, scale, out.data());
    ExpectClose(out, AttentionRef(q, k, v, s.n, s.past, s.heads, s.kv_heads, s.head_dim, scale), 2e-6, 1e-5,
                "attention n " + std::to_string(s.n) + " past " + std::to_string(s.past) + " heads " +
                    std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) + " d " + std::to_string(s.head_dim));
    std::vector<float> inplace = q;  // out may alias q
    cpu::Attention(inplace.data(), k.data(), v.data(), s.n, s.past, s.heads, s.kv_heads, s.head_dim, scale,
                   inplace.data());
    EXPECT_EQ(inplace, out);
  }
}

TEST(CpuKernelsTest, AttentionIsCausal) {
  // Token i must not see cache rows after past + i: changing them leaves its output unchanged.
  std::mt19937 rng(10);
  const int64_t n = 3, past = 2, heads = 2, kv = 1, d = 32;
  const std::vector<float> q = RandomFloats(n * heads * d, rng);
  std::vector<float> k = RandomFloats((past + n) * kv * d, rng);
  std::vector<float> v = RandomFloats((past + n) * kv * d, rng);
  std::vector<float> out1(q.size()), out2(q.size());
  cpu::Attention(q.data(), k.data(), v.data(), n, past, heads, kv, d, 0.2f, out1.data());
  for (int64_t c = 0; c < kv * d; ++c) {  // the last row, visible only to the last token
    k[(past + n - 1) * kv * d + c] = 50.0f;
    v[(past + n - 1) * kv * d + c] = -50.0f;
  }
  cpu::Attention(q.data(), k.data(), v.data(), n, past, heads, kv, d, 0.2f, out2.data());
  const size_t per_token = heads * d;
  EXPECT_TRUE(std::equal(out1.begin(), out1.begin() + (n - 1) * per_token, out2.begin()));
  EXPECT_FALSE(std::equal(out1.begin() + (n - 1) * per_token, out1.end(), out2.begin() + (n - 1) * per_token));
}

// ---- RouterTopK ------------------------------------------------------------------------------------------------

TEST(CpuKernelsTest, RouterTopKBreaksTiesByLowerId) {
  const std::vector<float> logits = {1, 3, 3, 0, 3, /*token 1*/ 2, 2, 2, 2, 2};
  std::vector<int32_t> ids(2 * 3);
  std::vector<float> weights(2 * 3);
  cpu::RouterTopK(logits.data(), 2, 5, 3, false, ids.data(), weights.data());
  EXPECT_EQ(ids, std::vector<int32_t>({1, 2, 4, 0, 1, 2}));
  const double z = 3 * std::exp(3.0) + std::exp(1.0) + 1.0;
  ExpectClose(weights, {std::exp(3.0) / z, std::exp(3.0) / z, std::exp(3.0) / z, 0.2, 0.2, 0.2}, 1e-7, 1e-6,
              "tied weights");
  cpu::RouterTopK(logits.data(), 2, 5, 2, true, ids.data(), weights.data());
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 4), std::vector<int32_t>({1, 2, 0, 1}));
  ExpectClose(std::vector<float>(weights.begin(), weights.begin() + 4), {0.5, 0.5, 0.5, 0.5}, 1e-7, 0, "renormalised");
}

TEST(CpuKernelsTest, RouterTopKMatchesSortedSoftmax) {
  std::mt19937 rng(11);
  for (int64_t experts : {2, 8, 60, 64, 128}) {
    for (int64_t k : {1, 2, 4, 8}) {
      if (k > experts) continue;
      for (bool renorm : {false, true}) {
        const int64_t n = 5;
        // Logits on a grid of 1/64 with repeats, so some ties are exact and all others are well separated.
        std::uniform_int_distribution<int> grid(-200, 200);
        std::vector<float> logits(n * experts);
        for (float& l : logits) l = grid(rng) / 64.0f;
        std::vector<int32_t> ids(n * k);
        std::vector<float> weights(n * k);
        cpu::RouterTopK(logits.data(), n, experts, k, renorm, ids.data(), weights.data());
        for (int64_t t = 0; t < n; ++t) {
          std::vector<std::pair<double, int>> ranked;  // (-prob, id): ascending = best first, lower id on ties
          double z = 0;
          for (int64_t e = 0; e < experts; ++e) z += std::exp(static_cast<double>(logits[t * experts + e]));
          for (int64_t e = 0; e < experts; ++e) {
            ranked.push_back({-std::exp(static_cast<double>(logits[t * experts + e])) / z, static_cast<int>(e)});
          }
          std::sort(ranked.begin(), ranked.end());
          double top = 0;
          for (int64_t j = 0; j < k; ++j) top -= ranked[j].first;
          std::vector<double> want;
          for (int64_t j = 0; j < k; ++j) {
            EXPECT_EQ(ids[t * k + j], ranked[j].second) << "experts " << experts << " k " << k << " token " << t;
            want.push_back(-ranked[j].first / (renorm ? top : 1.0));
          }
          ExpectClose(std::vector<float>(weights.begin() + t * k, weights.begin() + (t + 1) * k), want, 1e-7, 1e-5,
                      "router weights");
        }
      }
    }
  }
}

// ---- elementwise, gather, scatter ------------------------------------------------------------------------------

TEST(CpuKernelsTest, SwiGluMatchesDoubleReference) {
  std::mt19937 rng(12);
  std::vector<float> gate = RandomFloats(37, rng, 6.0f);
  gate[0] = -100.0f;
  gate[1] = 100.0f;
  gate[2] = 0.0f;
  const std::vector<float> up = RandomFloats(37, rng, 2.0f);
  std::vector<double> want(37);
  for (int i = 0; i < 37; ++i) want[i] = gate[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))) * up[i];
  std::vector<float> out(37);
  cpu::SwiGlu(gate.data(), up.data(), 37, out.data());
  ExpectClose(out, want, 1e-7, 1e-6, "swiglu");
  cpu::SwiGlu(gate.data(), up.data(), 37, gate.data());  // in place over gate
  EXPECT_EQ(gate, out);
}

TEST(CpuKernelsTest, AddAddsElementwise) {
  std::mt19937 rng(13);
  const std::vector<float> x = RandomFloats(13, rng);
  std::vector<float> y = RandomFloats(13, rng);
  std::vector<float> want(13);
  for (int i = 0; i < 13; ++i) want[i] = y[i] + x[i];
  cpu::Add(x.data(), 13, y.data());
  EXPECT_EQ(y, want);
}

TEST(CpuKernelsTest, ConvertRoundsToSixteenBitsAndBackExactly) {
  // Values on and beside the bf16 / fp16 halfway points, a subnormal, infinities, NaN.
  std::vector<float> x = {1.0f, 1.00390625f, 1.005859375f, -3.3333333f, 1e-41f, 65519.0f, 65520.0f, 1e30f};
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(x.size());
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> half(x.size());
    cpu::Convert(x.data(), DType::kF32, n, half.data(), dtype);
    std::vector<float> back(x.size());
    cpu::Convert(half.data(), dtype, n, back.data(), DType::kF32);
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t want = dtype == DType::kBF16 ? F32ToBf16(x[i]) : F32ToF16(x[i]);
      EXPECT_EQ(half[i], want) << DTypeName(dtype) << " value " << i;
      const float widened = dtype == DType::kBF16 ? Bf16ToF32(want) : F16ToF32(want);
      if (std::isnan(x[i])) {
        EXPECT_TRUE(std::isnan(back[i]));
      } else {
        EXPECT_EQ(back[i], widened) << DTypeName(dtype) << " value " << i;
      }
    }
  }
  std::vector<float> copy(x.size());
  cpu::Convert(x.data(), DType::kF32, n, copy.data(), DType::kF32);
  EXPECT_EQ(std::memcmp(copy.data(), x.data(), x.size() * sizeof(float)), 0);
}

TEST(CpuKernelsTest, GatherRowsCopiesRowsExactly) {
  std::mt19937 rng(14);
  const int64_t dim = 9;
  const std::vector<float> src = RandomFloats(6 * dim, rng);
  const std::vector<int32_t> rows = {5, 0, 5, 2};
  std::vector<float> dst(rows.size() * dim);
  cpu::GatherRows(src.data(), rows.data(), 4, dim, dst.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t c = 0; c < dim; ++c) EXPECT_EQ(dst[i * dim + c], src[rows[i] * dim + c]);
  }
}

TEST(CpuKernelsTest, ScatterAddScaledAccumulatesRepeatedRows) {
  std::mt19937 rng(15);
  const int64_t dim = 11, n = 5, dst_rows = 3;
  const std::vector<float> src = RandomFloats(n * dim, rng);
  const std::vector<int32_t> rows = {2, 0, 2, 2, 1};
  const std::vector<float> scale = {0.5f, -1.25f, 2.0f, 0.1f, -3.0f};
  for (bool sigmoid : {false, true}) {
    std::vector<float> dst = RandomFloats(dst_rows * dim, rng);
    std::vector<double> want(dst.begin(), dst.end());
    for (int64_t i = 0; i < n; ++i) {
      const double f = sigmoid ? 1.0 / (1.0 + std::exp(-static_cast<double>(scale[i]))) : scale[i];
      for (int64_t c = 0; c < dim; ++c) want[rows[i] * dim + c] += f * src[i * dim + c];
    }
    cpu::ScatterAddScaled(src.data(), rows.data(), scale.data(), n, dim, sigmoid, dst.data());
    ExpectClose(dst, want, 1e-6, 1e-6, sigmoid ? "scatter sigmoid" : "scatter");
  }
}

}  // namespace
}  // namespace odmoe
