// Timed devices (src/backend/timed_device.h) and their shape map (src/backend/shape_map.h): the modelled
// duration of ops and copies read from the device's virtual clock (no test waits on a real clock), time_scale,
// the pinned and pageable links, charging at Mixtral-8x7B's shapes, pacing to a (fake) wall clock, results equal
// to the mock GPU's bit for bit, and CreateNodeDevice for a cluster file's "timed:PROFILE" node.
#include "src/backend/timed_device.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/backend/mock_gpu_device.h"
#include "src/backend/shape_map.h"
#include "src/common/cluster_config.h"
#include "src/common/strings.h"
#include "src/model/model_config.h"
#include "src/model/synthetic.h"
#include "tests/backend/run_every_op.h"

namespace odmoe {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Round figures so that expected times are easy to write.
DeviceProfile TestProfile() {
  DeviceProfile p;
  p.name = "card";
  p.memory_bytes = uint64_t{1} << 30;
  p.memory_bytes_per_s = 100e9;
  p.h2d_pinned_bytes_per_s = 10e9;
  p.h2d_pageable_bytes_per_s = 5e9;
  p.d2h_bytes_per_s = 8e9;
  p.launch_latency_s = 4e-6;
  p.copy_latency_s = 6e-6;
  p.fp32_flops_per_s = 1e12;
  p.bf16_flops_per_s = 2e12;
  p.fp16_flops_per_s = 2e12;
  p.int8_ops_per_s = 4e12;
  return p;
}

std::unique_ptr<MockGpuDevice> Timed(double time_scale = 1.0, ShapeMap shapes = {},
                                     std::shared_ptr<WallClock> clock = nullptr) {
  TimedDeviceOptions o;
  o.profile = TestProfile();
  o.shapes = std::move(shapes);
  o.time_scale = time_scale;
  o.wall_clock = std::move(clock);
  o.record_timeline = true;
  return CreateTimedDevice(o);
}

std::unique_ptr<Buffer> Alloc(Device& device, size_t bytes) {
  auto buffer = device.Allocate(bytes, "test");
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return buffer.ok() ? std::move(*buffer) : nullptr;
}

// Durations are differences of clock readings: equal to the expected figure within a picosecond.
constexpr double kTol = 1e-12;
double Duration(const MockGpuInterval& i) { return i.end_s - i.start_s; }

// tests/data/tiny-mixtral (hidden 64, experts of 128, 4 heads / 2 kv heads of 16, vocab 256, 4 experts) charged
// as configs/models/mixtral-8x7b (4096, 14336, 32 / 8 of 128, 32000, 8), bf16 on both sides.
ShapeMap TinyAsMixtral() {
  auto running = SyntheticModelConfig(SyntheticSpec{StrCat(ODMOE_SOURCE_DIR, "/tests/data/tiny-mixtral"), 0, 0});
  EXPECT_TRUE(running.ok()) << running.status();
  auto shapes = TimingShapes(*running, /*running_expert_bytes=*/3 * 64 * 128 * 2, "tiny-mixtral",
                             StrCat(ODMOE_SOURCE_DIR, "/configs/models/mixtral-8x7b/config.json"));
  EXPECT_TRUE(shapes.ok()) << shapes.status();
  return shapes.ok() ? *shapes : ShapeMap();
}

// A wall clock that only moves when told to or when slept on: what the device waited for is read back.
class FakeClock final : public WallClock {
 public:
  double NowSeconds() override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void SleepUntil(double seconds) override {
    absl::MutexLock lock(&mu_);
    sleeps_.push_back(seconds);
    now_ = std::max(now_, seconds);
  }
  void Set(double seconds) {
    absl::MutexLock lock(&mu_);
    now_ = seconds;
  }
  std::vector<double> sleeps() {
    absl::MutexLock lock(&mu_);
    return sleeps_;
  }

 private:
  absl::Mutex mu_;
  double now_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<double> sleeps_ ABSL_GUARDED_BY(mu_);
};

TEST(TimedDeviceTest, AnOpTakesLaunchLatencyPlusItsRooflineAtItsWeightsDtype) {
  auto device = Timed();
  const int64_t n = 1, in = 256, out = 512;
  auto x = Alloc(*device, n * in * 4);
  auto w = Alloc(*device, out * in * 2);
  auto y = Alloc(*device, n * out * 4);
  device->ClearTimeline();
  device->MatMul(x->as<float>(), WeightRef{w->data(), DType::kBF16}, {}, n, in, out, y->as<float>(), nullptr);
  // Memory-bound: (512*256*2 + 256*4 + 512*4) bytes / 100 GB/s = 2.65216 us, above 2*256*512 flops / 2 TFLOP/s.
  ASSERT_EQ(device->timeline().size(), 1u);
  EXPECT_NEAR(Duration(device->timeline()[0]), 4e-6 + 265216 / 100e9, kTol);
  // Compute-bound: 64 rows of fp32 weights at 1 TFLOP/s: 2*64*256*512 flops = 16.78 us.
  auto x64 = Alloc(*device, 64 * in * 4);
  auto y64 = Alloc(*device, 64 * out * 4);
  auto w32 = Alloc(*device, out * in * 4);
  device->ClearTimeline();
  device->MatMul(x64->as<float>(), WeightRef{w32->data(), DType::kF32}, {}, 64, in, out, y64->as<float>(), nullptr);
  EXPECT_NEAR(Duration(device->timeline()[0]), 4e-6 + 2.0 * 64 * 256 * 512 / 1e12, kTol);
  // An elementwise op: 3 * 1000 * 4 bytes at 100 GB/s.
  auto a = Alloc(*device, 4000);
  auto b = Alloc(*device, 4000);
  device->ClearTimeline();
  device->Add(a->as<float>(), 1000, b->as<float>(), nullptr);
  EXPECT_NEAR(Duration(device->timeline()[0]), 4e-6 + 12000 / 100e9, kTol);
  // Ops of one stream serialise: the next starts where the last ended.
  device->Add(a->as<float>(), 1000, b->as<float>(), nullptr);
  EXPECT_DOUBLE_EQ(device->timeline()[1].start_s, device->timeline()[0].end_s);
}

TEST(TimedDeviceTest, CopiesTakeCopyLatencyPlusBytesOverTheirLink) {
  auto device = Timed();
  std::vector<uint8_t> pageable(1 << 20, 7), pinned(1 << 20, 9), back(1 << 20);
  ASSERT_TRUE(device->RegisterHostMemory(pinned.data(), pinned.size()).ok());
  auto dst = Alloc(*device, 1 << 20);
  device->CopyToDevice(dst->data(), pageable.data(), pageable.size(), nullptr);
  device->CopyToDevice(dst->data(), pinned.data(), pinned.size(), nullptr);
  device->CopyToHost(back.data(), dst->data(), back.size(), nullptr);
  auto other = Alloc(*device, 1 << 20);
  device->CopyOnDevice(other->data(), dst->data(), 1 << 20, nullptr);
  const std::vector<MockGpuInterval> t = device->timeline();
  ASSERT_EQ(t.size(), 4u);
  EXPECT_NEAR(Duration(t[0]), 6e-6 + (1 << 20) / 5e9, kTol);   // pageable
  EXPECT_NEAR(Duration(t[1]), 6e-6 + (1 << 20) / 10e9, kTol);  // pinned
  EXPECT_NEAR(Duration(t[2]), 6e-6 + (1 << 20) / 8e9, kTol);   // device to host
  EXPECT_NEAR(Duration(t[3]), 4e-6 + 2.0 * (1 << 20) / 100e9, kTol);
  EXPECT_EQ(back, pinned);
  // CopyToHost returned when its bytes were on the host.
  EXPECT_DOUBLE_EQ(device->virtual_time_s(), t[2].end_s);
  device->UnregisterHostMemory(pinned.data());
}

TEST(TimedDeviceTest, TimeScaleStretchesEveryDuration) {
  auto once = Timed(1.0);
  auto slow = Timed(10.0);
  std::vector<uint8_t> host(4096, 1);
  for (MockGpuDevice* d : {once.get(), slow.get()}) {
    auto buffer = Alloc(*d, 4096);
    auto out = Alloc(*d, 4096);
    d->CopyToDevice(buffer->data(), host.data(), host.size(), nullptr);
    d->SwiGlu(buffer->as<float>(), buffer->as<float>(), 1024, out->as<float>(), nullptr);
    d->Synchronize(nullptr);
  }
  ASSERT_EQ(once->timeline().size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(Duration(slow->timeline()[i]), 10 * Duration(once->timeline()[i]), 1e-15) << i;
  }
  EXPECT_NEAR(slow->virtual_time_s(), 10 * once->virtual_time_s(), 1e-15);
}

TEST(TimedDeviceTest, ChargesTheTargetModelsShapes) {
  const ShapeMap shapes = TinyAsMixtral();
  ASSERT_FALSE(shapes.identity());
  EXPECT_TRUE(shapes.ambiguous().empty());
  auto device = Timed(1.0, shapes);
  // An expert load: tiny-mixtral's expert (3 x 64 x 128 bf16) is charged as Mixtral-8x7B's, 3 x 4096 x 14336 bf16
  // bytes, over the pinned link.
  const uint64_t tiny_expert = 3 * 64 * 128 * 2, mixtral_expert = uint64_t{3} * 4096 * 14336 * 2;
  std::vector<uint8_t> expert(tiny_expert, 3);
  ASSERT_TRUE(device->RegisterHostMemory(expert.data(), expert.size()).ok());
  auto on_device = Alloc(*device, tiny_expert);
  device->CopyToDevice(on_device->data(), expert.data(), expert.size(), nullptr);
  // A hidden state (one row of 64 fp32) is charged as a row of 4096.
  std::vector<float> hidden(64, 1.0f);
  auto h = Alloc(*device, 64 * 4);
  device->CopyToDevice(h->data(), hidden.data(), 64 * 4, nullptr);
  // The expert's up projection for one token: [128, 64] bf16 charged as [14336, 4096] bf16.
  auto y = Alloc(*device, 128 * 4);
  device->MatMul(h->as<float>(), WeightRef{on_device->data(), DType::kBF16}, {}, 1, 64, 128, y->as<float>(), nullptr);
  // Decode attention of one token over 10 past positions with 4 / 2 heads of 16: charged with 32 / 8 heads of 128.
  auto q = Alloc(*device, 4 * 16 * 4);
  auto kv = Alloc(*device, 11 * 2 * 16 * 4);
  auto out = Alloc(*device, 4 * 16 * 4);
  device->Attention(q->as<float>(), KvCacheRef{kv->data()}, KvCacheRef{kv->data()}, 1, 10, 4, 2, 16, 0.25f,
                    out->as<float>(), nullptr);
  const std::vector<MockGpuInterval> t = device->timeline();
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].bytes, mixtral_expert);
  EXPECT_NEAR(Duration(t[0]), 6e-6 + static_cast<double>(mixtral_expert) / 10e9, kTol);  // 35.2 ms
  EXPECT_EQ(t[1].bytes, 4096u * 4);
  EXPECT_NEAR(Duration(t[1]), 6e-6 + 4096.0 * 4 / 5e9, kTol);  // `hidden` is pageable
  const uint64_t matmul_bytes = uint64_t{14336} * 4096 * 2 + 4096 * 4 + 14336 * 4;
  EXPECT_EQ(t[2].bytes, matmul_bytes);
  EXPECT_DOUBLE_EQ(t[2].flops, 2.0 * 4096 * 14336);
  EXPECT_NEAR(Duration(t[2]), 4e-6 + static_cast<double>(matmul_bytes) / 100e9, kTol);
  EXPECT_DOUBLE_EQ(t[3].flops, 4.0 * 32 * 128 * 11);
  EXPECT_EQ(t[3].bytes, 2u * 32 * 128 * 4 + 2u * 11 * 8 * 128 * 4);
  device->UnregisterHostMemory(expert.data());
}

TEST(TimedDeviceTest, QuantizedWeightsKeepTheirDtypeAtTheTargetShape) {
  const ShapeMap shapes = TinyAsMixtral();
  OpShape int8{.kind = OpKind::kMatMul, .n = 1, .in_dim = 64, .out_dim = 128, .weight = DType::kI8};
  const OpShape charged = shapes.Charge(int8);
  EXPECT_EQ(charged.weight, DType::kI8);
  EXPECT_EQ(charged.in_dim, 4096);
  EXPECT_EQ(charged.out_dim, 14336);
  OpShape f32 = int8;
  f32.weight = DType::kF32;
  EXPECT_EQ(shapes.Charge(f32).weight, DType::kBF16);  // dense weights at the target's torch_dtype
  // Sizes that name no dimension are charged as they are: token counts, top-k, unknown widths.
  const OpShape router = shapes.Charge(OpShape{.kind = OpKind::kRouterTopK, .n = 5, .experts = 4, .k = 2});
  EXPECT_EQ(router.n, 5);
  EXPECT_EQ(router.experts, 8);
  EXPECT_EQ(router.k, 2);
  EXPECT_EQ(shapes.Charge(OpShape{.kind = OpKind::kAdd, .count = 3 * 64}).count, 3 * 4096);
  EXPECT_EQ(shapes.Charge(OpShape{.kind = OpKind::kAdd, .count = 7}).count, 7);
  EXPECT_EQ(shapes.Charge(OpShape{.kind = OpKind::kSwiGlu, .count = 2 * 128}).count, 2 * 14336);
  // Token selection over a row of the running vocabulary (256) is charged over Mixtral's 32000.
  const OpShape select = shapes.Charge(OpShape{.kind = OpKind::kSelectTokens, .n = 3, .dim = 256});
  EXPECT_EQ(select.n, 3);
  EXPECT_EQ(select.dim, 32000);
  EXPECT_EQ(WorkOf(select).bytes, uint64_t{3} * 32000 * 4 + 3 * 24);
}

TEST(TimedDeviceTest, ShapeMapNamesWhatItCannotMap) {
  ModelDims a{.hidden = 64,
              .expert_intermediate = 128,
              .heads = 4,
              .kv_heads = 2,
              .head_dim = 16,
              .vocab = 256,
              .experts = 4,
              .expert_bytes = 49152};
  ModelDims b = a;
  b.expert_intermediate = 0;
  auto bad = ShapeMap::Between(a, b, "small", "big");
  EXPECT_EQ(bad.status().message(),
            "big: expert intermediate size is 0; a timing model needs MoE models on both sides");
  b = a;
  b.shared_intermediate = 256;
  EXPECT_EQ(ShapeMap::Between(a, b, "small", "big").status().message(),
            "big has a shared expert and small has none: its ops could not be charged at the other's shapes");
  // Hidden and expert width equal in the running model but not in the target: charged at the larger.
  ModelDims same = a;
  same.expert_intermediate = 64;
  b = a;
  b.hidden = 4096;
  b.heads = 32;
  b.head_dim = 128;
  b.expert_intermediate = 14336;
  auto clash = ShapeMap::Between(same, b, "small", "big");
  ASSERT_TRUE(clash.ok()) << clash.status();
  EXPECT_THAT(clash->ambiguous(), ::testing::Contains("64 -> 4096 or 14336"));
  EXPECT_EQ(clash->Charge(OpShape{.kind = OpKind::kMatMul, .n = 1, .in_dim = 64, .out_dim = 64}).in_dim, 14336);
  // The identity charges everything as it is.
  const OpShape any{.kind = OpKind::kMatMul, .n = 2, .in_dim = 64, .out_dim = 128, .weight = DType::kF32};
  EXPECT_EQ(ShapeMap().Charge(any).in_dim, 64);
  EXPECT_EQ(ShapeMap().CopyBytes(12345), 12345u);
}

TEST(TimedDeviceTest, WaitsPaceToTheWallClock) {
  auto clock = std::make_shared<FakeClock>();
  auto device = Timed(1.0, {}, clock);
  auto a = Alloc(*device, 4000);
  auto b = Alloc(*device, 4000);
  clock->Set(1.0);  // the host issues the op at t = 1 s: it starts then, not at 0
  device->Add(a->as<float>(), 1000, b->as<float>(), nullptr);
  const double end = 1.0 + 4e-6 + 12000 / 100e9;
  EXPECT_DOUBLE_EQ(device->timeline().back().start_s, 1.0);
  EXPECT_TRUE(clock->sleeps().empty());  // enqueueing never waits
  device->Synchronize(nullptr);
  ASSERT_EQ(clock->sleeps().size(), 1u);
  EXPECT_DOUBLE_EQ(clock->sleeps()[0], end);
  EXPECT_DOUBLE_EQ(device->virtual_time_s(), end);
  std::vector<float> host(1000);
  device->CopyToHost(host.data(), b->data(), 4000, nullptr);
  ASSERT_EQ(clock->sleeps().size(), 2u);
  EXPECT_DOUBLE_EQ(clock->sleeps()[1], end + 6e-6 + 4000 / 8e9);
}

TEST(TimedDeviceTest, ResultsEqualTheMockGpusBitForBit) {
  MockGpuDevice mock;
  auto timed = Timed(1.0, TinyAsMixtral());
  const auto want = RunEveryOp(mock);
  const auto got = RunEveryOp(*timed);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "result " << i;
  EXPECT_EQ(timed->op_counts(), mock.op_counts());
  // The clocks differ: the timed device charged Mixtral-8x7B's shapes at the test profile.
  EXPECT_GT(timed->completion_time_s(), mock.completion_time_s());
}

TEST(TimedDeviceTest, CreateNodeDeviceMakesTheNodesTimedDevice) {
  const std::string text = StrCat(R"(
[cluster]
device_profiles = ["profiles/rtx3090.toml"]
timing_model = "models/mixtral-8x7b/config.json"
time_scale = 2
[model]
synthetic = ")",
                                  ODMOE_SOURCE_DIR, R"(/tests/data/tiny-mixtral/config.json"
[[node]]
name = "main"
role = "main"
address = "127.0.0.1:1"
device = "timed:rtx3090"
[[node]]
name = "w0"
role = "worker"
address = "127.0.0.1:2"
device = "mock-gpu"
)");
  auto cluster = ParseClusterConfig(text, "emulated.toml", StrCat(ODMOE_SOURCE_DIR, "/configs"));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto main = CreateNodeDevice(*cluster, *cluster->main(), "", /*capacity_bytes=*/uint64_t{1} << 30);
  ASSERT_TRUE(main.ok()) << main.status();
  EXPECT_THAT((*main)->name(), StartsWith("timed:rtx3090 (1.0 GiB, 936 GB/s"));
  EXPECT_THAT((*main)->name(), HasSubstr("target shapes; time x 2"));
  EXPECT_EQ((*main)->memory_info().capacity, uint64_t{1} << 30);
  auto worker = CreateNodeDevice(*cluster, *cluster->workers()[0], "");
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_THAT((*worker)->name(), StartsWith("mock-gpu"));
  // Outside a cluster file there are no profiles.
  EXPECT_THAT(CreateDevice("timed:rtx3090").status().message(), HasSubstr("[[device_profile]]"));
  // A timing model that does not exist names the cluster file and the field.
  ClusterConfig broken = *cluster;
  broken.timing_model = "/nonexistent/config.json";
  auto failed = CreateNodeDevice(broken, *broken.main(), "");
  EXPECT_THAT(failed.status().message(), HasSubstr("emulated.toml: [cluster] timing_model: "));
}

// Emulation over shaped links: the timing model's payloads against the running model's. tiny-mixtral (hidden
// 64; 4 layers of 2 K/V heads of 16) against Mixtral-8x7B (hidden 4096; 32 layers of 8 K/V heads of 128).
TEST(TimedDeviceTest, PayloadScaleIsTheTimingModelsBytesOverTheRunningModels) {
  const std::string config_path = StrCat(ODMOE_SOURCE_DIR, "/tests/data/tiny-mixtral/config.json");
  auto running = SyntheticModelConfig(SyntheticSpec{config_path, 0, 0});
  ASSERT_TRUE(running.ok()) << running.status();
  ClusterConfig cluster;
  cluster.file = "emulated.toml";
  auto none = PayloadScaleOf(cluster, *running);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->hidden, 1.0);
  EXPECT_EQ(none->kv, 1.0);
  cluster.timing_model = StrCat(ODMOE_SOURCE_DIR, "/configs/models/mixtral-8x7b/config.json");
  auto scale = PayloadScaleOf(cluster, *running);
  ASSERT_TRUE(scale.ok()) << scale.status();
  EXPECT_EQ(scale->hidden, 4096.0 / 64.0);
  EXPECT_EQ(scale->kv, (32.0 * 8 * 128) / (4.0 * 2 * 16));
  // Padding: the bytes that make the payload `scale` times as large, within the room a message has.
  EXPECT_EQ(PayloadScale::Padding(1000, 64.0, 1 << 20), 63000u);
  EXPECT_EQ(PayloadScale::Padding(1000, 64.0, 5000), 5000u);
  EXPECT_EQ(PayloadScale::Padding(1000, 1.0, 1 << 20), 0u);
  EXPECT_EQ(PayloadScale::Padding(1000, 0.5, 1 << 20), 0u);
  cluster.timing_model = "/nonexistent/config.json";
  EXPECT_THAT(PayloadScaleOf(cluster, *running).status().message(),
              HasSubstr("emulated.toml: [cluster] timing_model: "));
}

}  // namespace
}  // namespace odmoe
