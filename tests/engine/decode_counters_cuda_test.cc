// What one decode step of the resident engine asks of the GPU, as the emulated CUDA runtime counts it
// (tools/simt/include/simt/counters.h): host synchronizations, device allocations, kernel launches per layer, the
// bytes written into the KV cache and the bytes copied back to the host, per decode token, on tiny-mixtral-kjv
// (8 layers, 2 KV heads of 32). Built only against the SIMT emulator (tools/simt/tests/CMakeLists.txt), label
// cuda-emulated: the counts are the runtime's, not the engine's own report. Also: the resident path that makes
// those counts (routed experts from the router's ids on the device) gives the host path's logits and routing bit
// for bit, and the tokens picked on the device are the host sampler's for the same logits.
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
// (3 GEMVs, SwiGLU, scatter-add): 18.4; 18.5 with the token picked on the device (one launch per token).
constexpr double kMaxLaunchesPerLayer = 18.5;
constexpr double kMaxPageableCopies =
    0;  // 17 before the router's result and the logits came back to page-locked memory
// Bytes copied from the device into host memory per greedy decode token: the token's id alone (4 bytes a row) since
// the token is picked on the device; the whole logits row before (vocab x 4 = 16384 bytes).
constexpr double kHostBytesPerToken = sizeof(int32_t);

constexpr char kModel[] = "tiny-mixtral-kjv";

// kModel on the (emulated) CUDA device.
absl::StatusOr<std::unique_ptr<LocalModel>> OpenOnCuda() {
  if (!testing::HaveSharedModel(kModel)) return absl::NotFoundError("needs " + testing::SharedModel(kModel));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice("cuda"));
  return LocalModel::Open(testing::SharedModel(kModel), std::move(device));
}

TEST(DecodeCountersCudaTest, ResidentDecodeStepOnTinyMixtral) {
  auto model = OpenOnCuda();
  ASSERT_TRUE(model.ok()) << model.status();
  Engine& engine = (*model)->engine();
  const ModelConfig& c = (*model)->config();

  // An odd capacity, so the KV cache's allocations are the only ones of their size.
  constexpr int64_t kCapacity = 61;
  ASSERT_TRUE(engine.StartSequence(kCapacity).ok());
  const std::vector<int32_t> prompt = {1, 415, 2936, 302};
  ASSERT_TRUE(engine.Forward(prompt, nullptr, ForwardKind::kPrefill).ok());
  // One decode step first: whatever a first decode sets up once (e.g. the attention's scratch) is not per token.
  int32_t next = 7;
  ASSERT_TRUE(engine.Forward(std::vector<int32_t>{next}, nullptr, ForwardKind::kDecode).ok());

  // Greedy decode as Generate runs it: each token picked on the device and fed back.
  constexpr int kSteps = 3;
  simt::ResetCounters();
  const DeviceCounters before = (*model)->device().counters();
  EXPECT_EQ(before.host_syncs, 0u) << "Device::counters() reads the runtime's counts";
  for (int step = 0; step < kSteps; ++step) {
    auto token = engine.ForwardAndSelect(std::vector<int32_t>{next}, nullptr, ForwardKind::kDecode, TokenChoice{});
    ASSERT_TRUE(token.ok()) << token.status();
    next = *token;
  }
  const simt::Counters counts = simt::ReadCounters();
  const DeviceCounters device_counts = (*model)->device().counters();

  // The cache is in the model's dtype, bf16 (2 bytes a value).
  const size_t kv_cache_bytes = static_cast<size_t>(kCapacity * c.kv_size()) * 2;
  uint64_t kv_written = 0;
  int kv_buffers = 0;
  for (const auto& [base, w] : counts.written) {
    if (w.size == kv_cache_bytes) {
      kv_written += w.bytes;
      ++kv_buffers;
    }
  }
  const double syncs = static_cast<double>(counts.host_syncs) / kSteps;
  const double pageable = static_cast<double>(counts.pageable_copies_to_host) / kSteps;
  const double allocations = static_cast<double>(counts.allocations) / kSteps;
  const double launches = static_cast<double>(counts.launches) / kSteps;
  const double launches_per_layer = launches / static_cast<double>(c.num_layers);
  const double kv_bytes = static_cast<double>(kv_written) / kSteps;
  const double host_bytes = static_cast<double>(counts.copy_bytes_to_host) / kSteps;
  std::cout << "[decode counters] " << kModel << " per decode token: host syncs " << syncs
            << ", pageable copies to host " << pageable << ", allocations " << allocations << ", frees "
            << static_cast<double>(counts.frees) / kSteps << ", launches " << launches << " (" << launches_per_layer
            << " per layer), bytes copied from device " << static_cast<double>(counts.copy_bytes_from_device) / kSteps
            << " (to the host " << host_bytes << ")"
            << ", KV-cache bytes written " << kv_bytes << " into " << kv_buffers << " buffers\n";
  for (const auto& [site, s] : counts.sites) {
    std::cout << "  " << static_cast<double>(s.launches) / kSteps << " x " << site << "\n";
  }

  EXPECT_EQ(device_counts.host_syncs, counts.host_syncs);
  EXPECT_EQ(device_counts.launches, counts.launches);
  EXPECT_LE(syncs, kMaxHostSyncs);
  EXPECT_LE(pageable, kMaxPageableCopies);
  EXPECT_EQ(counts.allocations, 0u) << "a resident decode step allocates nothing";
  EXPECT_EQ(counts.frees, 0u);
  EXPECT_LE(launches_per_layer, kMaxLaunchesPerLayer);
  EXPECT_EQ(host_bytes, kHostBytesPerToken) << "a greedy decode token brings back its id alone, not the logits";
  EXPECT_EQ((*model)->device().op_counts()["SelectTokens"], kSteps);
  // K and V of one position per layer, bf16: 2 x layers x kv_heads x head_dim x 2 (counted in the checked build,
  // where kernels' stores are).
  EXPECT_EQ(kv_buffers, 2 * c.num_layers);
  EXPECT_EQ(kv_bytes, static_cast<double>(2 * c.num_layers * c.num_kv_heads * c.head_dim * 2));
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
// the same seed, picks the same tokens: greedy, and sampling with and without top-k / top-p cuts.
TEST(DecodeCountersCudaTest, TokensPickedOnTheDeviceAreTheHostSamplersOnTheSameLogits) {
  auto model = OpenOnCuda();
  ASSERT_TRUE(model.ok()) << model.status();
  Engine& engine = (*model)->engine();
  const std::vector<int32_t> prompt = {1, 415, 2936, 302};
  constexpr int kTokens = 8;
  std::vector<std::vector<int32_t>> picked;
  for (const SamplingOptions& sampling : {SamplingOptions{}, SamplingOptions{0.9, 40, 0.95, 5},
                                          SamplingOptions{1.5, 0, 0.7, 6}, SamplingOptions{1.2, 3, 1.0, 7}}) {
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
                                       << " top_p " << sampling.top_p;
    picked.push_back(host);
  }
  EXPECT_TRUE(picked[1] != picked[0] || picked[2] != picked[0] || picked[3] != picked[0])
      << "the sampled requests should not all be the greedy one";
}

}  // namespace
}  // namespace odmoe
