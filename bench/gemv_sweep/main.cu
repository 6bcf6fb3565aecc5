// gemv_sweep's driver: the copy bandwidth, then every variant (sweep.h).
#include <algorithm>
#include <vector>

#include "bench/gemv_sweep/sweep.h"

namespace odmoe::sweep {

__global__ void FillKernel(uint32_t* p, size_t words, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // Keep every 16-bit half a finite bf16 / fp16 of modest size: clear the top exponent bits of each half.
    p[i] = h & 0x3fff3fffu;
  }
}

void* RandomDeviceBytes(size_t bytes, uint32_t seed) {
  void* p = nullptr;
  SWEEP_CHECK(cudaMalloc(&p, bytes));
  FillKernel<<<1024, 256>>>(static_cast<uint32_t*>(p), bytes / 4, seed);
  SWEEP_CHECK(cudaGetLastError());
  SWEEP_CHECK(cudaDeviceSynchronize());
  return p;
}

void Report(const Variant& v, double copy_gbs) {
  for (int i = 0; i < v.copies; ++i) v.launch(i);  // warm-up (and a launcher's shared memory attribute)
  SWEEP_CHECK(cudaGetLastError());
  cudaFuncAttributes attr{};
  SWEEP_CHECK(cudaFuncGetAttributes(&attr, v.func));
  int blocks_per_sm = 0;
  SWEEP_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, v.func, v.threads, v.shared_bytes));
  cudaEvent_t start, stop;
  SWEEP_CHECK(cudaEventCreate(&start));
  SWEEP_CHECK(cudaEventCreate(&stop));
  constexpr int kIters = 20, kRuns = 7;
  std::vector<float> ms;
  for (int run = 0; run < kRuns; ++run) {
    SWEEP_CHECK(cudaEventRecord(start));
    for (int i = 0; i < kIters; ++i) v.launch(i % v.copies);
    SWEEP_CHECK(cudaEventRecord(stop));
    SWEEP_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    SWEEP_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  SWEEP_CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double us = 1e3 * ms[kRuns / 2] / kIters;
  const double gbs = v.bytes / us / 1e3;
  std::printf("%-26s %-12s %9.1f %9.1f %7.1f%% %5d %4d\n", v.kernel.c_str(), v.shape.c_str(), us, gbs,
              100 * gbs / copy_gbs, attr.numRegs, blocks_per_sm);
  std::fflush(stdout);
  SWEEP_CHECK(cudaEventDestroy(start));
  SWEEP_CHECK(cudaEventDestroy(stop));
}

// Device-to-device copy of 2 GiB, bytes read plus written, median of 5.
double CopyBandwidth() {
  const size_t bytes = size_t{2} << 30;
  void* a = RandomDeviceBytes(bytes, 1);
  void* b = nullptr;
  SWEEP_CHECK(cudaMalloc(&b, bytes));
  cudaEvent_t start, stop;
  SWEEP_CHECK(cudaEventCreate(&start));
  SWEEP_CHECK(cudaEventCreate(&stop));
  SWEEP_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  std::vector<float> ms;
  for (int i = 0; i < 5; ++i) {
    SWEEP_CHECK(cudaEventRecord(start));
    SWEEP_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    SWEEP_CHECK(cudaEventRecord(stop));
    SWEEP_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    SWEEP_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  SWEEP_CHECK(cudaFree(a));
  SWEEP_CHECK(cudaFree(b));
  return 2.0 * static_cast<double>(bytes) / (ms[2] * 1e-3) / 1e9;
}

}  // namespace odmoe::sweep

int main() {
  using namespace odmoe::sweep;
  cudaDeviceProp prop{};
  SWEEP_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy = CopyBandwidth();
  std::printf("%s, %d SMs: copy %.1f GB/s (read + write)\n", prop.name, prop.multiProcessorCount, copy);
  std::printf("%-26s %-12s %9s %9s %8s %5s %4s\n", "kernel", "shape", "us/call", "GB/s", "of_copy", "regs", "b/SM");
  SweepDense(copy);
  SweepQuant(copy);
  return 0;
}
