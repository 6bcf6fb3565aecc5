// RoPE (HF rotate_half), in place. One block per token: the first threads compute the token's cos/sin table
// (half = head_dim / 2 entries; inv_freq from the caller's table, or in float32 like torch with the power
// evaluated in double and rounded once, i.e. the correctly rounded float32 power), then the block rotates the
// (head, pair) elements of all heads, kBatch pairs per thread at a time with every load of a batch issued before
// its stores (x is rotated in place, so the compiler cannot move a load above an earlier store; one pair at a
// time cost a memory latency per pair: about 9 us for 32 heads of 128 on an H200, under Nsight Compute). The
// first batch is loaded before the table is computed, so that its memory latency and the table's arithmetic
// overlap; with 256 threads of 8 pairs, one decode token's q and k of up to 2048 pairs (e.g. 32 heads of 128)
// are one batch.
//
// HeadNormRopeKernel<W> (Qwen3's per-head q / k norms, then RoPE): one 256-thread block per (token, head), a thread
// per element; the norm is RmsNormHeldKernel<W, 1>'s (kernels/norm_row.cuh's HeldRowNorm, into shared memory), the
// rotation RopeKernel's (CosSin, RotatePair), so one launch gives the bits of three.
#include "kernels/rope.h"

#include "kernels/common.cuh"
#include "kernels/norm_row.cuh"

namespace odmoe::kernels {
namespace {

using internal::HeldRowNorm;

constexpr int kThreads = internal::kNormThreads;  // HeadNormRopeKernel's blocks are the held norm's
constexpr int kBatch = 8;

// cos and sin of pair i's angle at position pos (rope.h): inv_freq from the caller's table, or in float32 like torch
// with the power evaluated in double and rounded once.
__device__ __forceinline__ void CosSin(float pos, int i, int head_dim, float theta, const float* inv_freq_table,
                                       float* cos_out, float* sin_out) {
  float inv_freq;
  if (inv_freq_table != nullptr) {
    inv_freq = inv_freq_table[i];
  } else {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float power = static_cast<float>(pow(static_cast<double>(theta), static_cast<double>(exponent)));
    inv_freq = 1.0f / power;
  }
  const float angle = __fmul_rn(pos, inv_freq);
  *cos_out = cosf(angle);
  *sin_out = sinf(angle);
}

// The rotation of one (x1, x2) pair: the one expression of both kernels.
__device__ __forceinline__ void RotatePair(float x1, float x2, float c, float s, float* y1, float* y2) {
  *y1 = x1 * c - x2 * s;
  *y2 = x2 * c + x1 * s;
}

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
    CosSin(pos, i, head_dim, theta, inv_freq_table, &table[i], &table[half + i]);
  }
  __syncthreads();
  for (int64_t e0 = threadIdx.x; e0 < pairs; e0 += kThreads * kBatch) {
    if (e0 != threadIdx.x) load(e0);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (e0 + j * kThreads < pairs) {
        const float c = table[col[j]];
        const float s = table[half + col[j]];
        RotatePair(x1[j], x2[j], c, s, &xt[at[j]], &xt[at[j] + half]);
      }
    }
  }
}

// Heads of up to kThreads elements: a thread per element, as RmsNormHeldKernel<W, 1> holds them.
constexpr int kMaxNormedHeadDim = kThreads;
static_assert(kMaxNormedHeadDim == kHeadNormRopeMaxHeadDim);

// Block b: token b / (heads + kv_heads), head b % (heads + kv_heads) of q, then of k.
template <typename W>
__global__ void __launch_bounds__(kThreads)
    HeadNormRopeKernel(float* q, float* k, const W* __restrict__ q_weight, const W* __restrict__ k_weight,
                       const int32_t* __restrict__ positions, int64_t heads, int64_t kv_heads, int head_dim, float eps,
                       float theta, const float* __restrict__ inv_freq_table) {
  __shared__ float normed[kMaxNormedHeadDim];
  __shared__ float table[kMaxNormedHeadDim];  // [half] cos, then [half] sin
  const int64_t t = blockIdx.x / (heads + kv_heads);
  const int64_t h = blockIdx.x % (heads + kv_heads);
  float* row = h < heads ? q + (t * heads + h) * head_dim : k + (t * kv_heads + (h - heads)) * head_dim;
  const W* weight = h < heads ? q_weight : k_weight;
  const int i = threadIdx.x;
  const int half = head_dim / 2;
  if (i < half) {
    CosSin(static_cast<float>(positions[t]), i, head_dim, theta, inv_freq_table, &table[i], &table[half + i]);
  }
  float y[1];
  HeldRowNorm<W, 1>(row, nullptr, nullptr, weight, head_dim, eps, normed, y);
  __syncthreads();  // the normed head and the table
  if (i < half) RotatePair(normed[i], normed[i + half], table[i], table[half + i], &row[i], &row[i + half]);
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

template <typename W>
cudaError_t LaunchHeadNormRope(float* q, float* k, const W* q_weight, const W* k_weight, const int32_t* positions,
                               int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, double theta,
                               const float* inv_freq, cudaStream_t stream) {
  if (heads < 0 || kv_heads < 0 || head_dim <= 0 || head_dim % 2 != 0 || head_dim > kMaxNormedHeadDim) {
    return cudaErrorInvalidValue;
  }
  if (n <= 0 || heads + kv_heads == 0) return cudaSuccess;
  if (n > 0x7fffffff / (heads + kv_heads)) return cudaErrorInvalidValue;
  HeadNormRopeKernel<W><<<static_cast<unsigned>(n * (heads + kv_heads)), kThreads, 0, stream>>>(
      q, k, q_weight, k_weight, positions, heads, kv_heads, static_cast<int>(head_dim), eps, static_cast<float>(theta),
      inv_freq);
  return cudaGetLastError();
}

#define ODMOE_INSTANTIATE(W)                                                                                       \
  template cudaError_t LaunchHeadNormRope<W>(float*, float*, const W*, const W*, const int32_t*, int64_t, int64_t, \
                                             int64_t, int64_t, float, double, const float*, cudaStream_t);
ODMOE_INSTANTIATE(float)
ODMOE_INSTANTIATE(__half)
ODMOE_INSTANTIATE(__nv_bfloat16)
#undef ODMOE_INSTANTIATE

}  // namespace odmoe::kernels
