// gemv_sweep: times every variant of the one-token GEMV kernels (rows per warp, ring depth) on the shapes of a
// decode, and the INT8 / NF4 candidates with 16-byte code loads (kernels/quant.h: LaunchGemvInt8Wide,
// LaunchGemvNf4Wide) likewise, so that one GPU run says which variant each shape should take. A tool for a machine with
// a GPU, built for sm_90 only (with the rest of the build, so CI compiles it) and run by bench/device_check.sh; each
// variant's kernel is the library's own template (dense.cu and quant.cu include the kernels' .cu files), launched as
// the library's dispatch would launch it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

namespace odmoe::sweep {

#define SWEEP_CHECK(call)                                                                         \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// One timed variant: `launch(copy)` runs the kernel on operand copy `copy` (0 .. copies - 1, rotated so that no
// call finds its weights in L2); bytes: what one call must read and write.
struct Variant {
  std::string kernel;  // e.g. "int8 rows2 depth8"
  std::string shape;   // "out x in"
  double bytes;
  const void* func;  // the __global__ function, for its registers and occupancy
  int threads;       // per block
  int copies;
  std::function<void(int)> launch;
  size_t shared_bytes = 0;  // dynamic shared memory per block
};

// Times v (median of several event-timed runs of `iters` calls) and prints one line: microseconds per call, GB/s,
// share of `copy_gbs`, registers, resident blocks per SM.
void Report(const Variant& v, double copy_gbs);

// Device memory filled with pseudo-random bytes (never zeros: METHOD.md).
void* RandomDeviceBytes(size_t bytes, uint32_t seed);

// The two families' variants, reported as they run.
void SweepDense(double copy_gbs);
void SweepQuant(double copy_gbs);

}  // namespace odmoe::sweep
