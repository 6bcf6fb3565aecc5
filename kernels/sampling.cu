// Argmax and per-row token selection, one block of 1024 threads per row (the rule: kernels/sampling_rule.h).
//
// SelectTokensKernel, for a row that samples, passes over the row (each a strided loop with a block reduction):
// the max of z; for top-k a radix select on the order-preserving key of z (8 passes of 4 bits, counting) and a
// chunked scan that breaks ties at the threshold by id; the kept mass Z; for top-p the same radix select weighted by
// the masses of the top-k set, and its tie scan; finally a chunked inclusive scan of the masses of the kept set
// (less the tokens min-p drops) in id order that picks the token where it first exceeds the draw. Counts and masses
// are uint64 integers, so every sum is exact whatever the order of its additions: the pick is the CPU reference's
// (cpu::SelectTokens).
#include "kernels/sampling.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::BlockMax;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// (value, id) maximum with ties to the lower id, over the block, NaN skipped; every thread gets the id (0 when
// every value is NaN).
__device__ int64_t BlockArgmax(const float* __restrict__ l, int64_t vocab) {
  __shared__ float best_v[kWarps];
  __shared__ int64_t best_i[kWarps];
  float bv = -INFINITY;
  int64_t bi = vocab;  // none yet
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = l[i];
    if (v == v && (bi == vocab || v > bv)) {  // strided ascending ids: strict > keeps the lower id
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

// Order-preserving map of a float to uint32 (larger float, larger key); SampleZ has folded -0 into +0.
__device__ __forceinline__ uint32_t OrderKey(float z) {
  const uint32_t b = __float_as_uint(z);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct Row {
  const float* l;
  int64_t vocab;
  float temperature;
  float zmax;
  __device__ float Z(int64_t i) const { return SampleZ(l[i], temperature); }
  __device__ uint64_t Mass(float z) const { return SampleMass(z - zmax); }
};

// A kept set: all tokens, or those with key > tau plus those with key == tau and id <= cut.
struct Keep {
  bool all = true;
  uint32_t tau = 0;
  int64_t cut = 0;
  __device__ bool Has(uint32_t key, int64_t id) const { return all || key > tau || (key == tau && id <= cut); }
};

__device__ __forceinline__ uint64_t WarpSum(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, returned to every thread.
__device__ uint64_t BlockSum(uint64_t v) {
  __shared__ uint64_t partial[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // earlier users of `partial` are done
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return WarpSum(partial[lane]);
}

// Sums the 16 per-thread values over the block; out[16] (shared) gets the totals.
__device__ void BlockSum16(const uint64_t (&h)[16], uint64_t* out) {
  __shared__ uint64_t partial[16][kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int b = 0; b < 16; ++b) {
    const uint64_t v = WarpSum(h[b]);
    if (lane == 0) partial[b][warp] = v;
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    uint64_t s = 0;
    for (int w = 0; w < kWarps; ++w) s += partial[threadIdx.x][w];
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

// Exclusive prefix sum over the block in thread order; *total gets the sum.
__device__ uint64_t BlockExclusiveScan(uint64_t v, uint64_t* total) {
  __shared__ uint64_t warp_sums[kWarps];
  __shared__ uint64_t block_total;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  uint64_t inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t t = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += t;
  }
  __syncthreads();
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const uint64_t w = warp_sums[lane];
    uint64_t winc = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t t = __shfl_up_sync(0xffffffffu, winc, o);
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
  uint64_t above;  // weight of the members with key > tau
};

// The largest key tau such that the weight of the members of `in` with key >= tau reaches `target` (a bin with
// no weight is never chosen). Not found when all the members together weigh less. The sums are exact, so a bin
// chosen at one pass always holds the answer of the next.
__device__ Selection RadixSelect(const Row& row, Weight weight, const Keep& in, uint64_t target) {
  __shared__ uint64_t hist[16];
  uint32_t prefix = 0;
  uint32_t mask = 0;
  uint64_t above = 0;
  for (int shift = 28; shift >= 0; shift -= 4) {
    uint64_t h[16];
#pragma unroll
    for (int b = 0; b < 16; ++b) h[b] = 0;
    for (int64_t i = threadIdx.x; i < row.vocab; i += kThreads) {
      const float z = row.Z(i);
      const uint32_t key = OrderKey(z);
      if ((key & mask) != prefix || !in.Has(key, i)) continue;
      const uint64_t w = weight == Weight::kCount ? 1 : row.Mass(z);
      const uint32_t d = (key >> shift) & 15u;
#pragma unroll
      for (int b = 0; b < 16; ++b) h[b] += d == static_cast<uint32_t>(b) ? w : 0;
    }
    BlockSum16(h, hist);
    uint64_t cum = above;
    int digit = -1;
    for (int b = 15; b >= 0; --b) {
      if (hist[b] > 0 && cum + hist[b] >= target) {
        digit = b;
        break;
      }
      cum += hist[b];
    }
    if (digit < 0) return {false, 0, 0};  // first pass only: the members weigh less than the target
    above = cum;
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 15u << shift;
  }
  return {true, prefix, above};
}

// The smallest id such that the weight of the members of `in` with key == tau and id <= it reaches `need` (walking
// ids in order). Each thread whose chunk reaches `need` proposes the id where its walk does; the lowest proposal
// wins (the last id if there is none, which exact sums rule out).
__device__ int64_t TieCut(const Row& row, Weight weight, const Keep& in, uint32_t tau, uint64_t need) {
  __shared__ unsigned long long cut;
  const int64_t chunk = (row.vocab + kThreads - 1) / kThreads;
  const int64_t lo = min(row.vocab, threadIdx.x * chunk);
  const int64_t hi = min(row.vocab, lo + chunk);
  uint64_t local = 0;
  int64_t my_last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    const float z = row.Z(i);
    const uint32_t key = OrderKey(z);
    if (key == tau && in.Has(key, i)) {
      local += weight == Weight::kCount ? 1 : row.Mass(z);
      my_last = i;
    }
  }
  if (threadIdx.x == 0) cut = static_cast<unsigned long long>(row.vocab - 1);
  uint64_t total;
  const uint64_t excl = BlockExclusiveScan(local, &total);  // synchronizes after `cut` is set
  if (my_last >= 0 && need <= excl + local) {
    uint64_t run = excl;
    int64_t pick = my_last;
    for (int64_t i = lo; i < hi; ++i) {
      const float z = row.Z(i);
      const uint32_t key = OrderKey(z);
      if (key == tau && in.Has(key, i)) {
        run += weight == Weight::kCount ? 1 : row.Mass(z);
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

// The kept set of a cut by `weight` to `target` (steps 3 and 5 of the rule) within `in`: all of `in` when its
// members weigh less than the target.
__device__ Keep Cut(const Row& row, Weight weight, const Keep& in, uint64_t target) {
  const Selection s = RadixSelect(row, weight, in, target);
  Keep out;
  if (s.found) {
    out.all = false;
    out.tau = s.tau;
    out.cut = TieCut(row, weight, in, s.tau, target - s.above);
  }
  return out;
}

__global__ void __launch_bounds__(kThreads)
    SelectTokensKernel(const float* logits, int64_t vocab, const TokenChoice* __restrict__ choices, int32_t* out) {
  const int64_t r = blockIdx.x;
  const float* l = logits + r * vocab;
  const TokenChoice c = choices[r];
  if (IsGreedy(c)) {
    const int64_t id = BlockArgmax(l, vocab);
    if (threadIdx.x == 0) out[r] = static_cast<int32_t>(id);
    return;
  }
  Row row{l, vocab, c.temperature, 0.0f};
  float zmax = -INFINITY;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) zmax = fmaxf(zmax, row.Z(i));
  row.zmax = BlockMax(zmax);

  const Keep all;
  Keep top_k_set;
  if (c.top_k > 0 && c.top_k < vocab) top_k_set = Cut(row, Weight::kCount, all, static_cast<uint64_t>(c.top_k));
  Keep top_p_set;
  if (c.top_p < 1.0f) {
    uint64_t zk = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      const float z = row.Z(i);
      if (top_k_set.Has(OrderKey(z), i)) zk += row.Mass(z);
    }
    zk = BlockSum(zk);
    if (zk > 0) top_p_set = Cut(row, Weight::kMass, top_k_set, MulFraction(zk, Fraction24(c.top_p)));
  }

  // Inverse CDF over the kept tokens in id order: chunked, each thread's chunk a contiguous id range. Every
  // thread whose chunk ends above `need` proposes the token where its walk first exceeds it; the lowest proposal
  // wins, so the result does not depend on timing.
  __shared__ unsigned long long chosen;
  __shared__ unsigned long long last_kept;
  const int64_t chunk = (vocab + kThreads - 1) / kThreads;
  const int64_t lo = min(vocab, threadIdx.x * chunk);
  const int64_t hi = min(vocab, lo + chunk);
  const uint64_t least = MinPMass(c, row.zmax);  // step 5b
  // Whether token i is kept (steps 3, 5 and 5b), with its mass in *mass when it is.
  auto kept = [&](int64_t i, uint64_t* mass) {
    const float z = row.Z(i);
    const uint32_t key = OrderKey(z);
    if (!top_k_set.Has(key, i) || !top_p_set.Has(key, i)) return false;
    *mass = row.Mass(z);
    return *mass >= least;
  };
  uint64_t local = 0;
  int64_t my_last = -1;
  for (int64_t i = lo; i < hi; ++i) {
    uint64_t m = 0;
    if (kept(i, &m)) {
      local += m;
      my_last = i;
    }
  }
  if (threadIdx.x == 0) {
    chosen = ~0ull;
    last_kept = 0;
  }
  uint64_t total;
  const uint64_t excl = BlockExclusiveScan(local, &total);  // synchronizes after the initialisation above
  if (my_last >= 0) atomicMax(&last_kept, static_cast<unsigned long long>(my_last));
  const uint64_t need = MulFraction(total, Fraction24(c.uniform));
  if (my_last >= 0 && need < excl + local) {
    uint64_t run = excl;
    int64_t pick = my_last;
    for (int64_t i = lo; i < hi; ++i) {
      uint64_t m = 0;
      if (!kept(i, &m)) continue;
      run += m;
      if (run > need) {
        pick = i;
        break;
      }
    }
    atomicMin(&chosen, static_cast<unsigned long long>(pick));
  }
  __syncthreads();
  if (threadIdx.x == 0) out[r] = static_cast<int32_t>(chosen != ~0ull ? chosen : last_kept);
}

__global__ void __launch_bounds__(256) ChangeLogitsKernel(float* logits, const LogitChange* changes, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const LogitChange c = changes[i];
  logits[c.index] = ChangedLogit(logits[c.index], c.penalty, c.delta);
}

}  // namespace

cudaError_t LaunchArgmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out_ids, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > 0x7fffffff || rows > 0x7fffffff) return cudaErrorInvalidValue;
  ArgmaxKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, out_ids);
  return cudaGetLastError();
}

cudaError_t LaunchSelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices,
                               int32_t* out_ids, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > kSampleMaxVocab || rows > 0x7fffffff) return cudaErrorInvalidValue;
  SelectTokensKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, choices, out_ids);
  return cudaGetLastError();
}

cudaError_t LaunchChangeLogits(float* logits, const LogitChange* changes, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (n > 0x7fffffff) return cudaErrorInvalidValue;
  constexpr int64_t kBlock = 256;
  ChangeLogitsKernel<<<static_cast<unsigned>((n + kBlock - 1) / kBlock), kBlock, 0, stream>>>(logits, changes, n);
  return cudaGetLastError();
}

}  // namespace odmoe::kernels
