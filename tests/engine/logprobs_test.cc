// Token log-probabilities (src/engine/logprobs.h): log_softmax of a row of logits, its top alternatives, and the
// edge cases JSON cannot carry.
#include "src/engine/logprobs.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace odmoe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(LogprobsTest, EqualLogitsShareTheMassEvenly) {
  const std::vector<float> logits(8, 3.25f);
  const PositionLogprobs lp = LogprobsOf(logits, 5, 3);
  EXPECT_EQ(lp.token.id, 5);
  EXPECT_FLOAT_EQ(lp.token.logprob, static_cast<float>(-std::log(8.0)));
  ASSERT_EQ(lp.top.size(), 3u);  // ties go to the lowest ids
  EXPECT_EQ(lp.top[0].id, 0);
  EXPECT_EQ(lp.top[1].id, 1);
  EXPECT_EQ(lp.top[2].id, 2);
}

TEST(LogprobsTest, MatchesLogSoftmaxAndOrdersTheAlternatives) {
  const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 2.0f, 7.0f, -30.0f};
  double sum = 0;
  for (const float l : logits) sum += std::exp(static_cast<double>(l));
  const PositionLogprobs lp = LogprobsOf(logits, 1, 4);
  EXPECT_NEAR(lp.token.logprob, -1.0 - std::log(sum), 1e-6);
  ASSERT_EQ(lp.top.size(), 4u);
  const int32_t order[4] = {4, 2, 3, 0};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(lp.top[i].id, order[i]);
    EXPECT_NEAR(lp.top[i].logprob, logits[static_cast<size_t>(order[i])] - std::log(sum), 1e-6);
  }
  // The probabilities of the whole row sum to 1.
  const PositionLogprobs all = LogprobsOf(logits, 0, 100);
  ASSERT_EQ(all.top.size(), logits.size());  // min(top_n, vocab)
  double total = 0;
  for (const TokenLogprob& t : all.top) total += std::exp(static_cast<double>(t.logprob));
  EXPECT_NEAR(total, 1.0, 1e-6);
}

TEST(LogprobsTest, LargeLogitsDoNotOverflow) {
  const std::vector<float> logits = {1e30f, 1e30f, 0.0f};
  const PositionLogprobs lp = LogprobsOf(logits, 0, 0);
  EXPECT_FLOAT_EQ(lp.token.logprob, static_cast<float>(-std::log(2.0)));
  EXPECT_TRUE(lp.top.empty());
  EXPECT_EQ(LogprobsOf(logits, 2, 0).token.logprob, kLogprobFloor);  // far below the floor
}

TEST(LogprobsTest, ImpossibleTokensGetTheFloorAndNanCountsAsMinusInfinity) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {-kInf, nan, 1.0f, 1.0f};
  EXPECT_EQ(LogprobsOf(logits, 0, 0).token.logprob, kLogprobFloor);
  EXPECT_EQ(LogprobsOf(logits, 1, 0).token.logprob, kLogprobFloor);
  const PositionLogprobs lp = LogprobsOf(logits, 2, 4);
  EXPECT_FLOAT_EQ(lp.token.logprob, static_cast<float>(-std::log(2.0)));
  ASSERT_EQ(lp.top.size(), 4u);
  EXPECT_EQ(lp.top[0].id, 2);
  EXPECT_EQ(lp.top[1].id, 3);
  EXPECT_EQ(lp.top[2].id, 0);  // -inf and NaN tie at the bottom: the lower id first
  EXPECT_EQ(lp.top[3].id, 1);
  EXPECT_EQ(lp.top[3].logprob, kLogprobFloor);
}

TEST(LogprobsTest, ARowWithoutAFiniteMaximumGivesCertaintyOrTheFloor) {
  const std::vector<float> all_minus = {-kInf, -kInf};
  EXPECT_EQ(LogprobsOf(all_minus, 1, 0).token.logprob, kLogprobFloor);
  const std::vector<float> with_inf = {0.0f, kInf, 3.0f};
  EXPECT_EQ(LogprobsOf(with_inf, 1, 1).token.logprob, 0.0f);
  EXPECT_EQ(LogprobsOf(with_inf, 1, 1).top[0].id, 1);
  EXPECT_EQ(LogprobsOf(with_inf, 2, 0).token.logprob, kLogprobFloor);
}

}  // namespace
}  // namespace odmoe
