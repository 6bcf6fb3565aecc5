// How scattered the GEMVs' loads are, as the emulated runtime counts them (simt::LoadRequests in
// tools/simt/include/simt/counters.h): every read-only load of a launch grouped into warp requests, and the 128-byte
// lines those touch per 128 bytes requested (1 when every request is coalesced). Built only against the SIMT
// emulator's checked kernels (tools/simt/tests/CMakeLists.txt), label cuda-emulated.
//
// The INT8 and NF4 GEMVs' loads must be no more scattered than the dense bf16 GEMV's (its pattern reached 84% of the
// copy bandwidth on an H200), for one token and for several. When a lane's unit was 16 bytes of codes, each of its
// activation loads spread a warp over 32 lines (NF4) or 16 (INT8): 5.4 and 2.5 lines per 128 bytes for one token
// here, against the bf16 GEMV's 1.5, and for NF4 an L1 81% busy at 14% of DRAM bandwidth on the H200.
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

// The read-only loads of the one launch `launch` makes, printed under `name`.
template <typename Launch>
simt::LoadRequests LoadsOf(const std::string& name, Launch launch) {
  simt::ResetCounters();
  EXPECT_EQ(launch(), cudaSuccess) << name;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
  const simt::Counters counts = simt::ReadCounters();
  EXPECT_EQ(counts.launches, 1u) << name;
  simt::LoadRequests ldg;
  for (const auto& [site, c] : counts.sites) ldg.Add(c.ldg);
  std::printf("%-28s requests %8llu  bytes %10llu  sectors/request %5.1f  lines/request %5.1f  lines/128 B %5.2f\n",
              name.c_str(), static_cast<unsigned long long>(ldg.requests), static_cast<unsigned long long>(ldg.bytes),
              ldg.requests ? static_cast<double>(ldg.sectors) / ldg.requests : 0.0,
              ldg.requests ? static_cast<double>(ldg.lines) / ldg.requests : 0.0, ldg.LinesPer128Bytes());
  return ldg;
}

TEST(GemvLoadPatternsTest, QuantizedGemvLoadsAreNoMoreScatteredThanTheBf16Gemvs) {
  ASSERT_TRUE(simt::CountsKernelAccesses()) << "needs the emulator's checked build";
  // 8192 rows: the one-token kernels' 4-rows-per-warp path (2 for bf16); 512 columns: 2 steps of NF4 words a lane.
  constexpr int64_t kRows = 8192;
  constexpr int64_t kCols = 512;
  // Zeroed buffers: the values do not change which addresses a GEMV loads.
  DeviceArray<float> x(kernels::kGemvMaxTokens * kCols), y(kernels::kGemvMaxTokens * kRows);
  DeviceArray<__nv_bfloat16> bf16(kRows * kCols);
  DeviceArray<uint8_t> nf4_codes(kRows * kernels::Nf4RowBytes(kCols));
  DeviceArray<float> nf4_absmax(kRows * kernels::Nf4BlocksPerRow(kCols));
  DeviceArray<int8_t> int8_codes(kRows * kCols);
  DeviceArray<float> int8_absmax(kRows);
  for (const int64_t n : {int64_t{1}, kernels::kGemvMaxTokens}) {
    const std::string tokens = " n=" + std::to_string(n);
    const simt::LoadRequests dense = LoadsOf("bf16 GEMV" + tokens, [&] {
      return kernels::LaunchGemv(x.get(), bf16.get(), static_cast<const __nv_bfloat16*>(nullptr), n, kCols, kRows,
                                 y.get(), nullptr);
    });
    const simt::LoadRequests nf4 = LoadsOf("NF4 GEMV" + tokens, [&] {
      return kernels::LaunchGemvNf4(x.get(), nf4_codes.get(), nf4_absmax.get(), n, kCols, kRows, y.get(), nullptr);
    });
    const simt::LoadRequests int8 = LoadsOf("INT8 GEMV" + tokens, [&] {
      return kernels::LaunchGemvInt8(x.get(), int8_codes.get(), int8_absmax.get(), n, kCols, kRows, y.get(), nullptr);
    });
    ASSERT_GT(dense.requests, 0u);
    ASSERT_GT(nf4.requests, 0u);
    ASSERT_GT(int8.requests, 0u);
    EXPECT_LE(nf4.LinesPer128Bytes(), 1.05 * dense.LinesPer128Bytes()) << "NF4" << tokens;
    EXPECT_LE(int8.LinesPer128Bytes(), 1.05 * dense.LinesPer128Bytes()) << "INT8" << tokens;
  }
}

}  // namespace
}  // namespace odmoe
