// The CUDA backend through the Device interface against CpuDevice (the fp32 reference): every op on the same
// inputs, including both MatMul paths (GEMV and cuBLAS) for F32/F16/BF16 weights, both paths (GEMV and GEMM)
// for INT8 / NF4 quantized weights, and both attention kernels; memory accounting and capacity errors; streams,
// events and copies; op counts. Skipped without a GPU, except the check that creating the device then fails
// with a clear Unavailable error.
#include "src/backend/cuda_device.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/cpu_device.h"
#include "src/backend/quantize.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::ExpectClose;
using gpu_test::RandomFloats;

TEST(CreateCudaDeviceTest, FailsClearlyWithoutAGpuOrForABadOrdinal) {
  std::string why;
  if (!gpu_test::HaveGpu(&why)) {
    const auto device = CreateCudaDevice(0, 0);
    ASSERT_FALSE(device.ok());
    EXPECT_EQ(device.status().code(), absl::StatusCode::kUnavailable) << device.status();
    EXPECT_NE(std::string(device.status().message()).find("cudaGetDeviceCount"), std::string::npos) << device.status();
    return;
  }
  const auto device = CreateCudaDevice(1000, 0);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << device.status();
}

// The same bytes on the CPU reference device and on the CUDA device.
struct Twin {
  std::unique_ptr<Buffer> cpu;
  std::unique_ptr<Buffer> gpu;
};

class CudaDeviceTest : public gpu_test::CudaDeviceFixture {
 protected:
  void SetUp() override {
    CudaDeviceFixture::SetUp();
    cpu_ = std::make_unique<CpuDevice>();
  }

  Twin Make(const void* data, size_t bytes, const std::string& tag) {
    Twin t;
    auto c = cpu_->Allocate(bytes, tag);
    auto g = gpu_->Allocate(bytes, tag);
    EXPECT_TRUE(c.ok() && g.ok());
    t.cpu = std::move(c).value();
    t.gpu = std::move(g).value();
    if (data != nullptr) {
      cpu_->CopyToDevice(t.cpu->data(), data, bytes, nullptr);
      gpu_->CopyToDevice(t.gpu->data(), data, bytes, nullptr);
      // `data` may be a temporary, and ops may run on other streams.
      gpu_->Synchronize(nullptr);
    }
    return t;
  }
  template <typename T>
  Twin Make(const std::vector<T>& v, const std::string& tag) {
    return Make(v.data(), v.size() * sizeof(T), tag);
  }
  Twin Zeros(size_t floats, const std::string& tag) {
    std::vector<float> z(floats, 0.0f);
    return Make(z, tag);
  }
  // A weight as raw bytes of its dtype.
  Twin Weight(DType dtype, const std::vector<float>& values, const std::string& tag) {
    return Make(gpu_test::TestWeight::Encode(dtype, values), tag);
  }
  static WeightRef CpuRef(const Twin& t, DType dtype) { return WeightRef{t.cpu->data(), dtype}; }
  static WeightRef GpuRef(const Twin& t, DType dtype) { return WeightRef{t.gpu->data(), dtype}; }

  template <typename T>
  std::vector<T> Get(Device& device, const Buffer& buffer) {
    std::vector<T> host(buffer.size() / sizeof(T));
    device.CopyToHost(host.data(), buffer.data(), buffer.size(), nullptr);
    return host;
  }
  void ExpectSame(const Twin& t, double atol, double rtol, const std::string& what) {
    ExpectClose(Get<float>(*gpu_, *t.gpu), Get<float>(*cpu_, *t.cpu), atol, rtol, what);
  }

  std::unique_ptr<Device> cpu_;
};

TEST_F(CudaDeviceTest, KindNameAndMemoryInfo) {
  EXPECT_EQ(gpu_->kind(), DeviceKind::kCuda);
  EXPECT_EQ(gpu_->name().rfind("cuda:0", 0), 0u) << gpu_->name();
  const MemoryInfo info = gpu_->memory_info();
  EXPECT_GT(info.capacity, uint64_t{1} << 30);
  EXPECT_EQ(info.in_use, 0u);
}

TEST_F(CudaDeviceTest, CapacityIsEnforcedAndAccounted) {
  auto device = CreateCudaDevice(0, 1 << 20);
  ASSERT_TRUE(device.ok()) << device.status();
  auto a = (*device)->Allocate(600 << 10, "first");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*device)->memory_info().in_use, 600u << 10);
  auto b = (*device)->Allocate(600 << 10, "experts of layer 3");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(b.status().message()).find("experts of layer 3"), std::string::npos) << b.status();
  a->reset();
  EXPECT_EQ((*device)->memory_info().in_use, 0u);
  EXPECT_EQ((*device)->memory_info().peak, 600u << 10);
  (*device)->ResetPeak();
  EXPECT_EQ((*device)->memory_info().peak, 0u);
  // A buffer may outlive its device.
  auto c = (*device)->Allocate(1024, "survivor");
  ASSERT_TRUE(c.ok());
  device->reset();
  c->reset();
}

TEST_F(CudaDeviceTest, StreamWorkspaceCountsAgainstTheCapacity) {
  // The cuBLAS workspace and the GEMM scratch of a prepared stream are counted in memory_info(), and a 16-bit
  // GEMM on it allocates nothing more; a capacity too small for them is refused with ResourceExhausted.
  auto device = CreateCudaDevice(0, 256 << 20);
  ASSERT_TRUE(device.ok()) << device.status();
  auto stream = (*device)->CreateStream();
  const int64_t rows = 64, in = 1024, out = 512;
  ASSERT_TRUE((*device)->PrepareStream(stream.get(), rows, in).ok());
  const uint64_t prepared = (*device)->memory_info().in_use;
  EXPECT_GE(prepared, (uint64_t{4} << 20) + static_cast<uint64_t>(rows * in) * 4);
  auto x = (*device)->Allocate(rows * in * sizeof(float), "x");
  auto w = (*device)->Allocate(out * in * sizeof(uint16_t), "w");
  auto y = (*device)->Allocate(rows * out * sizeof(float), "y");
  ASSERT_TRUE(x.ok() && w.ok() && y.ok());
  const uint64_t buffers = (*x)->size() + (*w)->size() + (*y)->size();
  (*device)->MatMul((*x)->as<float>(), WeightRef{(*w)->data(), DType::kBF16}, WeightRef{}, rows, in, out,
                    (*y)->as<float>(), stream.get());
  (*device)->Synchronize(stream.get());
  EXPECT_EQ((*device)->memory_info().in_use, prepared + buffers);
  if (const std::optional<uint64_t> process = (*device)->process_device_bytes()) {
    EXPECT_GE(*process, (*device)->memory_info().in_use);  // the driver's figure includes the context
  }
  auto tiny = CreateCudaDevice(0, 1 << 20);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  auto tiny_stream = (*tiny)->CreateStream();
  const absl::Status refused = (*tiny)->PrepareStream(tiny_stream.get(), rows, in);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
}

// A worker's cycle: allocate an expert, load it on one stream, compute from it on another, evict it. No step may
// make the host wait for the device (counted by Device::counters(): the emulated runtime's own counts under the
// emulation, the backend's count of its runtime calls on a GPU), and each load sees its own bytes.
TEST_F(CudaDeviceTest, LoadingAndEvictingExpertsNeverWaitsForTheDevice) {
  constexpr size_t kExpertBytes = size_t{3} * 2048 * 768 * 2;  // gate, up, down of a Qwen3-30B-A3B expert, bf16
  constexpr size_t kProbe = 4096;                              // bytes of each load copied out by the "compute"
  constexpr int kCycles = 3;
  auto device = CreateCudaDevice(0, 2 * kExpertBytes + kCycles * kProbe);
  ASSERT_TRUE(device.ok()) << device.status();
  Device& d = **device;
  auto load = d.CreateStream();
  auto compute = d.CreateStream();
  auto loaded = d.CreateEvent();
  auto probes = d.Allocate(kCycles * kProbe, "probes");
  ASSERT_TRUE(probes.ok()) << probes.status();
  std::vector<std::vector<uint8_t>> hosts;
  for (int i = 0; i < kCycles; ++i) hosts.emplace_back(kExpertBytes, static_cast<uint8_t>(0x31 + 17 * i));

  d.ResetCounters();
  for (int i = 0; i < kCycles; ++i) {
    auto expert = d.Allocate(kExpertBytes, "expert");
    ASSERT_TRUE(expert.ok()) << expert.status();
    d.CopyToDevice((*expert)->data(), hosts[i].data(), kExpertBytes, load.get());
    d.RecordEvent(*loaded, load.get());
    d.WaitEvent(compute.get(), *loaded);
    d.CopyOnDevice((*probes)->as<uint8_t>() + i * kProbe, (*expert)->data(), kProbe, compute.get());
    expert->reset();  // evicted while the compute may still be queued
  }
  const DeviceCounters counts = d.counters();
  EXPECT_EQ(counts.host_syncs, 0u) << "an allocation or a free waited for the device";
  EXPECT_EQ(counts.allocations, static_cast<uint64_t>(kCycles));
  EXPECT_EQ(counts.frees, static_cast<uint64_t>(kCycles));
  EXPECT_EQ(d.memory_info().in_use, kCycles * kProbe);

  std::vector<uint8_t> back(kCycles * kProbe);
  d.CopyToHost(back.data(), (*probes)->data(), back.size(), compute.get());
  for (int i = 0; i < kCycles; ++i) {
    for (size_t j = 0; j < kProbe; ++j) ASSERT_EQ(back[i * kProbe + j], hosts[i][0]) << "cycle " << i << " byte " << j;
  }
}

// The budget is the capacity to the byte, whatever the pool keeps reserved behind it.
TEST_F(CudaDeviceTest, TheBudgetIsRefusedExactlyAtTheEdge) {
  constexpr size_t kExpertBytes = size_t{3} * 2048 * 768 * 2;
  auto device = CreateCudaDevice(0, 2 * kExpertBytes);
  ASSERT_TRUE(device.ok()) << device.status();
  Device& d = **device;
  auto a = d.Allocate(kExpertBytes, "expert a");
  auto b = d.Allocate(kExpertBytes, "expert b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(d.memory_info().in_use, 2 * kExpertBytes);
  auto one_more = d.Allocate(1, "one byte");
  ASSERT_FALSE(one_more.ok());
  EXPECT_EQ(one_more.status().code(), absl::StatusCode::kResourceExhausted) << one_more.status();
  b->reset();  // evicted: its memory stays in the pool, its bytes go back to the budget
  EXPECT_EQ(d.memory_info().in_use, kExpertBytes);
  auto too_big = d.Allocate(kExpertBytes + 1, "expert c");
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_NE(std::string(too_big.status().message()).find("expert c"), std::string::npos) << too_big.status();
  auto c = d.Allocate(kExpertBytes, "expert c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(d.memory_info().in_use, 2 * kExpertBytes);
  EXPECT_EQ(d.memory_info().peak, 2 * kExpertBytes);
}

// A budget larger than the GPU: what the GPU cannot hold is refused by the pool, clearly, after waiting once for
// the frees still pending (the only allocation that waits for the device), and the device goes on.
TEST_F(CudaDeviceTest, WhatTheGpuCannotHoldIsResourceExhausted) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ODMOE_ASSERT_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  auto device = CreateCudaDevice(0, 2 * static_cast<uint64_t>(total_bytes));
  ASSERT_TRUE(device.ok()) << device.status();
  (*device)->ResetCounters();
  auto huge = (*device)->Allocate(total_bytes + (size_t{1} << 30), "all the experts");
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ((*device)->counters().host_syncs, 1u) << "one wait for pending frees before giving up";
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_NE(std::string(huge.status().message()).find("all the experts"), std::string::npos) << huge.status();
  EXPECT_EQ((*device)->memory_info().in_use, 0u);
  auto small = (*device)->Allocate(1 << 20, "one expert");
  EXPECT_TRUE(small.ok()) << small.status();
}

TEST_F(CudaDeviceTest, StreamsEventsAndCopies) {
  const size_t count = 1 << 20;
  std::vector<float> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i) * 0.5f;
  auto a = gpu_->Allocate(count * 4, "a");
  auto b = gpu_->Allocate(count * 4, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  auto s1 = gpu_->CreateStream();
  auto s2 = gpu_->CreateStream();
  auto ev = gpu_->CreateEvent();
  gpu_->CopyToDevice((*a)->data(), host.data(), count * 4, s1.get());
  gpu_->RecordEvent(*ev, s1.get());
  gpu_->WaitEvent(s2.get(), *ev);
  gpu_->CopyOnDevice((*b)->data(), (*a)->data(), count * 4, s2.get());
  gpu_->Add(static_cast<const float*>((*a)->data()), count, static_cast<float*>((*b)->data()), s2.get());
  std::vector<float> back(count);
  gpu_->CopyToHost(back.data(), (*b)->data(), count * 4, s2.get());
  for (size_t i = 0; i < count; ++i) ASSERT_EQ(back[i], host[i] * 2) << i;
  gpu_->SynchronizeAll();
  const TransferStats stats = gpu_->transfer_stats();
  EXPECT_EQ(stats.h2d_copies, 1u);
  EXPECT_EQ(stats.h2d_bytes, count * 4);
  EXPECT_EQ(stats.d2d_copies, 1u);
  EXPECT_EQ(stats.d2h_copies, 1u);
  EXPECT_EQ(gpu_->op_counts().at("Add"), 1);
}

TEST_F(CudaDeviceTest, MatMulMatchesCpuDeviceOnBothPaths) {
  std::mt19937 rng(40);
  int64_t calls = 0;
  for (DType dtype : gpu_test::kWeightTypes) {
    for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{{64, 48}, {256, 1000}, {127, 33}}) {
      const Twin w = Weight(dtype, RandomFloats(static_cast<size_t>(in * out), rng), "w");
      const Twin bias = Weight(dtype, RandomFloats(static_cast<size_t>(out), rng), "bias");
      const Twin bias32 = Weight(DType::kF32, RandomFloats(static_cast<size_t>(out), rng), "bias32");
      for (int64_t n : {1, 3, 8, 9, 40, 300}) {
        const Twin x = Make(RandomFloats(static_cast<size_t>(n * in), rng), "x");
        const Twin y = Zeros(static_cast<size_t>(n * out), "y");
        const Twin yb = Zeros(static_cast<size_t>(n * out), "yb");
        for (Device* d : {cpu_.get(), gpu_.get()}) {
          const bool g = d == gpu_.get();
          const auto ref = [&](const Twin& t, DType dt) { return g ? GpuRef(t, dt) : CpuRef(t, dt); };
          const auto ptr = [&](const Twin& t) { return static_cast<float*>(g ? t.gpu->data() : t.cpu->data()); };
          d->MatMul(ptr(x), ref(w, dtype), ref(bias, dtype), n, in, out, ptr(y), nullptr);
          d->MatMul(ptr(x), ref(w, dtype), ref(bias32, DType::kF32), n, in, out, ptr(yb), nullptr);
        }
        calls += 2;
        // GEMV and fp32 cuBLAS (no TF32): fp32 rounding only. 16-bit cuBLAS: the activations carry ~16 bits.
        const bool gemm16 = n > 8 && dtype != DType::kF32;
        const double atol = (gemm16 ? 2e-4 : 2e-5) * std::sqrt(static_cast<double>(in));
        const std::string what = std::string(DTypeName(dtype)) + " n=" + std::to_string(n) +
                                 " in=" + std::to_string(in) + " out=" + std::to_string(out);
        ExpectSame(y, atol, 1e-4, what);
        ExpectSame(yb, atol, 1e-4, what + " (f32 bias)");
      }
    }
  }
  EXPECT_EQ(gpu_->op_counts().at("MatMul"), calls);
}

// fp16 weights on the cuBLAS path (n > 8) with activations past fp16's range (a model's outlier features): the
// split into 16-bit pairs scales such rows down and back, so the result is the CPU's, not inf or NaN.
TEST_F(CudaDeviceTest, Fp16GemmTakesActivationsPastFp16Range) {
  std::mt19937 rng(43);
  const int64_t n = 12, in = 96, out = 40;
  const Twin w = Weight(DType::kF16, RandomFloats(static_cast<size_t>(in * out), rng), "w");
  std::vector<float> xs = RandomFloats(static_cast<size_t>(n * in), rng);
  xs[5 * in + 3] = 2.0e5f;
  xs[9 * in + 0] = -7.0e4f;
  const Twin x = Make(xs, "x");
  const Twin y = Zeros(static_cast<size_t>(n * out), "y");
  for (Device* d : {cpu_.get(), gpu_.get()}) {
    const bool g = d == gpu_.get();
    d->MatMul(static_cast<float*>(g ? x.gpu->data() : x.cpu->data()),
              g ? GpuRef(w, DType::kF16) : CpuRef(w, DType::kF16), WeightRef{}, n, in, out,
              static_cast<float*>(g ? y.gpu->data() : y.cpu->data()), nullptr);
  }
  // Row 5's outputs are ~2e5 * |w|: the pair keeps ~22 bits of each activation.
  ExpectSame(y, 2e-4 * std::sqrt(static_cast<double>(in)), 1e-5, "fp16 GEMM with activations up to 2e5");
}

// The RoPE inverse-frequency table the device keeps per (head_dim, theta) counts in memory_info().
TEST_F(CudaDeviceTest, RopeTablesAreAccounted) {
  auto device = CreateCudaDevice(0, 64 << 20);
  ASSERT_TRUE(device.ok()) << device.status();
  const int64_t heads = 2, head_dim = 48;
  auto q = (*device)->Allocate(heads * head_dim * sizeof(float), "q");
  auto pos = (*device)->Allocate(sizeof(int32_t), "pos");
  ASSERT_TRUE(q.ok() && pos.ok());
  const std::vector<float> q_host(static_cast<size_t>(heads * head_dim), 1.0f);
  const int32_t position = 5;
  (*device)->CopyToDevice((*q)->data(), q_host.data(), (*q)->size(), nullptr);
  (*device)->CopyToDevice((*pos)->data(), &position, sizeof position, nullptr);
  (*device)->Synchronize(nullptr);
  const uint64_t buffers = (*device)->memory_info().in_use;
  const uint64_t table = head_dim / 2 * sizeof(float);
  (*device)->Rope((*q)->as<float>(), static_cast<int32_t*>((*pos)->data()), 1, heads, head_dim, 10000.0, nullptr);
  (*device)->Synchronize(nullptr);
  EXPECT_EQ((*device)->memory_info().in_use, buffers + table);
  (*device)->Rope((*q)->as<float>(), static_cast<int32_t*>((*pos)->data()), 1, heads, head_dim, 10000.0, nullptr);
  (*device)->Rope((*q)->as<float>(), static_cast<int32_t*>((*pos)->data()), 1, heads, head_dim, 500000.0, nullptr);
  (*device)->Synchronize(nullptr);
  EXPECT_EQ((*device)->memory_info().in_use, buffers + 2 * table);  // one more table, for the second theta
}

// The KV cache in the compute dtype: F16 / BF16 models keep it in their dtype (anything else in F32); Convert
// rounds to 16 bits and widens back bitwise as the CPU device does; both attention kernels read a 16-bit cache
// as the CPU's fp32 attention reads the same values widened.
TEST_F(CudaDeviceTest, KvCacheInTheComputeDType) {
  EXPECT_EQ(gpu_->KvCacheDType(DType::kBF16), DType::kBF16);
  EXPECT_EQ(gpu_->KvCacheDType(DType::kF16), DType::kF16);
  EXPECT_EQ(gpu_->KvCacheDType(DType::kF32), DType::kF32);
  EXPECT_EQ(gpu_->KvCacheDType(DType::kI8), DType::kF32);
  EXPECT_EQ(cpu_->KvCacheDType(DType::kBF16), DType::kF32);

  std::mt19937 rng(43);
  const int64_t heads = 6, kv_heads = 2, head_dim = 40;
  const float scale = 1.0f / std::sqrt(40.0f);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (const auto& [n, past] : std::vector<std::pair<int64_t, int64_t>>{{1, 0}, {1, 300}, {3, 40}, {20, 5}}) {
      const std::string what =
          std::string(DTypeName(dtype)) + " n=" + std::to_string(n) + " past=" + std::to_string(past);
      const int64_t count = (past + n) * kv_heads * head_dim;
      std::vector<float> k = RandomFloats(static_cast<size_t>(count), rng, -3.0f, 3.0f);
      k[0] = 1.00390625f;  // a bf16 halfway point: rounds to even
      const Twin k32 = Make(k, "k fp32");
      const Twin v32 = Make(RandomFloats(static_cast<size_t>(count), rng), "v fp32");
      const Twin q = Make(RandomFloats(static_cast<size_t>(n * heads * head_dim), rng), "q");
      const Twin k16 = Make(std::vector<uint16_t>(static_cast<size_t>(count)), "k cache");
      const Twin v16 = Make(std::vector<uint16_t>(static_cast<size_t>(count)), "v cache");
      const Twin k_back = Zeros(static_cast<size_t>(count), "k widened");
      const Twin attn = Zeros(static_cast<size_t>(n * heads * head_dim), "attn");
      for (Device* d : {cpu_.get(), gpu_.get()}) {
        const bool g = d == gpu_.get();
        const auto p = [&](const Twin& t) { return g ? t.gpu->data() : t.cpu->data(); };
        d->Convert(p(k32), DType::kF32, count, p(k16), dtype, nullptr);
        d->Convert(p(v32), DType::kF32, count, p(v16), dtype, nullptr);
        d->Convert(p(k16), dtype, count, p(k_back), DType::kF32, nullptr);
        if (g) {
          d->Attention(static_cast<float*>(p(q)), KvCacheRef{p(k16), dtype}, KvCacheRef{p(v16), dtype}, n, past, heads,
                       kv_heads, head_dim, scale, static_cast<float*>(p(attn)), nullptr);
        } else {  // the CPU device's cache is fp32: the same values, widened
          const Twin v_back = Zeros(static_cast<size_t>(count), "v widened");
          d->Convert(p(v16), dtype, count, p(v_back), DType::kF32, nullptr);
          d->Attention(static_cast<float*>(p(q)), KvCacheRef{p(k_back)}, KvCacheRef{v_back.cpu->data()}, n, past, heads,
                       kv_heads, head_dim, scale, static_cast<float*>(p(attn)), nullptr);
        }
        d->Synchronize(nullptr);
      }
      EXPECT_EQ(Get<uint16_t>(*gpu_, *k16.gpu), Get<uint16_t>(*cpu_, *k16.cpu)) << what << " fp32 -> 16 bits";
      EXPECT_EQ(Get<uint16_t>(*gpu_, *v16.gpu), Get<uint16_t>(*cpu_, *v16.cpu)) << what << " fp32 -> 16 bits";
      ExpectSame(k_back, 0.0, 0.0, what + " 16 bits -> fp32");
      ExpectSame(attn, 2e-5, 1e-4, what + " attention over the 16-bit cache");
    }
  }
}

// Quantized weights: the dequantizing GEMV (n <= 8) and GEMM kernels against the CPU device, which computes
// the F32 MatMul of the dequantized weight; with no bias, a bias of the source dtype and an fp32 bias.
TEST_F(CudaDeviceTest, QuantizedMatMulMatchesCpuDevice) {
  std::mt19937 rng(42);
  int64_t calls = 0;
  for (DType quant : {DType::kI8, DType::kU8}) {
    for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{{64, 48}, {127, 33}, {256, 300}}) {
      const std::vector<float> values = RandomFloats(static_cast<size_t>(in * out), rng);
      std::vector<uint8_t> data;
      std::vector<float> scales;
      if (quant == DType::kI8) {
        data.resize(static_cast<size_t>(in * out));
        scales.resize(static_cast<size_t>(out));
        QuantizeInt8Rows(values.data(), DType::kF32, out, in, reinterpret_cast<int8_t*>(data.data()), scales.data());
      } else {
        data.resize(static_cast<size_t>(out * Nf4RowBytes(in)));
        scales.resize(static_cast<size_t>(out * Nf4BlocksPerRow(in)));
        QuantizeNf4(values.data(), DType::kF32, out, in, data.data(), scales.data());
      }
      const Twin w = Make(data, "w");
      const Twin ws = Make(scales, "w.scales");
      const Twin bias = Weight(DType::kBF16, RandomFloats(static_cast<size_t>(out), rng), "bias");
      const Twin bias32 = Weight(DType::kF32, RandomFloats(static_cast<size_t>(out), rng), "bias32");
      for (int64_t n : {1, 3, 8, 9, 70, 300}) {
        const Twin x = Make(RandomFloats(static_cast<size_t>(n * in), rng), "x");
        const Twin y = Zeros(static_cast<size_t>(n * out), "y");
        const Twin yb = Zeros(static_cast<size_t>(n * out), "yb");
        const Twin yb32 = Zeros(static_cast<size_t>(n * out), "yb32");
        for (Device* d : {cpu_.get(), gpu_.get()}) {
          const bool g = d == gpu_.get();
          const auto ref = [&](const Twin& t, DType dt) { return g ? GpuRef(t, dt) : CpuRef(t, dt); };
          const auto ptr = [&](const Twin& t) { return static_cast<float*>(g ? t.gpu->data() : t.cpu->data()); };
          WeightRef wq = ref(w, quant);
          wq.scales = ptr(ws);
          d->MatMul(ptr(x), wq, WeightRef{}, n, in, out, ptr(y), nullptr);
          d->MatMul(ptr(x), wq, ref(bias, DType::kBF16), n, in, out, ptr(yb), nullptr);
          d->MatMul(ptr(x), wq, ref(bias32, DType::kF32), n, in, out, ptr(yb32), nullptr);
        }
        calls += 3;
        // Scales applied to partial sums, another summation order: fp32 rounding differences only.
        const double atol = 2e-5 * std::sqrt(static_cast<double>(in));
        const std::string what = std::string(DTypeName(quant)) + " n=" + std::to_string(n) +
                                 " in=" + std::to_string(in) + " out=" + std::to_string(out);
        ExpectSame(y, atol, 1e-4, what);
        ExpectSame(yb, atol, 1e-4, what + " (bf16 bias)");
        ExpectSame(yb32, atol, 1e-4, what + " (f32 bias)");
      }
    }
  }
  EXPECT_EQ(gpu_->op_counts().at("MatMul"), calls);
}

TEST_F(CudaDeviceTest, LayerOpsMatchCpuDevice) {
  std::mt19937 rng(41);
  const int64_t vocab = 97, hidden = 96, heads = 6, kv_heads = 2, head_dim = 48, experts = 16, top_k = 4;
  for (DType dtype : gpu_test::kWeightTypes) {
    for (const auto& [n, past] : std::vector<std::pair<int64_t, int64_t>>{{1, 0}, {1, 2000}, {3, 40}, {20, 5}}) {
      const std::string what =
          std::string(DTypeName(dtype)) + " n=" + std::to_string(n) + " past=" + std::to_string(past);
      const int64_t len = past + n;
      std::vector<int32_t> ids_host(static_cast<size_t>(n));
      std::vector<int32_t> pos_host(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        ids_host[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + 5) % vocab);
        pos_host[static_cast<size_t>(i)] = static_cast<int32_t>(past + i);
      }
      const Twin ids = Make(ids_host, "ids");
      const Twin pos = Make(pos_host, "positions");
      const Twin table = Weight(dtype, RandomFloats(static_cast<size_t>(vocab * hidden), rng), "embed");
      const Twin norm_w = Weight(dtype, RandomFloats(static_cast<size_t>(hidden), rng, 0.5f, 1.5f), "norm");
      const Twin h = Zeros(static_cast<size_t>(n * hidden), "h");
      const Twin normed = Zeros(static_cast<size_t>(n * hidden), "normed");
      const Twin q = Make(RandomFloats(static_cast<size_t>(n * heads * head_dim), rng), "q");
      const Twin kc = Make(RandomFloats(static_cast<size_t>(len * kv_heads * head_dim), rng), "k cache");
      const Twin vc = Make(RandomFloats(static_cast<size_t>(len * kv_heads * head_dim), rng), "v cache");
      const Twin attn = Zeros(static_cast<size_t>(n * heads * head_dim), "attn");
      const Twin logits = Make(RandomFloats(static_cast<size_t>(n * experts), rng, -3.0f, 3.0f), "router logits");
      const Twin rids = Make(std::vector<int32_t>(static_cast<size_t>(n * top_k), 0), "expert ids");
      const Twin rw = Zeros(static_cast<size_t>(n * top_k), "expert weights");
      const Twin gate = Make(RandomFloats(static_cast<size_t>(n * hidden), rng, -4.0f, 4.0f), "gate");
      const Twin up = Make(RandomFloats(static_cast<size_t>(n * hidden), rng), "up");
      const Twin act = Zeros(static_cast<size_t>(n * hidden), "act");
      std::vector<int32_t> rows_host(static_cast<size_t>(2 * n));
      for (int64_t i = 0; i < 2 * n; ++i) rows_host[static_cast<size_t>(i)] = static_cast<int32_t>(i % n);
      const Twin rows = Make(rows_host, "rows");
      const Twin gathered = Zeros(static_cast<size_t>(2 * n * hidden), "gathered");
      const Twin scale = Make(RandomFloats(static_cast<size_t>(2 * n), rng), "scale");
      const Twin acc = Make(RandomFloats(static_cast<size_t>(n * hidden), rng), "acc");
      const Twin hq = Make(RandomFloats(static_cast<size_t>(n * heads * head_dim), rng), "q (head norms)");
      const Twin hk = Make(RandomFloats(static_cast<size_t>(n * kv_heads * head_dim), rng), "k (head norms)");
      const Twin q_norm = Weight(dtype, RandomFloats(static_cast<size_t>(head_dim), rng, 0.5f, 1.5f), "q_norm");
      const Twin k_norm = Weight(dtype, RandomFloats(static_cast<size_t>(head_dim), rng, 0.5f, 1.5f), "k_norm");
      const Twin residual = Make(RandomFloats(static_cast<size_t>(n * hidden), rng), "residual");
      const Twin routed_h = Zeros(static_cast<size_t>(n * hidden), "routed h");
      const Twin router = Weight(dtype, RandomFloats(static_cast<size_t>(8 * hidden), rng, -0.3f, 0.3f), "router");
      const Twin router_logits = Zeros(static_cast<size_t>(n * 8), "router logits (fused)");
      const Twin fused_ids = Make(std::vector<int32_t>(static_cast<size_t>(n * 2), 0), "expert ids (fused)");
      const Twin fused_w = Zeros(static_cast<size_t>(n * 2), "expert weights (fused)");
      for (Device* d : {cpu_.get(), gpu_.get()}) {
        const bool g = d == gpu_.get();
        const auto ref = [&](const Twin& t) { return g ? GpuRef(t, dtype) : CpuRef(t, dtype); };
        const auto f = [&](const Twin& t) { return static_cast<float*>(g ? t.gpu->data() : t.cpu->data()); };
        const auto i32 = [&](const Twin& t) { return static_cast<int32_t*>(g ? t.gpu->data() : t.cpu->data()); };
        auto stream = d->CreateStream();
        d->Embedding(i32(ids), n, ref(table), hidden, f(h), stream.get());
        d->RmsNorm(f(h), ref(norm_w), n, hidden, 1e-5f, f(normed), stream.get());
        d->Rope(f(q), i32(pos), n, heads, head_dim, 10000.0, stream.get());
        d->Rope(f(kc) + past * kv_heads * head_dim, i32(pos), n, kv_heads, head_dim, 10000.0, stream.get());
        d->HeadNormRope(f(hq), f(hk), ref(q_norm), ref(k_norm), i32(pos), n, heads, kv_heads, head_dim, 1e-6f, 1e6,
                        stream.get());
        d->AddRmsNormRoute(f(normed), f(residual), ref(norm_w), ref(router), n, hidden, 1e-5f, 8, 2, true, f(routed_h),
                           f(router_logits), i32(fused_ids), f(fused_w), stream.get());
        d->Attention(f(q), KvCacheRef{f(kc)}, KvCacheRef{f(vc)}, n, past, heads, kv_heads, head_dim,
                     1.0f / std::sqrt(48.0f), f(attn), stream.get());
        d->RouterTopK(f(logits), n, experts, top_k, true, i32(rids), f(rw), stream.get());
        d->SwiGlu(f(gate), f(up), n * hidden, f(act), stream.get());
        d->Add(f(normed), n * hidden, f(act), stream.get());
        d->GatherRows(f(act), i32(rows), 2 * n, hidden, f(gathered), stream.get());
        d->ScatterAddScaled(f(gathered), i32(rows), f(scale), 2 * n, hidden, true, f(acc), stream.get());
        d->Synchronize(stream.get());
      }
      ExpectSame(h, 0.0, 0.0, what + " embedding");
      ExpectSame(normed, 1e-6, 1e-5, what + " rmsnorm");
      ExpectSame(q, 1e-6, 1e-5, what + " rope q");
      ExpectSame(kc, 1e-6, 1e-5, what + " rope k");
      ExpectSame(hq, 1e-5, 1e-5, what + " head norms and rope, q");
      ExpectSame(hk, 1e-5, 1e-5, what + " head norms and rope, k");
      ExpectSame(residual, 1e-6, 1e-6, what + " norm and route: the residual");
      ExpectSame(routed_h, 1e-6, 1e-5, what + " norm and route: the norm");
      ExpectSame(router_logits, 1e-5, 1e-4, what + " norm and route: the logits");
      EXPECT_EQ(Get<int32_t>(*gpu_, *fused_ids.gpu), Get<int32_t>(*cpu_, *fused_ids.cpu)) << what << " routed ids";
      ExpectSame(fused_w, 1e-5, 1e-4, what + " norm and route: the weights (from the logits)");
      ExpectSame(attn, 2e-5, 1e-4, what + " attention");
      EXPECT_EQ(Get<int32_t>(*gpu_, *rids.gpu), Get<int32_t>(*cpu_, *rids.cpu)) << what << " router ids";
      ExpectSame(rw, 1e-7, 1e-5, what + " router weights");
      ExpectSame(act, 1e-6, 1e-5, what + " swiglu + add");
      ExpectSame(gathered, 1e-6, 1e-5, what + " gather");
      ExpectSame(acc, 1e-6, 1e-5, what + " scatter-add");
    }
  }
  const std::map<std::string, int64_t> counts = gpu_->op_counts();
  for (const char* op : {"Embedding", "RmsNorm", "Attention", "SwiGlu", "Add", "GatherRows", "ScatterAddScaled"}) {
    EXPECT_EQ(counts.at(op), 12) << op;
  }
  EXPECT_EQ(counts.at("Rope"), 24);
  EXPECT_EQ(counts.at("HeadNormRope"), 12) << "one launch for both norms and both rotations";
  // One launch but for the case of 20 rows (MatMul's GEMM), which takes the three ops.
  EXPECT_EQ(counts.at("AddRmsNormRoute"), 9);
  EXPECT_EQ(counts.at("AddRmsNorm"), 3);
  EXPECT_EQ(counts.at("MatMul"), 3);
  EXPECT_EQ(counts.at("RouterTopK"), 12 + 3);
}

// SelectTokens through the Device: the CUDA device and the CPU reference pick the same ids for the same logits and
// per-row choices (greedy rows among sampled ones), on a stream.
TEST_F(CudaDeviceTest, SelectTokensPicksTheCpuDevicesIds) {
  std::mt19937 rng(43);
  const int64_t vocab = 3001, rows = 12;
  const Twin logits = Make(RandomFloats(static_cast<size_t>(rows * vocab), rng, -6.0f, 6.0f), "logits");
  std::vector<TokenChoice> choices(static_cast<size_t>(rows));
  for (size_t r = 0; r < choices.size(); ++r) {
    if (r % 3 == 0) continue;  // greedy
    choices[r] = TokenChoice{0.5f + 0.25f * static_cast<float>(r % 4), static_cast<int32_t>(r % 2 == 0 ? 40 : 0),
                             r % 5 == 0 ? 1.0f : 0.9f, std::uniform_real_distribution<float>(0.0f, 1.0f)(rng),
                             r % 4 == 1 ? 0.1f : 0.0f};
  }
  const Twin dev_choices = Make(choices, "choices");
  const Twin ids = Make(std::vector<int32_t>(static_cast<size_t>(rows), -1), "ids");
  for (Device* d : {cpu_.get(), gpu_.get()}) {
    const bool g = d == gpu_.get();
    auto stream = d->CreateStream();
    d->SelectTokens(static_cast<const float*>(g ? logits.gpu->data() : logits.cpu->data()), rows, vocab,
                    static_cast<const TokenChoice*>(g ? dev_choices.gpu->data() : dev_choices.cpu->data()),
                    static_cast<int32_t*>(g ? ids.gpu->data() : ids.cpu->data()), stream.get());
    d->Synchronize(stream.get());
  }
  const std::vector<int32_t> got = Get<int32_t>(*gpu_, *ids.gpu);
  EXPECT_EQ(got, Get<int32_t>(*cpu_, *ids.cpu));
  for (int32_t id : got) EXPECT_TRUE(id >= 0 && id < vocab) << id;
  EXPECT_EQ(gpu_->op_counts().at("SelectTokens"), 1);
}

// One decode step's cache writes and attention recorded into a graph (CaptureGraph) and replayed at every position
// of a bf16 cache, its inputs (position, q, the new K and V rows) written into page-locked staging memory before
// each launch: bitwise the step run op by op (Convert into the cache at the position, Attention with past = the
// position), across the point where attention splits the sequence (32 keys). Nothing runs at the capture, every
// kernel of a replay comes from the graph, and the ops and copies are counted per launch.
TEST_F(CudaDeviceTest, AGraphReplaysADecodeStepAtEveryPosition) {
  std::mt19937 rng(44);
  const int64_t heads = 4, kv_heads = 2, head_dim = 32, capacity = 50, kv = kv_heads * head_dim, qs = heads * head_dim;
  const float scale = 1.0f / std::sqrt(32.0f);
  const DType dtype = DType::kBF16;
  ASSERT_TRUE(gpu_->SupportsGraphs());
  auto stream = gpu_->CreateStream();
  Stream* s = stream.get();
  // Staging: [position, q[qs], k[kv], v[kv]] as 4-byte values.
  auto staging = gpu_->AllocateHost((1 + qs + 2 * kv) * sizeof(float), "staging");
  auto out_host = gpu_->AllocateHost(qs * sizeof(float), "attention out");
  ASSERT_TRUE(staging.ok() && out_host.ok());
  const auto buffer = [&](size_t bytes, const char* tag) {
    auto b = gpu_->Allocate(bytes, tag);
    EXPECT_TRUE(b.ok()) << b.status();
    return *std::move(b);
  };
  std::unique_ptr<Buffer> inputs = buffer((1 + qs + 2 * kv) * sizeof(float), "inputs");
  std::unique_ptr<Buffer> out = buffer(qs * sizeof(float), "out");
  std::unique_ptr<Buffer> ws =
      buffer(std::max<size_t>(4, gpu_->AttentionAtWorkspaceBytes(1, capacity - 1, heads, head_dim)), "workspace");
  // The graph's caches and the op-by-op ones, zeroed.
  std::unique_ptr<Buffer> caches[2][2];
  for (auto& pair : caches) {
    for (auto& c : pair) {
      c = buffer(static_cast<size_t>(capacity * kv) * 2, "cache");
      const std::vector<uint16_t> zeros(static_cast<size_t>(capacity * kv), 0);
      gpu_->CopyToDevice(c->data(), zeros.data(), zeros.size() * 2, nullptr);
    }
  }
  gpu_->Synchronize(nullptr);
  const auto* pos = inputs->as<int32_t>();
  const float* q = inputs->as<float>() + 1;
  const float* k_row = q + qs;
  const float* v_row = k_row + kv;
  const KvCacheRef kc{caches[0][0]->data(), dtype}, vc{caches[0][1]->data(), dtype};

  gpu_->ResetCounters();
  auto graph = gpu_->CaptureGraph(s, [&] {
    gpu_->CopyToDevice(inputs->data(), (*staging)->data(), (*staging)->size(), s);
    gpu_->WriteKvRows(k_row, v_row, pos, 1, kv, kc, vc, capacity, s);
    gpu_->AttentionAt(q, kc, vc, 1, pos, capacity - 1, heads, kv_heads, head_dim, scale, ws->data(), out->as<float>(),
                      s);
    gpu_->CopyToHostAsync((*out_host)->data(), out->data(), out->size(), s);
    return absl::OkStatus();
  });
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_EQ(gpu_->counters().launches, 0u) << "a capture runs nothing";
  EXPECT_EQ(gpu_->op_counts().count("WriteKvRows"), 0u) << "ops are counted when they run";

  const DeviceCounters at_capture = gpu_->counters();
  for (int64_t p = 0; p < capacity; ++p) {
    float* st = (*staging)->as<float>();
    const int32_t position = static_cast<int32_t>(p);
    std::memcpy(st, &position, sizeof(position));
    const std::vector<float> fresh = RandomFloats(static_cast<size_t>(qs + 2 * kv), rng, -2.0f, 2.0f);
    std::memcpy(st + 1, fresh.data(), fresh.size() * sizeof(float));
    gpu_->LaunchGraph(**graph, s);
    gpu_->Synchronize(s);
    const std::vector<float> replayed((*out_host)->as<float>(), (*out_host)->as<float>() + qs);

    // Op by op, from the same inputs.
    gpu_->CopyToDevice(inputs->data(), st, (*staging)->size(), s);
    const KvCacheRef ke{caches[1][0]->data(), dtype}, ve{caches[1][1]->data(), dtype};
    auto* k_at = static_cast<uint8_t*>(caches[1][0]->data()) + p * kv * 2;
    auto* v_at = static_cast<uint8_t*>(caches[1][1]->data()) + p * kv * 2;
    gpu_->Convert(k_row, DType::kF32, kv, k_at, dtype, s);
    gpu_->Convert(v_row, DType::kF32, kv, v_at, dtype, s);
    gpu_->Attention(q, ke, ve, 1, p, heads, kv_heads, head_dim, scale, out->as<float>(), s);
    gpu_->Synchronize(s);  // Get copies on the default stream
    const std::vector<float> eager = Get<float>(*gpu_, *out);
    ASSERT_EQ(std::memcmp(replayed.data(), eager.data(), eager.size() * sizeof(float)), 0) << "position " << p;
  }
  EXPECT_EQ(Get<uint16_t>(*gpu_, *caches[0][0]), Get<uint16_t>(*gpu_, *caches[1][0]));
  EXPECT_EQ(Get<uint16_t>(*gpu_, *caches[0][1]), Get<uint16_t>(*gpu_, *caches[1][1]));
  const DeviceCounters c = gpu_->counters();
  EXPECT_EQ(c.graph_launches - at_capture.graph_launches, static_cast<uint64_t>(capacity));
  EXPECT_GE(c.graph_kernel_launches, static_cast<uint64_t>(2 * capacity)) << "the cache writes and attention";
  EXPECT_EQ(gpu_->op_counts().at("WriteKvRows"), capacity);
}

// RopeWriteKv gives bitwise what the ops it stands for give (Device::RopeWriteKv's default: Rope or HeadNormRope, then
// WriteKvRows, each CUDA's own): q, k and both caches, in one launch (counted as a RopeWriteKv op) without norms and
// with per-head norms, and through the default where the fused kernel does not apply (a head longer than its block,
// norms of two dtypes); caches in bf16 and f32, a position outside the caches (rotated, not stored).
TEST_F(CudaDeviceTest, RopeWriteKvIsTheOpsItStandsForBitwise) {
  struct Case {
    DType cache;
    int64_t head_dim;
    bool norms;
    DType q_norm, k_norm;
    bool one_launch;
  };
  const DType f32 = DType::kF32, bf16 = DType::kBF16;
  const Case cases[] = {{bf16, 64, false, f32, f32, true},    {f32, 48, false, f32, f32, true},
                        {bf16, 64, true, bf16, bf16, true},   {f32, 48, true, f32, f32, true},
                        {bf16, 320, true, bf16, bf16, false}, {bf16, 64, true, f32, bf16, false}};
  std::mt19937 rng(31);
  const int64_t n = 3, heads = 6, kv_heads = 2, capacity = 4;
  const std::vector<int32_t> positions = {3, 0, 4};  // 4: outside the caches
  for (const Case& c : cases) {
    const std::string what =
        std::string(DTypeName(c.cache)) + " cache, head_dim " + std::to_string(c.head_dim) +
        (c.norms ? ", norms " + std::string(DTypeName(c.q_norm)) + "/" + std::string(DTypeName(c.k_norm)) : "");
    const int64_t qs = n * heads * c.head_dim, kv = kv_heads * c.head_dim;
    const std::vector<float> qk = RandomFloats(static_cast<size_t>(qs + n * kv), rng, -2.0f, 2.0f);
    const std::vector<float> v = RandomFloats(static_cast<size_t>(n * kv), rng, -2.0f, 2.0f);
    const size_t cache_bytes = static_cast<size_t>(capacity * kv) * DTypeSize(c.cache);
    const std::vector<uint8_t> pattern(cache_bytes, 0x5a);
    const Twin q_norm = Weight(c.q_norm, RandomFloats(static_cast<size_t>(c.head_dim), rng, 0.5f, 1.5f), "q_norm");
    const Twin k_norm = Weight(c.k_norm, RandomFloats(static_cast<size_t>(c.head_dim), rng, 0.5f, 1.5f), "k_norm");
    const Twin pos = Make(positions, "positions");
    const Twin vs = Make(v, "v");
    std::vector<float> got_qk[2];
    std::vector<uint8_t> got_k[2], got_v[2];
    auto stream = gpu_->CreateStream();
    for (int fused = 0; fused < 2; ++fused) {
      const Twin qkb = Make(qk, "q and k");
      const Twin kc = Make(pattern, "k cache"), vc = Make(pattern, "v cache");
      float* q = static_cast<float*>(qkb.gpu->data());
      const WeightRef qn = c.norms ? GpuRef(q_norm, c.q_norm) : WeightRef{};
      const WeightRef kn = c.norms ? GpuRef(k_norm, c.k_norm) : WeightRef{};
      const auto* p = static_cast<const int32_t*>(pos.gpu->data());
      const KvCacheRef kr{kc.gpu->data(), c.cache}, vr{vc.gpu->data(), c.cache};
      const auto* vp = static_cast<const float*>(vs.gpu->data());
      const int64_t before = gpu_->op_counts()["RopeWriteKv"];
      if (fused == 1) {
        gpu_->RopeWriteKv(q, q + qs, vp, qn, kn, 1e-6f, p, n, heads, kv_heads, c.head_dim, 1e6, kr, vr, capacity,
                          stream.get());
        EXPECT_EQ(gpu_->op_counts()["RopeWriteKv"] - before, c.one_launch ? 1 : 0) << what;
      } else {
        gpu_->Device::RopeWriteKv(q, q + qs, vp, qn, kn, 1e-6f, p, n, heads, kv_heads, c.head_dim, 1e6, kr, vr,
                                  capacity, stream.get());
        EXPECT_EQ(gpu_->op_counts()["RopeWriteKv"], before) << what;
      }
      gpu_->Synchronize(stream.get());
      got_qk[fused] = Get<float>(*gpu_, *qkb.gpu);
      got_k[fused] = Get<uint8_t>(*gpu_, *kc.gpu);
      got_v[fused] = Get<uint8_t>(*gpu_, *vc.gpu);
    }
    EXPECT_EQ(std::memcmp(got_qk[0].data(), got_qk[1].data(), got_qk[0].size() * sizeof(float)), 0) << what;
    EXPECT_NE(std::memcmp(got_qk[1].data(), qk.data(), qk.size() * sizeof(float)), 0) << what << ": rotated";
    EXPECT_EQ(got_k[0], got_k[1]) << what << ": the K cache";
    EXPECT_EQ(got_v[0], got_v[1]) << what << ": the V cache";
    EXPECT_NE(got_v[1], pattern) << what << ": V stored";
  }
}

// A capture whose enqueue fails returns that error, runs nothing, and leaves the stream usable.
TEST_F(CudaDeviceTest, AFailedCaptureLeavesTheStreamUsable) {
  auto stream = gpu_->CreateStream();
  const Twin x = Make(std::vector<float>{1.0f, 2.0f}, "x");
  const Twin y = Make(std::vector<float>{10.0f, 20.0f}, "y");
  auto graph = gpu_->CaptureGraph(stream.get(), [&] {
    gpu_->Add(x.gpu->as<float>(), 2, y.gpu->as<float>(), stream.get());
    return absl::FailedPreconditionError("the step could not be enqueued");
  });
  ASSERT_FALSE(graph.ok());
  EXPECT_EQ(graph.status().code(), absl::StatusCode::kFailedPrecondition);
  gpu_->Add(x.gpu->as<float>(), 2, y.gpu->as<float>(), stream.get());
  gpu_->Synchronize(stream.get());
  EXPECT_EQ(Get<float>(*gpu_, *y.gpu), (std::vector<float>{11.0f, 22.0f})) << "the captured Add never ran";
  EXPECT_FALSE(cpu_->SupportsGraphs());
  EXPECT_EQ(cpu_->CaptureGraph(nullptr, [] { return absl::OkStatus(); }).status().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace odmoe
