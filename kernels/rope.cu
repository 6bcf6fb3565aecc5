// RoPE (HF rotate_half), in place. One block per token: the first threads compute the token's cos/sin table
// (half = head_dim / 2 entries; inv_freq from the caller's table, or in float32 like torch with the power
// evaluated in double and rounded once, i.e. the correctly rounded float32 power), then the block rotates the
// (head, pair) elements of all heads, kBatch pairs per thread at a time with every load of a batch issued before
// its stores (x is rotated in place, so the compiler cannot move a load above an earlier store; one pair at a
// time cost a memory latency per pair: about 9 us for 32 heads of 128 on an H200, under Nsight Compute). The
// first batch is loaded before the table is computed, so that its memory latency and the table's arithmetic
// overlap; with 256 threads of 8 pairs, one decode token's q and k of up to 2048 pairs (e.g. 32 heads of 128)
// are one batch.
#include "kernels/rope.h"

namespace odmoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 8;

__global__ void __launch_bounds__(kThreads)
    RopeKernel(float* x, const int32_t* __restrict__ positions, int64_t heads, int head_dim, float theta,
               const float* __restrict__ inv_freq_table) {
  extern __shared__ float table[];  // [half] cos, then [half] sin
  const int half = head_dim / 2;
  const int64_t t = blockIdx.x;
  float* xt = x + t * heads * head_dim;
  const int64_t pairs = heads * half;
  // One batch of this thread's pairs: element e of the token (e = head * half + column) at xt[at] and
  // xt[at + half].
  float x1[kBatch];
  float x2[kBatch];
  int64_t at[kBatch];  // offset of the pair's first element in xt
  int col[kBatch];     // its index in the head's first half
  auto load = [&](int64_t e0) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t e = e0 + j * kThreads;
      const int64_t h = e / half;
      col[j] = static_cast<int>(e - h * half);
      at[j] = h * head_dim + col[j];
      if (e < pairs) {
        x1[j] = xt[at[j]];
        x2[j] = xt[at[j] + half];
      }
    }
  };
  // The first batch is in flight while the table is computed.
  load(threadIdx.x);
  const float pos = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    float inv_freq;
    if (inv_freq_table != nullptr) {
      inv_freq = inv_freq_table[i];
    } else {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
      const float power = static_cast<float>(pow(static_cast<double>(theta), static_cast<double>(exponent)));
      inv_freq = 1.0f / power;
    }
    const float angle = __fmul_rn(pos, inv_freq);
    table[i] = cosf(angle);
    table[half + i] = sinf(angle);
  }
  __syncthreads();
  for (int64_t e0 = threadIdx.x; e0 < pairs; e0 += kThreads * kBatch) {
    if (e0 != threadIdx.x) load(e0);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (e0 + j * kThreads < pairs) {
        const float c = table[col[j]];
        const float s = table[half + col[j]];
        xt[at[j]] = x1[j] * c - x2[j] * s;
        xt[at[j] + half] = x2[j] * c + x1[j] * s;
      }
    }
  }
}

}  // namespace

cudaError_t LaunchRope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                       const float* inv_freq, cudaStream_t stream) {
  if (n <= 0 || heads <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > 8192 || n > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(head_dim) * sizeof(float);
  RopeKernel<<<static_cast<unsigned>(n), kThreads, smem, stream>>>(x, positions, heads, static_cast<int>(head_dim),
                                                                   static_cast<float>(theta), inv_freq);
  return cudaGetLastError();
}

}  // namespace odmoe::kernels
