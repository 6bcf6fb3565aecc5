#include "src/engine/sampler.h"

#include <cmath>
#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace odmoe {
namespace {

TEST(ArgMaxTest, LowestIndexWinsTies) {
  std::vector<float> l = {1.0f, 3.0f, 3.0f, -2.0f};
  EXPECT_EQ(ArgMax(l), 1);
  l = {NAN, 0.5f, 0.25f};
  EXPECT_EQ(ArgMax(l), 1);
}

TEST(SamplerTest, GreedyWithoutTemperature) {
  Sampler s(SamplingOptions{});
  std::vector<float> l = {0.1f, 0.2f, 5.0f, 0.3f};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s.Next(l), 2);
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDiffers) {
  std::vector<float> l(50);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(static_cast<float>(i)) * 2.0f;
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 42;
  Sampler a(o), b(o);
  std::vector<int32_t> ta, tb, tc;
  for (int i = 0; i < 100; ++i) {
    ta.push_back(a.Next(l));
    tb.push_back(b.Next(l));
  }
  o.seed = 43;
  Sampler c(o);
  for (int i = 0; i < 100; ++i) tc.push_back(c.Next(l));
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
}

TEST(SamplerTest, TopKOneAndTinyTopPAreGreedy) {
  std::vector<float> l = {0.5f, 1.5f, 1.4f, -1.0f, 1.49f};
  SamplingOptions o;
  o.temperature = 2.0;
  o.top_k = 1;
  Sampler s(o);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(s.Next(l), 1);
  o.top_k = 0;
  o.top_p = 1e-6;
  Sampler p(o);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(p.Next(l), 1);
}

TEST(SamplerTest, TopKRestrictsToTheBestK) {
  std::vector<float> l = {3.0f, 2.9f, 2.8f, 0.0f, 0.0f, 0.0f};
  SamplingOptions o;
  o.temperature = 5.0;
  o.top_k = 2;
  o.seed = 7;
  Sampler s(o);
  std::map<int32_t, int> seen;
  for (int i = 0; i < 400; ++i) ++seen[s.Next(l)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[0], 100);
  EXPECT_GT(seen[1], 100);
}

TEST(SamplerTest, FrequenciesFollowTheSoftmax) {
  // p = softmax([0, ln 3]) = [0.25, 0.75].
  std::vector<float> l = {0.0f, std::log(3.0f)};
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 1;
  Sampler s(o);
  int ones = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ones += s.Next(l) == 1;
  EXPECT_NEAR(static_cast<double>(ones) / n, 0.75, 0.02);
}

TEST(SamplingOptionsTest, RejectsBadValuesNamingTheFlag) {
  SamplingOptions o;
  o.temperature = -1;
  EXPECT_NE(o.Validate().message().find("sampling.temperature"), absl::string_view::npos);
  o = {};
  o.top_p = 0;
  EXPECT_NE(o.Validate().message().find("sampling.top_p"), absl::string_view::npos);
  o = {};
  o.top_k = -3;
  EXPECT_NE(o.Validate().message().find("sampling.top_k"), absl::string_view::npos);
  EXPECT_TRUE(SamplingOptions{}.Validate().ok());
}

}  // namespace
}  // namespace odmoe
