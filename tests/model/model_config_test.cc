// config.json parsing: every shared model's values, HF Transformers' per-architecture defaults, both rope
// layouts, nullable fields, and the refusals (unsupported feature -> Unimplemented naming the field; malformed
// JSON -> DataLoss naming the file; wrong type or value -> FailedPrecondition naming the field).
#include "src/model/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "src/common/json.h"
#include "src/common/status.h"
#include "src/model/model_layout.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kWhere[] = "m/config.json";

absl::StatusOr<ModelConfig> ParseText(const std::string& text) {
  auto json = ParseJson(text, kWhere);
  if (!json.ok()) return json.status();
  return ParseModelConfig(*json, kWhere);
}

ModelConfig MustParse(const std::string& text) {
  auto c = ParseText(text);
  EXPECT_TRUE(c.ok()) << c.status() << "\n" << text;
  return c.ok() ? *c : ModelConfig{};
}

// A complete small config of `arch` with `extra` fields merged over it (a null in `extra` removes the field).
Json SmallConfig(const std::string& arch, const Json& extra = Json::object()) {
  Json j = {{"architectures", {arch}},  {"hidden_size", 64},
            {"intermediate_size", 96},  {"num_hidden_layers", 4},
            {"num_attention_heads", 4}, {"num_key_value_heads", 2},
            {"vocab_size", 100},        {"max_position_embeddings", 256},
            {"num_experts_per_tok", 2}, {"eos_token_id", 2}};
  if (arch == "MixtralForCausalLM") {
    j["num_local_experts"] = 4;
  } else {
    j["num_experts"] = 4;
  }
  if (arch == "Qwen2MoeForCausalLM" || arch == "Qwen3MoeForCausalLM") j["moe_intermediate_size"] = 32;
  for (const auto& [k, v] : extra.items()) {
    if (v.is_null()) {
      j.erase(k);
    } else {
      j[k] = v;
    }
  }
  return j;
}

absl::StatusOr<ModelConfig> ParseSmall(const std::string& arch, const Json& extra) {
  return ParseModelConfig(SmallConfig(arch, extra), kWhere);
}

// The refusal of an unsupported feature: Unimplemented (exit code 6), naming the file and the field.
void ExpectUnsupported(const absl::StatusOr<ModelConfig>& c, const std::string& field) {
  ASSERT_FALSE(c.ok()) << "accepted; expected a refusal naming '" << field << "'";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_EQ(ExitCodeFor(c.status()), kExitUnsupported);
  EXPECT_THAT(c.status().message(), HasSubstr(std::string(kWhere) + ": field '" + field + "'")) << c.status();
}

// A wrong type or value: FailedPrecondition (exit code 5), naming the file and the field.
void ExpectInvalid(const absl::StatusOr<ModelConfig>& c, const std::string& field) {
  ASSERT_FALSE(c.ok()) << "accepted; expected an error naming '" << field << "'";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_EQ(ExitCodeFor(c.status()), kExitInvalidModel);
  EXPECT_THAT(c.status().message(), HasSubstr(std::string(kWhere) + ": field '" + field + "'")) << c.status();
}

// ---------------------------------------------------------------------------------------------------------
// The shared models.

#define REQUIRE_SHARED_MODEL(name)                                                                 \
  do {                                                                                             \
    if (!::odmoe::testing::HaveSharedModel(name)) {                                                \
      GTEST_SKIP() << "needs ../shared: " << ::odmoe::testing::SharedModel(name) << " is missing"; \
    }                                                                                              \
  } while (0)

ModelConfig LoadShared(const std::string& name) {
  auto c = LoadModelConfig(odmoe::testing::SharedModel(name));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

TEST(SharedModelConfigTest, MixtralTiny) {
  REQUIRE_SHARED_MODEL("mixtral-tiny");
  const ModelConfig c = LoadShared("mixtral-tiny");
  EXPECT_EQ(c.arch, Architecture::kMixtral);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);  // head_dim: null -> hidden / heads
  EXPECT_EQ(c.max_position_embeddings, 512);
  EXPECT_EQ(c.rope_theta, 1e6);  // from rope_parameters
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.expert_intermediate_size, 192);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.qk_norm, QkNorm::kNone);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_THAT(c.SparseLayers(), ElementsAre(0, 1, 2));
}

TEST(SharedModelConfigTest, DemoMixtralKjv) {
  REQUIRE_SHARED_MODEL("demo-mixtral-kjv");
  const ModelConfig c = LoadShared("demo-mixtral-kjv");
  EXPECT_EQ(c.arch, Architecture::kMixtral);
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_layers, 6);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.expert_intermediate_size, 256);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c.SparseLayers().size(), 6u);
}

TEST(SharedModelConfigTest, TinyMixtralKjvUsesTheClassicRopeKey) {
  REQUIRE_SHARED_MODEL("tiny-mixtral-kjv");
  const ModelConfig c = LoadShared("tiny-mixtral-kjv");
  EXPECT_EQ(c.arch, Architecture::kMixtral);
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.num_layers, 8);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);  // no head_dim key at all
  EXPECT_EQ(c.expert_intermediate_size, 512);
  EXPECT_EQ(c.rope_theta, 1e6);          // top-level rope_theta
  EXPECT_EQ(c.torch_dtype, "bfloat16");  // torch_dtype, not dtype
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(2));
}

TEST(SharedModelConfigTest, Qwen2MoeTiny) {
  REQUIRE_SHARED_MODEL("qwen2moe-tiny");
  const ModelConfig c = LoadShared("qwen2moe-tiny");
  EXPECT_EQ(c.arch, Architecture::kQwen2Moe);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k, 4);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.expert_intermediate_size, 96);
  EXPECT_EQ(c.shared_expert_intermediate_size, 256);
  EXPECT_EQ(c.dense_intermediate_size, 256);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.qk_norm, QkNorm::kNone);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.sliding_window.has_value());  // sliding_window 0, use_sliding_window false, all full_attention
  EXPECT_EQ(c.torch_dtype, "float16");
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_THAT(c.mlp_only_layers, IsEmpty());
  EXPECT_THAT(c.SparseLayers(), ElementsAre(0, 1, 2));
  EXPECT_THAT(c.eos_token_ids, ElementsAre(2));
}

TEST(SharedModelConfigTest, Qwen3MoeTiny) {
  REQUIRE_SHARED_MODEL("qwen3moe-tiny");
  const ModelConfig c = LoadShared("qwen3moe-tiny");
  EXPECT_EQ(c.arch, Architecture::kQwen3Moe);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 48);  // explicit, != hidden / heads
  EXPECT_EQ(c.q_size(), 192);
  EXPECT_EQ(c.kv_size(), 96);
  EXPECT_EQ(c.num_experts, 16);  // spelled num_local_experts in this file
  EXPECT_EQ(c.top_k, 4);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.expert_intermediate_size, 64);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_EQ(c.qk_norm, QkNorm::kPerHead);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_THAT(c.SparseLayers(), ElementsAre(0, 1, 2));
}

TEST(SharedModelConfigTest, OlmoeTiny) {
  REQUIRE_SHARED_MODEL("olmoe-tiny");
  const ModelConfig c = LoadShared("olmoe-tiny");
  EXPECT_EQ(c.arch, Architecture::kOlmoe);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.top_k, 4);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.expert_intermediate_size, 64);
  EXPECT_EQ(c.qk_norm, QkNorm::kFull);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope_theta, 1e4);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.torch_dtype, "float32");
  EXPECT_THAT(c.eos_token_ids, ElementsAre(2));
}

TEST(SharedModelConfigTest, EveryModelParses) {
  const std::vector<std::string> names = odmoe::testing::SharedModelNames();
  if (names.empty()) GTEST_SKIP() << "needs ../shared: no models under " << odmoe::testing::SharedDir();
  EXPECT_EQ(names.size(), 6u);
  for (const std::string& name : names) {
    auto c = LoadModelConfig(odmoe::testing::SharedModel(name));
    EXPECT_TRUE(c.ok()) << name << ": " << c.status();
  }
}

// ---------------------------------------------------------------------------------------------------------
// Defaults: a field the file omits takes HF Transformers' default for the architecture.

TEST(ModelConfigDefaultsTest, Mixtral) {
  const ModelConfig c = MustParse(R"({"architectures": ["MixtralForCausalLM"]})");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.expert_intermediate_size, 14336);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 4096 * 32);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k, 2);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c.torch_dtype, "float32");
}

TEST(ModelConfigDefaultsTest, Qwen2Moe) {
  const ModelConfig c = MustParse(R"({"architectures": ["Qwen2MoeForCausalLM"]})");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.dense_intermediate_size, 5632);
  EXPECT_EQ(c.num_layers, 24);
  EXPECT_EQ(c.num_heads, 16);
  EXPECT_EQ(c.num_kv_heads, 16);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 1e4);
  EXPECT_EQ(c.num_experts, 60);
  EXPECT_EQ(c.top_k, 4);
  EXPECT_EQ(c.expert_intermediate_size, 1408);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_TRUE(c.qkv_bias);  // Qwen2-MoE's q/k/v projections have biases unless qkv_bias says otherwise
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.sliding_window.has_value());  // use_sliding_window defaults to false
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_THAT(c.eos_token_ids, IsEmpty());
  EXPECT_EQ(c.SparseLayers().size(), 24u);
}

TEST(ModelConfigDefaultsTest, Qwen3Moe) {
  const ModelConfig c = MustParse(R"({"model_type": "qwen3_moe"})");  // model_type alone identifies it
  EXPECT_EQ(c.arch, Architecture::kQwen3Moe);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.dense_intermediate_size, 6144);
  EXPECT_EQ(c.num_layers, 24);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.top_k, 8);
  EXPECT_EQ(c.expert_intermediate_size, 768);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.qk_norm, QkNorm::kPerHead);
  EXPECT_EQ(c.rope_theta, 1e4);
}

TEST(ModelConfigDefaultsTest, Olmoe) {
  const ModelConfig c = MustParse(R"({"architectures": ["OlmoeForCausalLM"]})");
  EXPECT_EQ(c.vocab_size, 50304);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.expert_intermediate_size, 2048);
  EXPECT_EQ(c.num_layers, 16);
  EXPECT_EQ(c.num_heads, 16);
  EXPECT_EQ(c.num_kv_heads, 16);  // None -> num_attention_heads
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.rope_theta, 1e4);
  EXPECT_EQ(c.num_experts, 64);
  EXPECT_EQ(c.top_k, 8);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.qk_norm, QkNorm::kFull);
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_THAT(c.eos_token_ids, ElementsAre(50279));
}

TEST(ModelConfigDefaultsTest, NullKvHeadsMeansOnePerHead) {
  for (const char* arch : {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"}) {
    Json j = SmallConfig(arch);
    j["num_key_value_heads"] = nullptr;
    auto c = ParseModelConfig(j, kWhere);
    ASSERT_TRUE(c.ok()) << arch << ": " << c.status();
    EXPECT_EQ(c->num_kv_heads, 4) << arch;
  }
  // Omitted: the architecture's default (OLMoE's is None, i.e. one per head).
  auto olmoe = ParseSmall("OlmoeForCausalLM", {{"num_key_value_heads", Json()}});
  ASSERT_TRUE(olmoe.ok()) << olmoe.status();
  EXPECT_EQ(olmoe->num_kv_heads, 4);
  auto qwen3 = ParseSmall("Qwen3MoeForCausalLM", {{"num_key_value_heads", Json()}});
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_EQ(qwen3->num_kv_heads, 4);  // Qwen3-MoE's default is 4
  // Mixtral's default of 8 kv heads does not divide 4 heads.
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_key_value_heads", Json()}}), "num_key_value_heads");
}

TEST(ModelConfigDefaultsTest, OmittedDefaultTokenOutsideASmallVocabIsDropped) {
  // OLMoE's default eos (50279) does not exist in a 100-token vocabulary.
  auto c = ParseSmall("OlmoeForCausalLM", {{"eos_token_id", Json()}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, IsEmpty());
}

// ---------------------------------------------------------------------------------------------------------
// Field layouts.

TEST(ModelConfigTest, RopeThetaAtTopLevelOrInRopeParameters) {
  auto top = ParseSmall("MixtralForCausalLM", {{"rope_theta", 5e5}});
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->rope_theta, 5e5);
  auto nested =
      ParseSmall("MixtralForCausalLM", {{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 2e5}}}});
  ASSERT_TRUE(nested.ok()) << nested.status();
  EXPECT_EQ(nested->rope_theta, 2e5);
  auto both = ParseSmall("Qwen3MoeForCausalLM", {{"rope_theta", 5e5}, {"rope_parameters", {{"rope_theta", 3e5}}}});
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->rope_theta, 3e5);  // rope_parameters wins
  auto legacy = ParseSmall("Qwen2MoeForCausalLM", {{"rope_theta", 7e4}, {"rope_scaling", {{"type", "default"}}}});
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  EXPECT_EQ(legacy->rope_theta, 7e4);
  auto neither = ParseSmall("OlmoeForCausalLM", {});
  ASSERT_TRUE(neither.ok()) << neither.status();
  EXPECT_EQ(neither->rope_theta, 1e4);
  Json j = SmallConfig("MixtralForCausalLM", {{"rope_theta", 3e4}});
  j["rope_scaling"] = nullptr;
  j["rope_parameters"] = nullptr;
  EXPECT_EQ(MustParse(j.dump()).rope_theta, 3e4);
}

TEST(ModelConfigTest, HeadDim) {
  Json j = SmallConfig("MixtralForCausalLM");
  j["head_dim"] = nullptr;
  EXPECT_EQ(MustParse(j.dump()).head_dim, 16);  // 64 / 4
  j["head_dim"] = 24;
  const ModelConfig c = MustParse(j.dump());
  EXPECT_EQ(c.head_dim, 24);
  EXPECT_EQ(c.q_size(), 96);
  EXPECT_EQ(c.kv_size(), 48);
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"head_dim", 15}}), "head_dim");  // odd: no rotary pairs
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"head_dim", 0}}), "head_dim");
  // Without head_dim, hidden_size must split evenly into the heads.
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_attention_heads", 6}, {"num_key_value_heads", 3}}), "head_dim");
  // OLMoE's q/k norms span hidden_size: a head_dim that changes the projection width is refused.
  ExpectUnsupported(ParseSmall("OlmoeForCausalLM", {{"head_dim", 32}}), "head_dim");
}

TEST(ModelConfigTest, EosTokenIdNumberListOrNull) {
  EXPECT_THAT(ParseSmall("MixtralForCausalLM", {{"eos_token_id", 7}})->eos_token_ids, ElementsAre(7));
  EXPECT_THAT(ParseSmall("MixtralForCausalLM", {{"eos_token_id", {2, 9}}})->eos_token_ids, ElementsAre(2, 9));
  Json j = SmallConfig("MixtralForCausalLM");
  j["eos_token_id"] = nullptr;
  EXPECT_THAT(MustParse(j.dump()).eos_token_ids, IsEmpty());  // explicit null: no default
  j["bos_token_id"] = nullptr;
  EXPECT_FALSE(MustParse(j.dump()).bos_token_id.has_value());
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"eos_token_id", 100}}), "eos_token_id");  // vocab is 100
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"eos_token_id", {2, -1}}}), "eos_token_id");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"eos_token_id", "2"}}), "eos_token_id");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"bos_token_id", 1000}}), "bos_token_id");
}

TEST(ModelConfigTest, GenerationConfigEosIsMerged) {
  odmoe::testing::TempDir dir;
  odmoe::testing::WriteFile(dir.File("config.json"), SmallConfig("MixtralForCausalLM").dump());
  odmoe::testing::WriteFile(dir.File("generation_config.json"), R"({"eos_token_id": [2, 5]})");
  auto c = LoadModelConfig(dir.path());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2, 5));

  odmoe::testing::WriteFile(dir.File("generation_config.json"), R"({"eos_token_id": 500})");
  auto bad = LoadModelConfig(dir.path());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr(dir.File("generation_config.json") + ": field 'eos_token_id'"));

  odmoe::testing::WriteFile(dir.File("generation_config.json"), "{");
  auto corrupt = LoadModelConfig(dir.path());
  ASSERT_FALSE(corrupt.ok());
  EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(corrupt.status().message(), HasSubstr(dir.File("generation_config.json")));
}

TEST(ModelConfigTest, DtypeOrTorchDtype) {
  EXPECT_EQ(ParseSmall("MixtralForCausalLM", {{"dtype", "float16"}})->torch_dtype, "float16");
  EXPECT_EQ(ParseSmall("MixtralForCausalLM", {{"torch_dtype", "bfloat16"}})->torch_dtype, "bfloat16");
  EXPECT_EQ(ParseSmall("MixtralForCausalLM", {{"dtype", "float16"}, {"torch_dtype", "bfloat16"}})->torch_dtype,
            "float16");
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"dtype", "float64"}}), "dtype");
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"torch_dtype", "int8"}}), "torch_dtype");
}

TEST(ModelConfigTest, ExpertCountUnderEitherName) {
  EXPECT_EQ(ParseSmall("MixtralForCausalLM", {{"num_local_experts", Json()}, {"num_experts", 6}})->num_experts, 6);
  EXPECT_EQ(ParseSmall("Qwen3MoeForCausalLM", {{"num_experts", Json()}, {"num_local_experts", 6}})->num_experts, 6);
  ExpectInvalid(ParseSmall("OlmoeForCausalLM", {{"num_local_experts", 8}}), "num_experts");  // 4 vs 8
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_local_experts", 0}}), "num_local_experts");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_experts_per_tok", 5}}), "num_experts_per_tok");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_experts_per_tok", 0}}), "num_experts_per_tok");
}

TEST(ModelConfigTest, AttentionBiasesAndNorms) {
  auto q2 = ParseSmall("Qwen2MoeForCausalLM", {{"qkv_bias", false}});
  ASSERT_TRUE(q2.ok());
  EXPECT_FALSE(q2->qkv_bias);
  auto q3 = ParseSmall("Qwen3MoeForCausalLM", {{"attention_bias", true}});
  ASSERT_TRUE(q3.ok());
  EXPECT_TRUE(q3->qkv_bias);
  EXPECT_TRUE(q3->o_bias);
  auto ol = ParseSmall("OlmoeForCausalLM", {{"attention_bias", true}});
  ASSERT_TRUE(ol.ok());
  EXPECT_TRUE(ol->qkv_bias);
  EXPECT_TRUE(ol->o_bias);
  // Mixtral has no attention biases whatever the file says.
  EXPECT_FALSE(ParseSmall("MixtralForCausalLM", {{"attention_bias", true}})->qkv_bias);
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"qkv_bias", "yes"}}), "qkv_bias");

  // The tensors the layout asks for follow these flags.
  auto names = [](const ModelConfig& c) {
    std::vector<std::string> out;
    for (const TensorSpec& t : NonExpertTensors(c)) out.push_back(t.name);
    return out;
  };
  const auto q3_names = names(*q3);
  EXPECT_THAT(q3_names, ::testing::Contains("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_THAT(q3_names, ::testing::Contains("model.layers.0.self_attn.q_norm.weight"));
  EXPECT_THAT(names(*q2), ::testing::Not(::testing::Contains("model.layers.0.self_attn.q_proj.bias")));
}

TEST(ModelConfigTest, SharedExpert) {
  auto c = ParseSmall("Qwen2MoeForCausalLM", {{"shared_expert_intermediate_size", 48}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->shared_expert_intermediate_size, 48);
  bool has_gate = false;
  for (const TensorSpec& t : NonExpertTensors(*c)) {
    if (t.role == TensorRole::kSharedExpertGate) {
      has_gate = true;
      EXPECT_THAT(t.shape, ElementsAre(1, 64));
    }
  }
  EXPECT_TRUE(has_gate);
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"shared_expert_intermediate_size", -1}}),
                "shared_expert_intermediate_size");
}

TEST(ModelConfigTest, SparseLayersFromStepAndMlpOnlyLayers) {
  auto step = ParseSmall("Qwen2MoeForCausalLM", {{"decoder_sparse_step", 2}});
  ASSERT_TRUE(step.ok());
  EXPECT_THAT(step->SparseLayers(), ElementsAre(1, 3));
  EXPECT_EQ(step->SparseIndex(3), 1);
  EXPECT_EQ(step->SparseIndex(2), -1);
  auto only = ParseSmall("Qwen3MoeForCausalLM", {{"mlp_only_layers", {0, 2}}});
  ASSERT_TRUE(only.ok());
  EXPECT_THAT(only->SparseLayers(), ElementsAre(1, 3));
  EXPECT_FALSE(only->IsSparseLayer(0));
  // Dense layers need the dense MLP (intermediate_size), sparse ones the router.
  int dense = 0, routers = 0;
  for (const TensorSpec& t : NonExpertTensors(*only)) {
    if (t.role == TensorRole::kDenseGate) {
      ++dense;
      EXPECT_THAT(t.shape, ElementsAre(96, 64));
    }
    if (t.role == TensorRole::kRouter) ++routers;
  }
  EXPECT_EQ(dense, 2);
  EXPECT_EQ(routers, 2);
  auto none = ParseSmall("Qwen2MoeForCausalLM", {{"num_experts", 0}});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_THAT(none->SparseLayers(), IsEmpty());
  EXPECT_TRUE(AllExpertTensors(*none).empty());
  // Mixtral and OLMoE ignore these keys: every layer routes.
  EXPECT_EQ(ParseSmall("MixtralForCausalLM", {{"mlp_only_layers", {0}}})->SparseLayers().size(), 4u);
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"mlp_only_layers", {4}}}), "mlp_only_layers");
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"mlp_only_layers", "0"}}), "mlp_only_layers");
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"decoder_sparse_step", 0}}), "decoder_sparse_step");
}

TEST(ModelConfigTest, TiedEmbeddingsNeedNoLmHead) {
  auto c = ParseSmall("MixtralForCausalLM", {{"tie_word_embeddings", true}});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->tie_word_embeddings);
  for (const TensorSpec& t : NonExpertTensors(*c)) EXPECT_NE(t.name, "lm_head.weight");
  EXPECT_EQ(TensorName(*c, TensorRole::kLmHead), "model.embed_tokens.weight");
  auto untied = ParseSmall("MixtralForCausalLM", {});
  EXPECT_EQ(NonExpertTensors(*untied).back().name, "lm_head.weight");
}

// ---------------------------------------------------------------------------------------------------------
// Sliding window: recorded when in effect, refused only when a request is longer than the window.

TEST(ModelConfigTest, SlidingWindowMixtral) {
  auto c = ParseSmall("MixtralForCausalLM", {{"sliding_window", 64}});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->sliding_window.has_value());
  EXPECT_EQ(*c->sliding_window, 64);
  EXPECT_TRUE(CheckSequenceLength(*c, 64).ok());
  const absl::Status s = CheckSequenceLength(*c, 65);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("field 'sliding_window'"));
  Json j = SmallConfig("MixtralForCausalLM");
  j["sliding_window"] = nullptr;
  EXPECT_FALSE(MustParse(j.dump()).sliding_window.has_value());
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"sliding_window", 0}}), "sliding_window");
}

TEST(ModelConfigTest, SlidingWindowQwen) {
  // Off unless use_sliding_window, whatever sliding_window says.
  EXPECT_FALSE(ParseSmall("Qwen2MoeForCausalLM", {{"sliding_window", 32}})->sliding_window.has_value());
  EXPECT_FALSE(ParseSmall("Qwen3MoeForCausalLM", {{"sliding_window", 32}})->sliding_window.has_value());
  auto q3 = ParseSmall("Qwen3MoeForCausalLM", {{"use_sliding_window", true}, {"sliding_window", 32}});
  ASSERT_TRUE(q3.ok()) << q3.status();
  EXPECT_EQ(q3->sliding_window, 32);
  auto q3_default = ParseSmall("Qwen3MoeForCausalLM", {{"use_sliding_window", true}});
  EXPECT_EQ(q3_default->sliding_window, 4096);
  auto q2 = ParseSmall("Qwen2MoeForCausalLM", {{"use_sliding_window", true}, {"sliding_window", 32}});
  EXPECT_EQ(q2->sliding_window, 32);
  EXPECT_EQ(CheckSequenceLength(*q2, 33).code(), absl::StatusCode::kUnimplemented);
  // Qwen2-MoE: max_window_layers 0 leaves every layer on full attention.
  auto q2_none = ParseSmall("Qwen2MoeForCausalLM",
                            {{"use_sliding_window", true}, {"sliding_window", 32}, {"max_window_layers", 0}});
  EXPECT_FALSE(q2_none->sliding_window.has_value());
  // Explicit layer types decide; a sliding layer without use_sliding_window has a window of 0 in HF.
  auto typed =
      ParseSmall("Qwen2MoeForCausalLM",
                 {{"use_sliding_window", true},
                  {"sliding_window", 16},
                  {"layer_types", {"full_attention", "sliding_attention", "full_attention", "full_attention"}}});
  EXPECT_EQ(typed->sliding_window, 16);
  ExpectUnsupported(
      ParseSmall("Qwen2MoeForCausalLM",
                 {{"layer_types", {"full_attention", "sliding_attention", "full_attention", "full_attention"}}}),
      "sliding_window");
  ExpectUnsupported(
      ParseSmall("Qwen2MoeForCausalLM",
                 {{"layer_types", {"full_attention", "chunked_attention", "full_attention", "full_attention"}}}),
      "layer_types");
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"layer_types", {"full_attention"}}}), "layer_types");
  // OLMoE has no sliding window.
  EXPECT_FALSE(ParseSmall("OlmoeForCausalLM", {{"sliding_window", 8}})->sliding_window.has_value());
}

TEST(ModelConfigTest, MaxPositionEmbeddings) {
  auto c = ParseSmall("MixtralForCausalLM", {});
  EXPECT_TRUE(CheckSequenceLength(*c, 256).ok());
  const absl::Status s = CheckSequenceLength(*c, 257);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("max_position_embeddings"));
}

// ---------------------------------------------------------------------------------------------------------
// Refusals.

TEST(ModelConfigUnsupportedTest, EachFeatureIsRefusedNamingTheField) {
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"rope_parameters", {{"rope_type", "yarn"}, {"factor", 4.0}}}}),
                    "rope_parameters.rope_type");
  ExpectUnsupported(ParseSmall("Qwen2MoeForCausalLM", {{"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}}),
                    "rope_scaling.type");
  ExpectUnsupported(ParseSmall("Qwen3MoeForCausalLM", {{"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}}),
                    "rope_scaling.rope_type");
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"rope_parameters", {{"rope_type", "llama3"}}}}),
                    "rope_parameters.rope_type");
  ExpectUnsupported(
      ParseSmall("MixtralForCausalLM", {{"rope_parameters", {{"full_attention", {{"rope_theta", 1e4}}}}}}),
      "rope_parameters.full_attention");
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"partial_rotary_factor", 0.5}}), "partial_rotary_factor");
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"rope_parameters", {{"partial_rotary_factor", 0.25}}}}),
                    "rope_parameters.partial_rotary_factor");
  ExpectUnsupported(ParseSmall("OlmoeForCausalLM", {{"clip_qkv", 8.0}}), "clip_qkv");
  ExpectUnsupported(ParseSmall("LlamaForCausalLM", {}), "architectures");
  ExpectUnsupported(ParseSmall("DeepseekV3ForCausalLM", {}), "architectures");
  ExpectUnsupported(ParseText(R"({"model_type": "llama"})"), "model_type");
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"hidden_act", "gelu"}}), "hidden_act");
  ExpectUnsupported(ParseSmall("MixtralForCausalLM", {{"quantization_config", {{"quant_method", "gptq"}}}}),
                    "quantization_config");
  // A null clip_qkv (as OLMoE configs write) is no clipping.
  Json j = SmallConfig("OlmoeForCausalLM");
  j["clip_qkv"] = nullptr;
  EXPECT_TRUE(ParseModelConfig(j, kWhere).ok());
  // "swish" is SiLU under another name.
  EXPECT_TRUE(ParseSmall("MixtralForCausalLM", {{"hidden_act", "swish"}}).ok());
}

TEST(ModelConfigMalformedTest, InvalidJsonNamesTheFile) {
  odmoe::testing::TempDir dir;
  for (const char* text : {"", "{", R"({"hidden_size": 128,})", "\x89PNG\r\n", R"({"a": 1} {"b": 2})"}) {
    odmoe::testing::WriteFile(dir.File("config.json"), text);
    auto c = LoadModelConfig(dir.path());
    ASSERT_FALSE(c.ok()) << "accepted: " << text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << c.status();
    EXPECT_EQ(ExitCodeFor(c.status()), kExitCorrupt);
    EXPECT_THAT(c.status().message(), HasSubstr(dir.File("config.json") + ": invalid JSON")) << c.status();
  }
}

TEST(ModelConfigMalformedTest, MissingConfigIsNotFound) {
  odmoe::testing::TempDir dir;
  auto c = LoadModelConfig(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr(dir.File("config.json")));
  auto d = LoadModelConfig(dir.File("no-such-dir"));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelConfigMalformedTest, NotAnObject) {
  for (const char* text : {"[]", "42", "\"config\"", "null"}) {
    auto c = ParseText(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << text;
    EXPECT_THAT(c.status().message(), HasSubstr(kWhere));
  }
}

TEST(ModelConfigMalformedTest, WrongTypesNameTheField) {
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"hidden_size", "128"}}), "hidden_size");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_attention_heads", 4.5}}), "num_attention_heads");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_hidden_layers", true}}), "num_hidden_layers");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"vocab_size", {100}}}), "vocab_size");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"rms_norm_eps", "1e-5"}}), "rms_norm_eps");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"rope_theta", "1e6"}}), "rope_theta");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"rope_parameters", {1, 2}}}), "rope_parameters");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"tie_word_embeddings", "false"}}), "tie_word_embeddings");
  ExpectInvalid(ParseSmall("Qwen3MoeForCausalLM", {{"norm_topk_prob", 1}}), "norm_topk_prob");
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"use_sliding_window", "no"}}), "use_sliding_window");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"hidden_act", 3}}), "hidden_act");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"dtype", 16}}), "dtype");
  ExpectInvalid(ParseText(R"({"architectures": "MixtralForCausalLM"})"), "architectures");
  ExpectInvalid(ParseText(R"({"architectures": []})"), "architectures");
  ExpectInvalid(ParseText(R"({"hidden_size": 128})"), "architectures");
}

TEST(ModelConfigMalformedTest, BadValuesNameTheField) {
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"hidden_size", 0}}), "hidden_size");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"hidden_size", -64}}), "hidden_size");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"hidden_size", int64_t{1} << 40}}), "hidden_size");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"vocab_size", 0}}), "vocab_size");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_hidden_layers", 0}}), "num_hidden_layers");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"num_key_value_heads", 3}}), "num_key_value_heads");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"intermediate_size", 0}}), "intermediate_size");
  ExpectInvalid(ParseSmall("Qwen2MoeForCausalLM", {{"moe_intermediate_size", 0}}), "moe_intermediate_size");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"rms_norm_eps", 0}}), "rms_norm_eps");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"rope_theta", -1}}), "rope_theta");
  ExpectInvalid(ParseSmall("MixtralForCausalLM", {{"max_position_embeddings", 0}}), "max_position_embeddings");
}

}  // namespace
}  // namespace odmoe
