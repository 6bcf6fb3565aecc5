// A synthetic model runs end to end: finite logits, deterministic tokens, the same weights whether a process
// loads all of them or only a subset, and the CLI and bench entry points.
#include <cmath>
#include <cstring>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/engine/generator.h"
#include "src/engine/model_weights.h"
#include "src/model/synthetic.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

SyntheticSpec TinySpec(uint64_t seed, int64_t layers = 2) {
  return {odmoe::testing::SourceDir() + "/tests/data/tiny-mixtral/config.json", layers, seed};
}

std::unique_ptr<LocalModel> Open(const SyntheticSpec& spec) {
  auto device = CreateDevice("cpu");
  EXPECT_TRUE(device.ok()) << device.status();
  if (!device.ok()) return nullptr;
  auto m = LocalModel::OpenSynthetic(spec, std::move(device).value());
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(m).value() : nullptr;
}

const std::vector<int32_t> kPrompt = {1, 17, 250, 3, 99, 42, 7};

GenerateResult RunTiny(LocalModel& m) {
  GenerateOptions opt;
  opt.max_new_tokens = 12;
  opt.ignore_eos = true;
  opt.keep_last_logits = true;
  auto r = Generate(m.engine(), kPrompt, opt);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : GenerateResult{};
}

TEST(SyntheticModelTest, FiniteLogitsAndDeterministicTokens) {
  auto a = Open(TinySpec(1));
  auto b = Open(TinySpec(1));
  auto c = Open(TinySpec(2));
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->config().num_layers, 2);
  const GenerateResult ra = RunTiny(*a), rb = RunTiny(*b), rc = RunTiny(*c);
  ASSERT_EQ(ra.tokens.size(), 12u);
  ASSERT_EQ(ra.last_logits.size(), 256u);
  for (float x : ra.last_logits) ASSERT_TRUE(std::isfinite(x));
  EXPECT_EQ(ra.tokens, rb.tokens);
  EXPECT_EQ(ra.last_logits, rb.last_logits);
  EXPECT_NE(ra.last_logits, rc.last_logits);
}

TEST(SyntheticModelTest, DeepModelStaysFinite) {
  auto m = Open(TinySpec(3, 24));
  ASSERT_TRUE(m);
  const GenerateResult r = RunTiny(*m);
  for (float x : r.last_logits) ASSERT_TRUE(std::isfinite(x));
}

TEST(SyntheticModelTest, QkvThatCannotBeStackedAreStoredApart) {
  // One head of 2 and 130 hidden units: q's bf16 bytes (2 x 130 x 2 = 520) are not a multiple of 16, so k would
  // start off the 16-byte alignment; q, k and v are stored apart, and the engine projects them one by one.
  auto config = SyntheticModelConfig(TinySpec(5));
  ASSERT_TRUE(config.ok()) << config.status();
  config->hidden_size = 130;
  config->num_heads = 1;
  config->num_kv_heads = 1;
  config->head_dim = 2;
  auto device = CreateDevice("cpu");
  ASSERT_TRUE(device.ok());
  SyntheticSource source(*config, 5);
  auto weights = ModelWeights::Load(*config, source, **device, WeightSelection::All());
  ASSERT_TRUE(weights.ok()) << weights.status();
  const AttentionWeights& a = (*weights)->layer(0).attn;
  EXPECT_TRUE(a.qkv.empty());
  EXPECT_FALSE(a.q.empty() || a.k.empty() || a.v.empty());
  auto experts = LocalExpertExecutor::Create(**device, **weights, 64);
  ASSERT_TRUE(experts.ok()) << experts.status();
  auto engine = Engine::Create(**weights, **device, experts->get());
  ASSERT_TRUE(engine.ok()) << engine.status();
  GenerateOptions opt;
  opt.max_new_tokens = 4;
  opt.ignore_eos = true;
  opt.keep_last_logits = true;
  auto r = Generate(**engine, kPrompt, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens.size(), 4u);
  for (float v : r->last_logits) ASSERT_TRUE(std::isfinite(v));
}

TEST(SyntheticModelTest, SubsetLoadEqualsFullLoad) {
  auto config = SyntheticModelConfig(TinySpec(4));
  ASSERT_TRUE(config.ok()) << config.status();
  auto dev_full = CreateDevice("cpu");
  auto dev_part = CreateDevice("cpu");
  ASSERT_TRUE(dev_full.ok() && dev_part.ok());
  SyntheticSource full_source(*config, 4), part_source(*config, 4);
  auto full = ModelWeights::Load(*config, full_source, **dev_full, WeightSelection::All());
  WeightSelection some{false, WeightSelection::Experts::kSome, {{1, 3}, {0, 2}}};
  auto part = ModelWeights::Load(*config, part_source, **dev_part, some);
  ASSERT_TRUE(full.ok() && part.ok()) << full.status() << part.status();
  const size_t bytes = static_cast<size_t>(config->hidden_size * config->expert_intermediate_size) * 2;
  for (auto [l, e] : some.some) {
    const MlpWeights* a = (*full)->expert(l, e);
    const MlpWeights* b = (*part)->expert(l, e);
    ASSERT_TRUE(a && b);
    EXPECT_EQ(a->gate.dtype, DType::kBF16);
    EXPECT_EQ(std::memcmp(a->gate.data, b->gate.data, bytes), 0);
    EXPECT_EQ(std::memcmp(a->up.data, b->up.data, bytes), 0);
    EXPECT_EQ(std::memcmp(a->down.data, b->down.data, bytes), 0);
  }
  EXPECT_EQ((*part)->expert(0, 0), nullptr);
}

TEST(SyntheticModelTest, GenerateCli) {
  const std::string odmoe = odmoe::testing::ProgramPath("odmoe");
  const std::string config = TinySpec(0).config_path;
  auto r = odmoe::testing::RunProgram({odmoe, "generate", "--synthetic", config, "--layers", "2", "--weights-seed", "5",
                                       "--prompt-ids", "1,5,9", "--max-new-tokens", "4", "--ignore-eos", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"tokens\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"synthetic\""), std::string::npos) << r.out;
  auto again =
      odmoe::testing::RunProgram({odmoe, "generate", "--synthetic", config, "--layers", "2", "--weights-seed", "5",
                                  "--prompt-ids", "1,5,9", "--max-new-tokens", "4", "--ignore-eos", "--json"});
  EXPECT_EQ(again.out.substr(0, again.out.find("\"timings\"")), r.out.substr(0, r.out.find("\"timings\"")));
  // A text prompt needs a tokenizer, which synthetic models do not have.
  auto bad =
      odmoe::testing::RunProgram({odmoe, "generate", "--synthetic", config, "--prompt", "hi", "--max-new-tokens", "4"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
}

}  // namespace
}  // namespace odmoe
