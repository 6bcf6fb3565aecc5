// Argmax and top-k / top-p sampling kernels against a double-precision reference of the definition in
// kernels/sampling.h (tokens compared exactly; draws whose threshold lies within 1e-4 of a boundary of the
// reference's CDF are not compared, since fp32 may legitimately fall on either side). Skipped without a GPU.
#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::DeviceArray;
using gpu_test::GpuTest;

int32_t Argmax(const float* l, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (l[i] > l[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

// The reference: returns the token, or -1 when u or top_p sits too close to a boundary to be decided in fp32.
int32_t ReferenceSample(const float* l, int64_t vocab, float temperature, int64_t top_k, float top_p, float u) {
  if (temperature <= 0.0f || top_k == 1 || top_p <= 0.0f) return Argmax(l, vocab);
  std::vector<double> z(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) z[static_cast<size_t>(i)] = static_cast<float>(l[i] / temperature);
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[a] > z[b]; });
  int64_t kept = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  const double zmax = z[static_cast<size_t>(order[0])];
  std::vector<double> e(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) e[static_cast<size_t>(i)] = std::exp(z[static_cast<size_t>(i)] - zmax);
  double zk = 0.0;
  for (int64_t j = 0; j < kept; ++j) zk += e[static_cast<size_t>(order[j])];
  if (top_p < 1.0f) {
    const double target = static_cast<double>(top_p) * zk;
    double cum = 0.0;
    int64_t j = 0;
    for (; j < kept; ++j) {
      cum += e[static_cast<size_t>(order[j])];
      if (std::fabs(cum - target) < 1e-4 * zk) return -1;
      if (cum >= target) break;
    }
    kept = std::min(kept, j + 1);
  }
  std::vector<bool> in(static_cast<size_t>(vocab), false);
  double zs = 0.0;
  for (int64_t j = 0; j < kept; ++j) {
    in[static_cast<size_t>(order[j])] = true;
    zs += e[static_cast<size_t>(order[j])];
  }
  const double need = static_cast<double>(u) * zs;
  double run = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!in[static_cast<size_t>(i)]) continue;
    run += e[static_cast<size_t>(i)];
    last = i;
    if (std::fabs(run - need) < 1e-4 * zs) return -1;
    if (run > need) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);
}

class SamplingKernelTest : public GpuTest {};

TEST_F(SamplingKernelTest, ArgmaxTiesGoToTheLowestId) {
  const int64_t vocab = 5000;
  std::vector<float> logits(static_cast<size_t>(3 * vocab), -1.0f);
  logits[17] = 3.0f;
  logits[4999] = 3.0f;  // row 0: tie between 17 and 4999
  // row 1: all equal -> 0
  logits[static_cast<size_t>(2 * vocab + 4321)] = 0.5f;  // row 2: a single maximum
  DeviceArray<float> dl(logits);
  DeviceArray<int32_t> ids(3);
  ODMOE_ASSERT_CUDA(kernels::LaunchArgmax(dl.get(), 3, vocab, ids.get(), stream_));
  Sync();
  EXPECT_EQ(ids.Download(), (std::vector<int32_t>{17, 0, 4321}));
}

TEST_F(SamplingKernelTest, MatchesReference) {
  std::mt19937 rng(30);
  int compared = 0;
  int skipped = 0;
  for (int64_t vocab : {1, 7, 1000, 32000, 151936}) {
    const int64_t rows = 4;
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> logits(static_cast<size_t>(rows * vocab));
    for (float& v : logits) v = dist(rng);
    if (vocab > 10) logits[3] = logits[5];  // an exact tie somewhere
    DeviceArray<float> dl(logits);
    for (float temperature : {0.0f, 0.7f, 1.0f, 2.0f}) {
      for (int64_t top_k : {0, 1, 5, 50, 2000}) {
        for (float top_p : {1.0f, 0.95f, 0.5f, 0.1f}) {
          std::uniform_real_distribution<float> uni(0.0f, 1.0f);
          std::vector<float> u(static_cast<size_t>(rows));
          for (float& v : u) v = uni(rng);
          DeviceArray<float> du(u);
          DeviceArray<int32_t> ids(static_cast<size_t>(rows));
          ODMOE_ASSERT_CUDA(
              kernels::LaunchSample(dl.get(), rows, vocab, temperature, top_k, top_p, du.get(), ids.get(), stream_));
          Sync();
          const std::vector<int32_t> got = ids.Download();
          for (int64_t r = 0; r < rows; ++r) {
            const int32_t want =
                ReferenceSample(logits.data() + r * vocab, vocab, temperature, top_k, top_p, u[static_cast<size_t>(r)]);
            if (want < 0) {
              ++skipped;
              continue;
            }
            ++compared;
            EXPECT_EQ(got[static_cast<size_t>(r)], want)
                << "vocab=" << vocab << " T=" << temperature << " top_k=" << top_k << " top_p=" << top_p
                << " u=" << u[static_cast<size_t>(r)] << " row " << r;
          }
        }
      }
    }
  }
  EXPECT_GT(compared, 1000) << skipped << " draws skipped near boundaries";
}

TEST_F(SamplingKernelTest, ExtremeUniformsPickTheEndsOfTheKeptSet) {
  // Ten equal logits and top_k 4: the kept set is ids 0..3 (ties to the lower id); u = 0 picks 0, u -> 1 picks 3.
  std::vector<float> logits(10, 1.0f);
  DeviceArray<float> dl(logits);
  for (const auto& [u, want] : std::vector<std::pair<float, int32_t>>{{0.0f, 0}, {0.9999f, 3}, {0.3f, 1}}) {
    DeviceArray<float> du(std::vector<float>{u});
    DeviceArray<int32_t> ids(1);
    ODMOE_ASSERT_CUDA(kernels::LaunchSample(dl.get(), 1, 10, 1.0f, 4, 1.0f, du.get(), ids.get(), stream_));
    Sync();
    EXPECT_EQ(ids.Download()[0], want) << "u=" << u;
  }
}

}  // namespace
}  // namespace odmoe
