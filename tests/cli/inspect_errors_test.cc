// `odmoe inspect` as a user runs it: build/bin/odmoe on a copy of the shared mixtral-tiny checkpoint that each
// test corrupts one way. Every failure must end the process normally (no signal) with the exit code of its
// kind, print nothing on stdout, and print exactly one stderr line "odmoe inspect: ..." naming the file and the
// tensor or field at fault. Also: usage errors, --help, and the summary of every shared model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "tests/model/safetensors_builder.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

namespace fs = std::filesystem;
using ::odmoe::testing::ReadFile;
using ::odmoe::testing::RunProgram;
using ::odmoe::testing::RunResult;
using ::odmoe::testing::SafetensorsImage;
using ::odmoe::testing::WriteFile;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kModel[] = "mixtral-tiny";

std::string Odmoe() { return odmoe::testing::ProgramPath("odmoe"); }

// Exited normally with `code`, nothing on stdout, one stderr line "odmoe inspect: ..." containing `parts`.
void ExpectOneLineError(const RunResult& r, int code, const std::vector<std::string>& parts) {
  EXPECT_EQ(r.signal, 0) << "killed by signal " << r.signal << "; stderr: " << r.err;
  EXPECT_EQ(r.exit_code, code) << "stderr: " << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, StartsWith("odmoe inspect: "));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not exactly one line:\n" << r.err;
  EXPECT_TRUE(!r.err.empty() && r.err.back() == '\n') << r.err;
  for (const std::string& p : parts) EXPECT_THAT(r.err, HasSubstr(p));
}

class InspectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!odmoe::testing::HaveSharedModel(kModel)) {
      GTEST_SKIP() << "needs ../shared: " << odmoe::testing::SharedModel(kModel) << " is missing";
    }
    ASSERT_TRUE(fs::exists(Odmoe())) << Odmoe() << " is not built";
    dir_ = tmp_.File(kModel);
    fs::create_directory(dir_);
    odmoe::testing::CopyDir(odmoe::testing::SharedModel(kModel), dir_);
    for (const auto& e : fs::directory_iterator(dir_)) {  // the shared copies are read-only
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    }
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Weights() const { return Path("model.safetensors"); }
  std::string Config() const { return Path("config.json"); }

  RunResult Inspect(std::vector<std::string> extra = {}) const {
    std::vector<std::string> argv = {Odmoe(), "inspect", "--model", dir_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunProgram(argv);
  }

  SafetensorsImage LoadWeights() const { return odmoe::testing::SplitSafetensors(ReadFile(Weights())); }
  void SaveWeights(const SafetensorsImage& image) const {
    WriteFile(Weights(), odmoe::testing::JoinSafetensors(image));
  }

  Json LoadConfig() const { return Json::parse(ReadFile(Config())); }
  void SaveConfig(const Json& config) const { WriteFile(Config(), config.dump(2)); }

  odmoe::testing::TempDir tmp_;
  std::string dir_;
};

// ---------------------------------------------------------------------------------------------------------
// Corrupt safetensors.

TEST_F(InspectTest, TruncatedSafetensorsNamesTheFileAndTheLastTensor) {
  const SafetensorsImage image = LoadWeights();
  std::string last;
  uint64_t last_end = 0;
  for (const auto& [name, entry] : image.header.items()) {
    if (name == "__metadata__") continue;
    if (entry["data_offsets"][1].get<uint64_t>() > last_end) {
      last_end = entry["data_offsets"][1].get<uint64_t>();
      last = name;
    }
  }
  const std::string bytes = ReadFile(Weights());
  WriteFile(Weights(), bytes.substr(0, bytes.size() - 100));  // less than the last tensor holds
  ExpectOneLineError(Inspect(), kExitCorrupt, {Weights(), "tensor '" + last + "'", "outside the data section"});
}

TEST_F(InspectTest, TruncatedInsideTheHeader) {
  WriteFile(Weights(), ReadFile(Weights()).substr(0, 100));
  ExpectOneLineError(Inspect(), kExitCorrupt, {Weights(), "header length", "runs past the end"});
}

TEST_F(InspectTest, FileShorterThanTheHeaderLength) {
  WriteFile(Weights(), "abc");
  ExpectOneLineError(Inspect(), kExitCorrupt, {Weights(), "too short"});
}

TEST_F(InspectTest, HugeHeaderLength) {
  std::string bytes = ReadFile(Weights());
  std::fill(bytes.begin(), bytes.begin() + 8, '\xff');
  WriteFile(Weights(), bytes);
  ExpectOneLineError(Inspect(), kExitCorrupt, {Weights(), "header length", "exceeds the limit"});
}

TEST_F(InspectTest, InvalidHeaderJson) {
  std::string bytes = ReadFile(Weights());
  ASSERT_EQ(bytes[8], '{');
  bytes[9] = ':';  // {:"lm_head.weight": ...
  WriteFile(Weights(), bytes);
  ExpectOneLineError(Inspect(), kExitCorrupt, {Weights(), "invalid JSON"});
}

TEST_F(InspectTest, OffsetsOutOfBounds) {
  SafetensorsImage image = LoadWeights();
  const uint64_t size = image.data.size();
  image.header["model.norm.weight"]["data_offsets"] = {size, size + 256};
  SaveWeights(image);
  ExpectOneLineError(Inspect(), kExitCorrupt,
                     {Weights(), "tensor 'model.norm.weight'", "lie outside the data section"});
}

TEST_F(InspectTest, OverlappingTensors) {
  SafetensorsImage image = LoadWeights();
  const uint64_t begin = image.header["model.embed_tokens.weight"]["data_offsets"][0].get<uint64_t>();
  image.header["model.norm.weight"]["data_offsets"] = {begin + 2, begin + 258};
  SaveWeights(image);
  ExpectOneLineError(Inspect(), kExitCorrupt,
                     {Weights(), "'model.embed_tokens.weight' and 'model.norm.weight' overlap"});
}

TEST_F(InspectTest, OffsetsInconsistentWithShape) {
  SafetensorsImage image = LoadWeights();
  image.header["model.layers.1.input_layernorm.weight"]["shape"] = {64};
  SaveWeights(image);
  ExpectOneLineError(
      Inspect(), kExitCorrupt,
      {Weights(), "tensor 'model.layers.1.input_layernorm.weight'", "span 256 bytes", "shape [64] of BF16 needs 128"});
}

TEST_F(InspectTest, UnknownDtype) {
  SafetensorsImage image = LoadWeights();
  image.header["model.layers.0.post_attention_layernorm.weight"]["dtype"] = "BF17";
  SaveWeights(image);
  ExpectOneLineError(Inspect(), kExitCorrupt,
                     {Weights(), "tensor 'model.layers.0.post_attention_layernorm.weight'", "unknown dtype 'BF17'"});
}

TEST_F(InspectTest, KnownButUnsupportedDtypes) {
  struct Case {
    const char* dtype;
    int64_t elements;  // of the 256 bytes of a [128] BF16 norm
  };
  for (const Case& c : {Case{"F64", 32}, Case{"I64", 32}, Case{"F8_E4M3", 256}, Case{"I32", 64}}) {
    SCOPED_TRACE(c.dtype);
    SafetensorsImage image = LoadWeights();
    image.header["model.norm.weight"]["dtype"] = c.dtype;
    image.header["model.norm.weight"]["shape"] = {c.elements};
    SaveWeights(image);
    ExpectOneLineError(Inspect(), kExitUnsupported,
                       {Weights(), "tensor 'model.norm.weight'", StrCat("dtype ", c.dtype), "not support"});
    WriteFile(Weights(), ReadFile(odmoe::testing::SharedModel(kModel) + "/model.safetensors"));
  }
}

TEST_F(InspectTest, MissingTensor) {
  SafetensorsImage image = LoadWeights();
  ASSERT_EQ(image.header.erase("model.layers.2.self_attn.v_proj.weight"), 1u);
  SaveWeights(image);
  ExpectOneLineError(Inspect(), kExitNotFound,
                     {Weights(), "tensor 'model.layers.2.self_attn.v_proj.weight' is missing"});
}

TEST_F(InspectTest, MissingExpertTensor) {
  SafetensorsImage image = LoadWeights();
  ASSERT_EQ(image.header.erase("model.layers.1.block_sparse_moe.experts.7.w3.weight"), 1u);
  SaveWeights(image);
  ExpectOneLineError(Inspect(), kExitNotFound,
                     {Weights(), "tensor 'model.layers.1.block_sparse_moe.experts.7.w3.weight' is missing"});
}

TEST_F(InspectTest, WrongShape) {
  SafetensorsImage image = LoadWeights();
  image.header["model.layers.0.self_attn.q_proj.weight"]["shape"] = {64, 256};  // same bytes as [128, 128]
  SaveWeights(image);
  ExpectOneLineError(
      Inspect(), kExitInvalidModel,
      {Weights(), "tensor 'model.layers.0.self_attn.q_proj.weight'", "has shape [64, 256]", "needs [128, 128]"});
}

TEST_F(InspectTest, ConfigDisagreesWithTheWeights) {
  Json config = LoadConfig();
  config["vocab_size"] = 1024;
  SaveConfig(config);
  ExpectOneLineError(Inspect(), kExitInvalidModel,
                     {Weights(), "tensor 'model.embed_tokens.weight'", "[512, 128]", "needs [1024, 128]"});
}

TEST_F(InspectTest, TensorNameWithANewlineStaysOnOneLine) {
  SafetensorsImage image = LoadWeights();
  const uint64_t size = image.data.size();
  image.header["evil\nname"] = {{"dtype", "BF16"}, {"shape", {1}}, {"data_offsets", {size, size + 2}}};
  SaveWeights(image);
  ExpectOneLineError(Inspect(), kExitCorrupt, {Weights(), "tensor 'evil\\nname'"});
}

// ---------------------------------------------------------------------------------------------------------
// config.json.

TEST_F(InspectTest, MalformedConfigJson) {
  const std::string text = ReadFile(Config());
  WriteFile(Config(), text.substr(0, text.size() / 2));
  ExpectOneLineError(Inspect(), kExitCorrupt, {Config(), "invalid JSON"});
}

TEST_F(InspectTest, ConfigFieldOfTheWrongType) {
  Json config = LoadConfig();
  config["hidden_size"] = "128";
  SaveConfig(config);
  ExpectOneLineError(Inspect(), kExitInvalidModel, {Config(), "field 'hidden_size'", "expected an integer"});
}

TEST_F(InspectTest, ConfigValueOutOfRange) {
  Json config = LoadConfig();
  config["num_key_value_heads"] = 3;
  SaveConfig(config);
  ExpectOneLineError(Inspect(), kExitInvalidModel, {Config(), "field 'num_key_value_heads'"});
}

TEST_F(InspectTest, RopeScalingIsUnsupported) {
  Json config = LoadConfig();
  config["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"rope_theta", 1e6}};
  SaveConfig(config);
  ExpectOneLineError(Inspect(), kExitUnsupported, {Config(), "field 'rope_parameters.rope_type'", "yarn"});
}

TEST_F(InspectTest, LegacyRopeScalingIsUnsupported) {
  Json config = LoadConfig();
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  SaveConfig(config);
  ExpectOneLineError(Inspect(), kExitUnsupported, {Config(), "field 'rope_scaling.type'", "linear"});
}

TEST_F(InspectTest, ClipQkvIsUnsupported) {
  Json config = LoadConfig();
  config["clip_qkv"] = 8.0;
  SaveConfig(config);
  ExpectOneLineError(Inspect(), kExitUnsupported, {Config(), "field 'clip_qkv'"});
}

TEST_F(InspectTest, UnknownArchitectureIsUnsupported) {
  Json config = LoadConfig();
  config["architectures"] = {"LlamaForCausalLM"};
  SaveConfig(config);
  ExpectOneLineError(Inspect(), kExitUnsupported, {Config(), "field 'architectures'", "LlamaForCausalLM"});
}

TEST_F(InspectTest, MalformedGenerationConfig) {
  WriteFile(Path("generation_config.json"), "{\"eos_token_id\": ");
  ExpectOneLineError(Inspect(), kExitCorrupt, {Path("generation_config.json"), "invalid JSON"});
}

// ---------------------------------------------------------------------------------------------------------
// Missing files.

TEST_F(InspectTest, MissingConfig) {
  fs::remove(Config());
  ExpectOneLineError(Inspect(), kExitNotFound, {Config(), "no such file"});
}

TEST_F(InspectTest, MissingWeights) {
  fs::remove(Weights());
  ExpectOneLineError(Inspect(), kExitNotFound, {dir_, "no model.safetensors or model.safetensors.index.json"});
}

TEST_F(InspectTest, MissingModelFolder) {
  const RunResult r = RunProgram({Odmoe(), "inspect", "--model", tmp_.File("nowhere")});
  ExpectOneLineError(r, kExitNotFound, {tmp_.File("nowhere/config.json")});
}

TEST_F(InspectTest, MissingShard) {
  const SafetensorsImage image = LoadWeights();
  Json map = Json::object();
  for (const auto& [name, entry] : image.header.items()) {
    if (name != "__metadata__") map[name] = "model-00001-of-00002.safetensors";
  }
  fs::remove(Weights());
  WriteFile(Path("model.safetensors.index.json"), Json({{"weight_map", map}}).dump());
  ExpectOneLineError(Inspect(), kExitNotFound,
                     {Path("model-00001-of-00002.safetensors"), "no such file", Path("model.safetensors.index.json")});
}

TEST_F(InspectTest, ShardOutsideTheModelFolder) {
  WriteFile(tmp_.File("stolen.safetensors"), ReadFile(Weights()));  // a valid file, one folder up
  const SafetensorsImage image = LoadWeights();
  Json map = Json::object();
  for (const auto& [name, entry] : image.header.items()) {
    if (name != "__metadata__") map[name] = "../stolen.safetensors";
  }
  fs::remove(Weights());
  WriteFile(Path("model.safetensors.index.json"), Json({{"weight_map", map}}).dump());
  ExpectOneLineError(
      Inspect(), kExitCorrupt,
      {Path("model.safetensors.index.json"), "shard name '../stolen.safetensors'", "leaves the model folder"});
}

// ---------------------------------------------------------------------------------------------------------
// Usage.

TEST_F(InspectTest, UsageErrors) {
  const std::vector<std::vector<std::string>> cases = {
      {Odmoe(), "inspect"},
      {Odmoe(), "inspect", "--json"},
      {Odmoe(), "inspect", "--model"},
      {Odmoe(), "inspect", "--model", dir_, "--frobnicate"},
      {Odmoe(), "inspect", "--model", dir_, "extra"},
      {Odmoe(), "inspect", "--model", dir_, "--json=yes"},
      {Odmoe(), "inspect", "--model="},
  };
  for (const auto& argv : cases) {
    SCOPED_TRACE(argv.back());
    ExpectOneLineError(RunProgram(argv), kExitUsage, {"usage: odmoe inspect --model DIR [--json]"});
  }
  ExpectOneLineError(RunProgram({Odmoe(), "inspect", "--model", dir_, "--frobnicate"}), kExitUsage,
                     {"unknown flag --frobnicate"});
  ExpectOneLineError(RunProgram({Odmoe(), "inspect"}), kExitUsage, {"missing --model"});
}

TEST_F(InspectTest, Help) {
  const RunResult r = RunProgram({Odmoe(), "inspect", "--help"});
  EXPECT_EQ(r.signal, 0);
  EXPECT_EQ(r.exit_code, kExitOk);
  EXPECT_THAT(r.out, StartsWith("usage: odmoe inspect --model DIR [--json]\n"));
  EXPECT_EQ(r.err, "");
}

// ---------------------------------------------------------------------------------------------------------
// Success.

TEST_F(InspectTest, TextSummary) {
  const RunResult r = Inspect();
  ASSERT_EQ(r.exit_code, kExitOk) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("MixtralForCausalLM"));
  EXPECT_THAT(r.out, HasSubstr("3 (3 sparse: 0,1,2)"));
  EXPECT_THAT(r.out, HasSubstr("8, top-2 (renormalised)"));
  EXPECT_THAT(r.out, HasSubstr("4 heads, 2 kv heads, head_dim 32"));
  EXPECT_THAT(r.out, HasSubstr("2051968"));
  EXPECT_THAT(r.out, HasSubstr("BF16"));
  EXPECT_THAT(r.out, HasSubstr("none (no tokenizer.model or tokenizer.json): use --prompt-ids"));
}

TEST_F(InspectTest, JsonSummary) {
  const RunResult r = Inspect({"--json"});
  ASSERT_EQ(r.exit_code, kExitOk) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1);
  auto parsed = ParseJson(r.out, "stdout");
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << r.out;
  const Json& j = *parsed;
  EXPECT_EQ(j["architecture"], "MixtralForCausalLM");
  EXPECT_EQ(j["layers"], 3);
  EXPECT_EQ(j["sparse_layers"], Json({0, 1, 2}));
  EXPECT_EQ(j["experts"], 8);
  EXPECT_EQ(j["top_k"], 2);
  EXPECT_EQ(j["hidden_size"], 128);
  EXPECT_EQ(j["heads"], 4);
  EXPECT_EQ(j["kv_heads"], 2);
  EXPECT_EQ(j["head_dim"], 32);
  // 512 x 128 embedding and lm_head, 128 final norm; per layer 2 x 128 norms, q/k/v/o 128x128 + 2 x 64x128 +
  // 128x128, router 8 x 128, 8 experts x 3 x 192 x 128.
  const int64_t expert = 3 * 192 * 128;
  const int64_t per_layer = 2 * 128 + (128 * 128 * 2 + 64 * 128 * 2) + 8 * 128 + 8 * expert;
  const int64_t params = 2 * 512 * 128 + 128 + 3 * per_layer;
  EXPECT_EQ(j["params"], params);
  EXPECT_EQ(j["expert_params"], 3 * 8 * expert);
  EXPECT_EQ(j["tensor_bytes"], 2 * params);
  EXPECT_EQ(j["bytes_per_expert"], 2 * expert);
  EXPECT_EQ(j["dtypes"], Json({{"BF16", params}}));
  EXPECT_EQ(j["file_bytes"], fs::file_size(Weights()));
  EXPECT_EQ(j["tensors_needed"], 96);
  EXPECT_EQ(j["tokenizer_model"], false);
  EXPECT_TRUE(j["tokenizer"].is_null());
}

TEST(InspectSharedModelsTest, EverySharedModelInspectsCleanly) {
  const std::vector<std::string> names = odmoe::testing::SharedModelNames();
  if (names.empty()) GTEST_SKIP() << "needs ../shared: no models under " << odmoe::testing::SharedDir();
  ASSERT_TRUE(fs::exists(Odmoe())) << Odmoe() << " is not built";
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const std::string dir = odmoe::testing::SharedModel(name);
    const RunResult r = RunProgram({Odmoe(), "inspect", "--model", dir, "--json"});
    ASSERT_EQ(r.signal, 0);
    ASSERT_EQ(r.exit_code, kExitOk) << r.err;
    EXPECT_EQ(r.err, "");
    auto j = ParseJson(r.out, "stdout");
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ((*j)["tokenizer_model"], fs::exists(dir + "/tokenizer.model"));
    EXPECT_EQ((*j)["tokenizer"], fs::exists(dir + "/tokenizer.model") ? Json("tokenizer.model") : Json(nullptr));
    EXPECT_GT((*j)["params"].get<int64_t>(), 0);
    EXPECT_EQ((*j)["tensors_needed"], (*j)["tensors_in_checkpoint"]);
  }
}

}  // namespace
}  // namespace odmoe
