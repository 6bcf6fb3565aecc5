// The shadow's replay of main's pick rule (pick_replay.h): after the same generated tokens, the choice (with its
// draw) and the logit changes are main's Sampler's, also after a roll back; and the rule survives FollowStart.
#include "src/shadow_node/pick_replay.h"

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "src/engine/generator.h"
#include "src/rpc/sampling_proto.h"

namespace odmoe {

// How gtest shows a constraint parameter (its kind and schema), rather than a dump of its bytes.
static void PrintTo(const OutputConstraint& c, std::ostream* os) {
  *os << "constraint kind " << static_cast<int>(c.kind) << (c.schema.empty() ? "" : " schema ") << c.schema;
}

namespace {

ModelConfig SmallVocab() {
  ModelConfig c;
  c.vocab_size = 64;
  c.eos_token_ids = {2};
  return c;
}

// A rule that samples and changes logits every way main does.
GenerateOptions SampledAndPenalized() {
  GenerateOptions o;
  o.max_new_tokens = 16;
  o.sampling.temperature = 0.8;
  o.sampling.top_p = 0.9;
  o.sampling.seed = 1234;
  o.sampling.presence_penalty = 0.5;
  o.sampling.frequency_penalty = 0.25;
  o.sampling.repetition_penalty = 1.3;
  o.sampling.logit_bias = {{5, 3.0}, {9, -100.0}};
  o.stop_token_ids = {7};
  o.min_tokens = 3;
  return o;
}

void ExpectSameChoice(const TokenChoice& a, const TokenChoice& b, size_t pick) {
  EXPECT_EQ(a.temperature, b.temperature) << "pick " << pick;
  EXPECT_EQ(a.top_k, b.top_k) << "pick " << pick;
  EXPECT_EQ(a.top_p, b.top_p) << "pick " << pick;
  EXPECT_EQ(a.min_p, b.min_p) << "pick " << pick;
  EXPECT_EQ(a.uniform, b.uniform) << "pick " << pick;
}

void ExpectSameDeltas(std::span<const LogitDelta> a, std::span<const LogitDelta> b, size_t pick) {
  ASSERT_EQ(a.size(), b.size()) << "pick " << pick;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].id, b[i].id) << "pick " << pick;
    EXPECT_EQ(a[i].penalty, b[i].penalty) << "pick " << pick;
    EXPECT_EQ(a[i].delta, b[i].delta) << "pick " << pick;
  }
}

// Main's side: the choice and deltas of each pick, its Sampler driven as the engine drives it (NextChoice for a
// pick, Record of the token picked).
struct MainPicks {
  std::vector<TokenChoice> choices;
  std::vector<std::vector<LogitDelta>> deltas;
};
MainPicks MainsPicks(const ModelConfig& config, const GenerateOptions& options, const std::vector<int32_t>& prompt,
                     const std::vector<int32_t>& tokens) {
  Sampler sampler = RequestSampler(config, options, prompt);
  MainPicks out;
  for (size_t i = 0; i <= tokens.size(); ++i) {
    out.choices.push_back(sampler.NextChoice());
    out.deltas.emplace_back(sampler.Deltas().begin(), sampler.Deltas().end());
    if (i < tokens.size()) sampler.Record(tokens[i]);
  }
  return out;
}

TEST(PickReplayTest, EachPickIsMainsWithTheSameDrawAndLogitChanges) {
  const ModelConfig config = SmallVocab();
  const GenerateOptions options = SampledAndPenalized();
  const std::vector<int32_t> prompt = {1, 5, 6, 6};
  const std::vector<int32_t> tokens = {6, 10, 10, 11, 5, 2, 7, 12};
  const MainPicks main = MainsPicks(config, options, prompt, tokens);
  PickReplay replay(config, options, prompt);
  for (size_t i = 0; i <= tokens.size(); ++i) {
    ExpectSameChoice(replay.choice(), main.choices[i], i);
    ExpectSameDeltas(replay.deltas(), main.deltas[i], i);
    if (i < tokens.size()) replay.Push(tokens[i]);
  }
  EXPECT_EQ(replay.tokens(), tokens);
  // The draws differ from pick to pick (a sampled rule): a replay that reused one would match only by chance.
  EXPECT_NE(main.choices[0].uniform, main.choices[1].uniform);
}

TEST(PickReplayTest, ARollBackReplaysTheKeptTokensAndTheirDraws) {
  const ModelConfig config = SmallVocab();
  const GenerateOptions options = SampledAndPenalized();
  const std::vector<int32_t> prompt = {1, 5, 6, 6};
  // The replica guessed 20, 21, 22 after 6, 10; main picked 30 at the third token.
  PickReplay replay(config, options, prompt);
  for (int32_t id : {6, 10, 20, 21, 22}) replay.Push(id);
  replay.Truncate(2);
  EXPECT_EQ(replay.tokens(), (std::vector<int32_t>{6, 10}));
  const std::vector<int32_t> after = {6, 10, 30, 31};
  const MainPicks main = MainsPicks(config, options, prompt, after);
  for (size_t i = 2; i <= after.size(); ++i) {
    ExpectSameChoice(replay.choice(), main.choices[i], i);
    ExpectSameDeltas(replay.deltas(), main.deltas[i], i);
    if (i < after.size()) replay.Push(after[i]);
  }
  // Keeping as many tokens as there are (or more) changes nothing.
  const TokenChoice before = replay.choice();
  replay.Truncate(replay.tokens().size());
  replay.Truncate(100);
  ExpectSameChoice(replay.choice(), before, after.size());
  EXPECT_EQ(replay.tokens(), after);
}

// Structured output (a JSON object, and a JSON Schema): the replay bans what main's grammar bans after the same
// tokens, also after a roll back.
class ConstrainedPickReplayTest : public ::testing::TestWithParam<OutputConstraint> {};

TEST_P(ConstrainedPickReplayTest, BansWhatMainsGrammarBans) {
  const ModelConfig config = SmallVocab();
  std::vector<std::string> bytes(64);
  const std::vector<std::string> texts = {"{", "}", "\"", "a", ":", " ", "1", "{\"", "\":", "true", "b", "]"};
  for (size_t i = 0; i < texts.size(); ++i) bytes[i + 3] = texts[i];  // 0..2 special (2: EOS)
  for (size_t id = 3 + texts.size(); id < bytes.size(); ++id)
    bytes[id] = std::string(1, static_cast<char>('c' + id % 20));
  GenerateOptions options = SampledAndPenalized();
  options.min_tokens = 0;
  options.constraint = GetParam();
  options.vocabulary = std::make_shared<const TokenVocabulary>(bytes);
  ASSERT_TRUE(options.Validate(config.vocab_size).ok());
  auto id = [&](const std::string& t) {
    return static_cast<int32_t>(std::find(bytes.begin(), bytes.end(), t) - bytes.begin());
  };
  const std::vector<int32_t> prompt = {1, 5};
  const std::vector<int32_t> tokens = {id("{\""), id("a"), id("\":"), id(" "), id("true"), id("}"), 2};
  const MainPicks main = MainsPicks(config, options, prompt, tokens);
  EXPECT_GT(main.deltas[0].size(), 50u) << "before the object only '{', '{\"' and ' ' may come";
  PickReplay replay(config, options, prompt);
  // A wrong guess first, rolled back: the replay is main's again from there.
  for (int32_t t : {id("{\""), id("b"), id("b")}) replay.Push(t);
  replay.Truncate(1);
  for (size_t i = 1; i <= tokens.size(); ++i) {
    ExpectSameChoice(replay.choice(), main.choices[i], i);
    ExpectSameDeltas(replay.deltas(), main.deltas[i], i);
    if (i < tokens.size()) replay.Push(tokens[i]);
  }
  // The rule travels with its constraint.
  v1::PickRule proto;
  rpc::PickRuleToProto(options, &proto);
  const OutputConstraint travelled = rpc::PickRuleFromProto(proto, 16).constraint;
  EXPECT_EQ(travelled.kind, GetParam().kind);
  EXPECT_EQ(travelled.schema, GetParam().schema);
  EXPECT_EQ(travelled.compact, GetParam().compact);
}

INSTANTIATE_TEST_SUITE_P(
    Constraints, ConstrainedPickReplayTest,
    ::testing::Values(OutputConstraint{.kind = OutputConstraint::Kind::kJsonObject},
                      OutputConstraint{.kind = OutputConstraint::Kind::kJsonSchema,
                                       .schema = R"({"properties": {"a": {"type": "boolean"}}, "required": ["a"]})"}),
    [](const ::testing::TestParamInfo<OutputConstraint>& param_info) {
      return param_info.param.kind == OutputConstraint::Kind::kJsonObject ? std::string("JsonObject")
                                                                          : std::string("JsonSchema");
    });

TEST(PickReplayTest, GreedyHasNoDrawAndNoChanges) {
  GenerateOptions options;
  options.max_new_tokens = 8;
  options.ignore_eos = true;
  PickReplay replay(SmallVocab(), options, std::vector<int32_t>{1, 2, 3});
  for (int32_t id : {4, 4, 4}) {
    EXPECT_TRUE(kernels::IsGreedy(replay.choice()));
    EXPECT_EQ(replay.choice().uniform, 0.0f);
    EXPECT_TRUE(replay.deltas().empty());
    replay.Push(id);
  }
}

TEST(PickReplayTest, TheRuleTravelsInFollowStartWhole) {
  const GenerateOptions options = SampledAndPenalized();
  v1::PickRule proto;
  rpc::PickRuleToProto(options, &proto);
  const GenerateOptions back = rpc::PickRuleFromProto(proto, options.max_new_tokens);
  EXPECT_EQ(back.max_new_tokens, options.max_new_tokens);
  EXPECT_EQ(back.sampling.temperature, options.sampling.temperature);
  EXPECT_EQ(back.sampling.top_p, options.sampling.top_p);
  EXPECT_EQ(back.sampling.seed, options.sampling.seed);
  EXPECT_EQ(back.sampling.presence_penalty, options.sampling.presence_penalty);
  EXPECT_EQ(back.sampling.frequency_penalty, options.sampling.frequency_penalty);
  EXPECT_EQ(back.sampling.repetition_penalty, options.sampling.repetition_penalty);
  EXPECT_EQ(back.stop_token_ids, options.stop_token_ids);
  EXPECT_EQ(back.min_tokens, options.min_tokens);
  EXPECT_EQ(back.ignore_eos, options.ignore_eos);
  // logit_bias goes through a proto map: the same entries, in any order.
  std::vector<std::pair<int32_t, double>> bias = back.sampling.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, options.sampling.logit_bias);
  // An absent rule (a main that sends none) is greedy, with no change to any logit.
  const GenerateOptions none = rpc::PickRuleFromProto(v1::PickRule(), 4);
  EXPECT_EQ(none.sampling.temperature, 0.0);
  EXPECT_EQ(none.sampling.top_p, 1.0);
  EXPECT_EQ(none.sampling.repetition_penalty, 1.0);
  EXPECT_FALSE(none.sampling.ChangesLogits());
  EXPECT_TRUE(none.Validate(64).ok());
}

}  // namespace
}  // namespace odmoe
