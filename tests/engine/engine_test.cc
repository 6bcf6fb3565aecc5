// Engine properties that hold for any model: chunked prefill equals one pass, prefill + decode equals feeding
// the whole sequence at once, the mock GPU computes exactly what the CPU computes, and bad requests are errors.
#include "src/engine/engine.h"

#include <cmath>
#include <map>

#include "gtest/gtest.h"
#include "src/backend/cpu_kernels.h"
#include "src/backend/device_factory.h"
#include "src/engine/generator.h"
#include "tests/engine/stacked_projections_check.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

std::unique_ptr<LocalModel> OpenModel(const std::string& name, const std::string& device_spec,
                                      EngineOptions options = {}) {
  auto device = CreateDevice(device_spec);
  EXPECT_TRUE(device.ok()) << device.status();
  if (!device.ok()) return nullptr;
  auto model = LocalModel::Open(odmoe::testing::SharedModel(name), std::move(device).value(), options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(model).value() : nullptr;
}

double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(a[i]) - b[i]));
    ref = std::max(ref, std::fabs(static_cast<double>(b[i])));
  }
  return err / ref;
}

const std::vector<int32_t> kPrompt = {1, 17, 250, 3, 99, 42, 7, 300, 11, 64, 5};

class EngineModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!odmoe::testing::HaveSharedModel(GetParam())) {
      GTEST_SKIP() << "needs " << odmoe::testing::SharedModel(GetParam());
    }
  }
};

TEST_P(EngineModelTest, ChunkedPrefillEqualsOnePass) {
  auto one = OpenModel(GetParam(), "cpu");
  auto chunked = OpenModel(GetParam(), "cpu", EngineOptions{.max_tokens_per_forward = 3});
  ASSERT_TRUE(one && chunked);
  GenerateOptions opt;
  opt.max_new_tokens = 4;
  opt.keep_last_logits = true;
  opt.record_routing = true;
  auto a = Generate(one->engine(), kPrompt, opt);
  auto b = Generate(chunked->engine(), kPrompt, opt);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_LE(MaxRelDiff(b->last_logits, a->last_logits), 1e-5);
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_EQ(a->routing, b->routing);
  EXPECT_EQ(a->routing.size(), kPrompt.size() + 3);
}

TEST_P(EngineModelTest, DecodeEqualsOnePassOverTheWholeSequence) {
  auto model = OpenModel(GetParam(), "cpu");
  ASSERT_TRUE(model);
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  opt.ignore_eos = true;
  opt.record_routing = true;
  auto decoded = Generate(model->engine(), kPrompt, opt);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(decoded->tokens.size(), 6u);
  // Feed prompt + all generated tokens but the last in one prefill: same routing, and the logits of its last
  // position pick the last generated token.
  std::vector<int32_t> seq = kPrompt;
  seq.insert(seq.end(), decoded->tokens.begin(), decoded->tokens.end() - 1);
  GenerateOptions one;
  one.max_new_tokens = 1;
  one.record_routing = true;
  auto pass = Generate(model->engine(), seq, one);
  ASSERT_TRUE(pass.ok()) << pass.status();
  EXPECT_EQ(pass->routing, decoded->routing);
  EXPECT_EQ(pass->tokens.at(0), decoded->tokens.back());
}

TEST_P(EngineModelTest, MockGpuComputesExactlyWhatTheCpuComputes) {
  auto cpu = OpenModel(GetParam(), "cpu");
  auto mock = OpenModel(GetParam(), "mock-gpu");
  ASSERT_TRUE(cpu && mock);
  GenerateOptions opt;
  opt.max_new_tokens = 5;
  opt.keep_last_logits = true;
  opt.record_routing = true;
  auto a = Generate(cpu->engine(), kPrompt, opt);
  auto b = Generate(mock->engine(), kPrompt, opt);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->last_logits, b->last_logits);  // bitwise: the same kernels on the bytes that crossed the link
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_EQ(a->routing, b->routing);
  // Everything ran on the engine's own device.
  EXPECT_GT(mock->device().op_counts().at("MatMul"), 0);
  EXPECT_GT(mock->device().transfer_stats().h2d_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Models, EngineModelTest,
                         ::testing::Values("mixtral-tiny", "qwen2moe-tiny", "qwen3moe-tiny", "olmoe-tiny"),
                         [](const auto& p) {
                           std::string n = p.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(EngineTest, BadRequestsAreErrors) {
  if (!odmoe::testing::HaveSharedModel("mixtral-tiny")) GTEST_SKIP() << "needs ../shared/models/mixtral-tiny";
  auto model = OpenModel("mixtral-tiny", "cpu");
  ASSERT_TRUE(model);
  const ModelConfig& c = model->config();
  GenerateOptions opt;
  opt.max_new_tokens = 2;
  std::vector<int32_t> bad = {1, static_cast<int32_t>(c.vocab_size)};
  auto r = Generate(model->engine(), bad, opt);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(r.status().message().find("outside the vocabulary"), absl::string_view::npos) << r.status();
  r = Generate(model->engine(), std::vector<int32_t>{}, opt);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> longest(static_cast<size_t>(c.max_position_embeddings), 1);
  r = Generate(model->engine(), longest, opt);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << r.status();
  EXPECT_NE(r.status().message().find("max_position_embeddings"), absl::string_view::npos) << r.status();
  // The engine still serves a good request afterwards.
  r = Generate(model->engine(), kPrompt, opt);
  EXPECT_TRUE(r.ok()) << r.status();
}

// ForwardAndSelect picks, on the device, the token the host picks from Forward's logits by the same choice; it hands
// the logits back too when asked, and a choice without a place for the token (or the reverse) is refused.
TEST(EngineTest, ForwardAndSelectPicksWhatTheHostPicksFromTheLogits) {
  if (!odmoe::testing::HaveSharedModel("mixtral-tiny")) GTEST_SKIP() << "needs ../shared/models/mixtral-tiny";
  for (const char* device : {"cpu", "mock-gpu"}) {
    SCOPED_TRACE(device);
    auto model = OpenModel("mixtral-tiny", device);
    ASSERT_TRUE(model);
    Engine& engine = model->engine();
    const std::vector<TokenChoice> choices = {{}, {0.9f, 20, 0.95f, 0.3f}, {1.4f, 0, 0.8f, 0.77f}};
    for (const TokenChoice& choice : choices) {
      ASSERT_TRUE(engine.StartSequence(16).ok());
      auto logits = engine.Forward(kPrompt, nullptr);
      ASSERT_TRUE(logits.ok()) << logits.status();
      int32_t want = -1;
      cpu::SelectTokens(logits->data(), 1, static_cast<int64_t>(logits->size()), &choice, &want);

      ASSERT_TRUE(engine.StartSequence(16).ok());
      std::vector<float> kept;
      auto got = engine.ForwardAndSelect(kPrompt, nullptr, ForwardKind::kPrefill, choice, &kept);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, want);
      EXPECT_EQ(kept, *logits);
      // A decode step that wants only the token.
      auto next = engine.ForwardAndSelect(std::vector<int32_t>{*got}, nullptr, ForwardKind::kDecode, choice);
      ASSERT_TRUE(next.ok()) << next.status();
      EXPECT_GE(*next, 0);
    }
    EXPECT_EQ(model->device().op_counts()["SelectTokens"], 6);

    auto seq = engine.NewSequence(8, 1);
    ASSERT_TRUE(seq.ok());
    const TokenChoice greedy;
    const BatchInput half{seq->get(), kPrompt, nullptr, nullptr, &greedy, nullptr};
    EXPECT_EQ(engine.ForwardBatch(std::span<const BatchInput>(&half, 1), ForwardKind::kPrefill).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*seq)->position(), 0) << "a refused forward advances nothing";
  }
}

TEST_P(EngineModelTest, TruncateAndKvRoundTripReproduceTheSequence) {
  // The shadow's roll back and KV alignment: truncating and running the same tokens again gives the same
  // logits bit for bit; the KV rows read from one engine and written into another make it continue exactly
  // as the first (here over its own, identical rows, then over rows of another sequence).
  auto model = OpenModel(GetParam(), "cpu");
  ASSERT_TRUE(model);
  Engine& e = model->engine();
  const ModelConfig& c = model->config();
  ASSERT_TRUE(e.StartSequence(32).ok());
  ASSERT_TRUE(e.Forward(kPrompt, nullptr).ok());
  const int32_t a = 5, b = 9;
  auto la = e.Forward(std::span<const int32_t>(&a, 1), nullptr);
  ASSERT_TRUE(la.ok());
  const std::vector<float> first = *la;
  ASSERT_EQ(e.position(), static_cast<int64_t>(kPrompt.size()) + 1);
  std::vector<float> k(static_cast<size_t>(c.num_layers * c.kv_size())), v(k.size());
  ASSERT_TRUE(e.ReadKv(e.position() - 1, k.data(), v.data()).ok());
  // Another token at the same position, then back.
  ASSERT_TRUE(e.Truncate(static_cast<int64_t>(kPrompt.size())).ok());
  auto lb = e.Forward(std::span<const int32_t>(&b, 1), nullptr);
  ASSERT_TRUE(lb.ok());
  EXPECT_NE(*lb, first);
  ASSERT_TRUE(e.Truncate(static_cast<int64_t>(kPrompt.size())).ok());
  la = e.Forward(std::span<const int32_t>(&a, 1), nullptr);
  ASSERT_TRUE(la.ok());
  EXPECT_EQ(*la, first);
  // Writing back the rows read gives the same continuation; the K/V of token b instead changes it.
  std::vector<float> kb(k.size()), vb(k.size());
  ASSERT_TRUE(e.Truncate(static_cast<int64_t>(kPrompt.size())).ok());
  ASSERT_TRUE(e.Forward(std::span<const int32_t>(&b, 1), nullptr).ok());
  ASSERT_TRUE(e.ReadKv(e.position() - 1, kb.data(), vb.data()).ok());
  EXPECT_NE(kb, k);
  const int32_t next = 7;
  ASSERT_TRUE(e.WriteKv(e.position() - 1, k.data(), v.data()).ok());  // b's position now holds a's K/V
  auto with_a = e.Forward(std::span<const int32_t>(&next, 1), nullptr);
  ASSERT_TRUE(with_a.ok());
  ASSERT_TRUE(e.Truncate(static_cast<int64_t>(kPrompt.size())).ok());
  ASSERT_TRUE(e.Forward(std::span<const int32_t>(&a, 1), nullptr).ok());
  auto reference = e.Forward(std::span<const int32_t>(&next, 1), nullptr);
  ASSERT_TRUE(reference.ok());
  EXPECT_EQ(*with_a, *reference);
  // A range read equals the rows read one by one ([count, layers, kv_size]).
  const int64_t count = e.position();
  std::vector<float> rk(static_cast<size_t>(count) * k.size()), rv(rk.size());
  ASSERT_TRUE(e.ReadKvRange(0, count, rk.data(), rv.data()).ok());
  for (int64_t p = 0; p < count; ++p) {
    ASSERT_TRUE(e.ReadKv(p, k.data(), v.data()).ok());
    EXPECT_TRUE(std::equal(k.begin(), k.end(), rk.begin() + p * static_cast<int64_t>(k.size()))) << p;
    EXPECT_TRUE(std::equal(v.begin(), v.end(), rv.begin() + p * static_cast<int64_t>(v.size()))) << p;
  }
  EXPECT_EQ(e.ReadKvRange(1, count, rk.data(), rv.data()).code(), absl::StatusCode::kOutOfRange);
  // Bad positions are errors.
  EXPECT_EQ(e.Truncate(e.position() + 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(e.ReadKv(e.position(), k.data(), v.data()).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(e.WriteKv(-1, k.data(), v.data()).code(), absl::StatusCode::kOutOfRange);
}

TEST_P(EngineModelTest, QuantizedReplicaStaysCloseToTheModel) {
  // The shadow's replica: FP16/INT8/NF4 decoder-layer weights give logits near the full model's, further
  // away as the code gets coarser, and not identical (the weights really are quantized).
  auto full = OpenModel(GetParam(), "cpu");
  ASSERT_TRUE(full);
  auto checkpoint = Checkpoint::Open(odmoe::testing::SharedModel(GetParam()));
  ASSERT_TRUE(checkpoint.ok());
  GenerateOptions opt;
  opt.max_new_tokens = 1;
  opt.keep_last_logits = true;
  auto reference = Generate(full->engine(), kPrompt, opt);
  ASSERT_TRUE(reference.ok());
  std::map<WeightQuant, double> err;
  for (WeightQuant q : {WeightQuant::kFp16, WeightQuant::kInt8, WeightQuant::kNf4}) {
    auto device = CreateDevice("cpu");
    ASSERT_TRUE(device.ok());
    auto weights = ModelWeights::Load(full->config(), **checkpoint, **device, WeightSelection::Quantized(q));
    ASSERT_TRUE(weights.ok()) << weights.status();
    auto experts = LocalExpertExecutor::Create(**device, **weights, 256);
    ASSERT_TRUE(experts.ok());
    auto engine = Engine::Create(**weights, **device, experts->get());
    ASSERT_TRUE(engine.ok());
    auto r = Generate(**engine, kPrompt, opt);
    ASSERT_TRUE(r.ok()) << r.status();
    err[q] = MaxRelDiff(r->last_logits, reference->last_logits);
    if (q == WeightQuant::kInt8 || q == WeightQuant::kNf4) {
      EXPECT_GT(err[q], 0.0);  // (fp16 can be exact: bf16 checkpoints' values often fit fp16)
      // Quantized weights are a quarter / an eighth of fp32 (plus scales).
      EXPECT_LT((*weights)->device_bytes(), full->weights().device_bytes());
    }
  }
  // Loose bounds: these test models have random weights and small logits, so relative errors look large.
  EXPECT_LT(err[WeightQuant::kFp16], 1e-2);
  EXPECT_LT(err[WeightQuant::kInt8], 0.2);
  EXPECT_LT(err[WeightQuant::kNf4], 1.5);
  EXPECT_LE(err[WeightQuant::kFp16], err[WeightQuant::kInt8]);
  EXPECT_LT(err[WeightQuant::kInt8], err[WeightQuant::kNf4]);
}

TEST_P(EngineModelTest, StackedProjectionsAreTheirMatricesBitwise) {
  // Each layer's q, k and v (and biases), and the gate and up of a shared expert or dense MLP, are stored as one
  // stack whose row blocks are the matrices, so that one token's projections take one MatMul: each row must be
  // bitwise what its own matrix gives, at every precision the shadow's replica may use.
  odmoe::testing::ExpectStackedProjectionsBitwise(GetParam(), "cpu");
}

TEST(GroupByExpertTest, AscendingExpertsTokensInOrder) {
  // 3 tokens, k = 2.
  const std::vector<int32_t> ids = {5, 1, 1, 3, 5, 3};
  const std::vector<float> w = {0.6f, 0.4f, 0.7f, 0.3f, 0.9f, 0.1f};
  auto b = GroupByExpert(ids, w, 3, 2);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].expert, 1);
  EXPECT_EQ(b[0].rows, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(b[0].weights, (std::vector<float>{0.4f, 0.7f}));
  EXPECT_EQ(b[1].expert, 3);
  EXPECT_EQ(b[1].rows, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(b[2].expert, 5);
  EXPECT_EQ(b[2].rows, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(b[2].weights, (std::vector<float>{0.6f, 0.9f}));
}

}  // namespace
}  // namespace odmoe
