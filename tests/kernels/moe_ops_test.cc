// Router top-k, SwiGLU, Add, bias, embedding, gather and ordered scatter-add kernels against the CPU reference
// (src/backend/cpu_kernels.h); expert ids compared exactly, with explicit ties. Skipped without a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/elementwise.h"
#include "kernels/gemv.h"
#include "kernels/norm.h"
#include "kernels/router.h"
#include "src/backend/cpu_kernels.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::DeviceArray;
using gpu_test::ExpectClose;
using gpu_test::GpuTest;
using gpu_test::RandomFloats;
using gpu_test::TestWeight;

class RouterKernelTest : public GpuTest {
 protected:
  void Check(const std::vector<float>& logits, int64_t n, int64_t experts, int64_t k, bool renormalize,
             const std::string& what) {
    std::vector<int32_t> want_ids(static_cast<size_t>(n * k));
    std::vector<float> want_w(want_ids.size());
    cpu::RouterTopK(logits.data(), n, experts, k, renormalize, want_ids.data(), want_w.data());
    DeviceArray<float> dl(logits);
    DeviceArray<int32_t> ids(want_ids.size());
    DeviceArray<float> weights(want_w.size());
    ODMOE_ASSERT_CUDA(
        kernels::LaunchRouterTopK(dl.get(), n, experts, k, renormalize, ids.get(), weights.get(), stream_));
    Sync();
    EXPECT_EQ(ids.Download(), want_ids) << what;
    ExpectClose(weights.Download(), want_w, 1e-7, 1e-5, what);
  }
};

TEST_F(RouterKernelTest, MatchesCpuReference) {
  std::mt19937 rng(10);
  for (int64_t experts : {8, 16, 60, 64, 128, 257}) {
    for (int64_t k : {1, 2, 4, 8}) {
      for (int64_t n : {1, 7, 33}) {
        for (bool renormalize : {false, true}) {
          const std::vector<float> logits = RandomFloats(static_cast<size_t>(n * experts), rng, -4.0f, 4.0f);
          Check(logits, n, experts, k, renormalize,
                "experts=" + std::to_string(experts) + " k=" + std::to_string(k) + " n=" + std::to_string(n) +
                    (renormalize ? " renormalized" : ""));
        }
      }
    }
  }
}

TEST_F(RouterKernelTest, TiesGoToTheLowerExpertId) {
  // Row 0: all equal -> 0, 1, 2, 3. Row 1: pairs of equal logits, best pair at ids 5 and 2.
  const std::vector<float> logits = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f,  0.5f,  //
                                     0.0f, 1.0f, 2.0f, 1.0f, 0.0f, 2.0f, -1.0f, 1.0f};
  Check(logits, 2, 8, 4, true, "ties");
  Check(logits, 2, 8, 8, false, "ties, k = experts");
  DeviceArray<float> dl(logits);
  DeviceArray<int32_t> ids(8);
  DeviceArray<float> weights(8);
  ODMOE_ASSERT_CUDA(kernels::LaunchRouterTopK(dl.get(), 2, 8, 4, true, ids.get(), weights.get(), stream_));
  Sync();
  EXPECT_EQ(ids.Download(), (std::vector<int32_t>{0, 1, 2, 3, 2, 5, 1, 3}));
}

// A NaN or +inf logit makes the whole row's probabilities NaN (the softmax sum is NaN). The CPU reference then
// orders by id (NaN after every number, ties to the lower id); every lane of the kernel's warp must agree on it,
// with more experts than lanes, and the weights are NaN.
TEST_F(RouterKernelTest, NanRowsPickTheCpuOrder) {
  constexpr int64_t kExperts = 64, kTopK = 4;
  std::mt19937 rng(12);
  std::vector<float> logits = RandomFloats(3 * kExperts, rng, -4.0f, 4.0f);
  logits[0 * kExperts + 40] = std::numeric_limits<float>::quiet_NaN();
  logits[1 * kExperts + 3] = std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < kExperts; ++e) logits[2 * kExperts + e] = std::numeric_limits<float>::quiet_NaN();
  for (bool renormalize : {false, true}) {
    std::vector<int32_t> want_ids(3 * kTopK);
    std::vector<float> want_w(want_ids.size());
    cpu::RouterTopK(logits.data(), 3, kExperts, kTopK, renormalize, want_ids.data(), want_w.data());
    DeviceArray<float> dl(logits);
    DeviceArray<int32_t> ids(want_ids.size());
    DeviceArray<float> weights(want_w.size());
    ODMOE_ASSERT_CUDA(
        kernels::LaunchRouterTopK(dl.get(), 3, kExperts, kTopK, renormalize, ids.get(), weights.get(), stream_));
    Sync();
    EXPECT_EQ(ids.Download(), want_ids);
    EXPECT_EQ(want_ids, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}));
    for (float w : weights.Download()) EXPECT_TRUE(std::isnan(w)) << w;
  }
}

// A sparse layer's post-attention norm and router in one launch give bitwise what LaunchAddRmsNorm, LaunchGemv (no
// bias) and LaunchRouterTopK give: every weight dtype, rows of 1 to kGemvMaxTokens tokens, each of the norm's
// register tiers and past their ends, 1 to 8 experts, h aligned (the GEMV's 16-byte path) and not (its scalar
// path), with and without renormalisation. Too many experts or too long a row are refused.
TEST_F(RouterKernelTest, AddRmsNormRouterIsTheThreeLaunchesBitwise) {
  std::mt19937 rng(17);
  int cases = 0;
  for (DType dtype : gpu_test::kWeightTypes) {
    for (int64_t dim : {7, 64, 257, 2048, 4100, 8192}) {
      for (const auto& [experts, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {5, 2}, {8, 2}, {8, 8}}) {
        for (int64_t rows : {int64_t{1}, int64_t{3}, kernels::kGemvMaxTokens}) {
          for (bool aligned : {true, false}) {
            const bool renormalize = (cases++ % 2) == 0;
            const std::string what = std::string(DTypeName(dtype)) + " dim=" + std::to_string(dim) +
                                     " experts=" + std::to_string(experts) + " k=" + std::to_string(k) +
                                     " rows=" + std::to_string(rows) + (aligned ? "" : " (h unaligned)");
            const size_t size = static_cast<size_t>(rows * dim);
            const std::vector<float> x = RandomFloats(size, rng, -3.0f, 3.0f);
            const std::vector<float> delta = RandomFloats(size, rng, -1.0f, 1.0f);
            gpu_test::TestWeight norm(dtype, RandomFloats(static_cast<size_t>(dim), rng, 0.5f, 1.5f));
            gpu_test::TestWeight router(dtype, RandomFloats(static_cast<size_t>(experts * dim), rng, -0.2f, 0.2f));
            DeviceArray<float> dd(delta), x_three(x), x_one(x);
            // h one float past an aligned start when !aligned
            DeviceArray<float> h_three(size + 1), h_one(size + 1);
            const size_t shift = aligned ? 0 : 1;
            DeviceArray<float> l_three(static_cast<size_t>(rows * experts)), l_one(static_cast<size_t>(rows * experts));
            DeviceArray<int32_t> i_three(static_cast<size_t>(rows * k)), i_one(static_cast<size_t>(rows * k));
            DeviceArray<float> w_three(static_cast<size_t>(rows * k)), w_one(static_cast<size_t>(rows * k));
            gpu_test::WithDeviceType(norm, [&](auto* np) {
              using W = std::remove_const_t<std::remove_pointer_t<decltype(np)>>;
              const W* rp = reinterpret_cast<const W*>(router.device.get());
              float* h3 = h_three.get() + shift;
              float* h1 = h_one.get() + shift;
              ODMOE_ASSERT_CUDA(kernels::LaunchAddRmsNorm(dd.get(), x_three.get(), np, rows, dim, 1e-5f, h3, stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchGemv<W>(h3, rp, nullptr, rows, dim, experts, l_three.get(), stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchRouterTopK(l_three.get(), rows, experts, k, renormalize, i_three.get(),
                                                          w_three.get(), stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchAddRmsNormRouter(dd.get(), x_one.get(), np, rows, dim, 1e-5f, h1, rp,
                                                                experts, k, renormalize, l_one.get(), i_one.get(),
                                                                w_one.get(), stream_));
            });
            Sync();
            const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
              return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
            };
            EXPECT_TRUE(same(x_one.Download(), x_three.Download())) << what << ": the residual";
            EXPECT_TRUE(same(h_one.Download(), h_three.Download())) << what << ": the norm";
            EXPECT_TRUE(same(l_one.Download(), l_three.Download())) << what << ": the logits";
            EXPECT_EQ(i_one.Download(), i_three.Download()) << what << ": the experts";
            EXPECT_TRUE(same(w_one.Download(), w_three.Download())) << what << ": the weights";
          }
        }
      }
    }
  }
  DeviceArray<float> buf(static_cast<size_t>(9 * 8193));
  DeviceArray<int32_t> ids(9);
  const float* f = buf.get();
  EXPECT_EQ(kernels::LaunchAddRmsNormRouter(f, buf.get(), f, 1, 64, 1e-5f, buf.get() + 64, f, 9, 2, true, buf.get(),
                                            ids.get(), buf.get(), stream_),
            cudaErrorInvalidValue)
      << "9 experts";
  EXPECT_EQ(kernels::LaunchAddRmsNormRouter(f, buf.get(), f, 1, 8193, 1e-5f, buf.get() + 8193, f, 2, 2, true, buf.get(),
                                            ids.get(), buf.get(), stream_),
            cudaErrorInvalidValue)
      << "a row of 8193";
}

class ElementwiseKernelTest : public GpuTest {};

TEST_F(ElementwiseKernelTest, SwiGluAndAdd) {
  std::mt19937 rng(11);
  for (int64_t count : {1, 3, 4, 1023, 4099, 100000}) {
    const std::vector<float> gate = RandomFloats(static_cast<size_t>(count), rng, -8.0f, 8.0f);
    const std::vector<float> up = RandomFloats(static_cast<size_t>(count), rng);
    std::vector<float> want(gate.size());
    cpu::SwiGlu(gate.data(), up.data(), count, want.data());
    DeviceArray<float> dg(gate), du(up), dout(gate.size());
    ODMOE_ASSERT_CUDA(kernels::LaunchSwiGlu(dg.get(), du.get(), count, dout.get(), stream_));
    ODMOE_ASSERT_CUDA(kernels::LaunchSwiGlu(dg.get(), du.get(), count, dg.get(), stream_));  // out aliases gate
    Sync();
    ExpectClose(dout.Download(), want, 1e-7, 2e-6, "swiglu count=" + std::to_string(count));
    ExpectClose(dg.Download(), want, 1e-7, 2e-6, "swiglu in place count=" + std::to_string(count));

    // Add, aligned and with both operands one float off 16-byte alignment (the scalar path).
    std::vector<float> y = RandomFloats(static_cast<size_t>(count), rng);
    std::vector<float> want_add = y;
    cpu::Add(up.data(), count, want_add.data());
    DeviceArray<float> dy(y);
    DeviceArray<float> ux(static_cast<size_t>(count), 1), uy(static_cast<size_t>(count), 1);
    ux.Upload(up, 1);
    uy.Upload(y, 1);
    ODMOE_ASSERT_CUDA(kernels::LaunchAdd(du.get(), count, dy.get(), stream_));
    ODMOE_ASSERT_CUDA(kernels::LaunchAdd(ux.get() + 1, count, uy.get() + 1, stream_));
    Sync();
    EXPECT_EQ(dy.Download(), want_add) << "add count=" << count;
    EXPECT_EQ(uy.Download(1, static_cast<size_t>(count)), want_add) << "unaligned add count=" << count;
  }
}

TEST_F(ElementwiseKernelTest, EmbeddingAndBias) {
  std::mt19937 rng(12);
  const int64_t vocab = 301;
  for (DType dtype : gpu_test::kWeightTypes) {
    for (int64_t dim : {1, 5, 64, 300}) {
      TestWeight table(dtype, RandomFloats(static_cast<size_t>(vocab * dim), rng));
      const std::vector<int32_t> ids = {0, 300, 7, 7, 150};
      const int64_t n = static_cast<int64_t>(ids.size());
      std::vector<float> want(static_cast<size_t>(n * dim));
      cpu::Embedding(ids.data(), n, table.host_ref(), dim, want.data());
      DeviceArray<int32_t> dids(ids);
      DeviceArray<float> out(want.size());
      gpu_test::WithDeviceType(table, [&](auto* t) {
        ODMOE_ASSERT_CUDA(kernels::LaunchEmbedding(dids.get(), n, t, dim, out.get(), stream_));
      });
      Sync();
      EXPECT_EQ(out.Download(), want) << DTypeName(dtype) << " dim=" << dim;

      // Bias: y[i, :] += bias, exactly the widened bias values added in fp32.
      TestWeight bias(dtype, RandomFloats(static_cast<size_t>(dim), rng));
      std::vector<float> want_bias = want;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < dim; ++j)
          want_bias[static_cast<size_t>(i * dim + j)] += cpu::WeightAt(bias.host_ref(), j);
      }
      gpu_test::WithDeviceType(
          bias, [&](auto* b) { ODMOE_ASSERT_CUDA(kernels::LaunchAddBias(b, n, dim, out.get(), stream_)); });
      Sync();
      EXPECT_EQ(out.Download(), want_bias) << "bias " << DTypeName(dtype) << " dim=" << dim;
    }
  }
}

TEST_F(ElementwiseKernelTest, GatherAndOrderedScatterAdd) {
  std::mt19937 rng(13);
  for (int64_t dim : {1, 3, 128, 1000}) {
    for (bool sigmoid : {false, true}) {
      const int64_t src_rows = 9;
      const std::vector<float> table = RandomFloats(static_cast<size_t>(src_rows * dim), rng);
      // Repeated rows, within and across groups of 8, to exercise the in-order accumulation.
      const std::vector<int32_t> rows = {3, 0, 3, 8, 3, 1, 1, 0, 3, 2, 8, 8, 5, 3, 3, 0, 7, 6, 3};
      const int64_t n = static_cast<int64_t>(rows.size());
      std::vector<float> want_gather(static_cast<size_t>(n * dim));
      cpu::GatherRows(table.data(), rows.data(), n, dim, want_gather.data());
      DeviceArray<float> dtable(table);
      DeviceArray<int32_t> drows(rows);
      DeviceArray<float> gathered(want_gather.size());
      ODMOE_ASSERT_CUDA(kernels::LaunchGatherRows(dtable.get(), drows.get(), n, dim, gathered.get(), stream_));
      Sync();
      EXPECT_EQ(gathered.Download(), want_gather) << "gather dim=" << dim;

      const std::vector<float> src = RandomFloats(static_cast<size_t>(n * dim), rng);
      const std::vector<float> scale = RandomFloats(static_cast<size_t>(n), rng, -2.0f, 2.0f);
      std::vector<float> want = table;
      cpu::ScatterAddScaled(src.data(), rows.data(), scale.data(), n, dim, sigmoid, want.data());
      DeviceArray<float> dsrc(src), dscale(scale), dst(table);
      ODMOE_ASSERT_CUDA(
          kernels::LaunchScatterAddScaled(dsrc.get(), drows.get(), dscale.get(), n, dim, sigmoid, dst.get(), stream_));
      Sync();
      const std::string what = "scatter dim=" + std::to_string(dim) + (sigmoid ? " sigmoid" : "");
      if (sigmoid) {
        ExpectClose(dst.Download(), want, 1e-6, 1e-6, what);  // expf may differ from the CPU's by an ulp
      } else {
        EXPECT_EQ(dst.Download(), want) << what << ": the same fp32 operations in the same order";
      }
    }
  }
}

// Rows of activations split into 16-bit (hi, lo) pairs: hi + lo, times the row's scale, is x to about twice the
// 16-bit mantissa. Row 1 reaches past fp16's range (65504): its fp16 pair is scaled down by a power of two
// instead of overflowing to inf; bf16 (fp32's range) never scales.
TEST_F(ElementwiseKernelTest, SplitToPairKeepsNearFp32Precision) {
  constexpr int64_t kRows = 3, kCols = 1500;
  std::mt19937 rng(14);
  std::vector<float> x = RandomFloats(kRows * kCols, rng, -100.0f, 100.0f);
  for (int64_t c = 0; c < kCols; ++c) x[kCols + c] *= 3000.0f;  // up to 3e5
  x[kCols + 7] = -1.0e6f;
  DeviceArray<__nv_bfloat16> bhi(x.size()), blo(x.size());
  DeviceArray<__half> hhi(x.size()), hlo(x.size());
  DeviceArray<float> bscale(kRows), hscale(kRows);
  DeviceArray<float> dx(x);
  ODMOE_ASSERT_CUDA(kernels::LaunchSplitToPair(dx.get(), kRows, kCols, bhi.get(), blo.get(), bscale.get(), stream_));
  ODMOE_ASSERT_CUDA(kernels::LaunchSplitToPair(dx.get(), kRows, kCols, hhi.get(), hlo.get(), hscale.get(), stream_));
  Sync();
  const auto bh = bhi.Download(), bl = blo.Download();
  const auto hh = hhi.Download(), hl = hlo.Download();
  const std::vector<float> bs = bscale.Download(), hs = hscale.Download();
  EXPECT_EQ(bs, (std::vector<float>{1.0f, 1.0f, 1.0f}));
  EXPECT_EQ(hs, (std::vector<float>{1.0f, 32.0f, 1.0f}));  // 1e6 / 32 = 31250 < 2^15 <= 1e6 / 16
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t row = i / kCols;
    uint16_t bits[4];
    std::memcpy(&bits[0], &bh[i], 2);
    std::memcpy(&bits[1], &bl[i], 2);
    std::memcpy(&bits[2], &hh[i], 2);
    std::memcpy(&bits[3], &hl[i], 2);
    const double b = (static_cast<double>(Bf16ToF32(bits[0])) + Bf16ToF32(bits[1])) * bs[row];
    const double h = (static_cast<double>(F16ToF32(bits[2])) + F16ToF32(bits[3])) * hs[row];
    ASSERT_LE(std::fabs(b - x[i]), std::fabs(x[i]) * std::ldexp(1.0, -16)) << "bf16 pair of " << x[i];
    ASSERT_LE(std::fabs(h - x[i]), std::fabs(x[i]) * std::ldexp(1.0, -21) + 1e-7 * hs[row]) << "f16 pair of " << x[i];
  }
  // The GEMM's output rows are scaled back by the row scales.
  DeviceArray<float> y(std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f});
  ODMOE_ASSERT_CUDA(kernels::LaunchScaleRows(y.get(), kRows, 2, hscale.get(), stream_));
  EXPECT_EQ(y.Download(), (std::vector<float>{1.0f, 2.0f, 96.0f, 128.0f, 5.0f, 6.0f}));
}

}  // namespace
}  // namespace odmoe
