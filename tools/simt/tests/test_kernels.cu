// Kernels that exercise the emulator: every construct odmoe's kernels use, written as CUDA. Compiled through
// rewrite_cu.py and prelude.h, fast and checked (the checked build must report nothing for these).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tools/simt/tests/test_kernels.h"

namespace simt_test {
namespace {

__global__ void IntrinsicsKernel(const float* __restrict__ a, const float* __restrict__ b, int n, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = a[i], y = b[i];
  out[6 * i + 0] = __fmul_rn(x, y);
  out[6 * i + 1] = __fadd_rn(x, y);
  out[6 * i + 2] = __fdiv_rn(x, y);
  out[6 * i + 3] = __uint_as_float(__float_as_uint(x));
  out[6 * i + 4] = __half2float(__float2half_rn(x));
  out[6 * i + 5] = __bfloat162float(__float2bfloat16_rn(x));
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) BlockSumKernel(const float* in, float* out) {
  __shared__ float partial[kThreads];
  const int t = threadIdx.x;
  partial[t] = in[blockIdx.x * kThreads + t];
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (t < s) partial[t] += partial[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = partial[0];
}

__global__ void ShufflesKernel(const float* f, const int* iv, const int64_t* l, float* out_f, int* out_i,
                               int64_t* out_l, int* out_w) {
  const int t = threadIdx.x;
  const int lane = t & 31;
  float s = f[t];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  out_f[t] = s;
  int scan = iv[t];
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, scan, o);
    if (lane >= o) scan += up;
  }
  out_i[t] = scan;
  out_l[t] = __shfl_sync(0xffffffffu, l[t], 5);
  int w = iv[t];
  for (int o = 4; o > 0; o >>= 1) w ^= __shfl_xor_sync(0xffffffffu, w, o, 8);
  __syncwarp();
  out_w[t] = w;
}

__global__ void SharedPerBlockKernel(int* out) {
  __shared__ int slot[4];
  if (threadIdx.x < 4) slot[threadIdx.x] = static_cast<int>(blockIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slot[threadIdx.x % 4];
}

__global__ void DynamicSharedKernel(int slice, int* out) {
  extern __shared__ int dyn[];
  const int t = threadIdx.x;
  for (int k = 0; k < slice; ++k) dyn[t * slice + k] = t;
  __syncthreads();
  const int next = (t + 1) % static_cast<int>(blockDim.x);
  out[t] = dyn[next * slice + slice - 1];
}

__global__ void Grid3dKernel(int* out) {
  const unsigned x = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned y = blockIdx.y * blockDim.y + threadIdx.y;
  const unsigned z = blockIdx.z * blockDim.z + threadIdx.z;
  const unsigned nx = gridDim.x * blockDim.x, ny = gridDim.y * blockDim.y;
  out[(z * ny + y) * nx + x] = static_cast<int>(x | y << 8 | z << 16);
}

__global__ void AtomicMinMaxKernel(const unsigned long long* in, unsigned long long* out) {
  __shared__ unsigned long long lo;
  __shared__ unsigned long long hi;
  if (threadIdx.x == 0) {
    lo = ~0ull;
    hi = 0;
  }
  __syncthreads();
  atomicMin(&lo, in[threadIdx.x]);
  atomicMax(&hi, in[threadIdx.x]);
  __syncthreads();
  if (threadIdx.x == 0) {
    out[0] = lo;
    out[1] = hi;
  }
}

// Neighbouring threads write neighbouring bytes (one 8-byte shadow granule holds 8 threads' bytes), and lanes
// 0-15 of warp 0 exchange through shared memory ordered by a half-warp __syncwarp only.
__global__ void ByteNeighboursKernel(uint8_t* out, int* half_warp_out) {
  __shared__ uint8_t bytes[256];
  __shared__ int half[16];
  const int t = threadIdx.x;
  bytes[t] = static_cast<uint8_t>(t);
  out[t] = static_cast<uint8_t>(t);
  if (t < 16) {
    half[t] = t * 10;
    __syncwarp(0x0000ffffu);
    half_warp_out[t] = half[t ^ 1];
  }
  __syncthreads();
  out[blockDim.x + t] = bytes[(t + 1) % blockDim.x];
}

__global__ void DeadlockKernel() {
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    __syncwarp();
  }
}

__global__ void DivergentBarrierKernel() {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void ScaleKernel(const float* x, float a, int n, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i];
}

__global__ void AddIntoKernel(const float* x, int n, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += x[i];
}

__global__ void StridedLoadsKernel(const float4* x, int stride, int loads, float* out) {
  float sum = 0.0f;
  for (int k = 0; k < loads; ++k) {
    const float4 v = __ldg(x + (static_cast<int64_t>(k) * blockDim.x + threadIdx.x) * stride);
    sum += v.x + v.y + v.z + v.w;
  }
  out[threadIdx.x] = sum;
}

}  // namespace

cudaError_t Intrinsics(const float* a, const float* b, int n, float* out) {
  IntrinsicsKernel<<<(n + 63) / 64, 64>>>(a, b, n, out);
  return cudaGetLastError();
}

cudaError_t BlockSum(const float* in, int threads, int blocks, float* out) {
  if (threads == 64) {
    BlockSumKernel<64><<<blocks, 64, 0, nullptr>>>(in, out);
  } else if (threads == 256) {
    BlockSumKernel<256><<<blocks, 256, 0, nullptr>>>(in, out);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t Shuffles(const float* f, const int* i, const int64_t* l, int threads, float* out_f, int* out_i,
                     int64_t* out_l, int* out_w) {
  ShufflesKernel<<<1, threads>>>(f, i, l, out_f, out_i, out_l, out_w);
  return cudaGetLastError();
}

cudaError_t SharedPerBlock(int threads, int blocks, int* out) {
  SharedPerBlockKernel<<<blocks, threads>>>(out);
  return cudaGetLastError();
}

cudaError_t DynamicShared(int threads, size_t bytes, bool opt_in, int* out) {
  if (opt_in) {
    const cudaError_t e =
        cudaFuncSetAttribute(DynamicSharedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess) return e;
  }
  const int slice = static_cast<int>(bytes / sizeof(int) / static_cast<size_t>(threads));
  DynamicSharedKernel<<<1, threads, bytes>>>(slice, out);
  return cudaGetLastError();
}

cudaError_t Grid3d(dim3 grid, dim3 block, int* out) {
  Grid3dKernel<<<grid, block>>>(out);
  return cudaGetLastError();
}

cudaError_t AtomicMinMax(const unsigned long long* in, int threads, unsigned long long* out) {
  AtomicMinMaxKernel<<<1, threads>>>(in, out);
  return cudaGetLastError();
}

cudaError_t ByteNeighbours(int threads, uint8_t* out, int* half_warp_out) {
  ByteNeighboursKernel<<<1, threads>>>(out, half_warp_out);
  return cudaGetLastError();
}

cudaError_t Deadlock() {
  DeadlockKernel<<<1, 64>>>();
  return cudaGetLastError();
}

cudaError_t DivergentBarrier() {
  DivergentBarrierKernel<<<1, 64>>>();
  return cudaGetLastError();
}

cudaError_t Scale(const float* x, float a, int n, float* y, cudaStream_t stream, int threads) {
  ScaleKernel<<<(n + threads - 1) / threads, threads, 0, stream>>>(x, a, n, y);
  return cudaGetLastError();
}

cudaError_t AddInto(const float* x, int n, float* y, cudaStream_t stream) {
  AddIntoKernel<<<(n + 63) / 64, 64, 0, stream>>>(x, n, y);
  return cudaGetLastError();
}

cudaError_t StridedLoads(const float4* x, int stride, int threads, int loads, float* out) {
  StridedLoadsKernel<<<1, threads>>>(x, stride, loads, out);
  return cudaGetLastError();
}

}  // namespace simt_test
