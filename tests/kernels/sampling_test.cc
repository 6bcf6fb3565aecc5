// The token-selection kernels against the CPU reference (cpu::ArgMax, cpu::SelectTokens): the rule of
// kernels/sampling_rule.h makes every sum an integer, so the ids must be equal, every draw compared (none skipped
// near a boundary) — over random logits, uniforms and per-row options (min-p among them), exact ties, top-p targets
// met exactly, and rows that mix greedy and sampling in one launch. Skipped without a GPU (and run under the CUDA
// emulation).
#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/cpu_kernels.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::DeviceArray;
using gpu_test::GpuTest;

class SamplingKernelTest : public GpuTest {
 protected:
  // The kernel's ids for `choices` (one per row of `logits`).
  std::vector<int32_t> Select(const std::vector<float>& logits, int64_t vocab,
                              const std::vector<TokenChoice>& choices) {
    DeviceArray<float> dl(logits);
    DeviceArray<TokenChoice> dc(choices);
    DeviceArray<int32_t> ids(choices.size());
    const int64_t rows = static_cast<int64_t>(choices.size());
    EXPECT_EQ(kernels::LaunchSelectTokens(dl.get(), rows, vocab, dc.get(), ids.get(), stream_), cudaSuccess);
    Sync();
    return ids.Download();
  }
  static std::vector<int32_t> Reference(const std::vector<float>& logits, int64_t vocab,
                                        const std::vector<TokenChoice>& choices) {
    std::vector<int32_t> ids(choices.size());
    cpu::SelectTokens(logits.data(), static_cast<int64_t>(choices.size()), vocab, choices.data(), ids.data());
    return ids;
  }
};

std::string Describe(const TokenChoice& c) {
  return "T=" + std::to_string(c.temperature) + " top_k=" + std::to_string(c.top_k) +
         " top_p=" + std::to_string(c.top_p) + " min_p=" + std::to_string(c.min_p) + " u=" + std::to_string(c.uniform);
}

TEST_F(SamplingKernelTest, ArgmaxTiesGoToTheLowestIdAndNanNeverWins) {
  const int64_t vocab = 5000;
  std::vector<float> logits(static_cast<size_t>(5 * vocab), -1.0f);
  logits[17] = 3.0f;
  logits[4999] = 3.0f;  // row 0: tie between 17 and 4999
  // row 1: all equal -> 0
  logits[static_cast<size_t>(2 * vocab + 4321)] = 0.5f;  // row 2: a single maximum
  // row 3: NaN first in every thread's stride and at the top; the maximum is 2.0 at 1500
  for (int64_t i = 0; i < 1024; ++i) logits[static_cast<size_t>(3 * vocab + i)] = NAN;
  logits[static_cast<size_t>(3 * vocab + 1500)] = 2.0f;
  // row 4: every value NaN -> 0
  std::fill(logits.begin() + 4 * vocab, logits.end(), NAN);
  DeviceArray<float> dl(logits);
  DeviceArray<int32_t> ids(5);
  ODMOE_ASSERT_CUDA(kernels::LaunchArgmax(dl.get(), 5, vocab, ids.get(), stream_));
  Sync();
  EXPECT_EQ(ids.Download(), (std::vector<int32_t>{17, 0, 4321, 1500, 0}));
  for (int r = 0; r < 5; ++r) EXPECT_EQ(cpu::ArgMax(logits.data() + r * vocab, vocab), ids.Download()[r]) << r;
  // The same rows picked greedily by LaunchSelectTokens.
  EXPECT_EQ(Select(logits, vocab, std::vector<TokenChoice>(5)), ids.Download());
}

// Every draw of random rows, options and uniforms: the kernel's id is the CPU reference's.
TEST_F(SamplingKernelTest, SelectTokensMatchesTheCpuReferenceExactly) {
  std::mt19937 rng(30);
  int compared = 0, sampled = 0;
  for (int64_t vocab : {1, 7, 1000, 4096, 32000, 151936}) {
    const int64_t rows = 16;
    const int rounds = vocab > 10000 ? 2 : 10;
    for (int round = 0; round < rounds; ++round) {
      std::normal_distribution<float> dist(0.0f, round % 2 == 0 ? 3.0f : 0.5f);
      std::vector<float> logits(static_cast<size_t>(rows * vocab));
      for (float& v : logits) v = dist(rng);
      for (int64_t r = 0; r < rows; ++r) {
        float* l = logits.data() + r * vocab;
        if (vocab > 10) {
          l[3] = l[5];                                     // an exact tie somewhere
          l[vocab - 1] = *std::max_element(l, l + vocab);  // a tie at the top, far from the first
        }
        if (r % 4 == 3) {  // coarse logits: many exact ties
          for (int64_t i = 0; i < vocab; ++i) l[i] = std::round(l[i] * 2.0f) / 2.0f;
        }
      }
      std::vector<TokenChoice> choices(static_cast<size_t>(rows));
      const float temperatures[] = {0.0f, 0.3f, 0.7f, 1.0f, 2.0f};
      const int32_t top_ks[] = {0, 1, 2, 5, 50, 2000};
      const float top_ps[] = {1.0f, 0.999f, 0.95f, 0.5f, 0.1f, 1e-6f};
      const float min_ps[] = {0.0f, 0.0f, 1e-6f, 0.05f, 0.3f, 1.0f};
      std::uniform_real_distribution<float> uni(0.0f, 1.0f);
      for (TokenChoice& c : choices) {
        c.temperature = temperatures[rng() % 5];
        c.top_k = top_ks[rng() % 6];
        c.top_p = top_ps[rng() % 6];
        c.min_p = min_ps[rng() % 6];
        c.uniform = rng() % 8 == 0 ? (rng() % 2 == 0 ? 0.0f : 0x1.fffffep-1f) : uni(rng);
        sampled += kernels::IsGreedy(c) ? 0 : 1;
      }
      const std::vector<int32_t> got = Select(logits, vocab, choices);
      const std::vector<int32_t> want = Reference(logits, vocab, choices);
      for (size_t r = 0; r < choices.size(); ++r) {
        ++compared;
        EXPECT_EQ(got[r], want[r]) << "vocab=" << vocab << " round " << round << " row " << r << " "
                                   << Describe(choices[r]);
      }
    }
  }
  EXPECT_EQ(compared, (4 * 10 + 2 * 2) * 16);
  EXPECT_GT(sampled, 400) << "rows that sample, not greedy";
}

// Edges of the rule, with the ids it defines.
TEST_F(SamplingKernelTest, TopPAndTopKEdgesPickWhatTheRuleSays) {
  struct Case {
    std::vector<float> logits;
    TokenChoice choice;
    int32_t want;
  };
  const std::vector<float> ten(10, 1.0f);
  const std::vector<float> pair = {1.0f, 1.0f};
  const std::vector<float> four = {1.0f, 1.0f, 0.0f, -1.0f};
  const std::vector<Case> cases = {
      // Ten equal logits and top_k 4: the kept set is ids 0..3 (ties to the lower id); u = 0 picks 0, u -> 1 picks 3.
      {ten, {1.0f, 4, 1.0f, 0.0f}, 0},
      {ten, {1.0f, 4, 1.0f, 0.9999f}, 3},
      {ten, {1.0f, 4, 1.0f, 0.3f}, 1},
      {ten, {1.0f, 4, 1.0f, 0.25f}, 1},  // need = M / 4 exactly: the first running mass above it is id 1's
      // Two equal best logits and top_p 0.5: the first alone reaches half the mass exactly, so it alone is kept.
      {pair, {1.0f, 0, 0.5f, 0.9999f}, 0},
      // top_p just above 0.5 (one 2^-24 step): both are kept; u picks the second.
      {pair, {1.0f, 0, 0.5f + 0x1p-24f, 0.75f}, 1},
      // No cut: u near 1 walks to the last token in id order.
      {four, {1.0f, 0, 1.0f, 0x1.fffffep-1f}, 3},
      // top_k >= vocab cuts nothing; top_k 1, top_p 0 or temperature 0 are the argmax.
      {four, {1.0f, 4, 1.0f, 0x1.fffffep-1f}, 3},
      {four, {1.0f, 1, 1.0f, 0.9f}, 0},
      {four, {1.0f, 0, 0.0f, 0.9f}, 0},
      {four, {0.0f, 0, 1.0f, 0.9f}, 0},
      // top_p 0.75 of {1, 1, 0, -1} (masses 1, 1, 0.37, 0.14): the two best reach it; u near 1 picks the second.
      {four, {1.0f, 0, 0.75f, 0x1.fffffep-1f}, 1},
      // A NaN logit is never kept ahead of a number, and weighs nothing.
      {{NAN, 0.0f, NAN}, {1.0f, 0, 1.0f, 0.9f}, 1},
      {{NAN, 0.0f, NAN}, {1.0f, 2, 1.0f, 0.9f}, 1},
      // min_p of {1, 1, 0, -1}: 0.2 drops id 3 (0.14 of the best), 0.5 ids 2 and 3; 1 keeps the ties of the best.
      {four, {1.0f, 0, 1.0f, 0x1.fffffep-1f, 0.2f}, 2},
      {four, {1.0f, 0, 1.0f, 0x1.fffffep-1f, 0.5f}, 1},
      {four, {1.0f, 0, 1.0f, 0x1.fffffep-1f, 1.0f}, 1},
      {four, {1.0f, 0, 1.0f, 0.0f, 1.0f}, 0},
      // ... after the temperature: at 2 id 2 weighs 0.61 and id 3 0.37 of the best, so 0.5 keeps id 2.
      {four, {2.0f, 0, 1.0f, 0x1.fffffep-1f, 0.5f}, 2},
      // ... and after top-k: top_k 3 has dropped id 3 already.
      {four, {1.0f, 3, 1.0f, 0x1.fffffep-1f, 0.1f}, 2},
      // A row whose best logit is +inf weighs nothing: min_p cuts nothing and the last kept id is picked.
      {{INFINITY, 0.0f, 1.0f}, {1.0f, 0, 1.0f, 0.5f, 0.5f}, 2},
  };
  for (const Case& c : cases) {
    const int64_t vocab = static_cast<int64_t>(c.logits.size());
    const std::vector<TokenChoice> one = {c.choice};
    EXPECT_EQ(Select(c.logits, vocab, one)[0], c.want) << Describe(c.choice);
    EXPECT_EQ(Reference(c.logits, vocab, one)[0], c.want) << Describe(c.choice);
  }
}

// ChangeLogits: the kernel's logits are the CPU reference's bit for bit, over logits of every sign (zeros, NaN and
// infinities among them), penalties on both sides of 1 and deltas up to -inf; untouched logits stay as they were.
TEST_F(SamplingKernelTest, ChangeLogitsGivesTheCpuReferencesBits) {
  std::mt19937 rng(31);
  const int64_t rows = 3, vocab = 5000;
  std::normal_distribution<float> dist(0.0f, 4.0f);
  std::vector<float> logits(static_cast<size_t>(rows * vocab));
  for (float& v : logits) v = dist(rng);
  logits[1] = 0.0f;
  logits[2] = -0.0f;
  logits[3] = NAN;
  logits[4] = INFINITY;
  logits[5] = -INFINITY;
  const float penalties[] = {1.0f, 1.0f, 1.1f, 1.3f, 0.7f, 7.0f};
  const float deltas[] = {0.0f, 0.0f, -0.5f, 2.25f, -1.0f / 3.0f, -INFINITY};
  std::vector<LogitChange> changes;
  for (int32_t index = 1; index < rows * vocab; index += 1 + static_cast<int32_t>(rng() % 5)) {
    changes.push_back({.index = index, .penalty = penalties[rng() % 6], .delta = deltas[rng() % 6]});
  }
  std::vector<float> want = logits;
  cpu::ChangeLogits(want.data(), changes.data(), static_cast<int64_t>(changes.size()));
  DeviceArray<float> dl(logits);
  DeviceArray<LogitChange> dc(changes);
  ODMOE_ASSERT_CUDA(kernels::LaunchChangeLogits(dl.get(), dc.get(), static_cast<int64_t>(changes.size()), stream_));
  Sync();
  const std::vector<float> got = dl.Download();
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  // The rule by hand on a few: a positive logit divided, a negative one multiplied, then the delta added.
  EXPECT_EQ(kernels::ChangedLogit(3.0f, 1.5f, 0.25f), 2.25f);
  EXPECT_EQ(kernels::ChangedLogit(-3.0f, 1.5f, 0.25f), -4.25f);
  EXPECT_EQ(kernels::ChangedLogit(0.7f, 1.0f, 0.0f), 0.7f);
  EXPECT_EQ(kernels::ChangedLogit(2.0f, 1.0f, -INFINITY), -INFINITY);
  EXPECT_EQ(want[0], logits[0]) << "no change at index 0";
}

TEST_F(SamplingKernelTest, RefusesAVocabularyItsSumsCannotHold) {
  DeviceArray<int32_t> ids(1);
  EXPECT_EQ(kernels::LaunchSelectTokens(nullptr, 1, kernels::kSampleMaxVocab + 1, nullptr, ids.get(), stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchSelectTokens(nullptr, 0, 10, nullptr, ids.get(), stream_), cudaSuccess);
}

}  // namespace
}  // namespace odmoe
