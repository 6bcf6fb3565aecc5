// Goldens: the CPU engine against HF Transformers (fp32, ../shared/models/*/golden.json), with the thresholds
// of ../shared/README.md for fp32 compute:
//  - last_logits: max |ours - golden| / max |golden| <= 1e-3;
//  - greedy tokens: identical, up to (not including) the first step whose golden top-1 minus top-2 logit is
//    below 1e-3;
//  - routing: the expert set of every (position, sparse layer) whose golden margin exceeds 1e-4.
// Each check reports how many tokens / decisions it compared; comparing nothing is a failure.
#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <set>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/engine/generator.h"
#include "tests/engine/golden_support.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using testing::GoldenThresholds;

// The model of the parameter on the CPU engine, and its goldens (skipped without ../shared).
class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string dir = odmoe::testing::SharedModel(GetParam());
    if (!odmoe::testing::HaveSharedModel(GetParam())) GTEST_SKIP() << "needs " << dir << " (../shared is missing)";
    auto device = CreateDevice("cpu");
    ASSERT_TRUE(device.ok()) << device.status();
    auto model = LocalModel::Open(dir, std::move(device).value());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(model).value();
    auto golden = testing::LoadGolden(dir);
    ASSERT_TRUE(golden.ok()) << golden.status();
    golden_ = std::move(golden).value();
  }

  std::unique_ptr<LocalModel> model_;
  testing::Golden golden_;
};

TEST_P(GoldenTest, MatchesHfTransformers) {
  const std::string name = GetParam();
  const testing::GoldenCounts counts =
      testing::CheckGolden(*model_, golden_, GoldenThresholds::Fp32(), /*label=*/name + " cpu");
  std::cout << "[golden] " << name << " cpu: " << counts.cases << " cases, " << counts.logits << " logits, "
            << counts.tokens << " greedy tokens, " << counts.routing << " routing decisions compared ("
            << counts.routing_skipped << " below the margin skipped); max logit error ratio "
            << counts.max_logit_ratio << "\n";
  RecordProperty("tokens_compared", static_cast<int>(counts.tokens));
  RecordProperty("routing_compared", static_cast<int>(counts.routing));
  EXPECT_GT(counts.tokens, 0) << "compared no greedy token";
  EXPECT_GT(counts.routing, 0) << "compared no routing decision";
  EXPECT_GT(counts.logits, 0) << "compared no logits";
}

// The logprobs of the first generated token against log_softmax of HF's logits (in double here): each reported
// value within twice the logit tolerance, and the reported alternatives the likeliest by HF's logits (up to that
// tolerance).
TEST_P(GoldenTest, LogprobsAreTheLogSoftmaxOfHfsLogits) {
  int compared = 0;
  for (size_t ci = 0; ci < golden_.cases.size(); ++ci) {
    const testing::GoldenCase& gc = golden_.cases[ci];
    SCOPED_TRACE("case " + std::to_string(ci));
    double max = -INFINITY, max_abs = 0;
    for (const float l : gc.last_logits) {
      max = std::max(max, static_cast<double>(l));
      max_abs = std::max(max_abs, std::fabs(static_cast<double>(l)));
    }
    double sum = 0;
    for (const float l : gc.last_logits) sum += std::exp(l - max);
    auto hf = [&](int32_t id) { return gc.last_logits[static_cast<size_t>(id)] - max - std::log(sum); };
    const double tol = 2 * GoldenThresholds::Fp32().logit_ratio * max_abs;

    GenerateOptions options;
    options.max_new_tokens = 1;
    options.logprobs = 5;
    auto r = Generate(model_->engine(), gc.prompt_ids, options);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->logprobs.size(), 1u);
    const PositionLogprobs& lp = r->logprobs[0];
    EXPECT_NEAR(lp.token.logprob, hf(lp.token.id), tol);
    ASSERT_EQ(lp.top.size(), 5u);
    EXPECT_EQ(lp.top[0].id, lp.token.id) << "greedy picks the likeliest";
    std::vector<double> sorted;
    for (size_t i = 0; i < gc.last_logits.size(); ++i) sorted.push_back(hf(static_cast<int32_t>(i)));
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    for (const TokenLogprob& t : lp.top) {
      EXPECT_NEAR(t.logprob, hf(t.id), tol) << "token " << t.id;
      EXPECT_GE(hf(t.id), sorted[4] - 2 * tol) << "token " << t.id << " is not among HF's five likeliest";
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
}

INSTANTIATE_TEST_SUITE_P(SharedModels, GoldenTest, ::testing::ValuesIn(testing::GoldenModels()),
                         testing::GoldenParamName);

// Every model folder in ../shared/models is covered by the golden tests (here and golden_cuda_test.cc): a new one
// must be added to GoldenModels().
TEST(GoldenCoverage, EverySharedModelIsTested) {
  const std::set<std::string> tested(testing::GoldenModels().begin(), testing::GoldenModels().end());
  const auto names = odmoe::testing::SharedModelNames();
  if (names.empty()) GTEST_SKIP() << "needs " << odmoe::testing::SharedDir() << "/models";
  for (const std::string& n : names) EXPECT_TRUE(tested.count(n)) << n << " has no golden test";
}

}  // namespace
}  // namespace odmoe
