// The known-bad kernels of bad_kernels.h. Keep each bug alone in its kernel: the test checks the kind of report.
#include <cstdint>

#include "tools/simt/tests/bad_kernels.h"

namespace simt_bad {
namespace {

constexpr int kThreads = 64;

// Allocates n T's of device memory filled with bytes `fill`; the caller frees.
template <typename T>
T* Alloc(size_t n, int fill = 0) {
  void* p = nullptr;
  if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemset(p, fill, n * sizeof(T));
  return static_cast<T*>(p);
}

__global__ void MissingSyncThreadsKernel(const float* in, float* out) {
  __shared__ float s[kThreads];
  const int t = threadIdx.x;
  s[t] = in[t];
  __syncthreads();
  for (int k = kThreads / 2; k > 0; k >>= 1) {
    if (t < k) s[t] += s[t + k];
    // BUG: no __syncthreads() here
  }
  if (t == 0) out[0] = s[0];
}

__global__ void MissingSyncWarpKernel(float* out) {
  __shared__ float s[32];
  const int lane = threadIdx.x;
  s[lane] = static_cast<float>(lane);
  // BUG: no __syncwarp() here
  out[lane] = s[lane ^ 1];
}

__global__ void OffByOneKernel(float* out, int n) {
  const int i = threadIdx.x;
  if (i <= n) out[i] = 1.f;  // BUG: i < n
}

__global__ void MisalignedVectorLoadKernel(const float* in, float* out) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(in + 1));  // BUG: 4-byte aligned only
  out[threadIdx.x] = __uint_as_float(v.x);
}

__global__ void LanesExitBeforeShuffleKernel(float* out) {
  const int lane = threadIdx.x;
  if (lane >= 16) return;  // BUG: the full mask below includes these lanes
  float v = static_cast<float>(lane);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[lane] = v;
}

__global__ void WrongShuffleMaskKernel(float* out) {
  const int lane = threadIdx.x;
  float v = static_cast<float>(lane);
  if (lane < 16) v += __shfl_xor_sync(0x0000ffffu, v, 16);  // BUG: reads lanes 16-31, not in the mask
  out[lane] = v;
}

__global__ void BarrierInDivergentCodeKernel(float* out) {
  __shared__ float s[kThreads];
  const int t = threadIdx.x;
  if (t < 32) {
    s[t] = 1.f;
    __syncthreads();  // BUG: only warp 0 comes here
  }
  __syncthreads();
  out[t] = s[t % 32];
}

__global__ void PlainMinInsteadOfAtomicKernel(const unsigned long long* in, unsigned long long* out) {
  __shared__ unsigned long long best;
  if (threadIdx.x == 0) best = ~0ull;
  __syncthreads();
  const unsigned long long v = in[threadIdx.x];
  if (v < best) best = v;  // BUG: atomicMin(&best, v)
  __syncthreads();
  if (threadIdx.x == 0) out[0] = best;
}

__global__ void UndersizedDynamicSharedKernel(float* out) {
  extern __shared__ float dyn[];
  dyn[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = dyn[(threadIdx.x + 1) % blockDim.x];
}

__global__ void UninitializedSharedReadKernel(float* out) {
  __shared__ float s[kThreads + 1];
  s[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x + 1];  // BUG: s[kThreads] is never written
}

__global__ void UseAfterFreeKernel(const float* in, float* out) { out[threadIdx.x] = in[threadIdx.x]; }

__global__ void GraphReplayAfterFreeKernel(const float* in, float* out) { out[threadIdx.x] = in[threadIdx.x] + 1; }

__global__ void BlocksRaceOnGlobalKernel(float* out) {
  if (threadIdx.x == 0) out[0] = static_cast<float>(blockIdx.x);  // BUG: every block writes out[0]
}

__global__ void TwoThreadsWriteOneByteKernel(uint8_t* out) {
  out[threadIdx.x / 2] = static_cast<uint8_t>(threadIdx.x);  // BUG: threads 2k and 2k + 1 write byte k
}

__global__ void WriteAfterManyReadersKernel(float* out) {
  __shared__ float s;
  if (threadIdx.x == 0) s = 1.f;
  __syncthreads();
  out[threadIdx.x] = s;
  if (threadIdx.x == kThreads - 1) s = 2.f;  // BUG: no __syncthreads between the other threads' reads and this
}

}  // namespace

cudaError_t MissingSyncThreads() {
  float* in = Alloc<float>(kThreads);
  float* out = Alloc<float>(1);
  MissingSyncThreadsKernel<<<1, kThreads>>>(in, out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(in);
  cudaFree(out);
  return e;
}

cudaError_t MissingSyncWarp() {
  float* out = Alloc<float>(32);
  MissingSyncWarpKernel<<<1, 32>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t OffByOne() {
  const int n = 40;
  float* out = Alloc<float>(n);
  OffByOneKernel<<<1, kThreads>>>(out, n);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t MisalignedVectorLoad() {
  float* in = Alloc<float>(16);
  float* out = Alloc<float>(kThreads);
  MisalignedVectorLoadKernel<<<1, kThreads>>>(in, out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(in);
  cudaFree(out);
  return e;
}

cudaError_t LanesExitBeforeShuffle() {
  float* out = Alloc<float>(32);
  LanesExitBeforeShuffleKernel<<<1, 32>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t WrongShuffleMask() {
  float* out = Alloc<float>(32);
  WrongShuffleMaskKernel<<<1, 32>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t BarrierInDivergentCode() {
  float* out = Alloc<float>(kThreads);
  BarrierInDivergentCodeKernel<<<1, kThreads>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t PlainMinInsteadOfAtomic() {
  unsigned long long* in = Alloc<unsigned long long>(kThreads, 0x11);
  unsigned long long* out = Alloc<unsigned long long>(1);
  PlainMinInsteadOfAtomicKernel<<<1, kThreads>>>(in, out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(in);
  cudaFree(out);
  return e;
}

cudaError_t UndersizedDynamicShared() {
  float* out = Alloc<float>(kThreads);
  UndersizedDynamicSharedKernel<<<1, kThreads, kThreads * sizeof(float) - 4>>>(out);  // BUG: 4 bytes short
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t UninitializedSharedRead() {
  float* out = Alloc<float>(kThreads);
  UninitializedSharedReadKernel<<<1, kThreads>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t UseAfterFree() {
  float* in = Alloc<float>(kThreads);
  float* out = Alloc<float>(kThreads);
  cudaFree(in);  // BUG: freed before the kernel reads it
  UseAfterFreeKernel<<<1, kThreads>>>(in, out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t GraphReplayAfterFree() {
  float* in = Alloc<float>(kThreads);
  float* out = Alloc<float>(kThreads);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  GraphReplayAfterFreeKernel<<<1, kThreads, 0, s>>>(in, out);
  cudaStreamEndCapture(s, &graph);
  cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphLaunch(exec, s);  // fine
  cudaStreamSynchronize(s);
  cudaFree(in);  // BUG: the instantiated graph still reads it
  cudaGraphLaunch(exec, s);
  const cudaError_t e = cudaStreamSynchronize(s);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  cudaFree(out);
  return e;
}

cudaError_t BlocksRaceOnGlobal() {
  float* out = Alloc<float>(1);
  BlocksRaceOnGlobalKernel<<<4, 32>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t TwoThreadsWriteOneByte() {
  uint8_t* out = Alloc<uint8_t>(kThreads / 2);
  TwoThreadsWriteOneByteKernel<<<1, kThreads>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

cudaError_t WriteAfterManyReaders() {
  float* out = Alloc<float>(kThreads);
  WriteAfterManyReadersKernel<<<1, kThreads>>>(out);
  const cudaError_t e = cudaGetLastError();
  cudaFree(out);
  return e;
}

}  // namespace simt_bad
