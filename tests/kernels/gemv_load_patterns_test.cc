// How scattered the GEMVs' loads are, as the emulated runtime counts them (simt::LoadRequests in
// tools/simt/include/simt/counters.h): every read-only load of a launch grouped into warp requests, the 128-byte
// lines those touch per 128 bytes requested (1 when every request is coalesced) and per 1024 weights (the L1
// wavefronts a GEMV spends on each weight). Built only against the SIMT emulator's checked kernels
// (tools/simt/tests/CMakeLists.txt), label cuda-emulated.
//
// The dense bf16 and the INT8 GEMVs' requests are all coalesced; NF4's code requests are 64 bytes in one line (2
// bytes a lane) and its block scales broadcast, so it may touch up to 1.25 lines per 128 bytes. Per weight, the
// quantized GEMVs touch no more lines than the bf16 GEMV. With a lane's 8 consecutive columns per step, each
// activation load spread a warp over 8 lines instead of 4: 48 lines per 1024 weights (bf16, one token, 2 rows per
// warp then) and 24 (INT8 and NF4, 4 rows per warp), against 24 (bf16, 4 rows per warp now), 16 and 20; with 16 bytes
// of codes a lane, NF4 took 5.4 lines per 128 bytes, and on the H200 ran at 14% of DRAM bandwidth with L1 81% busy.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "kernels/gemv.h"
#include "kernels/quant.h"
#include "simt/counters.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::DeviceArray;

// The 128-byte lines `ldg` touched per 1024 of `weights`.
double LinesPer1024(const simt::LoadRequests& ldg, int64_t weights) {
  return static_cast<double>(ldg.lines) * 1024.0 / static_cast<double>(weights);
}

// The read-only loads of the one launch `launch` makes over `weights` weights, printed under `name`.
template <typename Launch>
simt::LoadRequests LoadsOf(const std::string& name, int64_t weights, Launch launch) {
  simt::ResetCounters();
  EXPECT_EQ(launch(), cudaSuccess) << name;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
  const simt::Counters counts = simt::ReadCounters();
  EXPECT_EQ(counts.launches, 1u) << name;
  simt::LoadRequests ldg;
  for (const auto& [site, c] : counts.sites) ldg.Add(c.ldg);
  std::printf(
      "%-16s requests %7llu  bytes %10llu  sectors/request %5.1f  lines/request %4.1f  lines/128 B %5.2f  "
      "lines/1024 weights %5.1f\n",
      name.c_str(), static_cast<unsigned long long>(ldg.requests), static_cast<unsigned long long>(ldg.bytes),
      ldg.requests ? static_cast<double>(ldg.sectors) / ldg.requests : 0.0,
      ldg.requests ? static_cast<double>(ldg.lines) / ldg.requests : 0.0, ldg.LinesPer128Bytes(),
      LinesPer1024(ldg, weights));
  return ldg;
}

TEST(GemvLoadPatternsTest, RequestsAreCoalescedAndQuantizedGemvsTouchNoMoreLinesPerWeightThanBf16) {
  ASSERT_TRUE(simt::CountsKernelAccesses()) << "needs the emulator's checked build";
  // 8192 rows: the one-token kernels' 4-rows-per-warp path; 512 columns: 2 steps of 256 a lane.
  constexpr int64_t kRows = 8192;
  constexpr int64_t kCols = 512;
  constexpr int64_t kWeights = kRows * kCols;
  // Zeroed buffers: the values do not change which addresses a GEMV loads.
  DeviceArray<float> x(kernels::kGemvMaxTokens * kCols), y(kernels::kGemvMaxTokens * kRows);
  DeviceArray<__nv_bfloat16> bf16(kWeights);
  DeviceArray<uint8_t> nf4_codes(kRows * kernels::Nf4RowBytes(kCols));
  DeviceArray<float> nf4_absmax(kRows * kernels::Nf4BlocksPerRow(kCols));
  DeviceArray<int8_t> int8_codes(kWeights);
  DeviceArray<float> int8_absmax(kRows);
  for (const int64_t n : {int64_t{1}, kernels::kGemvMaxTokens}) {
    const std::string tokens = " n=" + std::to_string(n);
    const simt::LoadRequests dense = LoadsOf("bf16 GEMV" + tokens, kWeights, [&] {
      return kernels::LaunchGemv(x.get(), bf16.get(), static_cast<const __nv_bfloat16*>(nullptr), n, kCols, kRows,
                                 y.get(), nullptr);
    });
    const simt::LoadRequests nf4 = LoadsOf("NF4 GEMV" + tokens, kWeights, [&] {
      return kernels::LaunchGemvNf4(x.get(), nf4_codes.get(), nf4_absmax.get(), n, kCols, kRows, y.get(), nullptr);
    });
    const simt::LoadRequests int8 = LoadsOf("INT8 GEMV" + tokens, kWeights, [&] {
      return kernels::LaunchGemvInt8(x.get(), int8_codes.get(), int8_absmax.get(), n, kCols, kRows, y.get(), nullptr);
    });
    ASSERT_GT(dense.requests, 0u);
    ASSERT_GT(nf4.requests, 0u);
    ASSERT_GT(int8.requests, 0u);
    EXPECT_LE(dense.LinesPer128Bytes(), 1.0) << "bf16" << tokens;
    EXPECT_LE(int8.LinesPer128Bytes(), 1.0) << "INT8" << tokens;
    EXPECT_LE(nf4.LinesPer128Bytes(), 1.25) << "NF4" << tokens;
    EXPECT_LE(LinesPer1024(nf4, kWeights), LinesPer1024(dense, kWeights)) << "NF4" << tokens;
    EXPECT_LE(LinesPer1024(int8, kWeights), LinesPer1024(dense, kWeights)) << "INT8" << tokens;
  }
}

}  // namespace
}  // namespace odmoe
