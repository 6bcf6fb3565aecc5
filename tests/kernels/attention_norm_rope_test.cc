// RMSNorm, RoPE and attention kernels against the CPU reference (src/backend/cpu_kernels.h): 1 token, sizes
// that are not multiples of the block, every weight dtype, head_dim 32/48/64/128/256, GQA ratios 1/2/4/6,
// past = 0 and long contexts (the decode kernel's sequence splits). Skipped without a GPU.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/norm.h"
#include "kernels/rope.h"
#include "src/backend/cpu_kernels.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::DeviceArray;
using gpu_test::ExpectClose;
using gpu_test::GpuTest;
using gpu_test::RandomFloats;
using gpu_test::TestWeight;

class RmsNormKernelTest : public GpuTest {};

TEST_F(RmsNormKernelTest, MatchesCpuReference) {
  std::mt19937 rng(1);
  for (DType dtype : gpu_test::kWeightTypes) {
    for (int64_t rows : {1, 3, 17}) {
      for (int64_t dim : {1, 7, 64, 127, 1000, 4096}) {
        const std::string what =
            std::string(DTypeName(dtype)) + " rows=" + std::to_string(rows) + " dim=" + std::to_string(dim);
        const std::vector<float> x = RandomFloats(static_cast<size_t>(rows * dim), rng, -3.0f, 3.0f);
        TestWeight w(dtype, RandomFloats(static_cast<size_t>(dim), rng, 0.5f, 1.5f));
        std::vector<float> want(x.size());
        cpu::RmsNorm(x.data(), w.host_ref(), rows, dim, 1e-6f, want.data());
        DeviceArray<float> dx(x);
        DeviceArray<float> dout(x.size());
        gpu_test::WithDeviceType(w, [&](auto* wp) {
          ODMOE_ASSERT_CUDA(kernels::LaunchRmsNorm(dx.get(), wp, rows, dim, 1e-6f, dout.get(), stream_));
          // In place (out aliases x).
          ODMOE_ASSERT_CUDA(kernels::LaunchRmsNorm(dx.get(), wp, rows, dim, 1e-6f, dx.get(), stream_));
        });
        Sync();
        ExpectClose(dout.Download(), want, 1e-6, 1e-5, what);
        ExpectClose(dx.Download(), want, 1e-6, 1e-5, what + " in place");
      }
    }
  }
}

class RopeKernelTest : public GpuTest {};

TEST_F(RopeKernelTest, MatchesCpuReference) {
  std::mt19937 rng(2);
  const std::vector<int32_t> all_positions = {0, 1, 7, 100, 4095, 4096, 32767};
  for (int64_t head_dim : {2, 32, 48, 64, 128, 256}) {
    for (int64_t heads : {1, 3, 8}) {
      for (double theta : {10000.0, 1000000.0}) {
        const int64_t n = static_cast<int64_t>(all_positions.size());
        const std::string what = "head_dim=" + std::to_string(head_dim) + " heads=" + std::to_string(heads) +
                                 " theta=" + std::to_string(theta);
        const std::vector<float> x = RandomFloats(static_cast<size_t>(n * heads * head_dim), rng);
        std::vector<float> want = x;
        cpu::Rope(want.data(), all_positions.data(), n, heads, head_dim, theta);
        std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
        cpu::RopeInvFreq(head_dim, theta, inv_freq.data());
        DeviceArray<float> with_table(x);
        DeviceArray<float> computed(x);
        DeviceArray<int32_t> positions(all_positions);
        DeviceArray<float> table(inv_freq);
        ODMOE_ASSERT_CUDA(
            kernels::LaunchRope(with_table.get(), positions.get(), n, heads, head_dim, theta, table.get(), stream_));
        ODMOE_ASSERT_CUDA(
            kernels::LaunchRope(computed.get(), positions.get(), n, heads, head_dim, theta, nullptr, stream_));
        Sync();
        // Same frequencies: only cos/sin (a few ulp of the angle's function) differ.
        ExpectClose(with_table.Download(), want, 2e-6, 2e-6, what + " (CPU inv_freq table)");
        // Own frequencies: the correctly rounded float power may differ from std::pow by an ulp, which moves
        // the float angle by an ulp or more (4e-3 at position 32767).
        ExpectClose(computed.Download(), want, 1e-2, 0.0, what + " (kernel inv_freq)");
      }
    }
  }
}

struct AttentionCase {
  int64_t n;
  int64_t past;
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
};

std::string Describe(const AttentionCase& c) {
  return "n=" + std::to_string(c.n) + " past=" + std::to_string(c.past) + " heads=" + std::to_string(c.heads) +
         " kv_heads=" + std::to_string(c.kv_heads) + " head_dim=" + std::to_string(c.head_dim);
}

class AttentionKernelTest : public GpuTest {
 protected:
  void Check(const AttentionCase& c, std::mt19937& rng) {
    const int64_t len = c.past + c.n;
    const std::vector<float> q = RandomFloats(static_cast<size_t>(c.n * c.heads * c.head_dim), rng, -2.0f, 2.0f);
    const std::vector<float> k = RandomFloats(static_cast<size_t>(len * c.kv_heads * c.head_dim), rng, -2.0f, 2.0f);
    const std::vector<float> v = RandomFloats(static_cast<size_t>(len * c.kv_heads * c.head_dim), rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    std::vector<float> want(q.size());
    cpu::Attention(q.data(), k.data(), v.data(), c.n, c.past, c.heads, c.kv_heads, c.head_dim, scale, want.data());
    DeviceArray<float> dq(q), dk(k), dv(v);
    DeviceArray<float> prefill(q.size()), decode(q.size()), unsplit(q.size());
    const size_t ws_floats = kernels::AttentionDecodeWorkspaceFloats(c.n, c.past, c.heads, c.head_dim);
    DeviceArray<float> workspace(std::max<size_t>(ws_floats, 1));
    ODMOE_ASSERT_CUDA(kernels::LaunchAttentionPrefill(dq.get(), dk.get(), dv.get(), c.n, c.past, c.heads, c.kv_heads,
                                                      c.head_dim, scale, prefill.get(), stream_));
    ODMOE_ASSERT_CUDA(kernels::LaunchAttentionDecode(dq.get(), dk.get(), dv.get(), c.n, c.past, c.heads, c.kv_heads,
                                                     c.head_dim, scale, decode.get(), workspace.get(), ws_floats,
                                                     stream_));
    ODMOE_ASSERT_CUDA(kernels::LaunchAttentionDecode(dq.get(), dk.get(), dv.get(), c.n, c.past, c.heads, c.kv_heads,
                                                     c.head_dim, scale, unsplit.get(), nullptr, 0, stream_));
    Sync();
    ExpectClose(prefill.Download(), want, 2e-5, 1e-4, "prefill " + Describe(c));
    ExpectClose(decode.Download(), want, 2e-5, 1e-4,
                "decode " + Describe(c) + " splits workspace " + std::to_string(ws_floats));
    ExpectClose(unsplit.Download(), want, 2e-5, 1e-4, "decode without splits " + Describe(c));
  }
};

TEST_F(AttentionKernelTest, DecodeShapes) {
  std::mt19937 rng(3);
  for (int64_t head_dim : {32, 48, 64, 128, 256}) {
    for (const auto& [heads, kv_heads] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {8, 2}, {12, 3}, {6, 1}}) {
      for (int64_t past : {0, 1, 63, 64, 300}) Check({1, past, heads, kv_heads, head_dim}, rng);
    }
  }
}

TEST_F(AttentionKernelTest, LongContexts) {
  std::mt19937 rng(4);
  Check({1, 5000, 8, 2, 128}, rng);
  Check({1, 16383, 4, 1, 64}, rng);
  Check({2, 4095, 4, 2, 48}, rng);
  Check({4, 2047, 32, 8, 128}, rng);
}

TEST_F(AttentionKernelTest, PrefillShapes) {
  std::mt19937 rng(5);
  for (int64_t head_dim : {32, 48, 64, 128}) {
    Check({5, 0, 4, 4, head_dim}, rng);
    Check({16, 0, 8, 2, head_dim}, rng);
    Check({17, 3, 6, 1, head_dim}, rng);
    Check({37, 0, 12, 3, head_dim}, rng);
    Check({64, 100, 4, 2, head_dim}, rng);
  }
  Check({130, 33, 2, 1, 256}, rng);
  Check({3, 0, 2, 2, 1}, rng);
}

TEST_F(AttentionKernelTest, RejectsBadShapes) {
  DeviceArray<float> buf(1024);
  EXPECT_EQ(kernels::LaunchAttentionPrefill(buf.get(), buf.get(), buf.get(), 1, 0, 3, 2, 64, 1.0f, buf.get(), stream_),
            cudaErrorInvalidValue);  // heads % kv_heads != 0
  EXPECT_EQ(kernels::LaunchAttentionDecode(buf.get(), buf.get(), buf.get(), 1, 0, 2, 2, 512, 1.0f, buf.get(), nullptr,
                                           0, stream_),
            cudaErrorInvalidValue);  // head_dim > kMaxHeadDim
}

}  // namespace
}  // namespace odmoe
