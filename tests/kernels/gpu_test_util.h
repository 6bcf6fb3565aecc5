// Helpers for the CUDA kernel tests: skipping without a GPU (and a CUDA Device fixture), device arrays, test weights in
// F32/F16/BF16, and float comparison with atol + rtol * |ref| (NaN and Inf always fail).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/cuda_device.h"
#include "src/backend/device.h"
#include "src/common/dtype.h"

namespace odmoe::gpu_test {

// True if a CUDA device of compute capability >= 8.0 is usable; otherwise *why says what is missing.
inline bool HaveGpu(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    *why = std::string("no CUDA device: cudaGetDeviceCount returned ") + cudaGetErrorName(err) + " (" +
           cudaGetErrorString(err) + "), " + std::to_string(count) + " devices";
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major < 8) {
    *why = std::string("CUDA device 0 (") + prop.name + ") is older than compute capability 8.0";
    return false;
  }
  return true;
}

#define ODMOE_ASSERT_CUDA(expr)                                                                      \
  do {                                                                                               \
    const cudaError_t odmoe_test_err_ = (expr);                                                      \
    ASSERT_EQ(odmoe_test_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(odmoe_test_err_); \
  } while (0)

// A test fixture that skips without a GPU and gives each test its own stream.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveGpu(&why)) GTEST_SKIP() << why;
    ODMOE_ASSERT_CUDA(cudaSetDevice(0));
    ODMOE_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      (void)cudaStreamDestroy(stream_);
    }
  }
  // Waits for the stream and fails on any asynchronous error.
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << cudaGetErrorString(cudaGetLastError()); }

  cudaStream_t stream_ = nullptr;
};

// A test fixture that skips without a GPU and gives each test a CUDA Device (ordinal 0, no budget).
class CudaDeviceFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveGpu(&why)) GTEST_SKIP() << why;
    auto device = CreateCudaDevice(0, 0);
    ASSERT_TRUE(device.ok()) << device.status();
    gpu_ = std::move(device).value();
  }

  std::unique_ptr<Device> gpu_;
};

// Device memory for `count` elements of T (plus `pad` spare elements, for misaligned views), freed on
// destruction.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count, size_t pad = 0) : count_(count) {
    if (cudaMalloc(&data_, (count + pad) * sizeof(T) + 1) != cudaSuccess) data_ = nullptr;
    if (data_ != nullptr) (void)cudaMemset(data_, 0, (count + pad) * sizeof(T) + 1);
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  ~DeviceArray() { (void)cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() { return data_; }
  const T* get() const { return data_; }
  size_t size() const { return count_; }

  void Upload(const std::vector<T>& host, size_t offset = 0) {
    EXPECT_EQ(cudaMemcpy(data_ + offset, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  // Waits for all device work, then copies `count` elements (default: all) starting at `offset`.
  std::vector<T> Download(size_t offset = 0, size_t count = static_cast<size_t>(-1)) const {
    if (count == static_cast<size_t>(-1)) count = count_;
    std::vector<T> host(count);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), data_ + offset, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t count_;
};

inline std::vector<float> RandomFloats(size_t count, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

// A weight in a storage dtype: host bytes (the CPU reference reads them), the same bytes on the device.
struct TestWeight {
  DType dtype = DType::kF32;
  std::vector<uint8_t> host;
  DeviceArray<uint8_t> device;
  TestWeight(DType dt, const std::vector<float>& values) : dtype(dt), host(Encode(dt, values)), device(host) {}
  static std::vector<uint8_t> Encode(DType dt, const std::vector<float>& values) {
    std::vector<uint8_t> bytes(values.size() * DTypeSize(dt));
    for (size_t i = 0; i < values.size(); ++i) {
      if (dt == DType::kF32) {
        std::memcpy(bytes.data() + 4 * i, &values[i], 4);
      } else {
        const uint16_t h = dt == DType::kBF16 ? F32ToBf16(values[i]) : F32ToF16(values[i]);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
    return bytes;
  }
  WeightRef host_ref() const { return WeightRef{host.data(), dtype}; }
  WeightRef device_ref() const { return WeightRef{device.get(), dtype}; }
};

// Calls f with the device bytes of `w` as const float*, const __half* or const __nv_bfloat16*.
template <typename F>
void WithDeviceType(const TestWeight& w, F&& f) {
  switch (w.dtype) {
    case DType::kF32:
      f(reinterpret_cast<const float*>(w.device.get()));
      return;
    case DType::kF16:
      f(reinterpret_cast<const __half*>(w.device.get()));
      return;
    case DType::kBF16:
      f(reinterpret_cast<const __nv_bfloat16*>(w.device.get()));
      return;
    default:
      FAIL() << "unexpected dtype";
  }
}

inline const DType kWeightTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// Every element within atol + rtol * |want|; NaN or Inf on either side fails. Reports the first few misses.
// Expects |got[i] - want[i]| <= tol[i] for every element (NaN and Inf always fail); reports the first five.
inline void ExpectWithin(const std::vector<float>& got, const std::vector<float>& want, const std::vector<double>& tol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(tol.size(), want.size()) << what;
  int reported = 0;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool finite = std::isfinite(got[i]) && std::isfinite(want[i]);
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!finite || err > tol[i]) {
      ++bad;
      if (reported++ < 5) {
        ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << want[i] << " (err " << err
                      << " > tol " << tol[i] << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements out of tolerance";
}

// Tolerance atol + rtol * |want[i]|.
inline void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol,
                        const std::string& what) {
  std::vector<double> tol(want.size());
  for (size_t i = 0; i < want.size(); ++i) tol[i] = atol + rtol * std::fabs(static_cast<double>(want[i]));
  ExpectWithin(got, want, tol, what);
}

// Tolerances for comparing two fp32 computations of y[n, rows] = x[n, cols] * w[rows, cols]^T that may sum in
// different orders and apply per-block scales to partial sums: each is within gamma * sum_k |x_k * w_k| of the
// exact value (the standard dot-product bound, gamma = m * u / (1 - m * u), u = 2^-24, m = cols + 4 roundings
// with the scale products), so the two differ by at most twice that. A bound relative to sum |x * w| rather
// than to |y| holds where the sum cancels (a row of large weights of both signs).
inline std::vector<double> MatMulTolerances(const std::vector<float>& x, const std::vector<float>& w, int64_t n,
                                            int64_t cols, int64_t rows) {
  const double m = static_cast<double>(cols + 4);
  const double u = std::ldexp(1.0, -24);
  const double gamma = m * u / (1.0 - m * u);
  std::vector<double> tol(static_cast<size_t>(n * rows));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      double magnitude = 0.0;
      for (int64_t k = 0; k < cols; ++k) {
        magnitude +=
            std::fabs(static_cast<double>(x[static_cast<size_t>(t * cols + k)]) * w[static_cast<size_t>(r * cols + k)]);
      }
      tol[static_cast<size_t>(t * rows + r)] = 2.0 * gamma * magnitude;
    }
  }
  return tol;
}

}  // namespace odmoe::gpu_test
