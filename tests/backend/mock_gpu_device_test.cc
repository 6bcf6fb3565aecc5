// MockGpuDevice: hard capacity, exact byte/copy/peak accounting, the virtual clock (link serialisation, events,
// overlap), determinism, checksums of device memory, results equal to CpuDevice's, and aborts when an op gets
// memory that is not this device's.
#include "src/backend/mock_gpu_device.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/backend/cpu_device.h"
#include "src/common/dtype.h"
#include "tests/backend/run_every_op.h"

namespace odmoe {
namespace {

using ::testing::HasSubstr;

// Round numbers so expected times are easy to write: 1 GB/s links with 10 us latency, 1 TFLOP/s, 100 GB/s.
MockGpuOptions TestOptions() {
  MockGpuOptions o;
  o.capacity_bytes = 4 << 20;
  o.h2d_bytes_per_s = 1e9;
  o.h2d_latency_s = 10e-6;
  o.d2h_bytes_per_s = 2e9;
  o.d2h_latency_s = 5e-6;
  o.flops_per_s = 1e12;
  o.mem_bytes_per_s = 100e9;
  return o;
}

std::unique_ptr<Buffer> Alloc(Device& device, size_t bytes, std::string_view tag = "test") {
  auto buffer = device.Allocate(bytes, tag);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  return buffer.ok() ? std::move(*buffer) : nullptr;
}

template <typename T>
std::unique_ptr<Buffer> Upload(Device& device, const std::vector<T>& host, Stream* stream = nullptr) {
  auto buffer = Alloc(device, host.size() * sizeof(T));
  device.CopyToDevice(buffer->data(), host.data(), host.size() * sizeof(T), stream);
  return buffer;
}

template <typename T>
std::vector<T> Download(Device& device, const Buffer& buffer) {
  std::vector<T> host(buffer.size() / sizeof(T));
  device.CopyToHost(host.data(), buffer.data(), buffer.size(), nullptr);
  return host;
}

// ---- memory ------------------------------------------------------------------------------------------------

TEST(MockGpuDeviceTest, CapacityIsAHardErrorNamingTheTag) {
  MockGpuDevice device(TestOptions());
  EXPECT_EQ(device.kind(), DeviceKind::kMockGpu);
  auto a = Alloc(device, 3 << 20, "layer 0 experts");
  ASSERT_NE(a, nullptr);
  auto b = device.Allocate((1 << 20) + 1, "expert 7.3");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), HasSubstr("'expert 7.3'"));
  EXPECT_THAT(b.status().message(), HasSubstr("1048577 bytes"));  // the request
  EXPECT_THAT(b.status().message(), HasSubstr("3145728 bytes"));  // in use
  EXPECT_THAT(b.status().message(), HasSubstr("4194304 bytes"));  // capacity
  EXPECT_EQ(device.stats().failed_allocations, 1u);
  EXPECT_EQ(device.memory_info().in_use, uint64_t{3} << 20);
  auto fill = Alloc(device, 1 << 20, "exactly full");
  ASSERT_NE(fill, nullptr);
  EXPECT_FALSE(device.Allocate(1, "one more byte").ok());
}

TEST(MockGpuDeviceTest, ReportsInUseAndPeakExactly) {
  MockGpuDevice device(TestOptions());
  auto a = Alloc(device, 1000);
  auto b = Alloc(device, 3000);
  EXPECT_EQ(device.memory_info().capacity, uint64_t{4} << 20);
  EXPECT_EQ(device.memory_info().in_use, 4000u);
  EXPECT_EQ(device.memory_info().peak, 4000u);
  b.reset();
  auto c = Alloc(device, 500);
  EXPECT_EQ(device.memory_info().in_use, 1500u);
  EXPECT_EQ(device.memory_info().peak, 4000u);
  device.ResetPeak();
  EXPECT_EQ(device.memory_info().peak, 1500u);
  EXPECT_EQ(device.stats().allocations, 3u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 256, 0u);
}

TEST(MockGpuDeviceTest, MemoryIsItsOwnAndStartsPoisoned) {
  MockGpuDevice device(TestOptions());
  auto buffer = Alloc(device, 16);
  EXPECT_TRUE(device.Contains(buffer->data(), 16));
  EXPECT_FALSE(device.Contains(buffer->data(), 17));
  EXPECT_FALSE(device.Contains(buffer->as<uint8_t>() + 16, 1));
  std::vector<float> host(4);
  EXPECT_FALSE(device.Contains(host.data(), 4));
  for (float v : Download<float>(device, *buffer)) EXPECT_TRUE(std::isnan(v));
  void* freed = buffer->data();
  buffer.reset();
  EXPECT_FALSE(device.Contains(freed, 1));
}

TEST(MockGpuDeviceTest, ChecksumOfDeviceMemoryEqualsHostSource) {
  EXPECT_EQ(Fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(Fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);  // published FNV-1a 64 test vector
  MockGpuDevice device(TestOptions());
  std::vector<uint8_t> host(100000);
  std::mt19937 rng(1);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  auto buffer = Upload(device, host);
  EXPECT_EQ(device.Checksum(buffer->data(), host.size()), Fnv1a64(host.data(), host.size()));
  host[500] ^= 1;  // the device keeps the bytes that crossed the link
  EXPECT_NE(device.Checksum(buffer->data(), host.size()), Fnv1a64(host.data(), host.size()));
}

// ---- the virtual clock --------------------------------------------------------------------------------------

TEST(MockGpuDeviceTest, CopyTimeIsLatencyPlusBytesOverBandwidth) {
  MockGpuDevice device(TestOptions());
  auto buffer = Alloc(device, 1000000);
  std::vector<uint8_t> host(1000000, 3);
  auto stream = device.CreateStream();
  device.CopyToDevice(buffer->data(), host.data(), host.size(), stream.get());
  const double expected = 10e-6 + 1000000 / 1e9;  // 1.01 ms
  EXPECT_EQ(device.StreamTime(stream.get()), expected);
  EXPECT_EQ(device.virtual_time_s(), 0.0);  // the host has not waited yet
  EXPECT_EQ(device.completion_time_s(), expected);
  device.Synchronize(stream.get());
  EXPECT_EQ(device.virtual_time_s(), expected);

  const std::vector<MockGpuInterval> timeline = device.timeline();
  ASSERT_EQ(timeline.size(), 1u);
  EXPECT_EQ(timeline[0].kind, MockGpuWork::kH2D);
  EXPECT_EQ(timeline[0].op, "CopyToDevice");
  EXPECT_EQ(timeline[0].stream_id, device.StreamId(stream.get()));
  EXPECT_EQ(timeline[0].start_s, 0.0);
  EXPECT_EQ(timeline[0].end_s, expected);
  EXPECT_EQ(timeline[0].bytes, 1000000u);
  const TransferStats t = device.transfer_stats();
  EXPECT_EQ(t.h2d_bytes, 1000000u);
  EXPECT_EQ(t.h2d_copies, 1u);
  EXPECT_EQ(t.d2h_copies, 0u);
  EXPECT_EQ(device.stats().h2d_busy_s, expected);

  // D2H on its own link, and the host waits for it.
  std::vector<uint8_t> back(1000);
  device.CopyToHost(back.data(), buffer->data(), 1000, stream.get());
  const double d2h_end = expected + (5e-6 + 1000 / 2e9);
  EXPECT_EQ(device.virtual_time_s(), d2h_end);
  EXPECT_EQ(device.transfer_stats().d2h_bytes, 1000u);
  EXPECT_EQ(device.transfer_stats().d2h_copies, 1u);
  EXPECT_EQ(back, std::vector<uint8_t>(1000, 3));
}

TEST(MockGpuDeviceTest, HostToDeviceCopiesShareOneLink) {
  MockGpuDevice device(TestOptions());
  auto a = Alloc(device, 2000);
  auto b = Alloc(device, 2000);
  std::vector<uint8_t> host(2000, 1);
  auto s1 = device.CreateStream();
  auto s2 = device.CreateStream();
  device.CopyToDevice(a->data(), host.data(), 2000, s1.get());
  device.CopyToDevice(b->data(), host.data(), 2000, s2.get());
  const double one = 10e-6 + 2000 / 1e9;
  EXPECT_EQ(device.StreamTime(s1.get()), one);
  EXPECT_EQ(device.StreamTime(s2.get()), one + one);  // waited for the link, not for s1
  // A D2H copy uses the other link and overlaps.
  std::vector<uint8_t> back(2000);
  auto s3 = device.CreateStream();
  device.CopyToHost(back.data(), a->data(), 2000, s3.get());
  const std::vector<MockGpuInterval> timeline = device.timeline();
  ASSERT_EQ(timeline.size(), 3u);
  EXPECT_EQ(timeline[2].kind, MockGpuWork::kD2H);
  EXPECT_EQ(timeline[2].start_s, 0.0);
}

TEST(MockGpuDeviceTest, SynchronizeEventAdvancesTheHostClockToTheEventOnly) {
  MockGpuDevice device(TestOptions());
  auto load = device.CreateStream();
  auto other = device.CreateStream();
  std::vector<float> a(1024, 1.0f), b(64 * 1024, 2.0f);
  auto a_dev = Upload(device, a, load.get());
  auto done = device.CreateEvent();
  device.RecordEvent(*done, load.get());
  auto b_dev = Upload(device, b, other.get());  // later on the link, not part of the event
  device.SynchronizeEvent(*done);
  EXPECT_DOUBLE_EQ(device.virtual_time_s(), device.StreamTime(load.get()));
  EXPECT_LT(device.virtual_time_s(), device.StreamTime(other.get()));
  auto never = device.CreateEvent();
  device.SynchronizeEvent(*never);  // never recorded: complete at once
  EXPECT_DOUBLE_EQ(device.virtual_time_s(), device.StreamTime(load.get()));
}

TEST(MockGpuDeviceTest, EventsOrderStreamsAndIndependentStreamsOverlap) {
  MockGpuDevice device(TestOptions());
  auto load = device.CreateStream();
  auto compute = device.CreateStream();
  auto other = device.CreateStream();
  const int64_t n = 2, in = 64, out = 32;
  std::mt19937 rng(2);
  std::vector<uint16_t> w(out * in);
  for (auto& v : w) v = F32ToBf16(std::uniform_real_distribution<float>(-1, 1)(rng));
  std::vector<float> x(n * in, 0.5f);

  auto x_dev = Upload(device, x, compute.get());  // first on the link
  auto w_dev = Upload(device, w, load.get());     // then the weights
  auto y_dev = Alloc(device, n * out * sizeof(float));
  const int64_t z_count = 256 * 1024;  // an Add over 1 MiB: 3 MiB of traffic, ~31 us, longer than the copies
  auto z_dev = Alloc(device, z_count * sizeof(float));
  auto loaded = device.CreateEvent();
  device.RecordEvent(*loaded, load.get());
  device.WaitEvent(compute.get(), *loaded);
  device.MatMul(x_dev->as<float>(), WeightRef{w_dev->data(), DType::kBF16}, WeightRef{}, n, in, out, y_dev->as<float>(),
                compute.get());
  device.Add(z_dev->as<float>(), z_count, z_dev->as<float>(), other.get());

  const std::vector<MockGpuInterval> tl = device.timeline();
  ASSERT_EQ(tl.size(), 4u);
  const MockGpuInterval& x_copy = tl[0];
  const MockGpuInterval& w_copy = tl[1];
  const MockGpuInterval& matmul = tl[2];
  const MockGpuInterval& add = tl[3];
  EXPECT_EQ(w_copy.start_s, x_copy.end_s);
  EXPECT_EQ(matmul.kind, MockGpuWork::kCompute);
  EXPECT_EQ(matmul.op, "MatMul");
  EXPECT_EQ(matmul.stream_id, device.StreamId(compute.get()));
  EXPECT_EQ(matmul.start_s, w_copy.end_s);  // waited for the load, not earlier
  // MatMul cost: 2*n*in*out flops; bf16 weights + activations in and out.
  const double flops = 2.0 * n * in * out;
  const uint64_t bytes = out * in * 2 + n * in * 4 + n * out * 4;
  EXPECT_EQ(matmul.flops, flops);
  EXPECT_EQ(matmul.bytes, bytes);
  EXPECT_EQ(matmul.end_s, matmul.start_s + std::max(flops / 1e12, bytes / 100e9));
  // The Add on an independent stream ran while the weights were crossing the link.
  EXPECT_EQ(add.start_s, 0.0);
  EXPECT_LT(add.start_s, w_copy.end_s);
  EXPECT_GT(add.end_s, w_copy.start_s);
  EXPECT_EQ(device.op_counts(), (std::map<std::string, int64_t>{{"Add", 1}, {"MatMul", 1}}));
  EXPECT_EQ(device.stats().ops, 2u);

  device.Synchronize(compute.get());
  EXPECT_EQ(device.virtual_time_s(), matmul.end_s);
  device.SynchronizeAll();  // the long Add on `other` finishes last
  EXPECT_GT(add.end_s, matmul.end_s);
  EXPECT_EQ(device.virtual_time_s(), add.end_s);
}

TEST(MockGpuDeviceTest, WorkStartsNoEarlierThanTheHostIssuedIt) {
  MockGpuDevice device(TestOptions());
  auto a = Alloc(device, 1000);
  std::vector<uint8_t> host(1000);
  auto s1 = device.CreateStream();
  device.CopyToDevice(a->data(), host.data(), 1000, s1.get());
  device.Synchronize(s1.get());
  const double t = device.virtual_time_s();
  EXPECT_GT(t, 0.0);
  auto s2 = device.CreateStream();  // fresh stream, its own time is 0
  device.Add(a->as<float>(), 10, a->as<float>(), s2.get());
  EXPECT_EQ(device.timeline().back().start_s, t);
  auto never = device.CreateEvent();  // never recorded: waiting on it is a no-op
  device.WaitEvent(s2.get(), *never);
  EXPECT_EQ(device.StreamTime(s2.get()), device.timeline().back().end_s);
}

// A fixed little workload: two streams, copies, events, ops and a read-back.
std::vector<float> Workload(MockGpuDevice& device) {
  auto load = device.CreateStream();
  auto compute = device.CreateStream();
  std::mt19937 rng(3);
  std::vector<float> x(3 * 40), w(24 * 40);
  for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
  for (auto& v : w) v = std::uniform_real_distribution<float>(-1, 1)(rng);
  auto x_dev = Upload(device, x, compute.get());
  auto y_dev = Alloc(device, 3 * 24 * sizeof(float));
  auto event = device.CreateEvent();
  std::vector<std::unique_ptr<Buffer>> weights;
  for (int layer = 0; layer < 3; ++layer) {
    weights.push_back(Upload(device, w, load.get()));
    device.RecordEvent(*event, load.get());
    device.WaitEvent(compute.get(), *event);
    device.MatMul(x_dev->as<float>(), WeightRef{weights.back()->data(), DType::kF32}, WeightRef{}, 3, 40, 24,
                  y_dev->as<float>(), compute.get());
    device.SwiGlu(y_dev->as<float>(), y_dev->as<float>(), 3 * 24, y_dev->as<float>(), compute.get());
  }
  std::vector<float> y(3 * 24);
  device.CopyToHost(y.data(), y_dev->data(), y.size() * sizeof(float), compute.get());
  return y;
}

TEST(MockGpuDeviceTest, IdenticalRunsGiveIdenticalTimelines) {
  MockGpuDevice a(TestOptions()), b(TestOptions());
  const std::vector<float> ya = Workload(a);
  const std::vector<float> yb = Workload(b);
  EXPECT_EQ(ya, yb);
  ASSERT_EQ(a.timeline().size(), 11u);  // 1 + 3 * (copy + 2 ops) + read-back
  EXPECT_EQ(a.timeline(), b.timeline());
  EXPECT_EQ(a.virtual_time_s(), b.virtual_time_s());
  EXPECT_GT(a.virtual_time_s(), 0.0);
  a.ClearTimeline();
  EXPECT_TRUE(a.timeline().empty());
}

TEST(MockGpuDeviceTest, TimelineCanBeOff) {
  MockGpuOptions options = TestOptions();
  options.record_timeline = false;
  MockGpuDevice device(options);
  Workload(device);
  EXPECT_TRUE(device.timeline().empty());
  EXPECT_EQ(device.transfer_stats().h2d_copies, 4u);
  EXPECT_GT(device.virtual_time_s(), 0.0);
}

// ---- results equal the CPU device's ---------------------------------------------------------------------------

TEST(MockGpuDeviceTest, ResultsEqualTheCpuDeviceBitForBit) {
  CpuDevice cpu;
  MockGpuDevice mock(TestOptions());
  const auto want = RunEveryOp(cpu);
  const auto got = RunEveryOp(mock);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << "result " << i;
    // Not trivially equal: every result has real values (no NaN from poisoned, never-written memory).
    std::vector<float> as_float(want[i].size() / 4);
    std::memcpy(as_float.data(), want[i].data(), want[i].size());
    for (float v : as_float) ASSERT_TRUE(std::isfinite(v)) << "result " << i;
  }
  EXPECT_EQ(mock.op_counts(), cpu.op_counts());
  EXPECT_EQ(mock.op_counts().size(), 12u);
  EXPECT_EQ(mock.transfer_stats().h2d_copies, cpu.transfer_stats().h2d_copies);
  EXPECT_EQ(mock.transfer_stats().h2d_bytes, cpu.transfer_stats().h2d_bytes);
  EXPECT_EQ(mock.transfer_stats().d2d_bytes, cpu.transfer_stats().d2d_bytes);
}

// ---- thread safety -----------------------------------------------------------------------------------------

TEST(MockGpuDeviceTest, LoaderAndComputeThreadsMayRunTogether) {
  MockGpuDevice device(TestOptions());
  auto load = device.CreateStream();
  auto compute = device.CreateStream();
  auto acc = Upload(device, std::vector<float>(256, 0.0f), compute.get());
  auto one = Upload(device, std::vector<float>(256, 1.0f), compute.get());
  std::thread loader([&] {
    std::vector<uint8_t> host(4096, 9);
    for (int i = 0; i < 200; ++i) {
      auto buffer = Alloc(device, host.size(), "expert");
      device.CopyToDevice(buffer->data(), host.data(), host.size(), load.get());
      EXPECT_EQ(device.Checksum(buffer->data(), host.size()), Fnv1a64(host.data(), host.size()));
    }
  });
  for (int i = 0; i < 200; ++i) device.Add(one->as<float>(), 256, acc->as<float>(), compute.get());
  loader.join();
  EXPECT_EQ(Download<float>(device, *acc), std::vector<float>(256, 200.0f));
  EXPECT_EQ(device.transfer_stats().h2d_copies, 202u);
  EXPECT_EQ(device.op_counts().at("Add"), 200);
  EXPECT_EQ(device.memory_info().in_use, 2u * 256 * 4);
}

// ---- memory that is not this device's aborts ------------------------------------------------------------------

class MockGpuDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(MockGpuDeathTest, HostPointerToAnOpAborts) {
  MockGpuDevice device(TestOptions());
  std::vector<float> host_x(64, 1.0f);
  auto w = Alloc(device, 8 * 64 * 4);
  auto y = Alloc(device, 8 * 4);
  EXPECT_DEATH(
      device.MatMul(host_x.data(), WeightRef{w->data(), DType::kF32}, WeightRef{}, 1, 64, 8, y->as<float>(), nullptr),
      "MatMul: argument 'x' .* is not inside a live allocation of this device");
  // Weights straight from a host (memory-mapped) checkpoint are caught too.
  std::vector<float> host_w(8 * 64);
  auto x = Alloc(device, 64 * 4);
  EXPECT_DEATH(device.MatMul(x->as<float>(), WeightRef{host_w.data(), DType::kF32}, WeightRef{}, 1, 64, 8,
                             y->as<float>(), nullptr),
               "MatMul: argument 'w'");
}

TEST_F(MockGpuDeathTest, CopiesCheckWhichSideIsTheDevice) {
  MockGpuDevice device(TestOptions());
  std::vector<uint8_t> a(16), b(16);
  auto buffer = Alloc(device, 16);
  EXPECT_DEATH(device.CopyToDevice(a.data(), b.data(), 16, nullptr), "CopyToDevice: argument 'dst'");
  EXPECT_DEATH(device.CopyToHost(a.data(), b.data(), 16, nullptr), "CopyToHost: argument 'src'");
  EXPECT_DEATH(device.CopyToDevice(buffer->data(), buffer->data(), 16, nullptr), "must be host memory");
  EXPECT_DEATH(device.CopyOnDevice(buffer->data(), a.data(), 16, nullptr), "CopyOnDevice: argument 'src'");
  EXPECT_DEATH(device.Checksum(a.data(), 16), "Checksum");
}

TEST_F(MockGpuDeathTest, OutOfBoundsAndFreedMemoryAbort) {
  MockGpuDevice device(TestOptions());
  auto x = Alloc(device, 10 * 4);
  EXPECT_DEATH(device.Add(x->as<float>(), 11, x->as<float>(), nullptr), "Add: argument 'x'");
  auto ids = Upload(device, std::vector<int32_t>{0, 5});
  auto table = Alloc(device, 5 * 8 * 4);  // 5 rows: id 5 is past the end
  auto out = Alloc(device, 2 * 8 * 4);
  EXPECT_DEATH(
      device.Embedding(ids->as<int32_t>(), 2, WeightRef{table->data(), DType::kF32}, 8, out->as<float>(), nullptr),
      "Embedding: argument 'table'");
  float* stale = x->as<float>();
  x.reset();
  auto y = Alloc(device, 10 * 4);
  if (y->data() != stale) {  // the allocator may hand the same block back
    EXPECT_DEATH(device.Add(y->as<float>(), 10, stale, nullptr), "Add: argument 'y'");
  }
  MockGpuDevice other(TestOptions());
  auto other_stream = other.CreateStream();
  EXPECT_DEATH(device.Add(y->as<float>(), 10, y->as<float>(), other_stream.get()), "Stream of another device");
}

}  // namespace
}  // namespace odmoe
