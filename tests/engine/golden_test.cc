// Goldens: the CPU engine against HF Transformers (fp32, ../shared/models/*/golden.json), with the thresholds
// of ../shared/README.md for fp32 compute:
//  - last_logits: max |ours - golden| / max |golden| <= 1e-3;
//  - greedy tokens: identical, up to (not including) the first step whose golden top-1 minus top-2 logit is
//    below 1e-3;
//  - routing: the expert set of every (position, sparse layer) whose golden margin exceeds 1e-4.
// Each check reports how many tokens / decisions it compared; comparing nothing is a failure.
#include <cmath>
#include <iostream>
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

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, MatchesHfTransformers) {
  const std::string name = GetParam();
  const std::string dir = odmoe::testing::SharedModel(name);
  if (!odmoe::testing::HaveSharedModel(name)) GTEST_SKIP() << "needs " << dir << " (../shared is missing)";
  auto device = CreateDevice("cpu");
  ASSERT_TRUE(device.ok()) << device.status();
  auto model = LocalModel::Open(dir, std::move(device).value());
  ASSERT_TRUE(model.ok()) << model.status();
  auto golden = testing::LoadGolden(dir);
  ASSERT_TRUE(golden.ok()) << golden.status();
  const testing::GoldenCounts counts =
      testing::CheckGolden(**model, *golden, GoldenThresholds::Fp32(), /*label=*/name + " cpu");
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
