#include "src/engine/sampler.h"

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string_view>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/cpu_kernels.h"
#include "src/common/status.h"
#include "src/engine/generator.h"

namespace odmoe {
namespace {

TEST(ArgMaxTest, LowestIndexWinsTies) {
  std::vector<float> l = {1.0f, 3.0f, 3.0f, -2.0f};
  EXPECT_EQ(ArgMax(l), 1);
  l = {NAN, 0.5f, 0.25f};
  EXPECT_EQ(ArgMax(l), 1);
  l = {0.5f, NAN, 7.0f, NAN};
  EXPECT_EQ(ArgMax(l), 2);
  l = {NAN, NAN};
  EXPECT_EQ(ArgMax(l), 0);
  l = {-INFINITY, -INFINITY};
  EXPECT_EQ(ArgMax(l), 0);
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

TEST(SamplerTest, TopPKeepsTheNucleusOnly) {
  // p = [0.5, 0.3, 0.15, 0.05]: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.8), renormalised to 5/8 and 3/8.
  std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingOptions o;
  o.temperature = 1.0;
  o.top_p = 0.7;
  o.seed = 3;
  Sampler s(o);
  std::map<int32_t, int> seen;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++seen[s.Next(l)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_NEAR(static_cast<double>(seen[0]) / n, 0.625, 0.02);
}

TEST(SamplerTest, MinPKeepsTheTokensNearTheBest) {
  // p = [0.5, 0.3, 0.15, 0.05]: min_p 0.2 keeps what is at least 0.1 likely, the first three, renormalised to
  // 10/19, 6/19 and 3/19; with top_p 0.7 first (HF's order) only the first two are left, 5/8 and 3/8.
  std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingOptions o;
  o.temperature = 1.0;
  o.min_p = 0.2;
  o.seed = 5;
  for (const double top_p : {1.0, 0.7}) {
    o.top_p = top_p;
    Sampler s(o);
    std::map<int32_t, int> seen;
    const int n = 20000;
    for (int i = 0; i < n; ++i) ++seen[s.Next(l)];
    EXPECT_EQ(seen.size(), top_p == 1.0 ? 3u : 2u) << top_p;
    EXPECT_NEAR(static_cast<double>(seen[0]) / n, top_p == 1.0 ? 10.0 / 19 : 0.625, 0.02) << top_p;
  }
}

// The choice a sampler hands to Device::SelectTokens: its options in fp32 and, when it samples, one draw per token
// from the seeded stream (a multiple of 2^-24 in [0, 1)); greedy draws nothing.
TEST(SamplerTest, NextChoiceCarriesTheOptionsAndOneDrawPerToken) {
  SamplingOptions o;
  o.temperature = 0.9;
  o.top_k = 40;
  o.top_p = 0.95;
  o.min_p = 0.05;
  o.seed = 11;
  Sampler a(o), b(o);
  for (int i = 0; i < 1000; ++i) {
    const TokenChoice c = a.NextChoice();
    EXPECT_EQ(c.temperature, 0.9f);
    EXPECT_EQ(c.top_k, 40);
    EXPECT_EQ(c.top_p, 0.95f);
    EXPECT_EQ(c.min_p, 0.05f);
    EXPECT_GE(c.uniform, 0.0f);
    EXPECT_LT(c.uniform, 1.0f);
    EXPECT_EQ(c.uniform * 0x1p24f, std::floor(c.uniform * 0x1p24f));
    EXPECT_EQ(b.NextChoice().uniform, c.uniform) << "the same seed, the same draws";
  }
  Sampler greedy(SamplingOptions{});
  const TokenChoice g = greedy.NextChoice();
  EXPECT_TRUE(kernels::IsGreedy(g));
  EXPECT_EQ(g.uniform, 0.0f);
  // Beyond fp32 / int32: a temperature that rounds to 0 is greedy, a top_k past int32 cuts nothing.
  SamplingOptions tiny;
  tiny.temperature = 1e-60;
  tiny.top_k = int64_t{1} << 40;
  EXPECT_TRUE(kernels::IsGreedy(ToTokenChoice(tiny, 0.5f)));
  EXPECT_EQ(ToTokenChoice(tiny, 0.5f).top_k, 0);
}

// Sampler::Next is the device op's rule on the host: cpu::SelectTokens with the choice a same-seeded sampler makes.
TEST(SamplerTest, NextIsSelectTokensWithTheNextChoice) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> l(300);
  for (float& v : l) v = dist(rng);
  SamplingOptions o;
  o.temperature = 0.8;
  o.top_k = 30;
  o.top_p = 0.9;
  o.seed = 9;
  Sampler a(o), b(o);
  for (int i = 0; i < 200; ++i) {
    const TokenChoice c = b.NextChoice();
    int32_t id = -1;
    cpu::SelectTokens(l.data(), 1, static_cast<int64_t>(l.size()), &c, &id);
    EXPECT_EQ(a.Next(l), id);
  }
}

// The fixed-point arithmetic of kernels/sampling_rule.h: the mass is exp to within fp32 rounding (and the fixed
// point's resolution), 2^39 at 0, 0 below exp(-32) and for NaN; the fractions are exact.
TEST(SamplingRuleTest, MassAndFractionsAreExactIntegers) {
  using kernels::Fraction24;
  using kernels::MulFraction;
  using kernels::SampleMass;
  EXPECT_EQ(SampleMass(0.0f), kernels::kSampleMassOne);
  EXPECT_EQ(SampleMass(-0.0f), kernels::kSampleMassOne);
  EXPECT_EQ(SampleMass(-32.5f), 0u);
  EXPECT_EQ(SampleMass(NAN), 0u);
  EXPECT_EQ(SampleMass(-INFINITY), 0u);
  for (float x = -20.0f; x <= 0.0f; x += 0.01953125f) {
    const double want = std::exp(static_cast<double>(x)) * 0x1p39;
    EXPECT_NEAR(static_cast<double>(SampleMass(x)), want, want * 4e-7 + 1.0) << x;
  }
  EXPECT_EQ(Fraction24(0.5f), 1u << 23);
  EXPECT_EQ(Fraction24(0.0f), 0u);
  EXPECT_EQ(Fraction24(-1.0f), 0u);
  EXPECT_EQ(Fraction24(1.0f), (1u << 24) - 1);
  EXPECT_EQ(Fraction24(0x1.fffffep-1f), (1u << 24) - 1);
  const uint64_t most = uint64_t{1} << 63;  // 2^24 tokens of mass 2^39
  EXPECT_EQ(MulFraction(most, (1u << 24) - 1), most - (uint64_t{1} << 39));
  EXPECT_EQ(MulFraction(most, 1u << 23), most / 2);
  EXPECT_EQ(MulFraction((uint64_t{1} << 24) + 3, 1u << 23), (uint64_t{1} << 23) + 1);
}

// Each refusal names its field in the message and as the payload the HTTP API reads (FieldOf).
TEST(SamplingOptionsTest, RejectsBadValuesNamingTheField) {
  // The message of o's refusal, which names `field` as its field too.
  auto refused = [](const SamplingOptions& o, std::string_view field) {
    const absl::Status s = o.Validate(100);
    EXPECT_EQ(FieldOf(s), field) << s;
    EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
    return std::string(s.message());
  };
  SamplingOptions o;
  o.temperature = -1;
  refused(o, "sampling.temperature");
  o = {};
  o.top_p = 0;
  refused(o, "sampling.top_p");
  o = {};
  o.top_k = -3;
  refused(o, "sampling.top_k");
  o = {};
  o.min_p = 1.5;
  EXPECT_EQ(refused(o, "sampling.min_p"), "sampling.min_p must be in [0, 1], got 1.5");
  o = {};
  o.repetition_penalty = 0;
  EXPECT_EQ(refused(o, "sampling.repetition_penalty"), "sampling.repetition_penalty must be in (0, 100], got 0");
  o.repetition_penalty = 101;
  refused(o, "sampling.repetition_penalty");
  o = {};
  o.presence_penalty = 2.5;
  EXPECT_EQ(refused(o, "sampling.presence_penalty"), "sampling.presence_penalty must be in [-2, 2], got 2.5");
  o = {};
  o.frequency_penalty = -3;
  refused(o, "sampling.frequency_penalty");
  o = {};
  o.logit_bias = {{100, 1.0}};
  EXPECT_EQ(refused(o, "sampling.logit_bias"), "sampling.logit_bias token id 100 is outside the vocabulary [0, 100)");
  EXPECT_EQ(o.Validate(100).code(), absl::StatusCode::kOutOfRange);
  o.logit_bias = {{5, 101.0}};
  EXPECT_NE(refused(o, "sampling.logit_bias").find("[-100, 100], got 101"), std::string::npos);
  o.logit_bias = {{5, 1.0}, {7, 2.0}, {5, 3.0}};
  EXPECT_EQ(refused(o, "sampling.logit_bias"), "sampling.logit_bias gives token 5 twice");
  o.logit_bias.assign(kMaxLogitBias + 1, {1, 1.0});
  EXPECT_NE(refused(o, "sampling.logit_bias").find("at most 300"), std::string::npos);
  EXPECT_TRUE(SamplingOptions{}.Validate(100).ok());
  EXPECT_EQ(FieldOf(SamplingOptions{}.Validate(100)), "");
}

TEST(GenerateOptionsTest, RejectsBadValuesNamingTheField) {
  auto field_of = [](const GenerateOptions& o) { return FieldOf(o.Validate(100)); };
  GenerateOptions o{.max_new_tokens = 4};
  EXPECT_TRUE(o.Validate(100).ok());
  o.sampling.top_p = 2;
  EXPECT_EQ(field_of(o), "sampling.top_p");
  o = {.max_new_tokens = 4, .logprobs = kMaxTopLogprobs + 1};
  EXPECT_EQ(field_of(o), "logprobs");
  o = {.max_new_tokens = 4, .prompt_logprobs = true};
  EXPECT_EQ(field_of(o), "prompt_logprobs");
  o = {.max_new_tokens = 4, .stop_token_ids = {3, 100}};
  EXPECT_EQ(o.Validate(100).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(field_of(o), "stop_token_ids");
  o = {.max_new_tokens = 4, .min_tokens = 5};
  EXPECT_EQ(o.Validate(100).message(), "min_tokens must be in [0, max_new_tokens = 4], got 5");
  EXPECT_EQ(field_of(o), "min_tokens");
}

// Logit bias at every pick, presence and frequency penalties by the count of each picked token: one delta per id, in
// id order, each computed in double and rounded once.
TEST(SamplerTest, DeltasFollowTheBiasAndTheCountsOfThePickedTokens) {
  SamplingOptions o;
  o.presence_penalty = 0.5;
  o.frequency_penalty = 0.25;
  o.logit_bias = {{9, -100.0}, {2, 1.5}};
  Sampler s(o);
  auto deltas = [&s] {
    std::vector<std::pair<int32_t, float>> out;
    for (const LogitDelta& d : s.Deltas()) out.emplace_back(d.id, d.delta);
    return out;
  };
  using V = std::vector<std::pair<int32_t, float>>;
  EXPECT_EQ(deltas(), (V{{2, 1.5f}, {9, -100.0f}}));
  s.Record(4);
  s.Record(2);
  s.Record(4);
  EXPECT_EQ(deltas(), (V{{2, 1.5f - 0.75f}, {4, -1.0f}, {9, -100.0f}}));
  // Bias alone: no counts kept, the same deltas at every pick.
  SamplingOptions bias_only;
  bias_only.logit_bias = {{3, 2.0}};
  Sampler b(bias_only);
  b.Record(3);
  b.Record(1);
  ASSERT_EQ(b.Deltas().size(), 1u);
  EXPECT_EQ(b.Deltas()[0].delta, 2.0f);
  EXPECT_TRUE(Sampler(SamplingOptions{}).Deltas().empty());
}

// The host pick adds the deltas: a bias of -100 on the best token makes greedy take the next; a frequency penalty
// makes greedy leave a token once its count outweighs its lead.
TEST(SamplerTest, HostPickAddsTheDeltasAndRecordsThePick) {
  const std::vector<float> l = {0.0f, 3.0f, 2.0f};
  SamplingOptions banned;
  banned.logit_bias = {{1, -100.0}};
  Sampler a(banned);
  EXPECT_EQ(a.Next(l), 2);
  SamplingOptions repeat;
  repeat.frequency_penalty = 0.6;  // token 1 leads by 1: after two picks (-1.2) token 2 wins, then 1 again
  Sampler r(repeat);
  std::vector<int32_t> picks;
  for (int i = 0; i < 4; ++i) picks.push_back(r.Next(l));
  EXPECT_EQ(picks, (std::vector<int32_t>{1, 1, 2, 1}));
}

// The repetition penalty covers the prompt's ids from the first pick and each picked id after it, in id order, with
// the other changes of the same id; without a penalty the prompt adds nothing.
TEST(SamplerTest, RepetitionPenaltyCoversThePromptAndThePicks) {
  SamplingOptions o;
  o.repetition_penalty = 1.25;
  o.presence_penalty = 0.5;
  o.logit_bias = {{6, 1.0}};
  const std::vector<int32_t> prompt = {4, 2, 4, 9};
  Sampler s(o, TokenBan{.ids = {9}, .picks = 1}, prompt);
  auto changes = [&s] {
    std::vector<std::tuple<int32_t, float, float>> out;
    for (const LogitDelta& d : s.Deltas()) out.emplace_back(d.id, d.penalty, d.delta);
    return out;
  };
  using V = std::vector<std::tuple<int32_t, float, float>>;
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(changes(), (V{{2, 1.25f, 0.0f}, {4, 1.25f, 0.0f}, {6, 1.0f, 1.0f}, {9, 1.25f, -inf}}));
  s.Record(6);  // the ban ends; 9 stays, as a prompt id
  EXPECT_EQ(changes(), (V{{2, 1.25f, 0.0f}, {4, 1.25f, 0.0f}, {6, 1.25f, 0.5f}, {9, 1.25f, 0.0f}}));
  s.Record(7);
  EXPECT_EQ(changes(), (V{{2, 1.25f, 0.0f}, {4, 1.25f, 0.0f}, {6, 1.25f, 0.5f}, {7, 1.25f, -0.5f}, {9, 1.25f, 0.0f}}));
  SamplingOptions none;
  EXPECT_TRUE(Sampler(none, {}, prompt).Deltas().empty());
  none.repetition_penalty = 1.5;
  EXPECT_EQ(Sampler(none, {}, prompt).Deltas().size(), 3u);

  // The host pick: a positive logit is divided, a negative one multiplied (HF's rule), so greedy leaves a token of
  // the prompt whose lead the penalty takes away.
  const std::vector<float> l = {2.0f, 1.5f, -1.0f, -1.2f};
  SamplingOptions p;
  p.repetition_penalty = 1.5;
  EXPECT_EQ(Sampler(p, {}, std::vector<int32_t>{0}).Next(l), 1);  // 2 / 1.5 < 1.5
  EXPECT_EQ(Sampler(p, {}, std::vector<int32_t>{3}).Next(l), 0);
  const std::vector<float> negative = {-1.0f, -1.2f};
  EXPECT_EQ(Sampler(p, {}, std::vector<int32_t>{0}).Next(negative), 1);  // -1 * 1.5 < -1.2
  // Each pick counts, once whatever its count: after 0 is picked (2.0 -> 1.33) 1 leads, and once 1 is picked too
  // (1.5 -> 1.0) 0 leads again.
  Sampler r(p);
  std::vector<int32_t> picks;
  for (int i = 0; i < 3; ++i) picks.push_back(r.Next(l));
  EXPECT_EQ(picks, (std::vector<int32_t>{0, 1, 0}));
  Sampler q(p, {}, std::vector<int32_t>{0});
  picks.clear();
  for (int i = 0; i < 3; ++i) picks.push_back(q.Next(l));
  EXPECT_EQ(picks, (std::vector<int32_t>{1, 0, 0}));
}

// A ban makes its ids' deltas -inf for its first picks, over any bias or count, and then goes: the ids it alone
// changed drop out of the deltas, the others get their own delta back.
TEST(SamplerTest, ATokenBanHoldsForItsPicksThenLeavesTheOtherChanges) {
  SamplingOptions o;
  o.frequency_penalty = 0.5;
  o.logit_bias = {{7, 2.0}};
  Sampler s(o, TokenBan{.ids = {7, 3}, .picks = 2});
  auto deltas = [&s] {
    std::vector<std::pair<int32_t, float>> out;
    for (const LogitDelta& d : s.Deltas()) out.emplace_back(d.id, d.delta);
    return out;
  };
  using V = std::vector<std::pair<int32_t, float>>;
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(deltas(), (V{{3, -inf}, {7, -inf}}));
  s.Record(5);
  EXPECT_EQ(deltas(), (V{{3, -inf}, {5, -0.5f}, {7, -inf}}));
  s.Record(5);  // the second pick: the ban is over
  EXPECT_EQ(deltas(), (V{{5, -1.0f}, {7, 2.0f}}));

  // The host pick: greedy takes the best id outside the ban while it holds, then the best.
  const std::vector<float> l = {0.0f, 1.0f, 4.0f, 3.0f};
  Sampler greedy(SamplingOptions{}, TokenBan{.ids = {2}, .picks = 3});
  std::vector<int32_t> picks;
  for (int i = 0; i < 5; ++i) picks.push_back(greedy.Next(l));
  EXPECT_EQ(picks, (std::vector<int32_t>{3, 3, 3, 2, 2}));
  EXPECT_TRUE(greedy.Deltas().empty());
  // No ids or no picks: no ban.
  EXPECT_TRUE(Sampler(SamplingOptions{}, TokenBan{.ids = {2}, .picks = 0}).Deltas().empty());
  EXPECT_TRUE(Sampler(SamplingOptions{}, TokenBan{.ids = {}, .picks = 4}).Deltas().empty());
}

// Sampled picks never draw a banned id, however likely.
TEST(SamplerTest, SampledPicksNeverDrawABannedId) {
  const std::vector<float> l = {0.0f, 1.0f, 9.0f, 0.5f};
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 3;
  Sampler s(o, TokenBan{.ids = {2}, .picks = 200});
  for (int i = 0; i < 200; ++i) EXPECT_NE(s.Next(l), 2) << "pick " << i;
  int twos = 0;
  for (int i = 0; i < 50; ++i) twos += s.Next(l) == 2;
  EXPECT_GT(twos, 40);  // exp(9) outweighs the rest about 2000 to 1 once the ban is over
}

}  // namespace
}  // namespace odmoe
