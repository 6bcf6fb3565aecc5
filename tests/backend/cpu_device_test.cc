// CpuDevice: allocation accounting, capacity refusal, counted copies and ops; the device factory.
#include "src/backend/cpu_device.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/backend/mock_gpu_device.h"

namespace odmoe {
namespace {

using ::testing::HasSubstr;

TEST(CpuDeviceTest, AllocationsAreAlignedAndAccounted) {
  CpuDevice device;
  EXPECT_EQ(device.kind(), DeviceKind::kCpu);
  EXPECT_EQ(device.memory_info().capacity, 0u);
  {
    auto a = device.Allocate(1000, "a");
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = device.Allocate(24, "b");
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*a)->data()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*b)->data()) % 64, 0u);
    EXPECT_EQ((*a)->size(), 1000u);
    EXPECT_EQ(device.memory_info().in_use, 1024u);
    EXPECT_EQ(device.memory_info().peak, 1024u);
    a->reset();
    EXPECT_EQ(device.memory_info().in_use, 24u);
    EXPECT_EQ(device.memory_info().peak, 1024u);
    device.ResetPeak();
    EXPECT_EQ(device.memory_info().peak, 24u);
    auto empty = device.Allocate(0, "empty");
    ASSERT_TRUE(empty.ok());
    EXPECT_NE((*empty)->data(), nullptr);
    EXPECT_EQ(device.memory_info().in_use, 24u);
  }
  EXPECT_EQ(device.memory_info().in_use, 0u);
  EXPECT_EQ(device.memory_info().peak, 24u);
}

TEST(CpuDeviceTest, CapacityRefusesWithTagRequestAndInUse) {
  CpuDevice device(/*capacity_bytes=*/1000);
  EXPECT_EQ(device.memory_info().capacity, 1000u);
  auto a = device.Allocate(600, "weights");
  ASSERT_TRUE(a.ok());
  auto b = device.Allocate(401, "kv cache");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), HasSubstr("'kv cache'"));
  EXPECT_THAT(b.status().message(), HasSubstr("401 bytes"));
  EXPECT_THAT(b.status().message(), HasSubstr("600 bytes"));
  EXPECT_THAT(b.status().message(), HasSubstr("1000 bytes"));
  EXPECT_EQ(device.memory_info().in_use, 600u);
  auto c = device.Allocate(400, "exactly full");
  EXPECT_TRUE(c.ok());
  a->reset();
  EXPECT_TRUE(device.Allocate(600, "after free").ok());
}

TEST(CpuDeviceTest, CopiesMoveBytesAndAreCounted) {
  CpuDevice device;
  auto buf = device.Allocate(64, "buf");
  ASSERT_TRUE(buf.ok());
  std::vector<uint8_t> host(64);
  for (int i = 0; i < 64; ++i) host[i] = static_cast<uint8_t>(i * 7);
  auto stream = device.CreateStream();
  device.CopyToDevice((*buf)->data(), host.data(), 64, stream.get());
  device.CopyOnDevice((*buf)->as<uint8_t>() + 32, (*buf)->data(), 16, nullptr);
  std::vector<uint8_t> back(64);
  device.CopyToHost(back.data(), (*buf)->data(), 64, stream.get());
  std::vector<uint8_t> want = host;
  std::memcpy(want.data() + 32, host.data(), 16);
  EXPECT_EQ(back, want);
  device.CopyToHost(back.data(), (*buf)->data(), 8, nullptr);
  const TransferStats stats = device.transfer_stats();
  EXPECT_EQ(stats.h2d_bytes, 64u);
  EXPECT_EQ(stats.h2d_copies, 1u);
  EXPECT_EQ(stats.d2h_bytes, 72u);
  EXPECT_EQ(stats.d2h_copies, 2u);
  EXPECT_EQ(stats.d2d_bytes, 16u);
  EXPECT_EQ(stats.d2d_copies, 1u);
}

TEST(CpuDeviceTest, OpsComputeAndAreCountedByName) {
  CpuDevice device;
  auto stream = device.CreateStream();
  auto event = device.CreateEvent();
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};  // [2, 3]
  const std::vector<float> x = {1, 1, 1};           // [1, 3]
  std::vector<float> y(2);
  device.MatMul(x.data(), WeightRef{w.data(), DType::kF32}, WeightRef{}, 1, 3, 2, y.data(), stream.get());
  device.RecordEvent(*event, stream.get());
  device.WaitEvent(nullptr, *event);
  device.MatMul(x.data(), WeightRef{w.data(), DType::kF32}, WeightRef{}, 1, 3, 2, y.data(), nullptr);
  device.Add(y.data(), 2, y.data(), nullptr);
  device.Synchronize(stream.get());
  device.SynchronizeAll();
  EXPECT_EQ(y, std::vector<float>({12, 30}));
  const std::map<std::string, int64_t> want = {{"Add", 1}, {"MatMul", 2}};
  EXPECT_EQ(device.op_counts(), want);
}

TEST(CpuDeviceTest, AccountingIsThreadSafe) {
  CpuDevice device;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&device] {
      std::vector<float> a(16, 1.0f), b(16, 2.0f);
      for (int i = 0; i < 500; ++i) {
        auto buf = device.Allocate(100 + i % 7, "worker");
        ASSERT_TRUE(buf.ok());
        device.CopyToDevice((*buf)->data(), a.data(), 64, nullptr);
        device.Add(a.data(), 16, b.data(), nullptr);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(device.memory_info().in_use, 0u);
  EXPECT_GE(device.memory_info().peak, 100u);
  EXPECT_LE(device.memory_info().peak, 4u * 106u);
  EXPECT_EQ(device.transfer_stats().h2d_copies, 2000u);
  EXPECT_EQ(device.op_counts().at("Add"), 2000);
}

TEST(CpuDeviceTest, BuffersMayOutliveTheDevice) {
  auto device = std::make_unique<CpuDevice>();
  auto buf = device->Allocate(128, "late");
  ASSERT_TRUE(buf.ok());
  device.reset();
  buf->reset();  // must not touch freed accounting
}

// ---- the factory ---------------------------------------------------------------------------------------------

TEST(DeviceFactoryTest, KindNames) {
  EXPECT_EQ(DeviceKindName(DeviceKind::kCpu), "cpu");
  EXPECT_EQ(DeviceKindName(DeviceKind::kMockGpu), "mock-gpu");
  EXPECT_EQ(DeviceKindName(DeviceKind::kCuda), "cuda");
}

TEST(DeviceFactoryTest, CreatesCpuAndMockGpu) {
  auto cpu = CreateDevice("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->kind(), DeviceKind::kCpu);

  auto mock = CreateDevice("mock-gpu");
  ASSERT_TRUE(mock.ok()) << mock.status();
  EXPECT_EQ((*mock)->kind(), DeviceKind::kMockGpu);
  EXPECT_EQ((*mock)->memory_info().capacity, MockGpuOptions().capacity_bytes);

  auto small = CreateDevice("mock-gpu:64");
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ((*small)->kind(), DeviceKind::kMockGpu);
  EXPECT_EQ((*small)->memory_info().capacity, uint64_t{64} << 20);
}

TEST(DeviceFactoryTest, RejectsBadSpecs) {
  auto unknown = CreateDevice("tpu");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("'tpu'"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("mock-gpu"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("cpu"));
  for (const char* bad : {"mock-gpu:", "mock-gpu:0", "mock-gpu:-5", "mock-gpu:12x", "mock-gpu:99999999999999999"}) {
    auto status = CreateDevice(bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(status.message(), HasSubstr("MiB")) << bad;
  }
}

TEST(DeviceFactoryTest, CudaIsCudaOrAClearError) {
  auto cuda = CreateDevice("cuda");
  if (cuda.ok()) {
    EXPECT_EQ((*cuda)->kind(), DeviceKind::kCuda);
  } else {
    EXPECT_FALSE(cuda.status().message().empty());  // e.g. "this build has no CUDA backend"
  }
}

}  // namespace
}  // namespace odmoe
