// Synthetic weights: a pure function of (seed, tensor name, index), so any subset generated anywhere equals the
// same tensors of the whole model; values finite, of the intended scale; configs with --layers; OpenModel's
// max_model_len.
#include "src/model/synthetic.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "src/model/model_layout.h"
#include "src/model/open_model.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

ModelConfig TinyConfig(int64_t layers = 0) {
  SyntheticSpec spec{odmoe::testing::SourceDir() + "/tests/data/tiny-mixtral/config.json", layers, 0};
  auto c = SyntheticModelConfig(spec);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

std::vector<uint8_t> Bytes(SyntheticSource& source, const TensorSpec& spec) {
  auto t = source.Read(spec);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return {};
  return std::vector<uint8_t>(t->data, t->data + t->nbytes);
}

// [model] max_model_len caps the context every length check reads (context_length), never above the model's.
TEST(SyntheticTest, OpenModelCapsTheContextAtMaxModelLen) {
  ModelSource source;
  source.synthetic = odmoe::testing::SourceDir() + "/tests/data/tiny-mixtral/config.json";
  auto whole = OpenModel(source, "");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->config.context_length(), 1024);
  EXPECT_TRUE(CheckSequenceLength(whole->config, 1024).ok());

  source.max_model_len = 100;
  auto capped = OpenModel(source, "");
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(capped->config.max_position_embeddings, 1024);  // the model's own, as inspect shows it
  EXPECT_EQ(capped->config.context_length(), 100);
  EXPECT_TRUE(CheckSequenceLength(capped->config, 100).ok());
  const absl::Status too_long = CheckSequenceLength(capped->config, 101);
  EXPECT_EQ(too_long.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(too_long.message(), "a sequence of 101 tokens exceeds the 100 positions served ([model] max_model_len)");
  EXPECT_EQ(capped->fingerprint, whole->fingerprint);  // the same model: nodes with either still agree

  source.max_model_len = 1025;
  auto beyond = OpenModel(source, "");
  ASSERT_FALSE(beyond.ok());
  EXPECT_EQ(beyond.status().message(),
            "[model] max_model_len 1025 exceeds " + source.synthetic + "'s max_position_embeddings (1024)");
}

TEST(SyntheticTest, ConfigLayersOverride) {
  SyntheticSpec spec{odmoe::testing::SourceDir() + "/configs/models/mixtral-8x7b/config.json", 16, 1};
  auto c = SyntheticModelConfig(spec);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_layers, 16);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->top_k, 2);
  EXPECT_EQ(c->expert_intermediate_size, 14336);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->vocab_size, 32000);
  EXPECT_EQ(SyntheticDType(*c), DType::kBF16);
  // A folder holding config.json works too; layers 0 keeps the config's.
  spec.config_path = odmoe::testing::SourceDir() + "/configs/models/mixtral-8x7b";
  spec.layers = 0;
  c = SyntheticModelConfig(spec);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_layers, 32);
  spec.layers = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(SyntheticModelConfig(spec).status()));
  spec.layers = 1;
  spec.config_path = "/no/such/config.json";
  EXPECT_FALSE(SyntheticModelConfig(spec).ok());
}

TEST(SyntheticTest, SameEverywhereWhateverElseIsGenerated) {
  const ModelConfig c = TinyConfig();
  const std::vector<TensorSpec> all = [&] {
    std::vector<TensorSpec> v = NonExpertTensors(c);
    for (const TensorSpec& s : AllExpertTensors(c)) v.push_back(s);
    return v;
  }();
  // The "main" process: everything in order.
  SyntheticSource full(c, 7);
  std::vector<std::vector<uint8_t>> full_bytes;
  for (const TensorSpec& s : all) full_bytes.push_back(Bytes(full, s));
  // A "worker": one expert of layer 2 only, in reverse order, from a fresh source.
  SyntheticSource worker(c, 7);
  const std::vector<TensorSpec> mine = ExpertTensors(c, 2, 3);
  for (auto it = mine.rbegin(); it != mine.rend(); ++it) {
    size_t idx = 0;
    while (all[idx].name != it->name) ++idx;
    EXPECT_EQ(Bytes(worker, *it), full_bytes[idx]) << it->name;
  }
  // Element ranges and thread counts do not change a value.
  const TensorSpec& big = mine[0];
  const uint64_t n = static_cast<uint64_t>(big.shape[0] * big.shape[1]);
  std::vector<uint16_t> part(n / 2);
  GenerateSyntheticTensor(7, big, DType::kBF16, n / 4, n / 2, part.data(), 3);
  size_t idx = 0;
  while (all[idx].name != big.name) ++idx;
  EXPECT_EQ(std::memcmp(part.data(), full_bytes[idx].data() + (n / 4) * 2, (n / 2) * 2), 0);
}

TEST(SyntheticTest, ThreadCountDoesNotMatter) {
  TensorSpec spec{"model.layers.0.block_sparse_moe.experts.0.w1.weight", {2048, 1024}, TensorRole::kExpertGate};
  const uint64_t n = 2048 * 1024;
  std::vector<uint16_t> one(n), many(n);
  GenerateSyntheticTensor(3, spec, DType::kBF16, 0, n, one.data(), 1);
  GenerateSyntheticTensor(3, spec, DType::kBF16, 0, n, many.data(), 4);
  EXPECT_EQ(one, many);
}

TEST(SyntheticTest, SeedsAndNamesDiffer) {
  const ModelConfig c = TinyConfig();
  const TensorSpec a = ExpertTensors(c, 0, 0)[0];
  const TensorSpec b = ExpertTensors(c, 0, 1)[0];
  SyntheticSource s1(c, 1), s2(c, 2);
  const auto a1 = Bytes(s1, a);
  const auto a2 = Bytes(s2, a);
  const auto b1 = Bytes(s1, b);
  EXPECT_NE(a1, a2);
  EXPECT_NE(a1, b1);
  // Same seed again: identical.
  SyntheticSource s1b(c, 1);
  EXPECT_EQ(Bytes(s1b, a), a1);
}

TEST(SyntheticTest, ValuesFiniteAndOfTheIntendedScale) {
  TensorSpec w{"w", {1 << 20}, TensorRole::kQ};
  TensorSpec norm{"n", {1 << 16}, TensorRole::kInputNorm};
  std::vector<float> v(1 << 20), nv(1 << 16);
  GenerateSyntheticTensor(5, w, DType::kF32, 0, v.size(), v.data());
  GenerateSyntheticTensor(5, norm, DType::kF32, 0, nv.size(), nv.data());
  double sum = 0, sq = 0;
  for (float x : v) {
    ASSERT_TRUE(std::isfinite(x));
    ASSERT_LT(std::fabs(x), 3.5f * kSyntheticStd);
    sum += x;
    sq += static_cast<double>(x) * x;
  }
  const double mean = sum / static_cast<double>(v.size());
  const double stddev = std::sqrt(sq / static_cast<double>(v.size()) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(stddev, kSyntheticStd, 2e-4);
  for (float x : nv) {
    ASSERT_TRUE(std::isfinite(x));
    ASSERT_GT(x, 1.0f - 3.5f * kSyntheticStd);
    ASSERT_LT(x, 1.0f + 3.5f * kSyntheticStd);
  }
  // bf16 rounding of the same values.
  std::vector<uint16_t> b(v.size());
  GenerateSyntheticTensor(5, w, DType::kBF16, 0, b.size(), b.data());
  for (size_t i = 0; i < 1000; ++i) EXPECT_EQ(b[i], F32ToBf16(v[i]));
}

TEST(SyntheticTest, ValidateChecksNamesAndShapes) {
  const ModelConfig c = TinyConfig();
  SyntheticSource s(c, 0);
  EXPECT_TRUE(s.Validate(NonExpertTensors(c)).ok());
  EXPECT_TRUE(s.Validate(AllExpertTensors(c)).ok());
  TensorSpec bad = NonExpertTensors(c)[0];
  bad.shape[0] += 1;
  EXPECT_TRUE(absl::IsFailedPrecondition(s.Validate({bad})));
  EXPECT_TRUE(absl::IsFailedPrecondition(s.Read(bad).status()));
  TensorSpec missing = ExpertTensors(c, 0, 0)[0];
  missing.name = "model.layers.99.block_sparse_moe.experts.0.w1.weight";
  EXPECT_TRUE(absl::IsNotFound(s.Validate({missing})));
  EXPECT_FALSE(s.stable());
}

}  // namespace
}  // namespace odmoe
