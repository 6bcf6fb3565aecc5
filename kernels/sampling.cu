// Argmax and top-k / top-p sampling, one block of 1024 threads per row (see sampling.h for the definition).
//
// SampleKernel passes over the row (each a strided loop with a fixed-order block reduction, so results are
// deterministic): the max of z = l / T; for top-k a radix select on the order-preserving key of z (8 passes of
// 4 bits, counting) and a chunked scan that breaks ties at the threshold by id; the kept mass Z; for top-p the
// same radix select weighted by e = exp(z - max) over the top-k set, and its tie scan; finally a chunked
// inclusive scan of e over the kept set in id order that picks the token where it first exceeds u * total.
#include "kernels/sampling.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::BlockMax;
using internal::BlockSum;
using internal::WarpSum;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// (value, id) maximum with ties to the lower id, over the block; every thread gets the id.
__device__ int64_t BlockArgmax(const float* __restrict__ l, int64_t vocab) {
  __shared__ float best_v[kWarps];
  __shared__ int64_t best_i[kWarps];
  float bv = -INFINITY;
  int64_t bi = vocab;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = l[i];
    if (bi == vocab || v > bv) {  // strided ascending ids: strict > keeps the lower id
      bv = v;
      bi = i;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi) || (bi == vocab && oi < vocab)) {
      bv = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    best_v[warp] = bv;
    best_i[warp] = bi;
  }
  __syncthreads();
  bv = best_v[lane];
  bi = best_i[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi) || (bi == vocab && oi < vocab)) {
      bv = ov;
      bi = oi;
    }
  }
  return bi < vocab ? bi : 0;
}

__global__ void __launch_bounds__(kThreads) ArgmaxKernel(const float* logits, int64_t vocab, int32_t* out) {
  const int64_t id = BlockArgmax(logits + static_cast<int64_t>(blockIdx.x) * vocab, vocab);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(id);
}

// Order-preserving map of a float to uint32 (larger float, larger key); -0 is folded into +0 by the caller.
__device__ __forceinline__ uint32_t OrderKey(float z) {
  const uint32_t b = __float_as_uint(z);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct Row {
  const float* l;
  int64_t vocab;
  float temperature;
  float zmax;
  __device__ float Z(int64_t i) const {
    const float z = l[i] / temperature;
    return z == 0.0f ? 0.0f : z;
  }
  __device__ float E(float z) const { return expf(z - zmax); }
};

// A kept set: all tokens, or those with key > tau plus those with key == tau and id <= cut.
struct Keep {
  bool all = true;
  uint32_t tau = 0;
  int64_t cut = 0;
  __device__ bool Has(uint32_t key, int64_t id) const { return all || key > tau || (key == tau && id <= cut); }
};

// Sums the 16 per-thread values over the block in a fixed order; out[16] (shared) gets the totals.
__device__ void BlockSum16(const float (&h)[16], float* out) {
  __shared__ float partial[16][kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int b = 0; b < 16; ++b) {
    const float v = WarpSum(h[b]);
    if (lane == 0) partial[b][warp] = v;
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += partial[threadIdx.x][w];
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

// Exclusive prefix sum over the block in thread order (fixed order); *total gets the sum.
__device__ float BlockExclusiveScan(float v, float* total) {
  __shared__ float warp_sums[kWarps];
  __shared__ float block_total;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float t = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += t;
  }
  __syncthreads();
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    float w = warp_sums[lane];
    float winc = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float t = __shfl_up_sync(0xffffffffu, winc, o);
      if (lane >= o) winc += t;
    }
    warp_sums[lane] = winc - w;  // exclusive over warps
    if (lane == 31) block_total = winc;
  }
  __syncthreads();
  *total = block_total;
  return warp_sums[warp] + (inc - v);
}

enum class Weight { kCount, kMass };

struct Selection {
  bool found;
  uint32_t tau;
  float above;  // weight of the members with key > tau
};

// The largest key tau such that the weight of the members of `in` with key >= tau reaches `target`.
__device__ Selection RadixSelect(const Row& row, Weight weight, const Keep& in, float target) {
  __shared__ float hist[16];
  uint32_t prefix = 0;
  uint32_t mask = 0;
  float above = 0.0f;
  for (int shift = 28; shift >= 0; shift -= 4) {
    float h[16];
#pragma unroll
    for (int b = 0; b < 16; ++b) h[b] = 0.0f;
    for (int64_t i = threadIdx.x; i < row.vocab; i += kThreads) {
      const float z = row.Z(i);
      const uint32_t key = OrderKey(z);
      if ((key & mask) != prefix || !in.Has(key, i)) continue;
      const float w = weight == Weight::kCount ? 1.0f : row.E(z);
      const uint32_t d = (key >> shift) & 15u;
#pragma unroll
      for (int b = 0; b < 16; ++b) h[b] += d == static_cast<uint32_t>(b) ? w : 0.0f;
    }
    BlockSum16(h, hist);
    float cum = above;
    int digit = -1;
    for (int b = 15; b >= 0; --b) {
      if (hist[b] > 0.0f && cum + hist[b] >= target) {
        digit = b;
        break;
      }
      cum += hist[b];
    }
    if (digit < 0) {
      if (shift == 28) return {false, 0, 0.0f};  // the members weigh less than the target: keep them all
      // Rounding: the sub-bins summed short of their parent. Take the lowest non-empty one (keep everything).
      cum = above;
      for (int b = 15; b >= 0; --b) {
        if (hist[b] > 0.0f) digit = b;
      }
      for (int b = 15; b > digit; --b) cum += hist[b];
    }
    above = cum;
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 15u << shift;
  }
  return {true, prefix, above};
}

// The smallest id such that the weight of the members of `in` with key == tau and id <= it reaches `need`
// (walking ids in order). Each thread whose chunk reaches `need` proposes an id (its last tie if rounding
// leaves its walk short) and the lowest proposal wins; the last id if there is none.
__device__ int64_t TieCut(const Row& row, Weight weight, const Keep& in, uint32_t tau, float need) {
  __shared__ unsigned long long cut;
  const int64_t chunk = (row.vocab + kThreads - 1) / kThreads;
  const int64_t lo = min(row.vocab, threadIdx.x * chunk);
  const int64_t hi = min(row.vocab, lo + chunk);
  float local = 0.0f;
  int64_t my_last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    const float z = row.Z(i);
    const uint32_t key = OrderKey(z);
    if (key == tau && in.Has(key, i)) {
      local += weight == Weight::kCount ? 1.0f : row.E(z);
      my_last = i;
    }
  }
  if (threadIdx.x == 0) cut = static_cast<unsigned long long>(row.vocab - 1);
  float total;
  const float excl = BlockExclusiveScan(local, &total);  // synchronizes after `cut` is set
  if (my_last >= 0 && need <= excl + local) {
    float run = excl;
    int64_t pick = my_last;
    for (int64_t i = lo; i < hi; ++i) {
      const float z = row.Z(i);
      const uint32_t key = OrderKey(z);
      if (key == tau && in.Has(key, i)) {
        run += weight == Weight::kCount ? 1.0f : row.E(z);
        if (run >= need) {
          pick = i;
          break;
        }
      }
    }
    atomicMin(&cut, static_cast<unsigned long long>(pick));
  }
  __syncthreads();
  const int64_t result = static_cast<int64_t>(cut);
  __syncthreads();
  return result;
}

__global__ void __launch_bounds__(kThreads)
    SampleKernel(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p,
                 const float* __restrict__ uniforms, int32_t* out) {
  const int64_t r = blockIdx.x;
  const float* l = logits + r * vocab;
  if (temperature <= 0.0f || top_k == 1 || top_p <= 0.0f) {
    const int64_t id = BlockArgmax(l, vocab);
    if (threadIdx.x == 0) out[r] = static_cast<int32_t>(id);
    return;
  }
  Row row{l, vocab, temperature, 0.0f};
  float zmax = -INFINITY;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) zmax = fmaxf(zmax, row.Z(i));
  row.zmax = BlockMax(zmax);

  const Keep all;
  Keep top_k_set;
  if (top_k > 0 && top_k < vocab) {
    const Selection s = RadixSelect(row, Weight::kCount, all, static_cast<float>(top_k));
    if (s.found) {
      top_k_set.all = false;
      top_k_set.tau = s.tau;
      top_k_set.cut = TieCut(row, Weight::kCount, all, s.tau, static_cast<float>(top_k) - s.above);
    }
  }
  Keep top_p_set;
  if (top_p < 1.0f) {
    float zk = 0.0f;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      const float z = row.Z(i);
      if (top_k_set.Has(OrderKey(z), i)) zk += row.E(z);
    }
    const float target = top_p * BlockSum(zk);
    const Selection s = RadixSelect(row, Weight::kMass, top_k_set, target);
    if (s.found) {
      top_p_set.all = false;
      top_p_set.tau = s.tau;
      top_p_set.cut = TieCut(row, Weight::kMass, top_k_set, s.tau, target - s.above);
    }
  }

  // Inverse CDF over the kept tokens in id order: chunked, each thread's chunk a contiguous id range. Every
  // thread whose chunk ends above `need` proposes the token where its walk first exceeds it (its last kept
  // token if rounding leaves it short); the lowest proposal wins, so the result does not depend on timing.
  __shared__ unsigned long long chosen;
  __shared__ unsigned long long last_kept;
  const int64_t chunk = (vocab + kThreads - 1) / kThreads;
  const int64_t lo = min(vocab, threadIdx.x * chunk);
  const int64_t hi = min(vocab, lo + chunk);
  float local = 0.0f;
  int64_t my_last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    const float z = row.Z(i);
    const uint32_t key = OrderKey(z);
    if (top_k_set.Has(key, i) && top_p_set.Has(key, i)) {
      local += row.E(z);
      my_last = i;
    }
  }
  if (threadIdx.x == 0) {
    chosen = ~0ull;
    last_kept = 0;
  }
  float total;
  const float excl = BlockExclusiveScan(local, &total);  // synchronizes after the initialisation above
  if (my_last >= 0) atomicMax(&last_kept, static_cast<unsigned long long>(my_last));
  const float u = fminf(fmaxf(uniforms[r], 0.0f), 1.0f);
  const float need = u * total;
  if (my_last >= 0 && need < excl + local) {
    float run = excl;
    int64_t pick = my_last;
    for (int64_t i = lo; i < hi; ++i) {
      const float z = row.Z(i);
      const uint32_t key = OrderKey(z);
      if (top_k_set.Has(key, i) && top_p_set.Has(key, i)) {
        run += row.E(z);
        if (run > need) {
          pick = i;
          break;
        }
      }
    }
    atomicMin(&chosen, static_cast<unsigned long long>(pick));
  }
  __syncthreads();
  if (threadIdx.x == 0) out[r] = static_cast<int32_t>(chosen != ~0ull ? chosen : last_kept);
}

}  // namespace

cudaError_t LaunchArgmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out_ids, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > 0x7fffffff || rows > 0x7fffffff) return cudaErrorInvalidValue;
  ArgmaxKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, out_ids);
  return cudaGetLastError();
}

cudaError_t LaunchSample(const float* logits, int64_t rows, int64_t vocab, float temperature, int64_t top_k,
                         float top_p, const float* uniforms, int32_t* out_ids, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > (int64_t{1} << 24) || rows > 0x7fffffff) return cudaErrorInvalidValue;
  SampleKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, temperature, top_k, top_p, uniforms,
                                                                     out_ids);
  return cudaGetLastError();
}

}  // namespace odmoe::kernels
