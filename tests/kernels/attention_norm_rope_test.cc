// RMSNorm, RoPE and attention kernels against the CPU reference (src/backend/cpu_kernels.h): 1 token, sizes
// that are not multiples of the block, every weight dtype, head_dim 32/48/64/80/128/256, GQA ratios
// 1/2/3/4/6/8/16, past = 0 and long contexts (the decode kernel's sequence splits), KV caches in every dtype and
// unaligned; LaunchAttentionDecodeAt bit for bit against LaunchAttentionDecode, one launch replayed while only the
// device past changes; LaunchKvStore bit for bit against LaunchConvert, LaunchRopeKvStore against LaunchRope and
// LaunchKvStore. Skipped without a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
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
      // Each of LaunchRmsNorm's kernels, at and past its largest row: 256, 2048, 4096 and 8192 held in registers.
      for (int64_t dim : {1, 7, 64, 127, 256, 257, 1000, 2048, 2049, 4096, 8192, 8193}) {
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

TEST_F(RmsNormKernelTest, AddRmsNormIsAddThenRmsNormBitwise) {
  std::mt19937 rng(3);
  for (DType dtype : gpu_test::kWeightTypes) {
    for (int64_t rows : {1, 5}) {
      for (int64_t dim : {7, 256, 257, 4096, 8192, 8193}) {
        const std::string what =
            std::string(DTypeName(dtype)) + " rows=" + std::to_string(rows) + " dim=" + std::to_string(dim);
        const std::vector<float> x = RandomFloats(static_cast<size_t>(rows * dim), rng, -3.0f, 3.0f);
        const std::vector<float> delta = RandomFloats(x.size(), rng, -1.0f, 1.0f);
        TestWeight w(dtype, RandomFloats(static_cast<size_t>(dim), rng, 0.5f, 1.5f));
        DeviceArray<float> dd(delta);
        DeviceArray<float> x_two(x), x_one(x);
        DeviceArray<float> out_two(x.size()), out_one(x.size());
        gpu_test::WithDeviceType(w, [&](auto* wp) {
          ODMOE_ASSERT_CUDA(kernels::LaunchAdd(dd.get(), rows * dim, x_two.get(), stream_));
          ODMOE_ASSERT_CUDA(kernels::LaunchRmsNorm(x_two.get(), wp, rows, dim, 1e-6f, out_two.get(), stream_));
          ODMOE_ASSERT_CUDA(
              kernels::LaunchAddRmsNorm(dd.get(), x_one.get(), wp, rows, dim, 1e-6f, out_one.get(), stream_));
        });
        Sync();
        const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
          return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
        };
        EXPECT_TRUE(same_bits(x_one.Download(), x_two.Download())) << what << ": the residual";
        EXPECT_TRUE(same_bits(out_one.Download(), out_two.Download())) << what << ": the norm";
      }
    }
  }
}

class RopeKernelTest : public GpuTest {};

TEST_F(RopeKernelTest, MatchesCpuReference) {
  std::mt19937 rng(2);
  const std::vector<int32_t> all_positions = {0, 1, 7, 100, 4095, 4096, 32767};
  for (int64_t head_dim : {2, 32, 48, 64, 128, 256}) {
    for (int64_t heads : {1, 3, 8, 40}) {
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

// Qwen3's per-head norms and rotation in one launch give bitwise what LaunchRmsNorm over q's and k's heads, then
// LaunchRope of each, give: q and k adjacent in one buffer (a decode token's [q | k]) and apart, every weight dtype,
// odd head counts and the largest head the kernel holds; a longer head is refused.
TEST_F(RopeKernelTest, HeadNormRopeIsTheNormsThenRopeBitwise) {
  std::mt19937 rng(5);
  const std::vector<int32_t> all_positions = {3, 0, 4095};
  const double theta = 1000000.0;
  const float eps = 1e-6f;
  for (DType dtype : gpu_test::kWeightTypes) {
    for (int64_t head_dim : {2, 64, 96, 128, 256}) {
      for (const auto& [heads, kv_heads] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {5, 1}, {32, 4}}) {
        for (int64_t n : {1, 3}) {
          for (bool table : {true, false}) {
            const std::string what = std::string(DTypeName(dtype)) + " head_dim=" + std::to_string(head_dim) +
                                     " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
                                     " n=" + std::to_string(n) + (table ? " (table)" : "");
            const int64_t q_size = n * heads * head_dim, k_size = n * kv_heads * head_dim;
            const std::vector<float> qk = RandomFloats(static_cast<size_t>(q_size + k_size), rng, -3.0f, 3.0f);
            TestWeight qw(dtype, RandomFloats(static_cast<size_t>(head_dim), rng, 0.5f, 1.5f));
            TestWeight kw(dtype, RandomFloats(static_cast<size_t>(head_dim), rng, 0.5f, 1.5f));
            std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
            cpu::RopeInvFreq(head_dim, theta, inv_freq.data());
            DeviceArray<float> freq(inv_freq);
            const float* f = table ? freq.get() : nullptr;
            const std::vector<int32_t> host_positions(all_positions.begin(), all_positions.begin() + n);
            DeviceArray<int32_t> positions(host_positions);
            DeviceArray<float> apart(qk), fused(qk);
            DeviceArray<float> q_alone(std::vector<float>(qk.begin(), qk.begin() + q_size));
            DeviceArray<float> k_alone(std::vector<float>(qk.begin() + q_size, qk.end()));
            gpu_test::WithDeviceType(qw, [&](auto* qp) {
              using W = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
              const W* kp = reinterpret_cast<const W*>(kw.device.get());
              float* q = apart.get();
              float* k = q + q_size;
              ODMOE_ASSERT_CUDA(kernels::LaunchRmsNorm(q, qp, n * heads, head_dim, eps, q, stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchRmsNorm(k, kp, n * kv_heads, head_dim, eps, k, stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchRope(q, positions.get(), n, heads, head_dim, theta, f, stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchRope(k, positions.get(), n, kv_heads, head_dim, theta, f, stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchHeadNormRope(fused.get(), fused.get() + q_size, qp, kp, positions.get(),
                                                            n, heads, kv_heads, head_dim, eps, theta, f, stream_));
              ODMOE_ASSERT_CUDA(kernels::LaunchHeadNormRope(q_alone.get(), k_alone.get(), qp, kp, positions.get(), n,
                                                            heads, kv_heads, head_dim, eps, theta, f, stream_));
            });
            Sync();
            const std::vector<float> want = apart.Download();
            const std::vector<float> got = fused.Download();
            EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << what;
            std::vector<float> got_apart = q_alone.Download();
            const std::vector<float> k_got = k_alone.Download();
            got_apart.insert(got_apart.end(), k_got.begin(), k_got.end());
            EXPECT_EQ(std::memcmp(got_apart.data(), want.data(), want.size() * sizeof(float)), 0) << what << " apart";
            // And the reference is right: the CPU's norm then rotation, to RoPE's tolerance.
            std::vector<float> cpu_q(qk.begin(), qk.begin() + q_size), cpu_k(qk.begin() + q_size, qk.end());
            cpu::RmsNorm(cpu_q.data(), qw.host_ref(), n * heads, head_dim, eps, cpu_q.data());
            cpu::RmsNorm(cpu_k.data(), kw.host_ref(), n * kv_heads, head_dim, eps, cpu_k.data());
            cpu::Rope(cpu_q.data(), host_positions.data(), n, heads, head_dim, theta);
            cpu::Rope(cpu_k.data(), host_positions.data(), n, kv_heads, head_dim, theta);
            cpu_q.insert(cpu_q.end(), cpu_k.begin(), cpu_k.end());
            if (table) ExpectClose(got, cpu_q, 1e-5, 1e-5, what + " against the CPU");
          }
        }
      }
    }
  }
  TestWeight w(DType::kF32, std::vector<float>(258, 1.0f));
  DeviceArray<float> x(std::vector<float>(258 * 2, 1.0f));
  DeviceArray<int32_t> positions(std::vector<int32_t>{0});
  EXPECT_EQ(kernels::LaunchHeadNormRope(x.get(), x.get() + 258, reinterpret_cast<const float*>(w.device.get()),
                                        reinterpret_cast<const float*>(w.device.get()), positions.get(), 1, 1, 1, 258,
                                        eps, theta, nullptr, stream_),
            cudaErrorInvalidValue)
      << "a head of 258 does not fit the kernel's block";
}

// RoPE that also stores k's rotated rows and v's rows into the caches gives bitwise what LaunchRope of q and of k,
// then LaunchKvStore, give; with Qwen3's per-head norms (LaunchHeadNormRopeKvStore), what LaunchHeadNormRope, then
// LaunchKvStore, give. Checked: q, k and both caches (which start as byte patterns, so a stray store shows), in
// every cache dtype and norm dtype; q and k adjacent (a decode token's [q | k]) and apart; positions outside [0,
// capacity) rotate their rows but store nothing; several tokens; a token's v row longer than a RoPE block's batch
// (32 kv heads of 128).
class RopeKvStoreTest : public GpuTest {
 protected:
  // norms: the per-head norms' dtype, or nullopt for RoPE alone.
  template <typename KV>
  void Check(int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim, bool adjacent, bool table,
             std::optional<DType> norms, std::mt19937& rng) {
    const std::string what = "sizeof(KV)=" + std::to_string(sizeof(KV)) + " n=" + std::to_string(n) +
                             " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
                             " head_dim=" + std::to_string(head_dim) + (adjacent ? " adjacent" : " apart") +
                             (table ? " (table)" : "") + (norms ? " norms " + std::string(DTypeName(*norms)) : "");
    const double theta = 10000.0;
    const float eps = 1e-6f;
    const int64_t capacity = 5;
    const std::vector<int32_t> all_positions = {2, 4, -1, 0, 5};  // -1 and 5 (= capacity) store nothing
    const std::vector<int32_t> host_positions(all_positions.begin(), all_positions.begin() + n);
    DeviceArray<int32_t> positions(host_positions);
    std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
    cpu::RopeInvFreq(head_dim, theta, inv_freq.data());
    DeviceArray<float> freq(inv_freq);
    const float* f = table ? freq.get() : nullptr;
    const int64_t q_size = n * heads * head_dim, kv_size = kv_heads * head_dim;
    // [q | k] of each run in one buffer, with a gap between them when apart; v alone.
    const int64_t gap = adjacent ? 0 : 3;
    std::vector<float> qk = RandomFloats(static_cast<size_t>(q_size + gap + n * kv_size), rng, -3.0f, 3.0f);
    const std::vector<float> v_host = RandomFloats(static_cast<size_t>(n * kv_size), rng, -3.0f, 3.0f);
    DeviceArray<float> qk_apart(qk), qk_fused(qk), v(v_host);
    const size_t cache_elems = static_cast<size_t>(capacity * kv_size);
    DeviceArray<KV> caches_apart(2 * cache_elems), caches_fused(2 * cache_elems);  // K's, then V's
    for (DeviceArray<KV>* c : {&caches_apart, &caches_fused}) {
      ODMOE_ASSERT_CUDA(cudaMemset(c->get(), 0x5a, cache_elems * sizeof(KV)));
      ODMOE_ASSERT_CUDA(cudaMemset(c->get() + cache_elems, 0xa5, cache_elems * sizeof(KV)));
    }
    float* q = qk_apart.get();
    float* k = q + q_size + gap;
    float* fq = qk_fused.get();
    float* fk = fq + q_size + gap;
    KV* kc = caches_fused.get();
    KV* vc = kc + cache_elems;
    if (!norms) {
      ODMOE_ASSERT_CUDA(kernels::LaunchRope(q, positions.get(), n, heads, head_dim, theta, f, stream_));
      ODMOE_ASSERT_CUDA(kernels::LaunchRope(k, positions.get(), n, kv_heads, head_dim, theta, f, stream_));
      ODMOE_ASSERT_CUDA(kernels::LaunchRopeKvStore(fq, fk, v.get(), positions.get(), n, heads, kv_heads, head_dim,
                                                   theta, f, kc, vc, capacity, stream_));
    } else {
      TestWeight qw(*norms, RandomFloats(static_cast<size_t>(head_dim), rng, 0.5f, 1.5f));
      TestWeight kw(*norms, RandomFloats(static_cast<size_t>(head_dim), rng, 0.5f, 1.5f));
      gpu_test::WithDeviceType(qw, [&](auto* qp) {
        using W = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
        const W* kp = reinterpret_cast<const W*>(kw.device.get());
        ODMOE_ASSERT_CUDA(kernels::LaunchHeadNormRope(q, k, qp, kp, positions.get(), n, heads, kv_heads, head_dim, eps,
                                                      theta, f, stream_));
        ODMOE_ASSERT_CUDA(kernels::LaunchHeadNormRopeKvStore(fq, fk, v.get(), qp, kp, positions.get(), n, heads,
                                                             kv_heads, head_dim, eps, theta, f, kc, vc, capacity,
                                                             stream_));
      });
      Sync();  // the weights go out of scope
    }
    ODMOE_ASSERT_CUDA(kernels::LaunchKvStore(k, v.get(), positions.get(), n, kv_size, caches_apart.get(),
                                             caches_apart.get() + cache_elems, capacity, stream_));
    Sync();
    const std::vector<float> want_qk = qk_apart.Download(), got_qk = qk_fused.Download();
    EXPECT_EQ(std::memcmp(got_qk.data(), want_qk.data(), want_qk.size() * sizeof(float)), 0) << what << ": q and k";
    EXPECT_NE(std::memcmp(got_qk.data(), qk.data(), qk.size() * sizeof(float)), 0) << what << ": rotated";
    const std::vector<KV> want_c = caches_apart.Download(), got_c = caches_fused.Download();
    EXPECT_EQ(std::memcmp(got_c.data(), want_c.data(), want_c.size() * sizeof(KV)), 0) << what << ": the caches";
    const std::vector<float> v_after = v.Download();
    EXPECT_EQ(std::memcmp(v_after.data(), v_host.data(), v_host.size() * sizeof(float)), 0) << what << ": v unchanged";
  }

  template <typename KV>
  void CheckAll(std::mt19937& rng) {
    for (const auto& [heads, kv_heads] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {5, 1}, {32, 4}, {32, 32}}) {
      for (int64_t head_dim : {2, 48, 128}) {
        for (int64_t n : {1, 5}) {
          Check<KV>(n, heads, kv_heads, head_dim, /*adjacent=*/true, /*table=*/true, std::nullopt, rng);
          Check<KV>(n, heads, kv_heads, head_dim, /*adjacent=*/false, /*table=*/n == 1, std::nullopt, rng);
          for (DType norms : gpu_test::kWeightTypes) {
            Check<KV>(n, heads, kv_heads, head_dim, /*adjacent=*/n == 1, /*table=*/true, norms, rng);
          }
        }
      }
    }
  }
};

TEST_F(RopeKvStoreTest, IsRopeThenKvStoreBitwise) {
  std::mt19937 rng(13);
  CheckAll<float>(rng);
  CheckAll<__half>(rng);
  CheckAll<__nv_bfloat16>(rng);
}

TEST_F(RopeKvStoreTest, EmptyAndBadArguments) {
  DeviceArray<float> buf(64);
  DeviceArray<float> cache(64);
  DeviceArray<int32_t> pos(std::vector<int32_t>{0});
  float* q = buf.get();
  float* c = cache.get();
  const auto launch = [&](int64_t n, int64_t head_dim, float* k, float* k_cache) {
    return kernels::LaunchRopeKvStore(q, k, buf.get() + 32, pos.get(), n, 1, 1, head_dim, 10000.0, nullptr, k_cache,
                                      c + 32, 4, stream_);
  };
  EXPECT_EQ(launch(0, 4, q + 4, c), cudaSuccess);
  EXPECT_EQ(launch(1, 4, q + 4, c), cudaSuccess);
  EXPECT_EQ(launch(-1, 4, q + 4, c), cudaErrorInvalidValue);
  EXPECT_EQ(launch(1, 3, q + 4, c), cudaErrorInvalidValue) << "an odd head";
  EXPECT_EQ(launch(1, 4, nullptr, c), cudaErrorInvalidValue);
  EXPECT_EQ(launch(1, 4, q + 4, nullptr), cudaErrorInvalidValue);
  const float* w = buf.get() + 48;  // norm weights (values do not matter here)
  const auto launch_normed = [&](int64_t n, int64_t head_dim, float* k, float* k_cache) {
    return kernels::LaunchHeadNormRopeKvStore(q, k, buf.get() + 32, w, w, pos.get(), n, 1, 1, head_dim, 1e-6f, 10000.0,
                                              nullptr, k_cache, c + 32, 4, stream_);
  };
  EXPECT_EQ(launch_normed(0, 4, q + 4, c), cudaSuccess);
  EXPECT_EQ(launch_normed(1, 4, q + 4, c), cudaSuccess);
  EXPECT_EQ(launch_normed(-1, 4, q + 4, c), cudaErrorInvalidValue);
  EXPECT_EQ(launch_normed(1, 3, q + 4, c), cudaErrorInvalidValue) << "an odd head";
  EXPECT_EQ(launch_normed(1, 258, q + 4, c), cudaErrorInvalidValue) << "a head longer than the block";
  EXPECT_EQ(launch_normed(1, 4, nullptr, c), cudaErrorInvalidValue);
  EXPECT_EQ(launch_normed(1, 4, q + 4, nullptr), cudaErrorInvalidValue);
  Sync();
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

// LaunchAttentionDecodeAt as a captured CUDA graph replays it: one set of launch arguments (the same pointers,
// max_past and workspace) run again and again while only the device int *past changes; each run is bitwise
// LaunchAttentionDecode's with that past and the workspace it asks for. The pasts lie on both sides of the split
// thresholds (context 32 / 33: one split or two; 1024 / 1025 with 64 (token, head) pairs: the splits drop from 32
// to 17 as keys_per_split doubles) and reach max_past, and the caches hold exactly max_past + n rows (the checked
// emulator reports any read beyond). The output is poisoned before each run, so every value comes from that run.
class AttentionDecodeAtTest : public AttentionKernelTest {
 protected:
  struct Shape {
    int64_t n;
    int64_t heads;
    int64_t kv_heads;
    int64_t head_dim;
    DType kv_dtype;
    bool misaligned = false;  // the scalar fallback
    // 0: the workspace AttentionDecodeAtWorkspaceFloats asks for; otherwise room for this many splits, given to
    // both launchers.
    int64_t workspace_splits = 0;
  };

  void Check(const Shape& c, std::mt19937& rng, const std::vector<int64_t>& pasts, int64_t max_past = 1100) {
    const int64_t rows = max_past + c.n;
    const std::vector<float> q = RandomFloats(static_cast<size_t>(c.n * c.heads * c.head_dim), rng, -2.0f, 2.0f);
    const std::vector<float> k = RandomFloats(static_cast<size_t>(rows * c.kv_heads * c.head_dim), rng, -2.0f, 2.0f);
    const std::vector<float> v = RandomFloats(static_cast<size_t>(rows * c.kv_heads * c.head_dim), rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    DeviceArray<float> dq(q);
    const DeviceKv dk(c.kv_dtype, k, c.misaligned);
    const DeviceKv dv(c.kv_dtype, v, c.misaligned);
    const size_t out_floats = q.size();
    DeviceArray<float> at_out(out_floats), want(out_floats);
    const size_t per_split = static_cast<size_t>(c.n * c.heads * (c.head_dim + 2));
    const size_t at_ws_floats = c.workspace_splits > 0
                                    ? per_split * static_cast<size_t>(c.workspace_splits)
                                    : kernels::AttentionDecodeAtWorkspaceFloats(c.n, max_past, c.heads, c.head_dim);
    DeviceArray<float> at_ws(std::max<size_t>(at_ws_floats, 1));
    DeviceArray<int32_t> dpast(1);
    const std::string shape = "n=" + std::to_string(c.n) + " heads=" + std::to_string(c.heads) +
                              " kv_heads=" + std::to_string(c.kv_heads) + " head_dim=" + std::to_string(c.head_dim) +
                              " kv " + std::string(DTypeName(c.kv_dtype)) + (c.misaligned ? " misaligned" : "") +
                              " workspace " + std::to_string(at_ws_floats);
    DeviceKv::WithPair(dk, dv, [&](auto* kp, auto* vp) {
      // The captured launch: nothing here depends on the past of a run.
      const auto launch_at = [&, kp, vp] {
        return kernels::LaunchAttentionDecodeAt(dq.get(), kp, vp, c.n, dpast.get(), max_past, c.heads, c.kv_heads,
                                                c.head_dim, scale, at_out.get(), at_ws.get(), at_ws_floats, stream_);
      };
      for (const int64_t past : pasts) {
        const std::string what = shape + " past=" + std::to_string(past);
        const size_t ws_floats = c.workspace_splits > 0
                                     ? at_ws_floats
                                     : kernels::AttentionDecodeWorkspaceFloats(c.n, past, c.heads, c.head_dim);
        DeviceArray<float> ws(std::max<size_t>(ws_floats, 1));
        const int32_t past32 = static_cast<int32_t>(past);
        ODMOE_ASSERT_CUDA(cudaMemcpyAsync(dpast.get(), &past32, sizeof(past32), cudaMemcpyHostToDevice, stream_));
        ODMOE_ASSERT_CUDA(cudaMemsetAsync(at_out.get(), 0xff, out_floats * sizeof(float), stream_));
        ODMOE_ASSERT_CUDA(launch_at());
        ODMOE_ASSERT_CUDA(kernels::LaunchAttentionDecode(dq.get(), kp, vp, c.n, past, c.heads, c.kv_heads, c.head_dim,
                                                         scale, want.get(), ws.get(), ws_floats, stream_));
        Sync();
        const std::vector<float> got_host = at_out.Download();
        const std::vector<float> want_host = want.Download();
        ASSERT_EQ(std::memcmp(got_host.data(), want_host.data(), out_floats * sizeof(float)), 0) << what;
      }
    });
  }
};

// Every past a context of max_past keys may have needs no more workspace than max_past's (and a run with a
// smaller one splits less, as LaunchAttentionDecode would).
TEST_F(AttentionDecodeAtTest, WorkspaceCoversEveryPast) {
  for (int64_t n : {1, 2, 3, 7}) {
    for (int64_t heads : {1, 4, 8, 28, 32, 64, 200, 4096}) {
      const size_t at = kernels::AttentionDecodeAtWorkspaceFloats(n, 5000, heads, 128);
      for (int64_t past = 0; past <= 5000; ++past) {
        ASSERT_LE(kernels::AttentionDecodeWorkspaceFloats(n, past, heads, 128), at)
            << "n=" << n << " heads=" << heads << " past=" << past;
      }
    }
  }
}

TEST_F(AttentionDecodeAtTest, MatchesDecodeBitwise) {
  std::mt19937 rng(7);
  const std::vector<int64_t> pasts = {0, 1, 31, 32, 33, 100, 1000, 1100};
  // GQA groups 1, 4 and 8, head_dim 64 and 128, 1 and 2 tokens: every one in bf16 (the models' cache dtype).
  for (const auto& [heads, kv_heads] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {8, 2}, {16, 2}}) {
    for (int64_t head_dim : {64, 128}) {
      for (int64_t n : {1, 2}) Check({n, heads, kv_heads, head_dim, DType::kBF16}, rng, pasts);
    }
  }
  Check({1, 8, 2, 128, DType::kF32}, rng, pasts);
  Check({2, 16, 2, 64, DType::kF16}, rng, pasts);
  // 64 (token, head) pairs: contexts of 1024 and 1025 keys split 32 and 17 ways (fewer splits for a longer past).
  Check({2, 32, 4, 64, DType::kBF16}, rng, {1023, 30, 31, 1022, 0}, /*max_past=*/1023);
  // The scalar fallback: an unaligned cache, a head_dim the 16-byte chunks do not divide.
  Check({1, 8, 2, 64, DType::kBF16, /*misaligned=*/true}, rng, pasts);
  Check({2, 4, 4, 128, DType::kF32, /*misaligned=*/true}, rng, pasts);
  Check({1, 6, 2, 36, DType::kF16}, rng, pasts);
  // A workspace for 3 splits only, the same for both launchers.
  Check({1, 8, 2, 128, DType::kBF16, false, 3}, rng, {1100, 33, 0, 500});
  Check({2, 4, 4, 64, DType::kF32, true, 3}, rng, {1100, 33, 0, 500});
}

// A *past outside [0, max_past] gives some output but reads no cache row past max_past + n (the checked emulator
// would report it) and writes nothing outside out and the workspace.
TEST_F(AttentionDecodeAtTest, PastOutOfRangeStaysInBounds) {
  std::mt19937 rng(8);
  for (const bool misaligned : {false, true}) {
    const int64_t n = 2, heads = 8, kv_heads = 2, head_dim = 64, max_past = 300;
    const int64_t rows = max_past + n;
    DeviceArray<float> dq(RandomFloats(static_cast<size_t>(n * heads * head_dim), rng));
    const std::vector<float> kv = RandomFloats(static_cast<size_t>(rows * kv_heads * head_dim), rng);
    const DeviceKv dk(DType::kBF16, kv, misaligned);
    const DeviceKv dv(DType::kBF16, kv, misaligned);
    DeviceArray<float> out(static_cast<size_t>(n * heads * head_dim));
    const size_t ws_floats = kernels::AttentionDecodeAtWorkspaceFloats(n, max_past, heads, head_dim);
    DeviceArray<float> ws(ws_floats);
    DeviceArray<int32_t> dpast(1);
    for (const int32_t past : {-1, -1000000, 301, 5000, 0x7fffffff, static_cast<int32_t>(0x80000000u)}) {
      ODMOE_ASSERT_CUDA(cudaMemcpyAsync(dpast.get(), &past, sizeof(past), cudaMemcpyHostToDevice, stream_));
      DeviceKv::WithPair(dk, dv, [&](auto* kp, auto* vp) {
        ODMOE_ASSERT_CUDA(kernels::LaunchAttentionDecodeAt(dq.get(), kp, vp, n, dpast.get(), max_past, heads, kv_heads,
                                                           head_dim, 0.125f, out.get(), ws.get(), ws_floats, stream_));
      });
      Sync();
    }
  }
}

// LaunchKvStore against LaunchConvert into the same rows (float rows: copied), in every cache dtype: aligned rows
// of a multiple of 4 (the vector path), an odd row size and unaligned rows or caches (the scalar path). K's rows
// go to the K cache and V's to the V cache; positions outside [0, capacity) write nothing, and no cache row but
// the targets changes (the caches start as byte patterns). The rows hold rounding ties, values past fp16's
// range, subnormals, infinities, NaN and -0.
class KvStoreTest : public GpuTest {
 protected:
  template <typename KV>
  void Check(int64_t kv_size, bool misaligned_rows, bool misaligned_cache, std::mt19937& rng) {
    const int64_t capacity = 7;
    const std::vector<int32_t> positions = {3, -1, 0, 7, 6, 1000, -2147483647 - 1, 2};
    const int64_t n = static_cast<int64_t>(positions.size());
    // K's rows, then V's: [2, n, kv_size].
    std::vector<float> rows = RandomFloats(static_cast<size_t>(2 * n * kv_size), rng, -3.0f, 3.0f);
    const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f800001u, 0x477fe000u, 0x47800000u,
                                 0x387fc000u, 0x00000001u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                                 0x33000001u, 0x7f7fffffu, 0x3f807fffu, 0x3a801000u};
    for (size_t i = 0; i < rows.size(); i += 3) std::memcpy(&rows[i], &specials[(i / 3) % 16], 4);
    const size_t row_pad = misaligned_rows ? 1 : 0;
    const size_t cache_pad = misaligned_cache ? 1 : 0;
    DeviceArray<float> drows(rows.size(), row_pad);
    drows.Upload(rows, row_pad);
    DeviceArray<int32_t> dpos(positions);
    // Both caches in one allocation, V's after K's (with the pad before each), each starting with its own byte.
    const size_t cache_elems = static_cast<size_t>(capacity * kv_size) + cache_pad;
    DeviceArray<KV> caches(2 * cache_elems);
    DeviceArray<KV> want(2 * cache_elems);
    for (DeviceArray<KV>* c : {&caches, &want}) {
      ODMOE_ASSERT_CUDA(cudaMemset(c->get(), 0x5a, cache_elems * sizeof(KV)));
      ODMOE_ASSERT_CUDA(cudaMemset(c->get() + cache_elems, 0xa5, cache_elems * sizeof(KV)));
    }
    // The expected caches: the patterns, and each in-range row as LaunchConvert writes it.
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t i = 0; i < n; ++i) {
        if (positions[i] < 0 || positions[i] >= capacity) continue;
        KV* dst = want.get() + kv * cache_elems + cache_pad + positions[i] * kv_size;
        const float* src = drows.get() + row_pad + (kv * n + i) * kv_size;
        if constexpr (std::is_same_v<KV, float>) {
          ODMOE_ASSERT_CUDA(cudaMemcpy(dst, src, kv_size * sizeof(float), cudaMemcpyDeviceToDevice));
        } else {
          ODMOE_ASSERT_CUDA(kernels::LaunchConvert(src, kv_size, dst, stream_));
        }
      }
    }
    const float* k_rows = drows.get() + row_pad;
    ODMOE_ASSERT_CUDA(kernels::LaunchKvStore(k_rows, k_rows + n * kv_size, dpos.get(), n, kv_size,
                                             caches.get() + cache_pad, caches.get() + cache_elems + cache_pad, capacity,
                                             stream_));
    Sync();
    const std::vector<KV> got_host = caches.Download();
    const std::vector<KV> want_host = want.Download();
    EXPECT_EQ(std::memcmp(got_host.data(), want_host.data(), got_host.size() * sizeof(KV)), 0)
        << "kv_size=" << kv_size << " sizeof(KV)=" << sizeof(KV) << (misaligned_rows ? " misaligned rows" : "")
        << (misaligned_cache ? " misaligned cache" : "");
  }

  template <typename KV>
  void CheckAll(std::mt19937& rng) {
    Check<KV>(256, false, false, rng);
    Check<KV>(1028, false, false, rng);  // more than one block per row
    Check<KV>(6, false, false, rng);
    Check<KV>(64, true, false, rng);
    Check<KV>(64, false, true, rng);
    Check<KV>(301, true, true, rng);
  }
};

TEST_F(KvStoreTest, MatchesConvert) {
  std::mt19937 rng(9);
  CheckAll<float>(rng);
  CheckAll<__half>(rng);
  CheckAll<__nv_bfloat16>(rng);
}

TEST_F(KvStoreTest, EmptyAndBadArguments) {
  DeviceArray<float> buf(16);
  DeviceArray<float> cache(16);
  DeviceArray<int32_t> pos(1);
  const float* rows = buf.get();
  EXPECT_EQ(kernels::LaunchKvStore(rows, rows, pos.get(), 0, 4, cache.get(), cache.get() + 4, 1, stream_), cudaSuccess);
  EXPECT_EQ(kernels::LaunchKvStore(rows, rows, pos.get(), 1, 0, cache.get(), cache.get() + 4, 1, stream_), cudaSuccess);
  EXPECT_EQ(kernels::LaunchKvStore(rows, rows, pos.get(), -1, 4, cache.get(), cache.get() + 4, 1, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchKvStore(rows, rows, static_cast<const int32_t*>(nullptr), 1, 4, cache.get(), cache.get() + 4,
                                   1, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchKvStore(rows, static_cast<const float*>(nullptr), pos.get(), 1, 4, cache.get(),
                                   cache.get() + 4, 1, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchKvStore(rows, rows, pos.get(), 1, 4, cache.get(), static_cast<float*>(nullptr), 1, stream_),
            cudaErrorInvalidValue);
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
  EXPECT_EQ(kernels::LaunchAttentionDecodeAt(buf.get(), buf.get(), buf.get(), 1, nullptr, 10, 2, 2, 64, 1.0f, buf.get(),
                                             nullptr, 0, stream_),
            cudaErrorInvalidValue);  // no past
}

}  // namespace
}  // namespace odmoe
