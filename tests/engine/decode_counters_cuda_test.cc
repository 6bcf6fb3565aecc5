// What one decode step of the resident engine asks of the GPU, as the emulated CUDA runtime counts it
// (tools/simt/include/simt/counters.h): host synchronizations, device allocations, kernel launches per layer, the
// bytes written into the KV cache and the bytes copied back to the host, per decode token, on tiny-mixtral-kjv
// (8 layers, 2 KV heads of 32). Built only against the SIMT emulator (tools/simt/tests/CMakeLists.txt), label
// cuda-emulated: the counts are the runtime's, not the engine's own report. Also: the resident path that makes
// those counts (routed experts from the router's ids on the device) gives the host path's logits and routing bit
// for bit, and the tokens picked on the device are the host sampler's for the same logits; and on qwen3moe-tiny,
// the launches its per-head q / k norms and RoPE take.
//
// The bounds are what the engine achieves now (issue 24 lowers them; the figures it printed are in the commit
// messages): each one fails when a change adds a sync, an allocation or launches to the decode step.
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "simt/counters.h"
#include "src/backend/device_factory.h"
#include "src/common/limits.h"
#include "src/common/status.h"
#include "src/engine/generator.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

// Per decode token, on tiny-mixtral-kjv.
// 25 while the router's ids and weights came back in two copies and the expert executor synchronized at its end;
// 9 with one copy per layer (ids and weights together, into page-locked memory) and the logits; now the experts
// read the router's ids on the device and the logits' copy is the only wait: 1.
constexpr double kMaxHostSyncs = 1;
// 23.4 before the KV cache was bf16; 25.4 when its K and V rows were written by two conversion kernels per layer
// where two device-to-device copies (not counted as launches) wrote fp32 rows; now the routed experts are three
// launches per layer (gate and up with SwiGLU, down, the ordered combine) where each of the 2 experts took 5
// (3 GEMVs, SwiGLU, scatter-add): 18.4; 18.5 with the token picked on the device (one launch per token); 15.5 since
// one token's q, k and v come from one GEMV over the stacked projection and q and k take one RoPE launch; 13.625
// since each residual addition but the last is one launch with the norm after it (109 a token: 15 fewer); 12.625
// since K and V go into their caches in one launch (101 a token); 10.625 since the post-attention norm, the
// router's GEMV and its top-k are one launch (85 a token); 9.625 since K and V go into their caches in RoPE's
// launch (77 a token).
constexpr double kMaxLaunchesPerLayer = 9.625;
// The kernels a replayed graph runs per layer: one more, the attention's split combine, which a graph holds
// whenever the sequence's capacity may need it (here 61 positions: two 32-key splits) and which returns at once
// while the context has one split; none of them launched by the host. 19.5 before q, k and v were stacked, 16.5
// before the residual additions took their norms with them, 14.625 before K and V were written by one launch,
// 13.625 before the norm and the router were one launch, 11.625 before K and V were written by RoPE's launch.
constexpr double kMaxGraphKernelsPerLayer = 10.625;
constexpr double kMaxPageableCopies =
    0;  // 17 before the router's result and the logits came back to page-locked memory
// Bytes copied from the device into host memory per greedy decode token: the token's id alone (4 bytes a row) since
// the token is picked on the device; the whole logits row before (vocab x 4 = 16384 bytes).
constexpr double kHostBytesPerToken = sizeof(int32_t);
// Bytes the copies of a decode token read from device memory, in hidden-state rows: the output row gathered for
// the LM head (the token's id comes on top). One more per sparse layer while `moe` was zeroed by a copy before the
// routed experts added onto it; they write it now.
constexpr double kDeviceCopyRowsPerToken = 1;

constexpr char kModel[] = "tiny-mixtral-kjv";

// `name` (kModel unless given) on the (emulated) CUDA device.
absl::StatusOr<std::unique_ptr<LocalModel>> OpenOnCuda(const std::string& name = kModel) {
  if (!testing::HaveSharedModel(name)) return absl::NotFoundError("needs " + testing::SharedModel(name));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice("cuda"));
  return LocalModel::Open(testing::SharedModel(name), std::move(device));
}

// An engine of its own over `model`'s weights and device, its experts resident (LocalExpertExecutor).
struct SecondEngine {
  std::unique_ptr<LocalExpertExecutor> experts;
  std::unique_ptr<Engine> engine;
};
absl::StatusOr<SecondEngine> MakeEngine(LocalModel& model, EngineOptions options) {
  SecondEngine e;
  ODMOE_ASSIGN_OR_RETURN(e.experts, LocalExpertExecutor::Create(model.device(), model.weights(), kMaxTokenRows));
  ODMOE_ASSIGN_OR_RETURN(e.engine, Engine::Create(model.weights(), model.device(), e.experts.get(), options));
  return e;
}

// The runtime's counts of kSteps greedy decode tokens (each picked on the device and fed back, as Generate runs
// them), after a prompt and `warm_up` such tokens, on a sequence of kCapacity positions.
constexpr int kSteps = 3;
constexpr int64_t kCapacity = 61;  // odd, so the KV cache's allocations are the only ones of their size
struct DecodeCounts {
  simt::Counters counts;
  DeviceCounters device;
  int64_t kv_written = 0;  // bytes written into the KV caches
  int kv_buffers = 0;      // caches written into
};
DecodeCounts CountDecode(Engine& engine, Device& device, int warm_up, const std::string& name = kModel) {
  DecodeCounts out;
  const ModelConfig& c = engine.config();
  EXPECT_TRUE(engine.StartSequence(kCapacity).ok());
  std::vector<int32_t> prompt = {1, 415, 2936, 302};
  for (int32_t& id : prompt) id %= static_cast<int32_t>(c.vocab_size);
  EXPECT_TRUE(engine.Forward(prompt, nullptr, ForwardKind::kPrefill).ok());
  int32_t next = 7;
  const auto step = [&] {
    auto token = engine.ForwardAndSelect(std::vector<int32_t>{next}, nullptr, ForwardKind::kDecode, TokenChoice{});
    EXPECT_TRUE(token.ok()) << token.status();
    next = token.value_or(0);
  };
  for (int i = 0; i < warm_up; ++i) step();
  simt::ResetCounters();
  EXPECT_EQ(device.counters().host_syncs, 0u) << "Device::counters() reads the runtime's counts";
  for (int i = 0; i < kSteps; ++i) step();
  out.counts = simt::ReadCounters();
  out.device = device.counters();
  // The cache is in the model's dtype, bf16 (2 bytes a value).
  const size_t kv_cache_bytes = static_cast<size_t>(kCapacity * c.kv_size()) * 2;
  for (const auto& [base, w] : out.counts.written) {
    if (w.size == kv_cache_bytes) {
      out.kv_written += static_cast<int64_t>(w.bytes);
      ++out.kv_buffers;
    }
  }
  const auto per_token = [](uint64_t v) { return static_cast<double>(v) / kSteps; };
  const simt::Counters& n = out.counts;
  std::cout << "[decode counters] " << name << " per decode token: host syncs " << per_token(n.host_syncs)
            << ", pageable copies to host " << per_token(n.pageable_copies_to_host) << ", allocations "
            << per_token(n.allocations) << ", frees " << per_token(n.frees) << ", launches " << per_token(n.launches)
            << " (" << per_token(n.launches) / static_cast<double>(c.num_layers) << " per layer; "
            << per_token(n.launches - n.graph_kernel_launches) << " by the host), graph launches "
            << per_token(n.graph_launches) << ", bytes copied from device " << per_token(n.copy_bytes_from_device)
            << " (to the host " << per_token(n.copy_bytes_to_host) << "), KV-cache bytes written "
            << per_token(static_cast<uint64_t>(out.kv_written)) << " into " << out.kv_buffers << " buffers\n";
  for (const auto& [site, s] : n.sites) {
    std::cout << "  " << per_token(s.launches) << " x " << site << ": bytes read " << per_token(s.bytes_read)
              << ", written " << per_token(s.bytes_written) << "; read-only loads " << per_token(s.ldg.bytes)
              << " bytes, " << s.ldg.LinesPer128Bytes() << " lines per 128 bytes\n";
  }
  return out;
}

// What both paths of a decode step must hold to (kSteps tokens counted in `d`).
void ExpectDecodeBounds(const DecodeCounts& d, const ModelConfig& c, double max_launches_per_layer) {
  const auto per_token = [](uint64_t v) { return static_cast<double>(v) / kSteps; };
  EXPECT_EQ(d.device.host_syncs, d.counts.host_syncs);
  EXPECT_EQ(d.device.launches, d.counts.launches);
  EXPECT_EQ(d.device.graph_launches, d.counts.graph_launches);
  EXPECT_LE(per_token(d.counts.host_syncs), kMaxHostSyncs);
  EXPECT_LE(per_token(d.counts.pageable_copies_to_host), kMaxPageableCopies);
  EXPECT_EQ(d.counts.allocations, 0u) << "a resident decode step allocates nothing";
  EXPECT_EQ(d.counts.frees, 0u);
  EXPECT_LE(per_token(d.counts.launches) / static_cast<double>(c.num_layers), max_launches_per_layer);
  EXPECT_EQ(per_token(d.counts.copy_bytes_to_host), kHostBytesPerToken)
      << "a greedy decode token brings back its id alone, not the logits";
  EXPECT_EQ(per_token(d.counts.copy_bytes_from_device),
            kDeviceCopyRowsPerToken * static_cast<double>(c.hidden_size * sizeof(float)) + kHostBytesPerToken)
      << "no copy into the routed experts' output before they write it";
  // K and V of one position per layer, bf16: 2 x layers x kv_heads x head_dim x 2 (counted in the checked build,
  // where kernels' stores are).
  EXPECT_EQ(d.kv_buffers, 2 * c.num_layers);
  EXPECT_EQ(per_token(static_cast<uint64_t>(d.kv_written)),
            static_cast<double>(2 * c.num_layers * c.num_kv_heads * c.head_dim * 2));
}

// Launches per kernel name (the site without its file and line).
std::map<std::string, uint64_t> LaunchesByKernel(const DecodeCounts& d) {
  std::map<std::string, uint64_t> launches;
  for (const auto& [site, counts] : d.counts.sites) launches[site.substr(0, site.rfind(' '))] += counts.launches;
  return launches;
}

// Op by op (EngineOptions::decode_graphs off): every kernel launched by the host.
TEST(DecodeCountersCudaTest, ResidentDecodeStepOnTinyMixtral) {
  auto model = OpenOnCuda();
  ASSERT_TRUE(model.ok()) << model.status();
  EngineOptions options;
  options.decode_graphs = false;
  auto second = MakeEngine(**model, options);
  ASSERT_TRUE(second.ok()) << second.status();
  Engine& engine = *second->engine;
  const DecodeCounts d = CountDecode(engine, (*model)->device(), /*warm_up=*/1);
  ExpectDecodeBounds(d, (*model)->config(), kMaxLaunchesPerLayer);
  // K and V go into the caches from RoPE's launch, one a layer: no KV store kernel of their own.
  std::map<std::string, uint64_t> launches = LaunchesByKernel(d);
  EXPECT_EQ(static_cast<double>(launches["RopeKernel<KV>"]) / kSteps,
            static_cast<double>((*model)->config().num_layers));
  EXPECT_EQ(launches.count("RopeKernel<void>"), 0u);
  EXPECT_EQ(launches.count("AttentionKvStoreKernel<KV, 4>") + launches.count("AttentionKvStoreKernel<KV, 1>"), 0u);
  EXPECT_EQ(d.counts.graph_launches, 0u);
  EXPECT_EQ(d.counts.graph_kernel_launches, 0u);
  EXPECT_EQ((*model)->device().op_counts()["SelectTokens"], kSteps + 1);
}

// As Generate runs it (graphs on): the first decode step of a kind runs op by op, the second is recorded into a
// graph, and every later one is that graph's one launch: no kernel launched by the host, the same kernels run.
TEST(DecodeCountersCudaTest, ResidentDecodeStepIsOneGraphLaunch) {
  auto model = OpenOnCuda();
  ASSERT_TRUE(model.ok()) << model.status();
  Engine& engine = (*model)->engine();
  const DecodeCounts d = CountDecode(engine, (*model)->device(), /*warm_up=*/2);
  ExpectDecodeBounds(d, (*model)->config(), kMaxGraphKernelsPerLayer);
  EXPECT_EQ(engine.decode_graphs().captures(), 1u);
  EXPECT_EQ(d.counts.graph_launches, static_cast<uint64_t>(kSteps)) << "one graph launch per token";
  EXPECT_EQ(d.counts.graph_kernel_launches, d.counts.launches) << "every kernel of the step from the graph";
  EXPECT_EQ(d.device.graph_kernel_launches, d.counts.graph_kernel_launches);
  // The ops of a replayed step are counted as run (the step's SelectTokens each time).
  EXPECT_EQ((*model)->device().op_counts()["SelectTokens"], kSteps + 2);
}

// Qwen3's per-head q / k norms and the rotation after them are one launch per layer (HeadNormRopeKernel) where
// they were three (two RMSNorms over the heads, one RoPE), and that launch also writes K and V into the caches
// (one more before): the only norms launched are the model's residual ones (the first layer's input norm, two per
// layer but the last's second, the final norm).
TEST(DecodeCountersCudaTest, Qwen3HeadNormsAndRopeAreOneLaunchPerLayer) {
  auto model = OpenOnCuda("qwen3moe-tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config();
  ASSERT_EQ(c.qk_norm, QkNorm::kPerHead);
  EngineOptions options;
  options.decode_graphs = false;
  auto second = MakeEngine(**model, options);
  ASSERT_TRUE(second.ok()) << second.status();
  const DecodeCounts d = CountDecode(*second->engine, (*model)->device(), /*warm_up=*/1, "qwen3moe-tiny");
  std::map<std::string, uint64_t> launches = LaunchesByKernel(d);
  const auto per_token = [](uint64_t v) { return static_cast<double>(v) / kSteps; };
  EXPECT_EQ(per_token(launches["HeadNormRopeKernel<W, KV>"]), static_cast<double>(c.num_layers));
  EXPECT_EQ(launches.count("RopeKernel<void>") + launches.count("RopeKernel<KV>"), 0u);
  EXPECT_EQ(launches.count("AttentionKvStoreKernel<KV, 4>") + launches.count("AttentionKvStoreKernel<KV, 1>"), 0u)
      << "K and V go into the caches from the norms' and RoPE's launch";
  EXPECT_EQ(per_token(launches["RmsNormHeldKernel<W, 1>"]), static_cast<double>(2 * c.num_layers + 1));
  EXPECT_LE(per_token(d.counts.host_syncs), kMaxHostSyncs);
  EXPECT_EQ(d.counts.allocations, 0u);
}

// Two sequences decoded together, one greedy and one sampled, by an engine with graphs and one without: the same
// tokens and routing at every step, through the changes that make a new graph or drop one: a batch that changes
// (one sequence alone for a while), a sequence rolled back (Truncate: same caches, earlier positions) and a
// sequence whose caches are made anew (StartSequence with more room).
TEST(DecodeCountersCudaTest, GraphsGiveTheOpByOpTokensAndRouting) {
  auto model = OpenOnCuda();
  ASSERT_TRUE(model.ok()) << model.status();
  EngineOptions options;
  options.max_sequences_per_forward = 2;
  auto graphs = MakeEngine(**model, options);
  options.decode_graphs = false;
  auto op_by_op = MakeEngine(**model, options);
  ASSERT_TRUE(graphs.ok() && op_by_op.ok());
  Engine* engines[2] = {graphs->engine.get(), op_by_op->engine.get()};
  const TokenChoice choices[2] = {TokenChoice{}, TokenChoice{0.9f, 40, 0.95f, 0.0f}};

  std::vector<int32_t> tokens[2];              // per engine: every token picked, in order
  std::vector<PositionRouting> routing[2][2];  // per engine, per sequence
  simt::ResetCounters();
  for (int e = 0; e < 2; ++e) {
    Engine& engine = *engines[e];
    std::unique_ptr<Sequence> seqs[2];
    int32_t next[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      auto seq = engine.NewSequence(40, static_cast<uint64_t>(i + 1));
      ASSERT_TRUE(seq.ok()) << seq.status();
      seqs[i] = *std::move(seq);
      const std::vector<int32_t> prompt = {1, 415 + i, 2936, 302 - i};
      BatchInput in{seqs[i].get(), prompt, &routing[e][i]};
      in.choice = &choices[0];
      in.token = &next[i];
      ASSERT_TRUE(engine.ForwardBatch(std::span<const BatchInput>(&in, 1), ForwardKind::kPrefill).ok());
    }
    // Steps 0-4 both sequences, 5-7 the first alone, 8-9 both again, the first rolled back by one before step 8.
    for (int step = 0; step < 10; ++step) {
      const int count = step >= 5 && step < 8 ? 1 : 2;
      if (step == 8) {
        ASSERT_TRUE(engine.Truncate(*seqs[0], seqs[0]->position() - 1).ok());
      }
      std::vector<BatchInput> inputs;
      int32_t fed[2];
      TokenChoice step_choices[2];
      for (int i = 0; i < count; ++i) {
        step_choices[i] = choices[i];
        step_choices[i].uniform = static_cast<float>((step * 7 + i * 3) % 10) / 10.0f;  // a new draw each step
        fed[i] = next[i];
        BatchInput in{seqs[i].get(), std::span<const int32_t>(&fed[i], 1), &routing[e][i]};
        in.choice = &step_choices[i];
        in.token = &next[i];
        inputs.push_back(in);
      }
      ASSERT_TRUE(engine.ForwardBatch(inputs, ForwardKind::kDecode).ok()) << "step " << step;
      for (int i = 0; i < count; ++i) tokens[e].push_back(next[i]);
    }
    // The engine's own sequence, made anew with more room (new caches) after a step of the old ones.
    ASSERT_TRUE(engine.StartSequence(16).ok());
    ASSERT_TRUE(engine.Forward(std::vector<int32_t>{1, 415}, nullptr, ForwardKind::kPrefill).ok());
    int32_t own = 302;
    for (int step = 0; step < 6; ++step) {
      if (step == 3) {
        ASSERT_TRUE(engine.StartSequence(24).ok());
        ASSERT_TRUE(engine.Forward(std::vector<int32_t>{1, 415}, nullptr, ForwardKind::kPrefill).ok());
      }
      auto token = engine.ForwardAndSelect(std::vector<int32_t>{own}, nullptr, ForwardKind::kDecode, TokenChoice{});
      ASSERT_TRUE(token.ok()) << token.status();
      own = *token;
      tokens[e].push_back(own);
    }
  }
  EXPECT_EQ(tokens[0], tokens[1]);
  EXPECT_EQ(routing[0][0], routing[1][0]);
  EXPECT_EQ(routing[0][1], routing[1][1]);
  EXPECT_EQ(routing[0][0].size(), 4u + 10u);
  // Recorded: both sequences at step 1 (replayed at 2-4, and again at 8-9 after the roll back), the first alone at
  // step 6 (replayed at 7), the own sequence's first caches at its step 1 (replayed at 2) and its new ones at 4
  // (replayed at 5).
  EXPECT_EQ(graphs->engine->decode_graphs().captures(), 4u);
  EXPECT_EQ(op_by_op->engine->decode_graphs().captures(), 0u);
  EXPECT_GT(simt::ReadCounters().graph_launches, 0u);
}

// Run only: the ids come to the host every layer (as for main's remote executor and the shadow's).
class HostIdsExecutor : public ExpertExecutor {
 public:
  explicit HostIdsExecutor(ExpertExecutor& inner) : inner_(inner) {}
  absl::Status Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                   std::span<const float> weights, float* out, Stream* stream) override {
    return inner_.Run(layer, h, n, ids, weights, out, stream);
  }

 private:
  ExpertExecutor& inner_;
};

// The resident engine (experts from the device ids, up to 8 rows a chunk) and the same engine with the ids
// brought to the host every layer give bitwise the same logits and the same routing, for a prefill that fits
// the resident path, one that does not (12 rows) and decode steps.
TEST(DecodeCountersCudaTest, ResidentPathGivesTheHostPathsLogitsAndRouting) {
  auto model = OpenOnCuda();
  ASSERT_TRUE(model.ok()) << model.status();
  Device& d = (*model)->device();
  const ModelConfig& c = (*model)->config();
  auto local = LocalExpertExecutor::Create(d, (*model)->weights(), kMaxTokenRows);
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_GT((*local)->DeviceIdsMaxTokens(), 0) << "every expert resident and dense on CUDA";
  HostIdsExecutor host_ids(**local);
  auto host_engine = Engine::Create((*model)->weights(), d, &host_ids);
  ASSERT_TRUE(host_engine.ok()) << host_engine.status();

  for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{1, 415, 2936, 302},
                                             std::vector<int32_t>{1, 9, 88, 415, 2936, 302, 7, 41, 5, 6, 1000, 3}}) {
    std::vector<PositionRouting> routing[2];
    std::vector<float> logits[2];
    Engine* engines[2] = {&(*model)->engine(), host_engine->get()};
    const int64_t resident_before = d.op_counts()["RoutedExperts"];
    for (int e = 0; e < 2; ++e) {
      ASSERT_TRUE(engines[e]->StartSequence(64).ok());
      auto out = engines[e]->Forward(prompt, &routing[e], ForwardKind::kPrefill);
      ASSERT_TRUE(out.ok()) << out.status();
      int32_t next = 7;
      for (int step = 0; step < 3; ++step) {
        out = engines[e]->Forward(std::vector<int32_t>{next}, &routing[e], ForwardKind::kDecode);
        ASSERT_TRUE(out.ok()) << out.status();
        next = static_cast<int32_t>((next * 31 + 11) % c.vocab_size);
        logits[e].insert(logits[e].end(), out->begin(), out->end());
      }
    }
    const int64_t sparse_layers = c.num_layers;  // every layer of tiny-mixtral-kjv is routed
    const int64_t resident_chunks = prompt.size() <= 8 ? 4 : 3;
    EXPECT_EQ(d.op_counts()["RoutedExperts"] - resident_before, resident_chunks * sparse_layers)
        << "only the resident engine, and only for chunks of up to 8 rows";
    ASSERT_EQ(logits[0].size(), logits[1].size());
    EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0)
        << "prompt of " << prompt.size() << ": the logits differ";
    EXPECT_EQ(routing[0], routing[1]) << "prompt of " << prompt.size();
    ASSERT_EQ(routing[0].size(), prompt.size() + 3);
    EXPECT_EQ(static_cast<int64_t>(routing[0][0].size()), sparse_layers);
  }
}

// Generate picks each token on the device (only its id comes back); the host sampler, given every logits row and
// the same seed, picks the same tokens: greedy, and sampling with and without top-k / top-p / min-p cuts.
TEST(DecodeCountersCudaTest, TokensPickedOnTheDeviceAreTheHostSamplersOnTheSameLogits) {
  auto model = OpenOnCuda();
  ASSERT_TRUE(model.ok()) << model.status();
  Engine& engine = (*model)->engine();
  const std::vector<int32_t> prompt = {1, 415, 2936, 302};
  constexpr int kTokens = 8;
  std::vector<std::vector<int32_t>> picked;
  for (const SamplingOptions& sampling :
       {SamplingOptions{}, SamplingOptions{.temperature = 0.9, .top_k = 40, .top_p = 0.95, .seed = 5},
        SamplingOptions{.temperature = 1.5, .top_k = 0, .top_p = 0.7, .seed = 6},
        SamplingOptions{.temperature = 1.2, .top_k = 3, .top_p = 1.0, .seed = 7},
        SamplingOptions{.temperature = 1.5, .top_k = 0, .top_p = 1.0, .min_p = 0.1, .seed = 8}}) {
    GenerateOptions options;
    options.max_new_tokens = kTokens;
    options.ignore_eos = true;
    options.sampling = sampling;
    auto generated = Generate(engine, prompt, options);
    ASSERT_TRUE(generated.ok()) << generated.status();

    Sampler sampler(sampling);
    ASSERT_TRUE(engine.StartSequence(static_cast<int64_t>(prompt.size()) + kTokens).ok());
    auto logits = engine.Forward(prompt, nullptr, ForwardKind::kPrefill);
    std::vector<int32_t> host;
    for (int i = 0; i < kTokens; ++i) {
      if (i > 0) logits = engine.Forward(std::vector<int32_t>{host.back()}, nullptr, ForwardKind::kDecode);
      ASSERT_TRUE(logits.ok()) << logits.status();
      host.push_back(sampler.Next(*logits));
    }
    EXPECT_EQ(generated->tokens, host) << "temperature " << sampling.temperature << " top_k " << sampling.top_k
                                       << " top_p " << sampling.top_p << " min_p " << sampling.min_p;
    picked.push_back(host);
  }
  EXPECT_TRUE(picked[1] != picked[0] || picked[2] != picked[0] || picked[3] != picked[0])
      << "the sampled requests should not all be the greedy one";
}

}  // namespace
}  // namespace odmoe
