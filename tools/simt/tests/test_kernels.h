// Host launchers of the emulator's test kernels (test_kernels.cu). Pointers are device pointers (cudaMalloc);
// each launcher returns cudaGetLastError() after its launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace simt_test {

// out[i] = {__fmul_rn(a[i], b[i]), __fadd_rn(..), __fdiv_rn(..), bits of a[i] round-tripped, half and bf16
// round trips}: 6 floats per element.
cudaError_t Intrinsics(const float* a, const float* b, int n, float* out);
// out[block] = sum of in[block * threads .. + threads) with a shared-memory tree and __syncthreads.
cudaError_t BlockSum(const float* in, int threads, int blocks, float* out);
// Per lane of each warp: out_f = warp sum by __shfl_xor_sync (float), out_i = inclusive scan by __shfl_up_sync
// (int), out_l = lane 5's int64 value by __shfl_sync, out_w = xor-reduction of width 8 (int).
cudaError_t Shuffles(const float* f, const int* i, const int64_t* l, int threads, float* out_f, int* out_i,
                     int64_t* out_l, int* out_w);
// Each block stores its index in a static __shared__ array, syncs, and writes what every thread sees:
// out[block * threads + t] = the value read back (== block index when shared memory is per block).
cudaError_t SharedPerBlock(int threads, int blocks, int* out);
// Dynamic shared memory of `bytes` (over 48 KB needs cudaFuncSetAttribute, done here when `opt_in`):
// each thread fills its slice, syncs, and reads the neighbour's: out[t] = (t + 1) % threads.
cudaError_t DynamicShared(int threads, size_t bytes, bool opt_in, int* out);
// A 3-D grid of 3-D blocks: out[linear global thread] = x | y << 8 | z << 16 of blockIdx*blockDim+threadIdx.
cudaError_t Grid3d(dim3 grid, dim3 block, int* out);
// atomicMin/atomicMax of every thread's value on 64-bit shared variables: out = {min, max}.
cudaError_t AtomicMinMax(const unsigned long long* in, int threads, unsigned long long* out);
// Thread t writes byte t of out and of a shared array, syncs, and writes out[threads + t] = the shared byte of
// thread (t + 1) % threads; lanes 0-15 swap ints through shared memory after a half-warp __syncwarp:
// half_warp_out[l] = (l ^ 1) * 10. threads <= 256.
cudaError_t ByteNeighbours(int threads, uint8_t* out, int* half_warp_out);
// Lane 0 of warp 0 waits at __syncthreads while its warp waits in a full-mask __syncwarp: a deadlock.
cudaError_t Deadlock();
// Half the block reaches one __syncthreads, half another.
cudaError_t DivergentBarrier();
// On `stream`, blocks of `threads`: y[i] = a * x[i] for i < n (for stream capture: a by value).
cudaError_t Scale(const float* x, float a, int n, float* y, cudaStream_t stream, int threads = 64);
// On `stream`: y[i] += x[i] for i < n.
cudaError_t AddInto(const float* x, int n, float* y, cudaStream_t stream);
// One block of `threads`; thread t loads x[(k * threads + t) * stride] for k < loads with __ldg: `loads` requests per
// warp. out[t] = the sum of its loads' components.
cudaError_t StridedLoads(const float4* x, int stride, int threads, int loads, float* out);

}  // namespace simt_test
