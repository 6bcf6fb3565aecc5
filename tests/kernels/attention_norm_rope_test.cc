// RMSNorm, RoPE and attention kernels against the CPU reference (src/backend/cpu_kernels.h): 1 token, sizes
// that are not multiples of the block, every weight dtype, head_dim 32/48/64/80/128/256, GQA ratios
// 1/2/3/4/6/8/16, past = 0 and long contexts (the decode kernel's sequence splits), KV caches in every dtype and
// unaligned. Skipped without a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
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

// The values a KV cache of this dtype holds for `values` (rounded to bf16 / fp16).
std::vector<float> RoundTo(DType dtype, const std::vector<float>& values) {
  const std::vector<uint8_t> bytes = TestWeight::Encode(dtype, values);
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = dtype == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
    }
  }
  return out;
}

// A KV cache on the device in a storage dtype; `misaligned` starts it one element past a 16-byte boundary (the
// decode kernel's scalar fallback).
class DeviceKv {
 public:
  DeviceKv(DType dtype, const std::vector<float>& values, bool misaligned)
      : dtype_(dtype),
        offset_(misaligned ? DTypeSize(dtype) : 0),
        bytes_(TestWeight::Encode(dtype, values).size(), 16) {
    bytes_.Upload(TestWeight::Encode(dtype, values), offset_);
  }
  // Calls f(k, v) with the two caches (of one dtype) as const float*, const __half* or const __nv_bfloat16*.
  template <typename F>
  static void WithPair(const DeviceKv& k, const DeviceKv& v, F&& f) {
    ASSERT_EQ(k.dtype_, v.dtype_);
    if (k.dtype_ == DType::kF32) {
      f(k.As<float>(), v.As<float>());
    } else if (k.dtype_ == DType::kF16) {
      f(k.As<__half>(), v.As<__half>());
    } else {
      f(k.As<__nv_bfloat16>(), v.As<__nv_bfloat16>());
    }
  }

 private:
  template <typename T>
  const T* As() const {
    return reinterpret_cast<const T*>(bytes_.get() + offset_);
  }

  DType dtype_;
  size_t offset_;
  DeviceArray<uint8_t> bytes_;
};

class AttentionKernelTest : public GpuTest {
 protected:
  // Prefill, decode with the workspace it asks for, and decode without splits, against the CPU reference on the
  // K/V values the cache dtype holds.
  void Check(const AttentionCase& c, std::mt19937& rng, DType kv_dtype = DType::kF32, bool misaligned = false) {
    const int64_t len = c.past + c.n;
    const std::vector<float> q = RandomFloats(static_cast<size_t>(c.n * c.heads * c.head_dim), rng, -2.0f, 2.0f);
    const std::vector<float> k =
        RoundTo(kv_dtype, RandomFloats(static_cast<size_t>(len * c.kv_heads * c.head_dim), rng, -2.0f, 2.0f));
    const std::vector<float> v =
        RoundTo(kv_dtype, RandomFloats(static_cast<size_t>(len * c.kv_heads * c.head_dim), rng));
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    std::vector<float> want(q.size());
    cpu::Attention(q.data(), k.data(), v.data(), c.n, c.past, c.heads, c.kv_heads, c.head_dim, scale, want.data());
    DeviceArray<float> dq(q);
    const DeviceKv dk(kv_dtype, k, misaligned);
    const DeviceKv dv(kv_dtype, v, misaligned);
    DeviceArray<float> prefill(q.size()), decode(q.size()), unsplit(q.size());
    const size_t ws_floats = kernels::AttentionDecodeWorkspaceFloats(c.n, c.past, c.heads, c.head_dim);
    DeviceArray<float> workspace(std::max<size_t>(ws_floats, 1));
    DeviceKv::WithPair(dk, dv, [&](auto* kp, auto* vp) {
      ODMOE_ASSERT_CUDA(kernels::LaunchAttentionPrefill(dq.get(), kp, vp, c.n, c.past, c.heads, c.kv_heads, c.head_dim,
                                                        scale, prefill.get(), stream_));
      ODMOE_ASSERT_CUDA(kernels::LaunchAttentionDecode(dq.get(), kp, vp, c.n, c.past, c.heads, c.kv_heads, c.head_dim,
                                                       scale, decode.get(), workspace.get(), ws_floats, stream_));
      ODMOE_ASSERT_CUDA(kernels::LaunchAttentionDecode(dq.get(), kp, vp, c.n, c.past, c.heads, c.kv_heads, c.head_dim,
                                                       scale, unsplit.get(), nullptr, 0, stream_));
    });
    Sync();
    const std::string what =
        Describe(c) + " kv " + std::string(DTypeName(kv_dtype)) + (misaligned ? " misaligned" : "");
    ExpectClose(prefill.Download(), want, 2e-5, 1e-4, "prefill " + what);
    ExpectClose(decode.Download(), want, 2e-5, 1e-4,
                "decode " + what + " splits workspace " + std::to_string(ws_floats));
    ExpectClose(unsplit.Download(), want, 2e-5, 1e-4, "decode without splits " + what);
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

// The decode path's cases: GQA ratios 1, 2, 3, 4, 8 and 16 (two blocks per kv head), head_dim 64 and 128, 1-4
// tokens (the first tokens' keys end before the last splits), contexts spanning several splits and not a multiple
// of a tile or a split, every cache dtype, and unaligned caches (the scalar fallback).
TEST_F(AttentionKernelTest, DecodeGqaGroups) {
  std::mt19937 rng(6);
  for (DType dtype : gpu_test::kWeightTypes) {
    // Every shape in bf16 (the models' cache dtype), a few in the others.
    const bool all = dtype == DType::kBF16;
    for (const auto& [heads, kv_heads] :
         std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {8, 4}, {8, 2}, {16, 2}, {32, 2}, {12, 4}}) {
      for (int64_t head_dim : {64, 128}) {
        Check({1, 100, heads, kv_heads, head_dim}, rng, dtype);
        Check({3, 61, heads, kv_heads, head_dim}, rng, dtype);
        if (!all) continue;
        Check({1, 0, heads, kv_heads, head_dim}, rng, dtype);
        Check({1, 1000, heads, kv_heads, head_dim}, rng, dtype);
        Check({2, 500, heads, kv_heads, head_dim}, rng, dtype);
        Check({4, 0, heads, kv_heads, head_dim}, rng, dtype);
      }
    }
    Check({1, 777, 8, 1, 256}, rng, dtype);
    Check({3, 300, 6, 2, 80}, rng, dtype);
    Check({2, 200, 8, 2, 128}, rng, dtype, /*misaligned=*/true);
    Check({1, 65, 4, 4, 64}, rng, dtype, /*misaligned=*/true);
  }
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
