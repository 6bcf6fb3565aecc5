// Checkpoint folders: the six shared models open and hold exactly the tensors their config needs; then small
// hand-built folders, single-file and sharded, each broken one way (missing or misshapen tensor, unsupported
// dtype, index naming files outside the folder or missing shards), each refused with the right Status code and
// a message naming the file and the tensor.
#include "src/model/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "src/common/json.h"
#include "src/common/status.h"
#include "src/model/model_config.h"
#include "src/model/model_layout.h"
#include "tests/model/safetensors_builder.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

namespace fs = std::filesystem;
using ::odmoe::testing::BuildSafetensors;
using ::odmoe::testing::ReadFile;
using ::odmoe::testing::StTensor;
using ::odmoe::testing::TempDir;
using ::odmoe::testing::WriteFile;
using ::testing::HasSubstr;

std::vector<TensorSpec> AllTensors(const ModelConfig& c) {
  std::vector<TensorSpec> out = NonExpertTensors(c);
  for (TensorSpec& t : AllExpertTensors(c)) out.push_back(std::move(t));
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// The shared models.

TEST(SharedCheckpointTest, EveryModelOpensAndHoldsExactlyWhatItsConfigNeeds) {
  const std::vector<std::string> names = odmoe::testing::SharedModelNames();
  if (names.empty()) GTEST_SKIP() << "needs ../shared: no models under " << odmoe::testing::SharedDir();
  EXPECT_EQ(names.size(), 6u);
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const std::string dir = odmoe::testing::SharedModel(name);
    auto config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    auto ck = Checkpoint::Open(dir);
    ASSERT_TRUE(ck.ok()) << ck.status();
    const std::vector<TensorSpec> non_expert = NonExpertTensors(*config);
    const std::vector<TensorSpec> experts = AllExpertTensors(*config);
    EXPECT_TRUE((*ck)->Validate(non_expert).ok()) << (*ck)->Validate(non_expert);
    EXPECT_TRUE((*ck)->Validate(experts).ok()) << (*ck)->Validate(experts);
    EXPECT_EQ(experts.size(), config->SparseLayers().size() * config->num_experts * 3);

    // The layout names every tensor in the checkpoint: nothing missing, nothing left over.
    std::vector<std::string> needed;
    for (const TensorSpec& t : AllTensors(*config)) needed.push_back(t.name);
    std::sort(needed.begin(), needed.end());
    EXPECT_EQ(needed, (*ck)->TensorNames());

    // Shard bytes add up to the files on disk.
    uint64_t on_disk = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() == ".safetensors") on_disk += e.file_size();
    }
    EXPECT_EQ((*ck)->TotalBytes(), on_disk);
    EXPECT_EQ((*ck)->shards().size(), name == "tiny-mixtral-kjv" ? 5u : 1u);

    // A tensor's bytes are where the header says: compare the final norm with the file read independently.
    auto norm = (*ck)->Read("model.norm.weight", std::vector<int64_t>{config->hidden_size});
    ASSERT_TRUE(norm.ok()) << norm.status();
    const std::string file = ReadFile(*norm->file);
    const size_t off = static_cast<size_t>(norm->info->offset);
    ASSERT_LE(off + norm->info->nbytes, file.size());
    EXPECT_EQ(std::memcmp(norm->data, file.data() + off, norm->info->nbytes), 0);
    EXPECT_EQ((*ck)->ReadNames(), std::vector<std::string>{"model.norm.weight"});
    EXPECT_EQ((*ck)->ExpertTensorsRead(), 0);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Small hand-built checkpoints.

constexpr char kConfig[] = R"({
  "architectures": ["MixtralForCausalLM"], "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 2,
  "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
  "vocab_size": 32, "max_position_embeddings": 64, "dtype": "bfloat16"
})";

class SmallCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tmp_.File("model");
    fs::create_directory(dir_);
    WriteFile(dir_ + "/config.json", kConfig);
    auto c = LoadModelConfig(dir_);
    ASSERT_TRUE(c.ok()) << c.status();
    config_ = *c;
    specs_ = AllTensors(config_);
    for (const TensorSpec& s : specs_) tensors_.push_back({s.name, "BF16", s.shape, ""});
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  void WriteSingle() const { WriteFile(Path("model.safetensors"), BuildSafetensors(tensors_)); }
  StTensor& Tensor(const std::string& name) {
    auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const StTensor& t) { return t.name == name; });
    EXPECT_NE(it, tensors_.end()) << name;
    return *it;
  }
  // Writes the tensors as two shards (first half, second half) and an index mapping every tensor.
  void WriteSharded(const std::string& first = "model-00001-of-00002.safetensors",
                    const std::string& second = "model-00002-of-00002.safetensors") const {
    const size_t half = tensors_.size() / 2;
    const std::vector<StTensor> a(tensors_.begin(), tensors_.begin() + half),
        b(tensors_.begin() + half, tensors_.end());
    WriteFile(Path("model-00001-of-00002.safetensors"), BuildSafetensors(a));
    WriteFile(Path("model-00002-of-00002.safetensors"), BuildSafetensors(b));
    Json map = Json::object();
    for (const StTensor& t : a) map[t.name] = first;
    for (const StTensor& t : b) map[t.name] = second;
    WriteFile(Path("model.safetensors.index.json"),
              Json({{"metadata", {{"total_size", 0}}}, {"weight_map", map}}).dump());
  }
  absl::Status OpenAndValidate() const {
    auto ck = Checkpoint::Open(dir_);
    if (!ck.ok()) return ck.status();
    return (*ck)->Validate(specs_);
  }

  TempDir tmp_;
  std::string dir_;
  ModelConfig config_;
  std::vector<TensorSpec> specs_;
  std::vector<StTensor> tensors_;
};

TEST_F(SmallCheckpointTest, ValidSingleFile) {
  WriteSingle();
  auto ck = Checkpoint::Open(dir_);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_TRUE((*ck)->Validate(specs_).ok());
  EXPECT_EQ((*ck)->source(), Path("model.safetensors"));
  EXPECT_EQ((*ck)->TensorNames().size(), specs_.size());
  const std::vector<TensorSpec> expert = ExpertTensors(config_, 1, 0);
  for (const TensorSpec& s : expert) ASSERT_TRUE((*ck)->Read(s).ok());
  auto embed = (*ck)->Read("model.embed_tokens.weight", std::vector<int64_t>{32, 16});
  ASSERT_TRUE(embed.ok()) << embed.status();
  EXPECT_EQ(embed->dtype, DType::kBF16);
  EXPECT_EQ(*embed->file, Path("model.safetensors"));
  EXPECT_EQ((*ck)->ExpertTensorsRead(), 3);
  EXPECT_EQ((*ck)->ReadNames().size(), 4u);
  EXPECT_EQ((*ck)->Find("nope"), nullptr);
  EXPECT_EQ((*ck)->ShardOf("nope"), nullptr);
}

TEST_F(SmallCheckpointTest, MissingTensor) {
  const std::string victim = "model.layers.1.block_sparse_moe.experts.1.w2.weight";
  tensors_.erase(std::find_if(tensors_.begin(), tensors_.end(), [&](const StTensor& t) { return t.name == victim; }));
  WriteSingle();
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(ExitCodeFor(s), kExitNotFound);
  EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors") + ": tensor '" + victim + "' is missing"));
}

TEST_F(SmallCheckpointTest, WrongShape) {
  Tensor("model.layers.0.self_attn.k_proj.weight").shape = {16, 8};  // should be [8, 16]: same bytes, transposed
  WriteSingle();
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(ExitCodeFor(s), kExitInvalidModel);
  EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors") +
                                     ": tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 8]"
                                     " but the config needs [8, 16]"));
  // A shape of the wrong rank is just as wrong.
  Tensor("model.layers.0.self_attn.k_proj.weight").shape = {128};
  WriteSingle();
  EXPECT_EQ(OpenAndValidate().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SmallCheckpointTest, UnsupportedDtypes) {
  for (const char* dtype : {"F64", "I64", "F8_E4M3", "I32", "U8", "BOOL", "I16"}) {
    SCOPED_TRACE(dtype);
    for (StTensor& t : tensors_) t.dtype = "BF16";
    Tensor("model.norm.weight").dtype = dtype;
    WriteSingle();
    const absl::Status s = OpenAndValidate();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_EQ(ExitCodeFor(s), kExitUnsupported);
    EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors") + ": tensor 'model.norm.weight' has dtype " + dtype));
  }
}

TEST_F(SmallCheckpointTest, MixedSupportedDtypes) {
  Tensor("model.norm.weight").dtype = "F32";
  Tensor("lm_head.weight").dtype = "F16";
  WriteSingle();
  EXPECT_TRUE(OpenAndValidate().ok()) << OpenAndValidate();
}

TEST_F(SmallCheckpointTest, CorruptFileNamesTheFile) {
  std::string file = BuildSafetensors(tensors_);
  WriteFile(Path("model.safetensors"), file.substr(0, file.size() - 100));
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors") + ": tensor '"));
}

TEST_F(SmallCheckpointTest, NoWeightsAtAll) {
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr(dir_));
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors"));
}

TEST_F(SmallCheckpointTest, ValidSharded) {
  WriteSharded();
  auto ck = Checkpoint::Open(dir_);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_TRUE((*ck)->Validate(specs_).ok()) << (*ck)->Validate(specs_);
  EXPECT_EQ((*ck)->shards().size(), 2u);
  EXPECT_EQ((*ck)->source(), Path("model.safetensors.index.json"));
  EXPECT_EQ((*ck)->ShardOf(specs_.back().name)->path(), Path("model-00002-of-00002.safetensors"));
  EXPECT_EQ((*ck)->ShardOf(specs_.front().name)->path(), Path("model-00001-of-00002.safetensors"));
}

TEST_F(SmallCheckpointTest, ShardedMissingTensorNamesTheIndex) {
  WriteSharded();
  Json index = Json::parse(ReadFile(Path("model.safetensors.index.json")));
  index["weight_map"].erase("model.norm.weight");
  WriteFile(Path("model.safetensors.index.json"), index.dump());
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors.index.json") + ": tensor 'model.norm.weight'"));
}

TEST_F(SmallCheckpointTest, ShardNamesMustStayInsideTheFolder) {
  // A valid shard really exists outside the model folder: the index must not reach it.
  WriteFile(tmp_.File("outside.safetensors"), BuildSafetensors(tensors_));
  const std::vector<std::string> names = {"../outside.safetensors",
                                          tmp_.File("outside.safetensors"),
                                          "/etc/passwd",
                                          "sub/../../outside.safetensors",
                                          "./model-00001-of-00002.safetensors",
                                          "sub//x.safetensors",
                                          "",
                                          "..",
                                          "a\\..\\b.safetensors"};
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    WriteSharded("model-00001-of-00002.safetensors", name);
    const absl::Status s = OpenAndValidate();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_EQ(ExitCodeFor(s), kExitCorrupt);
    EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors.index.json") + ": shard name '" + name +
                                       "' leaves the model folder"));
  }
  // A subfolder inside the model folder is fine.
  fs::create_directory(Path("sub"));
  WriteSharded("model-00001-of-00002.safetensors", "sub/second.safetensors");
  fs::rename(Path("model-00002-of-00002.safetensors"), Path("sub/second.safetensors"));
  EXPECT_TRUE(OpenAndValidate().ok()) << OpenAndValidate();
}

TEST_F(SmallCheckpointTest, MissingShard) {
  WriteSharded();
  fs::remove(Path("model-00002-of-00002.safetensors"));
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(ExitCodeFor(s), kExitNotFound);
  EXPECT_THAT(s.message(), HasSubstr(Path("model-00002-of-00002.safetensors") + ": no such file"));
  EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors.index.json")));
}

TEST_F(SmallCheckpointTest, IndexListsATensorItsShardLacks) {
  WriteSharded();
  Json index = Json::parse(ReadFile(Path("model.safetensors.index.json")));
  index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors";
  WriteFile(Path("model.safetensors.index.json"), index.dump());
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("tensor 'model.ghost.weight'"));
  EXPECT_THAT(s.message(), HasSubstr(Path("model.safetensors.index.json")));
}

TEST_F(SmallCheckpointTest, MalformedIndex) {
  WriteSharded();
  const std::string index = Path("model.safetensors.index.json");
  for (const char* text :
       {"{", "[]", R"({"metadata": {}})", R"({"weight_map": []})", R"({"weight_map": {"model.norm.weight": 3}})"}) {
    SCOPED_TRACE(text);
    WriteFile(index, text);
    const absl::Status s = OpenAndValidate();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(s.message(), HasSubstr(index));
  }
}

TEST_F(SmallCheckpointTest, CorruptShardNamesTheShard) {
  WriteSharded();
  const std::string shard = Path("model-00002-of-00002.safetensors");
  const std::string bytes = ReadFile(shard);
  WriteFile(shard, bytes.substr(0, 20));
  const absl::Status s = OpenAndValidate();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr(shard));
}

TEST_F(SmallCheckpointTest, SingleFileWinsOverAnIndexLikeTransformers) {
  WriteSingle();
  WriteFile(Path("model.safetensors.index.json"), "{ broken");
  auto ck = Checkpoint::Open(dir_);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ((*ck)->source(), Path("model.safetensors"));
}

}  // namespace
}  // namespace odmoe
