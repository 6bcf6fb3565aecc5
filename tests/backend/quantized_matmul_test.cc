// Device::MatMul with weight-only quantized weights (INT8 rows, NF4) on CpuDevice and MockGpuDevice: the result
// is bitwise the F32 MatMul of the weight dequantized with quantize.h, over odd shapes (in_dim not a multiple
// of 64, partial tiles of rows), n = 1, 3, 17, with and without a bias, for F32 / F16 / BF16 source weights.
// The mock GPU checks that the scales are its own memory, and ops other than MatMul refuse quantized weights.
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/cpu_device.h"
#include "src/backend/cpu_kernels.h"
#include "src/backend/mock_gpu_device.h"
#include "src/backend/quantize.h"
#include "src/common/dtype.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

std::unique_ptr<Buffer> Upload(Device& device, const void* data, size_t bytes) {
  auto buffer = device.Allocate(bytes, "test");
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!buffer.ok()) return nullptr;
  if (bytes > 0) device.CopyToDevice((*buffer)->data(), data, bytes, nullptr);
  return std::move(*buffer);
}
template <typename T>
std::unique_ptr<Buffer> Upload(Device& device, const std::vector<T>& host) {
  return Upload(device, host.data(), host.size() * sizeof(T));
}

std::vector<float> Download(Device& device, const Buffer& buffer) {
  std::vector<float> host(buffer.size() / sizeof(float));
  device.CopyToHost(host.data(), buffer.data(), buffer.size(), nullptr);
  return host;
}

// Values in `dtype`'s storage bytes, and (through `rounded`) the fp32 values those bytes hold.
std::vector<uint8_t> Encode(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kF16 ? F32ToF16(values[i]) : F32ToBf16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

// A weight [rows, cols] quantized from `dtype` source bytes, with its fp32 dequantization.
struct QuantWeight {
  DType dtype;                 // kI8 or kU8
  std::vector<uint8_t> data;   // int8 [rows, cols] or NF4 codes [rows, Nf4RowBytes(cols)]
  std::vector<float> scales;   // [rows] or [rows, Nf4BlocksPerRow(cols)]
  std::vector<float> dequant;  // [rows, cols]
};

QuantWeight Quantize(DType quant, DType source, const std::vector<uint8_t>& w, int64_t rows, int64_t cols) {
  QuantWeight q;
  q.dtype = quant;
  q.dequant.resize(static_cast<size_t>(rows * cols));
  if (quant == DType::kI8) {
    q.data.resize(static_cast<size_t>(rows * cols));
    q.scales.resize(static_cast<size_t>(rows));
    auto* codes = reinterpret_cast<int8_t*>(q.data.data());
    QuantizeInt8Rows(w.data(), source, rows, cols, codes, q.scales.data());
    DequantizeInt8Rows(codes, q.scales.data(), rows, cols, q.dequant.data());
  } else {
    q.data.resize(static_cast<size_t>(rows * Nf4RowBytes(cols)));
    q.scales.resize(static_cast<size_t>(rows * Nf4BlocksPerRow(cols)));
    QuantizeNf4(w.data(), source, rows, cols, q.data.data(), q.scales.data());
    DequantizeNf4(q.data.data(), q.scales.data(), rows, cols, q.dequant.data());
  }
  return q;
}

std::vector<float> RandomFloats(size_t count, std::mt19937& rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(count);
  for (float& f : v) f = dist(rng);
  return v;
}

void ExpectBitwiseEqual(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &want[i], 4);
    ASSERT_EQ(a, b) << what << " at " << i << ": " << got[i] << " vs " << want[i];
  }
}

MockGpuOptions MockOptions() {
  MockGpuOptions o;
  o.capacity_bytes = uint64_t{256} << 20;
  o.record_timeline = false;
  return o;
}

class QuantizedMatMulTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCpu) {
      device_ = std::make_unique<CpuDevice>();
    } else {
      device_ = std::make_unique<MockGpuDevice>(MockOptions());
    }
  }
  std::unique_ptr<Device> device_;
};

TEST_P(QuantizedMatMulTest, EqualsF32MatMulOfTheDequantizedWeightBitwise) {
  Device& d = *device_;
  std::mt19937 rng(7);
  // (in_dim, out_dim): in_dim below, at and across the NF4 block of 64 and the 8-lane dot; out_dim across the
  // 4-row tile of the CPU kernel.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},  {7, 5},    {63, 4},  {64, 9},
                                                           {65, 3}, {100, 33}, {130, 6}, {257, 17}};
  int64_t calls = 0;
  for (DType source : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (DType quant : {DType::kI8, DType::kU8}) {
      for (const auto& [in, out] : shapes) {
        std::vector<float> values = RandomFloats(static_cast<size_t>(in * out), rng, 0.05f);
        if (out > 2) std::fill(values.begin() + in, values.begin() + 2 * in, 0.0f);  // a zero row: absmax 0
        const std::vector<uint8_t> src = Encode(source, values);
        const QuantWeight q = Quantize(quant, source, src, out, in);
        const auto w_data = Upload(d, q.data);
        const auto w_scales = Upload(d, q.scales);
        const auto w_ref = Upload(d, q.dequant);
        const WeightRef wq{w_data->data(), quant, w_scales->as<float>()};
        const WeightRef wf{w_ref->data(), DType::kF32};
        const std::vector<float> bias_values = RandomFloats(static_cast<size_t>(out), rng, 1.0f);
        const auto bias16 = Upload(d, Encode(source, bias_values));
        const auto bias32 = Upload(d, bias_values);
        const std::vector<WeightRef> biases = {WeightRef{}, WeightRef{bias16->data(), source},
                                               WeightRef{bias32->data(), DType::kF32}};
        for (int64_t n : {1, 3, 17}) {
          const auto x = Upload(d, RandomFloats(static_cast<size_t>(n * in), rng, 1.0f));
          for (size_t b = 0; b < biases.size(); ++b) {
            const std::string what =
                StrCat(DTypeName(source), "->", DTypeName(quant), " in=", in, " out=", out, " n=", n, " bias=", b);
            const auto yq = Upload(d, std::vector<float>(static_cast<size_t>(n * out), -1.0f));
            const auto yf = Upload(d, std::vector<float>(static_cast<size_t>(n * out), -2.0f));
            d.MatMul(x->as<float>(), wq, biases[b], n, in, out, yq->as<float>(), nullptr);
            d.MatMul(x->as<float>(), wf, biases[b], n, in, out, yf->as<float>(), nullptr);
            calls += 2;
            ExpectBitwiseEqual(Download(d, *yq), Download(d, *yf), what);
          }
        }
      }
    }
  }
  EXPECT_EQ(d.op_counts().at("MatMul"), calls);
}

TEST_P(QuantizedMatMulTest, NoTokensOrNoOutputsWriteNothing) {
  Device& d = *device_;
  std::mt19937 rng(8);
  const int64_t in = 70, out = 5;
  const auto src = Encode(DType::kF32, RandomFloats(static_cast<size_t>(in * out), rng, 0.05f));
  const QuantWeight q = Quantize(DType::kU8, DType::kF32, src, out, in);
  const auto w_data = Upload(d, q.data);
  const auto w_scales = Upload(d, q.scales);
  const auto x = Upload(d, RandomFloats(static_cast<size_t>(in), rng, 1.0f));
  const auto y = Upload(d, std::vector<float>(static_cast<size_t>(out), 3.0f));
  const WeightRef wq{w_data->data(), DType::kU8, w_scales->as<float>()};
  d.MatMul(x->as<float>(), wq, WeightRef{}, 0, in, out, y->as<float>(), nullptr);
  d.MatMul(x->as<float>(), wq, WeightRef{}, 1, in, 0, y->as<float>(), nullptr);
  for (float v : Download(d, *y)) EXPECT_EQ(v, 3.0f);
}

INSTANTIATE_TEST_SUITE_P(Devices, QuantizedMatMulTest, ::testing::Values(DeviceKind::kCpu, DeviceKind::kMockGpu),
                         [](const ::testing::TestParamInfo<DeviceKind>& param_info) {
                           return param_info.param == DeviceKind::kCpu ? std::string("Cpu") : std::string("MockGpu");
                         });

TEST(QuantizedMatMulCostTest, MockGpuCountsCodesAndScales) {
  MockGpuOptions o = MockOptions();
  o.record_timeline = true;
  o.flops_per_s = 1e30;  // memory-bound: the duration is bytes / mem_bytes_per_s
  MockGpuDevice device(o);
  const int64_t in = 130, out = 6, n = 2;
  std::vector<uint8_t> codes(static_cast<size_t>(out * Nf4RowBytes(in)), 0x77);
  std::vector<float> scales(static_cast<size_t>(out * Nf4BlocksPerRow(in)), 1.0f);
  const auto w_data = Upload(device, codes);
  const auto w_scales = Upload(device, scales);
  const auto x = Upload(device, std::vector<float>(static_cast<size_t>(n * in), 1.0f));
  const auto y = Upload(device, std::vector<float>(static_cast<size_t>(n * out), 1.0f));
  device.ClearTimeline();
  device.MatMul(x->as<float>(), WeightRef{w_data->data(), DType::kU8, w_scales->as<float>()}, WeightRef{}, n, in, out,
                y->as<float>(), nullptr);
  const auto timeline = device.timeline();
  ASSERT_EQ(timeline.size(), 1u);
  EXPECT_EQ(timeline[0].bytes, codes.size() + scales.size() * 4 + static_cast<uint64_t>(n * (in + out)) * 4);
  for (float v : Download(device, *y)) EXPECT_EQ(v, 0.0f);  // code 7 is 0.0
}

// ---- misuse aborts ----------------------------------------------------------------------------------------------

class QuantizedMatMulDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(QuantizedMatMulDeathTest, MockGpuRejectsScalesOrCodesOutsideItsMemory) {
  MockGpuDevice device(MockOptions());
  const int64_t in = 100, out = 8;
  std::vector<int8_t> q(static_cast<size_t>(out * in), 1);
  std::vector<float> host_scales(static_cast<size_t>(out), 1.0f);
  const auto w_data = Upload(device, q);
  const auto w_scales = Upload(device, host_scales);
  const auto x = Upload(device, std::vector<float>(static_cast<size_t>(in), 1.0f));
  const auto y = Upload(device, std::vector<float>(static_cast<size_t>(out), 0.0f));
  // Scales in host memory.
  EXPECT_DEATH(device.MatMul(x->as<float>(), WeightRef{w_data->data(), DType::kI8, host_scales.data()}, WeightRef{}, 1,
                             in, out, y->as<float>(), nullptr),
               "MatMul: argument 'w.scales' .* is not inside a live allocation of this device");
  // Missing scales.
  EXPECT_DEATH(device.MatMul(x->as<float>(), WeightRef{w_data->data(), DType::kI8, nullptr}, WeightRef{}, 1, in, out,
                             y->as<float>(), nullptr),
               "MatMul: argument 'w.scales' is null");
  // As NF4 the codes fit (64 bytes per row), but the scales need [out, 2] floats and the buffer holds [out].
  EXPECT_DEATH(device.MatMul(x->as<float>(), WeightRef{w_data->data(), DType::kU8, w_scales->as<float>()}, WeightRef{},
                             1, in, out, y->as<float>(), nullptr),
               "MatMul: argument 'w.scales'");
  // Codes in host memory.
  EXPECT_DEATH(device.MatMul(x->as<float>(), WeightRef{q.data(), DType::kI8, w_scales->as<float>()}, WeightRef{}, 1, in,
                             out, y->as<float>(), nullptr),
               "MatMul: argument 'w'");
}

TEST_F(QuantizedMatMulDeathTest, OnlyMatMulWeightsMayBeQuantized) {
  const int64_t dim = 64;
  std::vector<int8_t> q(static_cast<size_t>(dim * dim), 1);
  std::vector<float> scales(static_cast<size_t>(dim), 1.0f);
  std::vector<float> x(static_cast<size_t>(dim), 1.0f), y(static_cast<size_t>(dim));
  std::vector<int32_t> ids = {0};
  const WeightRef wq{q.data(), DType::kI8, scales.data()};
  CpuDevice cpu;
  EXPECT_DEATH(cpu.RmsNorm(x.data(), wq, 1, dim, 1e-5f, y.data(), nullptr), "CHECK failed");
  EXPECT_DEATH(cpu.Embedding(ids.data(), 1, wq, dim, y.data(), nullptr), "CHECK failed");
  EXPECT_DEATH(cpu.MatMul(x.data(), wq, wq, 1, dim, dim, y.data(), nullptr), "CHECK failed");  // quantized bias
  EXPECT_DEATH(cpu.MatMul(x.data(), WeightRef{q.data(), DType::kI8}, WeightRef{}, 1, dim, dim, y.data(), nullptr),
               "CHECK failed");  // no scales

  MockGpuDevice mock(MockOptions());
  const auto dq = Upload(mock, q);
  const auto ds = Upload(mock, scales);
  const auto dx = Upload(mock, x);
  const auto dy = Upload(mock, y);
  const WeightRef mq{dq->data(), DType::kI8, ds->as<float>()};
  EXPECT_DEATH(mock.RmsNorm(dx->as<float>(), mq, 1, dim, 1e-5f, dy->as<float>(), nullptr), "CHECK failed");
  EXPECT_DEATH(mock.MatMul(dx->as<float>(), mq, mq, 1, dim, dim, dy->as<float>(), nullptr), "CHECK failed");
}

}  // namespace
}  // namespace odmoe
