// Hedged prefetch without a cluster: the margin on the shadow's router (hedge.h) and recall with hedges on main's
// prediction board (prediction.h).
#include "src/shadow_node/hedge.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "src/main_node/prediction.h"

namespace odmoe {
namespace {

// Logits whose softmax is `p` (p must sum to 1).
std::vector<float> LogitsOf(const std::vector<double>& p) {
  std::vector<float> out;
  for (double v : p) out.push_back(static_cast<float>(std::log(v)));
  return out;
}

TEST(HedgeTest, ProbabilitiesAreTheSoftmaxOverAllExperts) {
  const std::vector<double> p = RouterProbabilities(LogitsOf({0.5, 0.25, 0.125, 0.125}));
  ASSERT_EQ(p.size(), 4u);
  EXPECT_NEAR(p[0], 0.5, 1e-6);
  EXPECT_NEAR(p[3], 0.125, 1e-6);
  // Shifting every logit changes nothing.
  const std::vector<float> big = {1000.0f, 999.0f};
  const std::vector<double> q = RouterProbabilities(big);
  EXPECT_NEAR(q[0], 1 / (1 + std::exp(-1.0)), 1e-9);
}

TEST(HedgeTest, TheRunnerUpIsHedgedWhenWithinTheMargin) {
  // Top-2 {1, 3} (0.4, 0.27); the runner-up 0 has 0.26: p_k - p_(k+1) = 0.01 (softmax over all four experts,
  // not renormalised over the top-k).
  const std::vector<float> logits = LogitsOf({0.26, 0.4, 0.07, 0.27});
  const std::vector<int32_t> chosen = {1, 3};
  EXPECT_EQ(HedgeExperts(logits, chosen, 0.02), std::vector<int32_t>{0});
  EXPECT_EQ(HedgeExperts(logits, chosen, 0.0101), std::vector<int32_t>{0});
  EXPECT_TRUE(HedgeExperts(logits, chosen, 0.0099).empty());  // the difference must be below the margin
  EXPECT_TRUE(HedgeExperts(logits, chosen, 0.0).empty());     // 0 = off
  // Only the (k+1)-th: expert 2 (0.07) is never hedged, however large the margin.
  EXPECT_EQ(HedgeExperts(logits, chosen, 1.0), std::vector<int32_t>{0});
  // No expert beyond the top-k: nothing to hedge.
  const std::vector<int32_t> all = {1, 3, 0, 2};
  EXPECT_TRUE(HedgeExperts(logits, all, 1.0).empty());
}

TEST(HedgeTest, ATieWithTheKthIsHedgedOutsideTheChosenSet) {
  // Experts 0 and 2 tie for second place; the engine chose 2 (k = 2 with 1): 0 is the hedge, never 2 again.
  const std::vector<float> logits = LogitsOf({0.3, 0.4, 0.3});
  const std::vector<int32_t> chosen = {1, 2};
  EXPECT_EQ(HedgeExperts(logits, chosen, 0.001), std::vector<int32_t>{0});
}

TEST(PredictionBoardTest, RecallWithHedgesCountsTopKAndHedges) {
  PredictionBoard b;
  b.Reset(/*num_sparse=*/2, /*top_k=*/2);
  // (10, 0): top-k {1, 2}, hedge {3}; actual {1, 3}: 2 of 2 correct, one through the hedge.
  b.Put(10, 0, {1, 2}, {3});
  // (10, 1): top-k {4, 5}, hedge {6}; actual {4, 7}: 1 of 2.
  b.Put(10, 1, {4, 5}, {6});
  ASSERT_TRUE(b.Get(10, 0).has_value());
  EXPECT_EQ(*b.Get(10, 0), (std::vector<int32_t>{1, 2, 3}));  // what main resolves against
  b.Record(10, 0, {1, 3}, {true, false}, 0.0);
  b.Record(10, 1, {4, 7}, {true, false}, 1.5);
  b.SetHedgeLoads(2);
  const RecallSummary s = b.Summarize();
  EXPECT_EQ(s.correct, 3u);
  EXPECT_DOUBLE_EQ(s.recall, 3.0 / 4.0);
  EXPECT_EQ(s.timely, 2u);  // the hedge 3 was not resident yet
  EXPECT_DOUBLE_EQ(s.timely_recall, 2.0 / 4.0);
  EXPECT_EQ(s.hedges_used, 1u);
  EXPECT_EQ(s.hedge_loads, 2u);
  v1::RequestStats p;
  s.ToProto(&p);
  EXPECT_EQ(p.hedges_used(), 1u);
  EXPECT_EQ(p.hedge_loads(), 2u);
  // A later prediction of the same pair replaces hedges and all; Reset forgets the hedged loads.
  b.Put(10, 0, {1, 3});
  EXPECT_EQ(b.Summarize().hedges_used, 0u);
  b.Reset(2, 2);
  EXPECT_EQ(b.Summarize().hedge_loads, 0u);
}

}  // namespace
}  // namespace odmoe
