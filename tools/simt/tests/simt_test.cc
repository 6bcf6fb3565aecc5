// The SIMT emulator on kernels that use every construct odmoe's kernels use (test_kernels.cu), its CUDA runtime
// and its cuBLAS. The same file runs against the fast and the checked build of the kernels; a correct kernel
// must produce no report in either.
#include "simt/simt.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "simt/counters.h"
#include "tools/simt/tests/test_kernels.h"

namespace {

// Device buffer of n T's, freed at scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)), cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { EXPECT_EQ(cudaFree(p_), cudaSuccess); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  std::vector<T> ToHost() const {
    std::vector<T> out(n_);
    EXPECT_EQ(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

// Page-locked host buffer of n T's (cudaMallocHost), freed at scope exit.
template <typename T>
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t n) : n_(n) {
    EXPECT_EQ(cudaMallocHost(reinterpret_cast<void**>(&p_), n * sizeof(T)), cudaSuccess);
  }
  ~PinnedBuffer() { EXPECT_EQ(cudaFreeHost(p_), cudaSuccess); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  T* get() const { return p_; }
  T& operator[](size_t i) const { return p_[i]; }
  size_t size() const { return n_; }

 private:
  size_t n_;
  T* p_ = nullptr;
};

// Records the emulator's reports instead of aborting.
class SimtTest : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = simt::SetReportHandler([this](const simt::Report& r) { reports_.push_back(r); });
  }
  void TearDown() override {
    simt::SetReportHandler(previous_);
    (void)cudaDeviceReset();  // clears the sticky error a deadlock leaves
  }
  std::string AllReports() const {
    std::string s;
    for (const auto& r : reports_) s += std::string(simt::ErrorKindName(r.kind)) + ": " + r.message + "\n";
    return s;
  }
  std::vector<simt::Report> reports_;
  simt::ReportHandler previous_;
};

TEST_F(SimtTest, IntrinsicsRoundAndCastLikeTheGpu) {
  std::vector<float> a = {1.5f, -3.25f, 1e-3f, 70000.f, 3.1415926f};
  std::vector<float> b = {2.f, 0.5f, 3.f, -7.f, 1.f / 3};
  DeviceBuffer<float> da(a), db(b), out(a.size() * 6);
  ASSERT_EQ(simt_test::Intrinsics(da.get(), db.get(), static_cast<int>(a.size()), out.get()), cudaSuccess);
  const std::vector<float> got = out.ToHost();
  for (size_t i = 0; i < a.size(); ++i) {
    volatile float p = a[i] * b[i], s = a[i] + b[i], q = a[i] / b[i];
    EXPECT_EQ(got[6 * i + 0], p);
    EXPECT_EQ(got[6 * i + 1], s);
    EXPECT_EQ(got[6 * i + 2], q);
    EXPECT_EQ(got[6 * i + 3], a[i]);
    EXPECT_EQ(got[6 * i + 4], __half2float(__float2half_rn(a[i])));
    EXPECT_EQ(got[6 * i + 5], __bfloat162float(__float2bfloat16_rn(a[i])));
  }
  EXPECT_TRUE(std::isinf(got[6 * 3 + 4])) << "70000 overflows fp16";
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

TEST_F(SimtTest, SyncThreadsOrdersASharedMemoryTree) {
  for (int threads : {64, 256}) {
    const int blocks = 3;
    std::vector<float> in(static_cast<size_t>(threads) * blocks);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 17);
    DeviceBuffer<float> din(in), out(blocks);
    ASSERT_EQ(simt_test::BlockSum(din.get(), threads, blocks, out.get()), cudaSuccess);
    const std::vector<float> got = out.ToHost();
    for (int b = 0; b < blocks; ++b) {
      float want = 0;
      for (int t = 0; t < threads; ++t) want += in[static_cast<size_t>(b) * threads + t];
      EXPECT_EQ(got[b], want) << "threads " << threads << " block " << b;
    }
  }
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

TEST_F(SimtTest, ShufflesMoveFloatIntAndInt64InLockstep) {
  const int threads = 96;
  std::vector<float> f(threads);
  std::vector<int> iv(threads);
  std::vector<int64_t> l(threads);
  for (int t = 0; t < threads; ++t) {
    f[t] = 0.25f * t;
    iv[t] = t * 3 + 1;
    l[t] = (int64_t{1} << 40) + t;
  }
  DeviceBuffer<float> df(f), of(threads);
  DeviceBuffer<int> di(iv), oi(threads), ow(threads);
  DeviceBuffer<int64_t> dl(l), ol(threads);
  ASSERT_EQ(simt_test::Shuffles(df.get(), di.get(), dl.get(), threads, of.get(), oi.get(), ol.get(), ow.get()),
            cudaSuccess);
  const auto gf = of.ToHost();
  const auto gi = oi.ToHost();
  const auto gl = ol.ToHost();
  const auto gw = ow.ToHost();
  for (int t = 0; t < threads; ++t) {
    const int w = t / 32 * 32, lane = t % 32;
    float sum = 0;
    for (int k = 0; k < 32; ++k) sum += f[w + k];
    EXPECT_FLOAT_EQ(gf[t], sum) << t;
    int scan = 0;
    for (int k = 0; k <= lane; ++k) scan += iv[w + k];
    EXPECT_EQ(gi[t], scan) << t;
    EXPECT_EQ(gl[t], l[w + 5]) << t;
    int x = 0;
    for (int k = lane / 8 * 8; k < lane / 8 * 8 + 8; ++k) x ^= iv[w + k];
    EXPECT_EQ(gw[t], x) << t;
  }
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

TEST_F(SimtTest, StaticSharedMemoryIsPerBlock) {
  const int threads = 32, blocks = 5;
  DeviceBuffer<int> out(threads * blocks);
  ASSERT_EQ(simt_test::SharedPerBlock(threads, blocks, out.get()), cudaSuccess);
  const auto got = out.ToHost();
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) EXPECT_EQ(got[b * threads + t], b);
  }
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

TEST_F(SimtTest, DynamicSharedMemoryAndItsLimit) {
  const int threads = 128;
  DeviceBuffer<int> out(threads);
  ASSERT_EQ(simt_test::DynamicShared(threads, 16 * 1024, /*opt_in=*/false, out.get()), cudaSuccess);
  auto got = out.ToHost();
  for (int t = 0; t < threads; ++t) EXPECT_EQ(got[t], (t + 1) % threads);
  // Over 48 KB: refused without the opt-in, as on the hardware; accepted with it.
  EXPECT_EQ(simt_test::DynamicShared(threads, 64 * 1024, /*opt_in=*/false, out.get()), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a refused launch is not sticky";
  ASSERT_EQ(simt_test::DynamicShared(threads, 64 * 1024, /*opt_in=*/true, out.get()), cudaSuccess);
  got = out.ToHost();
  for (int t = 0; t < threads; ++t) EXPECT_EQ(got[t], (t + 1) % threads);
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

TEST_F(SimtTest, ThreeDimensionalGridsAndLaunchLimits) {
  const dim3 grid(3, 2, 2), block(4, 2, 3);
  const unsigned nx = 12, ny = 4, nz = 6;
  DeviceBuffer<int> out(nx * ny * nz);
  ASSERT_EQ(simt_test::Grid3d(grid, block, out.get()), cudaSuccess);
  const auto got = out.ToHost();
  for (unsigned z = 0; z < nz; ++z) {
    for (unsigned y = 0; y < ny; ++y) {
      for (unsigned x = 0; x < nx; ++x) EXPECT_EQ(got[(z * ny + y) * nx + x], static_cast<int>(x | y << 8 | z << 16));
    }
  }
  EXPECT_EQ(simt_test::Grid3d(dim3(1), dim3(1025), out.get()), cudaErrorInvalidConfiguration);
  EXPECT_EQ(simt_test::Grid3d(dim3(1, 1, 1), dim3(1, 1, 65), out.get()), cudaErrorInvalidConfiguration);
  EXPECT_EQ(simt_test::Grid3d(dim3(0), dim3(32), out.get()), cudaErrorInvalidConfiguration);
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

TEST_F(SimtTest, SharedAtomicMinMaxOn64Bits) {
  const int threads = 64;
  std::vector<unsigned long long> in(threads);
  for (int t = 0; t < threads; ++t) in[t] = (0x9E3779B97F4A7C15ull * (t + 1)) >> 3;
  DeviceBuffer<unsigned long long> din(in), out(2);
  ASSERT_EQ(simt_test::AtomicMinMax(din.get(), threads, out.get()), cudaSuccess);
  const auto got = out.ToHost();
  EXPECT_EQ(got[0], *std::min_element(in.begin(), in.end()));
  EXPECT_EQ(got[1], *std::max_element(in.begin(), in.end()));
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

// The checker tracks bytes, not words: neighbours writing neighbouring bytes do not race, and a half-warp
// __syncwarp orders the lanes that met.
TEST_F(SimtTest, ByteNeighboursAndAHalfWarpSyncAreNotRaces) {
  const int threads = 96;
  DeviceBuffer<uint8_t> out(2 * threads);
  DeviceBuffer<int> half(16);
  ASSERT_EQ(simt_test::ByteNeighbours(threads, out.get(), half.get()), cudaSuccess);
  const std::vector<uint8_t> got = out.ToHost();
  for (int t = 0; t < threads; ++t) {
    EXPECT_EQ(got[t], t);
    EXPECT_EQ(got[threads + t], (t + 1) % threads);
  }
  const std::vector<int> got_half = half.ToHost();
  for (int l = 0; l < 16; ++l) EXPECT_EQ(got_half[l], (l ^ 1) * 10);
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

TEST_F(SimtTest, DeadlockIsReportedWithWhereEachThreadWaits) {
  EXPECT_EQ(simt_test::Deadlock(), cudaErrorLaunchFailure);
  ASSERT_EQ(reports_.size(), 1u) << AllReports();
  EXPECT_EQ(reports_[0].kind, simt::ErrorKind::kDeadlock);
  EXPECT_EQ(reports_[0].kernel, "DeadlockKernel");
  EXPECT_NE(reports_[0].message.find("threads 0: __syncthreads at"), std::string::npos) << reports_[0].message;
  EXPECT_NE(reports_[0].message.find("threads 1-31: __syncwarp"), std::string::npos) << reports_[0].message;
  EXPECT_NE(reports_[0].message.find("threads 32-63: exited"), std::string::npos) << reports_[0].message;
  EXPECT_NE(reports_[0].message.find("test_kernels.cu:"), std::string::npos) << reports_[0].message;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure) << "a failed launch is sticky";
  EXPECT_EQ(cudaDeviceReset(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(SimtTest, BarrierAtDifferentCallSitesIsReported) {
  EXPECT_EQ(simt_test::DivergentBarrier(), cudaErrorLaunchFailure);
  ASSERT_EQ(reports_.size(), 1u) << AllReports();
  EXPECT_EQ(reports_[0].kind, simt::ErrorKind::kBarrierDivergence);
}

TEST_F(SimtTest, RuntimeMemoryStreamsAndEvents) {
  size_t free0 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1000), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
  size_t free1 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  EXPECT_EQ(free0 - free1, 1000u);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t e = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  std::vector<unsigned char> host(1000, 7), back(1000, 0);
  ASSERT_EQ(cudaMemsetAsync(p, 0, 1000, s), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(p, host.data(), 500, cudaMemcpyHostToDevice, s), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(nullptr, e, 0), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(back.data(), p, 1000, cudaMemcpyDeviceToHost, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_EQ(cudaEventSynchronize(e), cudaSuccess);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(back[i], i < 500 ? 7 : 0) << i;
  EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaErrorInvalidValue) << "double free";
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&p, size_t{1} << 50), cudaErrorMemoryAllocation);
  (void)cudaGetLastError();

  ASSERT_EQ(cudaHostRegister(host.data(), host.size(), cudaHostRegisterPortable), cudaSuccess);
  EXPECT_EQ(cudaHostRegister(host.data(), host.size(), cudaHostRegisterPortable), cudaErrorHostMemoryAlreadyRegistered);
  EXPECT_EQ(cudaHostUnregister(host.data()), cudaSuccess);
  (void)cudaGetLastError();

  int count = 0, device = -1;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count, 1);
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(device, 0);
  cudaDeviceProp prop;
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  EXPECT_EQ(prop.warpSize, 32);
  EXPECT_EQ(prop.totalGlobalMem, total);
  EXPECT_STREQ(cudaGetErrorName(cudaErrorInvalidValue), "cudaErrorInvalidValue");
  EXPECT_STREQ(cudaGetErrorString(cudaErrorMemoryAllocation), "out of memory");
}

// Read-only loads counted as a GPU's L1 sees them (checked build; the fast build counts none): 16 bytes per lane,
// lanes 16, 32 and 128 bytes apart; two warps; several loads of one call site per lane, each its own request.
TEST_F(SimtTest, CountsReadOnlyLoadsAsWarpRequests) {
  constexpr int kLoads = 3;
  float4* x = nullptr;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x), 64 * 8 * kLoads * sizeof(float4)), cudaSuccess);
  ASSERT_EQ(cudaMemset(x, 0, 64 * 8 * kLoads * sizeof(float4)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), 64 * sizeof(float)), cudaSuccess);
  struct Case {
    int stride;
    int threads;
    uint64_t sectors, lines;  // per request
  };
  for (const Case& c : {Case{1, 32, 16, 4}, Case{2, 32, 32, 8}, Case{8, 32, 32, 32}, Case{1, 64, 16, 4}}) {
    simt::ResetCounters();
    ASSERT_EQ(simt_test::StridedLoads(x, c.stride, c.threads, kLoads, out), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const simt::Counters counts = simt::ReadCounters();
    ASSERT_EQ(counts.sites.size(), 1u);
    const simt::LoadRequests& ldg = counts.sites.begin()->second.ldg;
    const std::string what = "stride " + std::to_string(c.stride) + ", " + std::to_string(c.threads) + " threads";
    if (!simt::CountsKernelAccesses()) {
      EXPECT_EQ(ldg.requests, 0u) << what;
      EXPECT_EQ(ldg.bytes, 0u) << what;
      continue;
    }
    const uint64_t requests = static_cast<uint64_t>(c.threads / 32 * kLoads);
    EXPECT_EQ(ldg.requests, requests) << what;
    EXPECT_EQ(ldg.bytes, requests * 32 * sizeof(float4)) << what;
    EXPECT_EQ(ldg.sectors, requests * c.sectors) << what;
    EXPECT_EQ(ldg.lines, requests * c.lines) << what;
    EXPECT_DOUBLE_EQ(ldg.LinesPer128Bytes(), static_cast<double>(c.lines) / 4) << what;
  }
  EXPECT_EQ(cudaFree(x), cudaSuccess);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
}

// The runtime's own counts: syncs (explicit, cudaFree, synchronous and pageable copies from the device), allocations,
// launches per site, copy traffic and, in the checked build, the kernel's own loads and stores.
TEST_F(SimtTest, CountsWhatTheProgramAsks) {
  simt::ResetCounters();
  std::vector<float> host(128, 1.0f), pinned_out(2, 0.0f);
  float* in = nullptr;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&in), host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), 2 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(in, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, nullptr),
            cudaSuccess);
  ASSERT_EQ(simt_test::BlockSum(in, 64, 2, out), cudaSuccess);
  ASSERT_EQ(simt_test::BlockSum(in, 64, 2, out), cudaSuccess);
  simt::Counters c = simt::ReadCounters();
  EXPECT_EQ(c.allocations, 2u);
  EXPECT_EQ(c.host_syncs, 0u) << "an upload and launches do not wait";
  EXPECT_EQ(c.launches, 2u);
  ASSERT_EQ(c.sites.size(), 1u);
  EXPECT_EQ(c.sites.begin()->second.launches, 2u);
  EXPECT_NE(c.sites.begin()->first.find("BlockSumKernel"), std::string::npos) << c.sites.begin()->first;
  EXPECT_EQ(c.written[in].bytes, host.size() * sizeof(float));
  if (simt::CountsKernelAccesses()) {
    EXPECT_EQ(c.kernel_bytes_read, 2 * host.size() * sizeof(float));
    EXPECT_EQ(c.kernel_bytes_written, 2 * 2 * sizeof(float));
    EXPECT_EQ(c.written[out].bytes, 2 * 2 * sizeof(float));
    EXPECT_EQ(c.sites.begin()->second.bytes_read, 2 * host.size() * sizeof(float));
  } else {
    EXPECT_EQ(c.kernel_bytes_read, 0u);
  }

  simt::ResetCounters();
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 2 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, out, 2 * sizeof(float), cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  EXPECT_EQ(simt::ReadCounters().host_syncs, 0u) << "a copy into pinned memory does not wait";
  EXPECT_EQ(simt::ReadCounters().pageable_copies_to_host, 0u);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(pinned[0], 64.0f);
  ASSERT_EQ(cudaMemcpyAsync(pinned_out.data(), out, 2 * sizeof(float), cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(pinned_out.data(), out, 2 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(in, out, 2 * sizeof(float), cudaMemcpyDeviceToDevice, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(in), cudaSuccess);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
  c = simt::ReadCounters();
  // stream sync, synchronous copy, device sync, cudaFreeHost, 2 x cudaFree; the pageable async copy apart
  EXPECT_EQ(c.host_syncs, 6u);
  EXPECT_EQ(c.pageable_copies_to_host, 1u);
  EXPECT_EQ(c.frees, 2u);
  EXPECT_EQ(c.allocations, 0u);
  EXPECT_EQ(c.copy_bytes_from_device, 4 * 2 * sizeof(float));
  EXPECT_EQ(c.copy_bytes_to_host, 3 * 2 * sizeof(float)) << "not the copy on the device";
  EXPECT_EQ(c.launches, 0u);
}

// Stream-ordered allocation: cudaMallocFromPoolAsync / cudaFreeAsync never make the host wait (cudaFree of the same
// memory does); a pool keeps what frees return up to its release threshold and gives the rest back at a host
// synchronization; cudaMemGetInfo counts what pools reserve.
TEST_F(SimtTest, MemoryPoolsAllocateAndFreeWithoutWaiting) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaMemPoolCreate(&pool, &props), cudaSuccess);
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  uint64_t threshold = 4 * kMiB;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold), cudaSuccess);
  int no = 0;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &no), cudaSuccess);
  int reuse = -1;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &reuse), cudaSuccess);
  EXPECT_EQ(reuse, 0);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  size_t free0 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  auto attr = [&](cudaMemPoolAttr a) {
    uint64_t v = 0;
    EXPECT_EQ(cudaMemPoolGetAttribute(pool, a, &v), cudaSuccess);
    return v;
  };

  simt::ResetCounters();
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(cudaMallocFromPoolAsync(&a, 3 * kMiB + 5, pool, s), cudaSuccess);
  ASSERT_EQ(cudaMallocFromPoolAsync(&b, 2 * kMiB, pool, s), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  ASSERT_EQ(cudaMemsetAsync(a, 1, 3 * kMiB + 5, s), cudaSuccess);
  EXPECT_EQ(attr(cudaMemPoolAttrUsedMemCurrent), 5 * kMiB + 5);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), 6 * kMiB) << "2 MiB granules";
  size_t free1 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  EXPECT_EQ(free0 - free1, 6 * kMiB);
  ASSERT_EQ(cudaFreeAsync(a, s), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(b, s), cudaSuccess);
  simt::Counters c = simt::ReadCounters();
  EXPECT_EQ(c.allocations, 2u);
  EXPECT_EQ(c.frees, 2u);
  EXPECT_EQ(c.host_syncs, 0u) << "stream-ordered allocation and free do not wait";
  EXPECT_EQ(attr(cudaMemPoolAttrUsedMemCurrent), 0u);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), 6 * kMiB) << "kept until a synchronization";
  EXPECT_EQ(attr(cudaMemPoolAttrUsedMemHigh), 5 * kMiB + 5);

  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), threshold) << "trimmed to the release threshold";
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemHigh), 6 * kMiB);
  ASSERT_EQ(cudaMallocFromPoolAsync(&a, kMiB, pool, s), cudaSuccess);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), threshold) << "served from what the pool keeps";
  ASSERT_EQ(cudaMemPoolTrimTo(pool, 0), cudaSuccess);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), 2 * kMiB) << "a trim keeps what live allocations need";

  EXPECT_EQ(cudaFreeAsync(a, s), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(a, s), cudaErrorInvalidValue) << "double free";
  (void)cudaGetLastError();
  void* plain = nullptr;
  ASSERT_EQ(cudaMalloc(&plain, 64), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(plain, s), cudaErrorInvalidValue) << "cudaMalloc memory goes back with cudaFree";
  (void)cudaGetLastError();
  EXPECT_EQ(cudaFree(plain), cudaSuccess);
  EXPECT_EQ(cudaMallocFromPoolAsync(&a, size_t{1} << 50, pool, s), cudaErrorMemoryAllocation);
  (void)cudaGetLastError();

  // cudaFree takes pool memory too, and waits for the device.
  ASSERT_EQ(cudaMallocFromPoolAsync(&a, 100, pool, s), cudaSuccess);
  simt::ResetCounters();
  EXPECT_EQ(cudaFree(a), cudaSuccess);
  EXPECT_EQ(simt::ReadCounters().host_syncs, 1u);

  // The default pool serves cudaMallocAsync; it cannot be destroyed.
  cudaMemPool_t default_pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&default_pool, 0), cudaSuccess);
  ASSERT_NE(default_pool, nullptr);
  EXPECT_NE(default_pool, pool);
  ASSERT_EQ(cudaMallocAsync(&b, 10, s), cudaSuccess);
  uint64_t used = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(default_pool, cudaMemPoolAttrUsedMemCurrent, &used), cudaSuccess);
  EXPECT_EQ(used, 10u);
  ASSERT_EQ(cudaFreeAsync(b, s), cudaSuccess);
  EXPECT_EQ(cudaMemPoolDestroy(default_pool), cudaErrorInvalidValue);
  (void)cudaGetLastError();

  // A pool destroyed with a live allocation goes with its last free, and gives its memory back.
  ASSERT_EQ(cudaMallocFromPoolAsync(&a, 100, pool, s), cudaSuccess);
  ASSERT_EQ(cudaMemPoolDestroy(pool), cudaSuccess);
  EXPECT_EQ(cudaMallocFromPoolAsync(&b, 100, pool, s), cudaErrorInvalidValue) << "a destroyed pool";
  (void)cudaGetLastError();
  ASSERT_EQ(cudaFreeAsync(a, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  size_t free2 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free2, &total), cudaSuccess);
  EXPECT_EQ(free2, free0);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// GemmEx in cuBLAS's column-major convention against a plain loop, for every input type and transpose.
TEST_F(SimtTest, GemmExMatchesAPlainLoop) {
  const int m = 5, n = 3, k = 7;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(h, nullptr), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetWorkspace(h, nullptr, 0), CUBLAS_STATUS_SUCCESS);
  for (cudaDataType type : {CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF}) {
    for (cublasOperation_t ta : {CUBLAS_OP_N, CUBLAS_OP_T}) {
      for (cublasOperation_t tb : {CUBLAS_OP_N, CUBLAS_OP_T}) {
        // Values exactly representable in every input type, so the plain loop sees what GemmEx sees.
        std::vector<float> a(m * k), b(k * n);
        for (float& v : a) v = __bfloat162float(__float2bfloat16_rn(dist(rng)));
        for (float& v : b) v = __bfloat162float(__float2bfloat16_rn(dist(rng)));
        auto pack = [&](const std::vector<float>& v) {
          std::vector<unsigned char> bytes;
          if (type == CUDA_R_32F) {
            bytes.resize(v.size() * 4);
            std::memcpy(bytes.data(), v.data(), bytes.size());
          } else {
            bytes.resize(v.size() * 2);
            for (size_t i = 0; i < v.size(); ++i) {
              const uint16_t bits = type == CUDA_R_16F ? __half_as_ushort(__float2half_rn(v[i]))
                                                       : __bfloat16_as_ushort(__float2bfloat16_rn(v[i]));
              std::memcpy(bytes.data() + 2 * i, &bits, 2);
            }
          }
          return bytes;
        };
        DeviceBuffer<unsigned char> da(pack(a)), db(pack(b));
        DeviceBuffer<float> dc(std::vector<float>(m * n, NAN));
        const int lda = ta == CUBLAS_OP_N ? m : k, ldb = tb == CUBLAS_OP_N ? k : n;
        const float one = 1.f, zero = 0.f;
        const cublasComputeType_t compute = type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
        ASSERT_EQ(cublasGemmEx(h, ta, tb, m, n, k, &one, da.get(), type, lda, db.get(), type, ldb, &zero, dc.get(),
                               CUDA_R_32F, m, compute, CUBLAS_GEMM_DEFAULT),
                  CUBLAS_STATUS_SUCCESS);
        const auto c = dc.ToHost();
        for (int j = 0; j < n; ++j) {
          for (int i = 0; i < m; ++i) {
            double want = 0, mag = 0;
            for (int p = 0; p < k; ++p) {
              const float x = ta == CUBLAS_OP_N ? a[p * lda + i] : a[i * lda + p];
              const float y = tb == CUBLAS_OP_N ? b[j * ldb + p] : b[p * ldb + j];
              want += static_cast<double>(x) * y;
              mag += std::fabs(static_cast<double>(x) * y);
            }
            EXPECT_NEAR(c[j * m + i], want, 1e-6 * mag + 1e-7) << "type " << type << " op " << ta << tb;
          }
        }
      }
    }
  }
  EXPECT_EQ(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, nullptr, nullptr, CUDA_R_64F, 1, nullptr, CUDA_R_64F, 1,
                         nullptr, nullptr, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
}

// ------------------------------------------------------------------------------------------------------------------
// Stream capture and graphs
// ------------------------------------------------------------------------------------------------------------------

// A decode step's shape, issued on s: the input staged in pinned memory is copied up, an accumulator cleared, kernels
// run, and the result copied down into pinned memory: out = 2 * a * in. Run at once, or recorded when s captures.
struct Step {
  int n = 100;  // two blocks of 64
  PinnedBuffer<float> in{100}, out{100};
  DeviceBuffer<float> d_in{100}, d_tmp{100}, d_acc{100};

  cudaError_t Issue(cudaStream_t s, float a) {
    const size_t bytes = n * sizeof(float);
    cudaError_t e = cudaMemcpyAsync(d_in.get(), in.get(), bytes, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess) e = cudaMemsetAsync(d_acc.get(), 0, bytes, s);
    if (e == cudaSuccess) e = simt_test::Scale(d_in.get(), a, n, d_tmp.get(), s);
    if (e == cudaSuccess) e = simt_test::AddInto(d_tmp.get(), n, d_acc.get(), s);
    if (e == cudaSuccess) e = simt_test::AddInto(d_tmp.get(), n, d_acc.get(), s);
    if (e == cudaSuccess) e = cudaMemcpyAsync(out.get(), d_acc.get(), bytes, cudaMemcpyDeviceToHost, s);
    return e;
  }
  void Stage(int round) {
    for (int i = 0; i < n; ++i) in[i] = static_cast<float>(i * (round + 1)) - 3.25f;
  }
};

cudaStreamCaptureStatus CaptureStatus(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  EXPECT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
  return status;
}

// Captured work runs nothing and counts nothing; each launch of the instantiated graph runs it in order, on the
// staging buffer's contents at that launch and the kernel parameters of the capture, as eager execution would.
TEST_F(SimtTest, GraphReplaysACapturedStepWithNewStagingData) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  Step step;
  const int n = step.n;
  step.Stage(0);
  for (int i = 0; i < n; ++i) step.out[i] = -1.f;
  ASSERT_EQ(cudaMemset(step.d_acc.get(), 0x7f, n * sizeof(float)), cudaSuccess);

  simt::ResetCounters();
  float a = 1.5f;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusActive);
  ASSERT_EQ(step.Issue(s, a), cudaSuccess);
  a = 100.f;  // the captured launch keeps the value it was given
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusNone);

  simt::Counters c = simt::ReadCounters();
  EXPECT_EQ(c.launches, 0u);
  EXPECT_EQ(c.graph_launches, 0u);
  EXPECT_EQ(c.copy_bytes_from_device, 0u);
  EXPECT_TRUE(c.written.empty());
  EXPECT_TRUE(c.sites.empty());
  for (int i = 0; i < n; ++i) ASSERT_EQ(step.out[i], -1.f) << "nothing runs during capture";
  for (float v : step.d_acc.ToHost()) ASSERT_NE(v, 0.f) << "the memset was not run";

  size_t count = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &count), cudaSuccess);
  ASSERT_EQ(count, 6u);
  std::vector<cudaGraphNode_t> nodes(8, reinterpret_cast<cudaGraphNode_t>(1));
  count = nodes.size();
  ASSERT_EQ(cudaGraphGetNodes(graph, nodes.data(), &count), cudaSuccess);
  ASSERT_EQ(count, 6u);
  EXPECT_EQ(nodes[6], nullptr);
  const cudaGraphNodeType want_types[] = {cudaGraphNodeTypeMemcpy, cudaGraphNodeTypeMemset, cudaGraphNodeTypeKernel,
                                          cudaGraphNodeTypeKernel, cudaGraphNodeTypeKernel, cudaGraphNodeTypeMemcpy};
  for (size_t i = 0; i < 6; ++i) {
    cudaGraphNodeType type = cudaGraphNodeTypeCount;
    ASSERT_EQ(cudaGraphNodeGetType(nodes[i], &type), cudaSuccess);
    EXPECT_EQ(type, want_types[i]) << "node " << i;
  }

  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);  // the instantiated graph stays valid

  simt::ResetCounters();
  std::vector<std::vector<float>> replayed;
  for (int round = 0; round < 3; ++round) {
    step.Stage(round);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    replayed.emplace_back(step.out.get(), step.out.get() + n);
  }
  c = simt::ReadCounters();
  const uint64_t bytes = n * sizeof(float);
  EXPECT_EQ(c.graph_launches, 3u);
  EXPECT_EQ(c.launches, 9u);
  EXPECT_EQ(c.graph_kernel_launches, 9u);
  EXPECT_EQ(c.launches - c.graph_kernel_launches, 0u) << "no launch issued by the host";
  EXPECT_EQ(c.host_syncs, 3u) << "the stream synchronizations only";
  EXPECT_EQ(c.pageable_copies_to_host, 0u);
  EXPECT_EQ(c.copy_bytes_from_device, 3 * bytes);
  EXPECT_EQ(c.copy_bytes_to_host, 3 * bytes);
  EXPECT_EQ(c.written[step.d_in.get()].bytes, 3 * bytes);
  EXPECT_EQ(c.written[step.d_acc.get()].bytes, simt::CountsKernelAccesses() ? 3 * 3 * bytes : 3 * bytes);
  ASSERT_EQ(c.sites.size(), 2u);
  for (const auto& [site, counts] : c.sites) {
    EXPECT_EQ(counts.launches, site.find("AddIntoKernel") != std::string::npos ? 6u : 3u) << site;
  }

  // The same step issued directly, with the captured parameter: the same results.
  for (int round = 0; round < 3; ++round) {
    step.Stage(round);
    ASSERT_EQ(step.Issue(s, 1.5f), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(replayed[round][i], step.out[i]) << "round " << round << " element " << i;
      ASSERT_EQ(step.out[i], 2 * (1.5f * step.in[i])) << "round " << round << " element " << i;
    }
  }
  c = simt::ReadCounters();
  EXPECT_EQ(c.launches, 18u);
  EXPECT_EQ(c.graph_kernel_launches, 9u);

  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaErrorInvalidValue) << "destroyed twice";
  EXPECT_EQ(cudaGraphLaunch(exec, s), cudaErrorInvalidResourceHandle) << "a destroyed instantiated graph";
  (void)cudaGetLastError();
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

// A captured cublasGemmEx reads its operands at every launch, with the alpha and beta of the capture.
TEST_F(SimtTest, CapturedGemmRunsAtEveryLaunch) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(h, s), CUBLAS_STATUS_SUCCESS);
  const int m = 3, n = 2, k = 4;
  std::vector<float> a(m * k), b(k * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) - 5;
  for (size_t i = 0; i < b.size(); ++i) b[i] = 0.5f * static_cast<float>(i);
  DeviceBuffer<float> da(a), db(b), dc(std::vector<float>(m * n, NAN));
  float alpha = 2.f, beta = 0.f;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, da.get(), CUDA_R_32F, m, db.get(), CUDA_R_32F, k,
                         &beta, dc.get(), CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  alpha = 7.f;
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  for (float v : dc.ToHost()) ASSERT_TRUE(std::isnan(v)) << "nothing runs during capture";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      for (float& v : a) v = -v;
      ASSERT_EQ(cudaMemcpy(da.get(), a.data(), a.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    }
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    const std::vector<float> got = dc.ToHost();
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        double want = 0;
        for (int p = 0; p < k; ++p) want += static_cast<double>(a[p * m + i]) * b[j * k + p];
        EXPECT_EQ(got[j * m + i], static_cast<float>(2 * want)) << "round " << round;
      }
    }
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// Every call a capture forbids fails with the real runtime's error, sets it as the (non-sticky) last error and
// invalidates the capture: further work on the stream fails and cudaStreamEndCapture returns no graph.
TEST_F(SimtTest, IllegalCallsDuringCaptureInvalidateIt) {
  cudaStream_t s = nullptr, other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  const int n = 64;
  DeviceBuffer<float> d(n), e(n);
  PinnedBuffer<float> pinned(n);
  std::vector<float> pageable(n, 1.f);
  void* pool_memory = nullptr;
  ASSERT_EQ(cudaMallocAsync(&pool_memory, 256, other), cudaSuccess);
  cudaEvent_t outside = nullptr;
  ASSERT_EQ(cudaEventCreate(&outside), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(outside, other), cudaSuccess);
  // An instantiated graph of one memset, to launch into the capturing stream.
  cudaGraph_t small = nullptr;
  cudaGraphExec_t small_exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(other, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(e.get(), 0, n * sizeof(float), other), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(other, &small), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&small_exec, small, 0), cudaSuccess);
  cublasHandle_t legacy_handle = nullptr;
  ASSERT_EQ(cublasCreate(&legacy_handle), CUBLAS_STATUS_SUCCESS);  // on the legacy stream
  const size_t bytes = n * sizeof(float);
  void* q = nullptr;

  struct Illegal {
    const char* what;
    cudaError_t want;
    std::function<cudaError_t()> call;
    bool launcher = false;  // returns cudaGetLastError() itself
  };
  const std::vector<Illegal> cases = {
      {"cudaMalloc", cudaErrorStreamCaptureUnsupported, [&] { return cudaMalloc(&q, 64); }},
      {"cudaFree", cudaErrorStreamCaptureUnsupported, [&] { return cudaFree(e.get()); }},
      {"cudaMallocHost", cudaErrorStreamCaptureUnsupported, [&] { return cudaMallocHost(&q, 64); }},
      {"cudaFreeHost", cudaErrorStreamCaptureUnsupported, [&] { return cudaFreeHost(pinned.get()); }},
      {"cudaHostRegister", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaHostRegister(pageable.data(), bytes, cudaHostRegisterDefault); }},
      {"cudaMemcpy", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMemcpy(d.get(), pinned.get(), bytes, cudaMemcpyHostToDevice); }},
      {"cudaMemset", cudaErrorStreamCaptureUnsupported, [&] { return cudaMemset(d.get(), 0, bytes); }},
      {"cudaDeviceSynchronize", cudaErrorStreamCaptureUnsupported, [&] { return cudaDeviceSynchronize(); }},
      {"cudaStreamSynchronize(capturing)", cudaErrorStreamCaptureUnsupported, [&] { return cudaStreamSynchronize(s); }},
      {"cudaStreamSynchronize(other)", cudaErrorStreamCaptureUnsupported, [&] { return cudaStreamSynchronize(other); }},
      {"cudaStreamQuery", cudaErrorStreamCaptureUnsupported, [&] { return cudaStreamQuery(s); }},
      {"cudaEventSynchronize", cudaErrorStreamCaptureUnsupported, [&] { return cudaEventSynchronize(outside); }},
      {"cudaEventQuery", cudaErrorStreamCaptureUnsupported, [&] { return cudaEventQuery(outside); }},
      {"cudaStreamWaitEvent(outside)", cudaErrorStreamCaptureIsolation,
       [&] { return cudaStreamWaitEvent(s, outside, 0); }},
      {"cudaMallocAsync", cudaErrorStreamCaptureUnsupported, [&] { return cudaMallocAsync(&q, 64, s); }},
      {"cudaFreeAsync", cudaErrorStreamCaptureUnsupported, [&] { return cudaFreeAsync(pool_memory, s); }},
      {"cudaMemcpyAsync from pageable", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMemcpyAsync(d.get(), pageable.data(), bytes, cudaMemcpyHostToDevice, s); }},
      {"cudaMemcpyAsync to pageable", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMemcpyAsync(pageable.data(), d.get(), bytes, cudaMemcpyDeviceToHost, s); }},
      {"launch on the legacy stream", cudaErrorStreamCaptureImplicit,
       [&] { return simt_test::Scale(d.get(), 2.f, n, e.get(), nullptr); }, true},
      {"cudaMemsetAsync on the legacy stream", cudaErrorStreamCaptureImplicit,
       [&] { return cudaMemsetAsync(d.get(), 0, bytes, cudaStreamLegacy); }},
      {"cublasGemmEx on the legacy stream", cudaErrorStreamCaptureImplicit,
       [&] {
         const float one = 1.f, zero = 0.f;
         const cublasStatus_t st =
             cublasGemmEx(legacy_handle, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, d.get(), CUDA_R_32F, 1, d.get(),
                          CUDA_R_32F, 1, &zero, e.get(), CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
         return st == CUBLAS_STATUS_EXECUTION_FAILED ? cudaPeekAtLastError() : cudaSuccess;
       }},
      {"a launch over the block limit", cudaErrorInvalidConfiguration,
       [&] { return simt_test::Scale(d.get(), 2.f, n, e.get(), s, /*threads=*/2048); }, true},
      {"cudaGraphLaunch into the capturing stream", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaGraphLaunch(small_exec, s); }},
      {"cudaStreamBeginCapture again", cudaErrorIllegalState,
       [&] { return cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal); }},
      {"cudaStreamDestroy", cudaErrorStreamCaptureUnsupported, [&] { return cudaStreamDestroy(s); }},
  };
  for (const Illegal& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    ASSERT_EQ(simt_test::Scale(d.get(), 2.f, n, e.get(), s), cudaSuccess);
    EXPECT_EQ(c.call(), c.want);
    if (!c.launcher) {
      EXPECT_EQ(cudaGetLastError(), c.want);
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "not sticky";
    EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusInvalidated);
    EXPECT_EQ(cudaMemsetAsync(d.get(), 0, bytes, s), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(simt_test::Scale(d.get(), 2.f, n, e.get(), s), cudaErrorStreamCaptureInvalidated);
    cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(1);
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(graph, nullptr);
    EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusNone);
    (void)cudaGetLastError();
  }
  // Relaxed mode allows potentially unsafe calls, but never synchronizing the capturing stream or the device.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&q, 64), cudaSuccess);
  ASSERT_EQ(cudaFree(q), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusInvalidated);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();

  EXPECT_EQ(cudaFreeAsync(pool_memory, other), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(small_exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(small), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(outside), cudaSuccess);
  EXPECT_EQ(cublasDestroy(legacy_handle), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
  EXPECT_TRUE(reports_.empty()) << AllReports();
}

// Where a capture may begin and end, what cudaStreamIsCapturing and cudaStreamGetCaptureInfo say, and events
// recorded inside a capture.
TEST_F(SimtTest, CaptureBeginsAndEndsWhereTheRuntimeAllows) {
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamBeginCapture(cudaStreamLegacy, cudaStreamCaptureModeGlobal), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaGetLastError(), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaStream_t s = nullptr, other = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);  // blocking: the legacy stream would wait for it
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorIllegalState) << "not capturing";
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusNone);
  (void)cudaGetLastError();
  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(cudaGraphInstantiate(&exec, nullptr, 0), cudaErrorInvalidValue);
  (void)cudaGetLastError();

  DeviceBuffer<int> d(16);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  EXPECT_EQ(cudaStreamIsCapturing(cudaStreamLegacy, &status), cudaErrorStreamCaptureImplicit);
  (void)cudaGetLastError();
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusActive) << "asking does not invalidate";
  unsigned long long id = 0;
  cudaGraph_t capturing = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  size_t num_deps = 7;
  ASSERT_EQ(cudaStreamGetCaptureInfo(s, &status, &id, &capturing, &deps, nullptr, &num_deps), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  EXPECT_NE(id, 0u);
  EXPECT_NE(capturing, nullptr);
  EXPECT_EQ(num_deps, 0u);
  EXPECT_EQ(cudaGraphDestroy(capturing), cudaErrorInvalidValue) << "the graph of a capture going on";
  (void)cudaGetLastError();
  ASSERT_EQ(cudaMemsetAsync(d.get(), 1, 64, s), cudaSuccess);
  ASSERT_EQ(cudaStreamGetCaptureInfo(s, &status, &id, &capturing, &deps, nullptr, &num_deps), cudaSuccess);
  ASSERT_EQ(num_deps, 1u);
  const cudaGraphNode_t memset_node = deps[0];
  // An event recorded in the capture may be waited for in it; it is no event for the host.
  cudaEvent_t ev = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ev, s), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(s, ev, 0), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  size_t count = 1;
  cudaGraphNode_t node = nullptr;
  ASSERT_EQ(cudaGraphGetNodes(graph, &node, &count), cudaSuccess);
  EXPECT_EQ(count, 1u) << "event records and waits add no node";
  EXPECT_EQ(node, memset_node);
  EXPECT_EQ(cudaEventQuery(ev), cudaErrorCapturedEvent);
  EXPECT_EQ(cudaEventSynchronize(ev), cudaErrorCapturedEvent);
  EXPECT_EQ(cudaStreamWaitEvent(other, ev, 0), cudaErrorCapturedEvent);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaEventRecord(ev, other), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(ev), cudaSuccess) << "recorded outside a capture again";
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaGraphInstantiateWithFlags(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, nullptr), cudaSuccess);
  for (int v : d.ToHost()) EXPECT_EQ(v, 0x01010101);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaErrorInvalidValue) << "destroyed twice";
  (void)cudaGetLastError();

  // A stream that does not capture cannot join a capture through an event (not modelled): refused, invalidating.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ev, s), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(other, ev, 0), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();

  // A capture not begun in Relaxed mode ends on the thread that began it.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  cudaError_t from_other_thread = cudaSuccess;
  std::thread([&] { from_other_thread = cudaStreamEndCapture(s, &graph); }).join();
  EXPECT_EQ(from_other_thread, cudaErrorStreamCaptureWrongThread);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
  std::thread([&] { from_other_thread = cudaStreamEndCapture(s, &graph); }).join();
  EXPECT_EQ(from_other_thread, cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  (void)cudaGetLastError();

  // The per-thread default stream captures; the legacy stream's work is refused meanwhile (it is blocking).
  ASSERT_EQ(cudaStreamBeginCapture(cudaStreamPerThread, cudaStreamCaptureModeRelaxed), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d.get(), 2, 64, cudaStreamPerThread), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(d.get(), 3, 64, nullptr), cudaErrorStreamCaptureImplicit);
  EXPECT_EQ(cudaStreamEndCapture(cudaStreamPerThread, &graph), cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaStreamBeginCapture(cudaStreamPerThread, cudaStreamCaptureModeRelaxed), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d.get(), 2, 64, cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(cudaStreamPerThread, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &count), cudaSuccess);
  EXPECT_EQ(count, 1u);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);

  EXPECT_EQ(cudaEventDestroy(ev), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
}

// ThreadLocal mode forbids only the capturing thread's potentially unsafe calls; Global mode every thread's, unless
// that thread set its own mode to Relaxed or ThreadLocal (cudaThreadExchangeStreamCaptureMode).
TEST_F(SimtTest, CaptureModesDecideWhoseCallsAreForbidden) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  auto malloc_on_other_thread = [](cudaStreamCaptureMode mode) {
    cudaError_t result = cudaSuccess;
    std::thread([&] {
      cudaStreamCaptureMode m = mode;
      EXPECT_EQ(cudaThreadExchangeStreamCaptureMode(&m), cudaSuccess);
      EXPECT_EQ(m, cudaStreamCaptureModeGlobal) << "every thread starts in Global mode";
      void* p = nullptr;
      result = cudaMalloc(&p, 64);
      if (result == cudaSuccess) {
        EXPECT_EQ(cudaFree(p), cudaSuccess);
      }
    }).join();
    return result;
  };
  cudaGraph_t graph = nullptr;
  void* p = nullptr;
  DeviceBuffer<int> d(16);

  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaMalloc(&p, 64), cudaErrorStreamCaptureUnsupported) << "the capturing thread's own";
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);

  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d.get(), 0, 16 * sizeof(int), s), cudaSuccess);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);

  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusActive);
  EXPECT_EQ(malloc_on_other_thread(cudaStreamCaptureModeGlobal), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(CaptureStatus(s), cudaStreamCaptureStatusInvalidated);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);

  // This thread in Relaxed mode may allocate beside its own Global capture.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&p, 64), cudaSuccess);
  ASSERT_EQ(cudaFree(p), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
  EXPECT_EQ(mode, cudaStreamCaptureModeRelaxed);
  (void)cudaGetLastError();
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// A memcpy node replayed after its device buffer was freed is reported (the runtime's copies are not instrumented,
// so the runtime checks them itself) and does not copy.
TEST_F(SimtTest, GraphCopyIntoFreedMemoryIsReported) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  PinnedBuffer<float> pinned(16);
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 16 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d, pinned.get(), 16 * sizeof(float), cudaMemcpyHostToDevice, s), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  EXPECT_TRUE(reports_.empty()) << AllReports();
  ASSERT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, s), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  ASSERT_EQ(reports_.size(), 1u) << AllReports();
  EXPECT_EQ(reports_[0].kind, simt::ErrorKind::kUseAfterFree);
  EXPECT_NE(reports_[0].message.find("cudaMemcpyAsync (graph node)"), std::string::npos) << reports_[0].message;
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

}  // namespace
