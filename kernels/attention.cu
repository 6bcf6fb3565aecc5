// Causal GQA attention, fp32 arithmetic, online softmax, over a KV cache stored as KV (float, __half or
// __nv_bfloat16: each value read as fp32).
//
// AttentionDecodeGqaKernel<KV, kGroup>: grid (kv_heads * head_blocks, splits, n), 128 threads. A block serves
//   the block_heads (<= kGroup <= 8) query heads of one kv head that it owns, for one query token and one slice
//   of the sequence, so each K/V element is read once per token (not once per query head). Needs 16-byte
//   aligned K/V and head_dim % Vec16<KV>::kElems == 0. The key row is cut into 16-byte chunks; thread
//   (row r, chunk c) loads chunk c of keys r, r + rows, ... of a tile (kLoads K and kLoads V chunks per thread,
//   all issued before any is used: many keys in flight per warp). K and V go raw into shared memory (rows padded
//   by one chunk, conflict-free). Then one thread per (key, head slot) computes whole dot products from shared
//   memory (no per-key reduction), one warp per head updates the running max / sum over the tile, and each
//   thread accumulates p * V for its chunk of its keys, for every head. The per-row partial sums are added
//   through shared memory at the end. Tiles hold rows * kLoads keys (32 for bf16, head_dim 128).
// AttentionDecodeScalarKernel: grid (heads, n, splits), 128 threads: the fallback for unaligned K/V or a head_dim
//   the chunks do not divide. The block walks its slice in tiles of 64 keys: each warp computes the scores of
//   every 4th key of the tile (lanes split head_dim, a warp sum), then the block updates its running max / sum
//   and each thread its 1-2 output dimensions (coalesced V reads).
// Both decode kernels split the sequence the same way (DecodeSplits: a function of n, past, heads and the
//   workspace only, so a sequence's result does not depend on what else is in the batch). One split writes `out`
//   directly; several write (max, sum, acc[head_dim]) per (token, query head, split) to the workspace and
//   AttentionCombineKernel merges them ("flash decoding"). The decode kernels and the combine kernel compute the
//   split geometry themselves, on the device, from past: a kernel parameter (LaunchAttentionDecode) or an int32 in
//   device memory read when they run (LaunchAttentionDecodeAt: the grid is sized for the most splits any past up
//   to max_past has, and blocks beyond the actual splits exit at once). Same kernels, same rule, same bits.
// AttentionKvStoreKernel: grid (kv_size chunks, rows, 2: K then V), 256 threads: fp32 rows of K and of V
//   converted into their caches' rows, whose positions it reads from device memory.
// AttentionPrefillKernel: grid (heads, ceil(n / 16)), 128 threads, dynamic shared memory. The 16 queries of the
//   block sit in shared memory; K (padded rows, conflict-free) and V tiles of 32 keys are staged there. Each warp
//   owns 4 queries; lane j scores key j of the tile, the warp updates max / sum with shuffles, and every lane
//   accumulates the output dimensions lane, lane + 32, ... for its warp's queries.
#include "kernels/attention.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::AllowDynamicShared;
using internal::CeilDiv;
using internal::StoreAs;
using internal::ToFloat;
using internal::Vec16;
using internal::WarpMax;
using internal::WarpSum;

constexpr int kDecThreads = 128;
constexpr int kDecWarps = kDecThreads / 32;
constexpr int kDecTile = 64;
constexpr int kDecDimsPerThread = kMaxHeadDim / kDecThreads;
// Sequence splits (both decode kernels): slices of a multiple of kSplitGranule keys, at least kMinKeysPerSplit,
// at most kMaxSplits, and about kTargetHeadSplits (token, query head, split) triples in all: with 4 query heads
// per kv head that is 512 blocks of the GQA kernel, about 4 per SM of an H100/H200.
constexpr int64_t kMaxSplits = 64;
constexpr int64_t kMinKeysPerSplit = 32;
constexpr int64_t kSplitGranule = 32;
constexpr int64_t kTargetHeadSplits = 2048;

__host__ __device__ inline int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ inline int64_t DivUp(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most splits for n tokens of `heads` query heads, whatever past: kMaxSplits, about kTargetHeadSplits
// (token, query head, split) triples, and `cap` (the splits the workspace holds). Not a function of past, so the
// host computes it once and the kernels take it as a parameter.
__host__ __device__ inline int64_t SplitLimit(int64_t n, int64_t heads, int64_t cap) {
  return Min64(Min64(kMaxSplits, Max64(1, kTargetHeadSplits / (heads * n))), cap);
}

// The splits the decode kernels aim at for a context of past + n keys under `limit` (SplitLimit): one per
// kMinKeysPerSplit keys, at most limit; 1 or less means no split. Non-decreasing in past.
__host__ __device__ inline int64_t TargetSplits(int64_t n, int64_t past, int64_t limit) {
  return Min64(DivUp(past + n, kMinKeysPerSplit), limit);
}

// How the decode kernels cut past + n keys: `splits` slices of keys_per_split keys (a multiple of kSplitGranule)
// each, the last one shorter. splits <= TargetSplits (rounding keys_per_split up to the granule can only remove
// splits), but is not monotonic in past: the grid of LaunchAttentionDecodeAt is sized by TargetSplits.
struct SplitGeometry {
  int64_t keys_per_split;
  int splits;
};

__host__ __device__ inline SplitGeometry DecodeSplits(int64_t n, int64_t past, int64_t limit) {
  const int64_t max_len = past + n;
  const int64_t target = TargetSplits(n, past, limit);
  if (target <= 1) return {max_len, 1};
  const int64_t keys_per_split = DivUp(DivUp(max_len, target), kSplitGranule) * kSplitGranule;
  const int64_t splits = DivUp(max_len, keys_per_split);
  return {splits == 1 ? max_len : keys_per_split, static_cast<int>(splits)};
}

constexpr int kGqaThreads = 128;
constexpr int kGqaMaxTile = 128;  // keys per tile at most
constexpr int kGqaMaxGroup = 8;   // query heads per block at most
// K and V chunks a thread loads per tile: 2 * 4 * 16 bytes in flight per thread, 16 KB per block (half with 8
// heads per block). More would not fit beside the accumulators (kGroup * 8 registers) in 128 registers.
template <int kGroup>
struct GqaLoads {
  static constexpr int kValue = kGroup >= 8 ? 2 : 4;
};

template <typename KV>
struct AttentionArgs {
  const float* q;
  const KV* k;
  const KV* v;
  float* out;
  float* partial;  // [n, heads, splits, head_dim + 2] when splits > 1
  int64_t n;
  int64_t past;  // with past_at: its upper bound, max_past
  // Decode kernels only: when not null, past is *past_at (clamped to [0, past]), read when the kernel runs.
  const int32_t* past_at;
  int64_t heads;
  int64_t kv_heads;
  int head_dim;
  float scale;
  int64_t split_limit;  // decode kernels only: SplitLimit
  // GQA decode kernel only: query heads per kv head, blocks per kv head, query heads per block (the last block
  // of a kv head may have fewer).
  int group;
  int head_blocks;
  int block_heads;
};

// The past a decode kernel works with: the parameter, or *past_at clamped to [0, max_past] (a value out of range
// gives some output, never an access outside the max_past + n rows of the caches).
template <typename KV>
__device__ __forceinline__ int64_t DecodePast(const AttentionArgs<KV>& a) {
  if (a.past_at == nullptr) return a.past;
  return Min64(Max64(*a.past_at, 0), a.past);
}

template <typename KV>
__global__ void __launch_bounds__(kDecThreads) AttentionDecodeScalarKernel(AttentionArgs<KV> a) {
  __shared__ float qs[kMaxHeadDim];
  __shared__ float scores[kDecTile];
  __shared__ float probs[kDecTile];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t h = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int split = blockIdx.z;
  const int64_t past = DecodePast(a);
  const SplitGeometry geo = DecodeSplits(a.n, past, a.split_limit);
  if (split >= geo.splits) return;  // the grid covers a longer past (LaunchAttentionDecodeAt)
  const int dim = a.head_dim;
  const int64_t kvh = h / (a.heads / a.kv_heads);
  const int64_t len = past + t + 1;
  const int64_t begin = split * geo.keys_per_split;
  const int64_t end = min(len, begin + geo.keys_per_split);
  const int64_t row_stride = a.kv_heads * dim;
  const float* qrow = a.q + (t * a.heads + h) * dim;
  for (int d = tid; d < dim; d += kDecThreads) qs[d] = qrow[d];
  __syncthreads();

  const KV* kbase = a.k + kvh * dim;
  const KV* vbase = a.v + kvh * dim;
  float m = -INFINITY;
  float l = 0.0f;
  float acc[kDecDimsPerThread] = {};
  for (int64_t tile0 = begin; tile0 < end; tile0 += kDecTile) {
    const int cnt = static_cast<int>(min(static_cast<int64_t>(kDecTile), end - tile0));
    for (int j = warp; j < cnt; j += kDecWarps) {
      const KV* kr = kbase + (tile0 + j) * row_stride;
      float dot = 0.0f;
      for (int d = lane; d < dim; d += 32) dot += qs[d] * ToFloat(kr[d]);
      dot = WarpSum(dot);
      if (lane == 0) scores[j] = dot * a.scale;
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int j = 0; j < cnt; ++j) tile_max = fmaxf(tile_max, scores[j]);
    const float m_new = fmaxf(m, tile_max);
    const float corr = expf(m - m_new);
    if (tid < cnt) probs[tid] = expf(scores[tid] - m_new);
    __syncthreads();
    float psum = 0.0f;
    for (int j = 0; j < cnt; ++j) psum += probs[j];
    l = l * corr + psum;
#pragma unroll
    for (int c = 0; c < kDecDimsPerThread; ++c) {
      const int d = tid + c * kDecThreads;
      if (d < dim) {
        float o = acc[c] * corr;
        const KV* vcol = vbase + tile0 * row_stride + d;
#pragma unroll 4
        for (int j = 0; j < cnt; ++j) o += probs[j] * ToFloat(vcol[j * row_stride]);
        acc[c] = o;
      }
    }
    m = m_new;
    __syncthreads();  // scores / probs are rewritten by the next tile
  }

  if (geo.splits == 1) {
    float* orow = a.out + (t * a.heads + h) * dim;
#pragma unroll
    for (int c = 0; c < kDecDimsPerThread; ++c) {
      const int d = tid + c * kDecThreads;
      if (d < dim) orow[d] = acc[c] / l;
    }
  } else {
    float* part = a.partial + ((t * a.heads + h) * geo.splits + split) * (dim + 2);
    if (tid == 0) {
      part[0] = m;
      part[1] = l;
    }
#pragma unroll
    for (int c = 0; c < kDecDimsPerThread; ++c) {
      const int d = tid + c * kDecThreads;
      if (d < dim) part[2 + d] = acc[c];
    }
  }
}

template <typename KV, int kGroup>
__global__ void __launch_bounds__(kGqaThreads, 4) AttentionDecodeGqaKernel(AttentionArgs<KV> a) {
  constexpr int kE = Vec16<KV>::kElems;  // elements per 16-byte chunk
  constexpr int kLoads = GqaLoads<kGroup>::kValue;
  constexpr int kWarps = kGqaThreads / 32;
  // K and V tiles: [tile][chunks + 1] raw chunks; tile * chunks <= rows * kLoads * chunks <= kLoads * kGqaThreads.
  // ks is reused at the end for the per-row sums: [rows][dim] floats, rows * dim <= kGqaThreads * kE.
  __shared__ uint4 ks[(kLoads + 1) * kGqaThreads];
  __shared__ uint4 vs[(kLoads + 1) * kGqaThreads];
  __shared__ __align__(16) float qs[kGroup * kMaxHeadDim];  // [block_heads, dim]
  __shared__ float ps[kGroup * kGqaMaxTile];                // [block_heads, tile]: scores, then probabilities
  __shared__ float run_max[kGroup];
  __shared__ float run_sum[kGroup];
  __shared__ float run_corr[kGroup];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int dim = a.head_dim;
  const int chunks = dim / kE;
  const int pitch = chunks + 1;
  const int rows = kGqaThreads / chunks;  // keys a load instruction of the block covers
  const int tile = min(rows * kLoads, kGqaMaxTile);
  const int c = tid % chunks;
  const int r = tid / chunks;            // r >= rows: no chunk (when chunks does not divide the block)
  const int slots = kGqaThreads / tile;  // threads per key in the score phase, each for every slots-th head
  const int sj = tid % tile;
  const int slot = tid / tile;

  const int64_t kvh = blockIdx.x / a.head_blocks;
  const int g0 = static_cast<int>(blockIdx.x % a.head_blocks) * a.block_heads;
  const int gb = min(a.block_heads, a.group - g0);
  const int64_t h0 = kvh * a.group + g0;
  const int split = blockIdx.y;
  const int64_t t = blockIdx.z;
  const int64_t past = DecodePast(a);
  const SplitGeometry geo = DecodeSplits(a.n, past, a.split_limit);
  if (split >= geo.splits) return;  // the grid covers a longer past (LaunchAttentionDecodeAt)
  const int64_t len = past + t + 1;
  const int64_t begin = split * geo.keys_per_split;
  const int64_t end = min(len, begin + geo.keys_per_split);
  const int64_t row_stride = a.kv_heads * dim;

  const float* qrow = a.q + (t * a.heads + h0) * dim;  // the block's heads are consecutive
  for (int i = tid; i < gb * dim; i += kGqaThreads) qs[i] = qrow[i];
  if (tid < kGroup) {
    run_max[tid] = -INFINITY;
    run_sum[tid] = 0.0f;
  }

  // Chunk c of key `begin + r`; consecutive loads of a thread are rows * row_stride apart.
  const int64_t first = (begin + r) * row_stride + kvh * dim + c * kE;
  const uint4* kp = reinterpret_cast<const uint4*>(a.k + first);
  const uint4* vp = reinterpret_cast<const uint4*>(a.v + first);
  const int64_t step = rows * row_stride / kE;  // in chunks
  float acc[kGroup][kE] = {};
  for (int64_t tile0 = begin; tile0 < end; tile0 += tile) {
    const int cnt = static_cast<int>(min(static_cast<int64_t>(tile), end - tile0));
    // Issue every load of the tile before storing any: 2 * kLoads 16-byte loads in flight per thread.
    uint4 kraw[kLoads];
    uint4 vraw[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      if (r < rows && r + i * rows < cnt) {
        kraw[i] = __ldg(kp + i * step);
        vraw[i] = __ldg(vp + i * step);
      }
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int j = r + i * rows;
      if (r < rows && j < cnt) {
        ks[j * pitch + c] = kraw[i];
        vs[j * pitch + c] = vraw[i];
      }
    }
    kp += kLoads * step;
    vp += kLoads * step;
    __syncthreads();  // K/V tiles and (first time) qs / run_* written; ps of the previous tile no longer read

    // Scores: thread (key sj, slot) takes heads slot, slot + slots, ...
    if (slot < slots && sj < cnt) {
      float dots[kGroup] = {};
      const uint4* krow = ks + sj * pitch;
#pragma unroll 1
      for (int ch = 0; ch < chunks; ++ch) {
        float kf[kE];
        Vec16<KV>::Unpack(krow[ch], kf);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          const int g = slot + k * slots;
          if (g < gb) {
            const float4* qv = reinterpret_cast<const float4*>(qs + g * dim + ch * kE);
#pragma unroll
            for (int v = 0; v < kE / 4; ++v) {
              const float4 q4 = qv[v];
              dots[k] += q4.x * kf[4 * v] + q4.y * kf[4 * v + 1] + q4.z * kf[4 * v + 2] + q4.w * kf[4 * v + 3];
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const int g = slot + k * slots;
        if (g < gb) ps[g * kGqaMaxTile + sj] = dots[k] * a.scale;
      }
    }
    __syncthreads();

    // Online softmax: warp w updates heads w, w + kWarps, ...
    for (int g = warp; g < gb; g += kWarps) {
      float* pg = ps + g * kGqaMaxTile;
      float mx = -INFINITY;
      for (int j = lane; j < cnt; j += 32) mx = fmaxf(mx, pg[j]);
      const float m_old = run_max[g];
      const float m_new = fmaxf(m_old, WarpMax(mx));  // finite: cnt >= 1
      float sum = 0.0f;
      for (int j = lane; j < cnt; j += 32) {
        const float p = expf(pg[j] - m_new);
        pg[j] = p;
        sum += p;
      }
      sum = WarpSum(sum);  // also orders every lane's read of run_max before lane 0 rewrites it
      if (lane == 0) {
        const float corr = expf(m_old - m_new);
        run_corr[g] = corr;
        run_sum[g] = run_sum[g] * corr + sum;
        run_max[g] = m_new;
      }
    }
    __syncthreads();

    // acc[g] = acc[g] * corr[g] + sum over the thread's keys of p[g][key] * V[key][chunk].
    if (r < rows) {
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (g < gb) {
          const float corr = run_corr[g];
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[g][e] *= corr;
        }
      }
#pragma unroll 1
      for (int i = 0; i < kLoads; ++i) {
        const int j = r + i * rows;
        if (j < cnt) {
          float vf[kE];
          Vec16<KV>::Unpack(vs[j * pitch + c], vf);
#pragma unroll
          for (int g = 0; g < kGroup; ++g) {
            if (g < gb) {
              const float p = ps[g * kGqaMaxTile + j];
#pragma unroll
              for (int e = 0; e < kE; ++e) acc[g][e] += p * vf[e];
            }
          }
        }
      }
    }
    // The next tile's K stores follow the barrier after this tile's scores; its V stores replace chunks only this
    // thread reads; its scores follow its first barrier.
  }

  // Sum the rows' partial accumulators head by head through shared memory (ks is no longer read: the last
  // tile's scores came before two barriers) and write the result or the split's partial.
  float* red = reinterpret_cast<float*>(ks);  // [rows][dim]
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (g >= gb) break;  // uniform over the block
    if (r < rows) {
#pragma unroll
      for (int e = 0; e < kE; ++e) red[r * dim + c * kE + e] = acc[g][e];
    }
    __syncthreads();
    const int64_t h = h0 + g;
    if (geo.splits == 1) {
      const float l = run_sum[g];
      float* orow = a.out + (t * a.heads + h) * dim;
      for (int d = tid; d < dim; d += kGqaThreads) {
        float o = 0.0f;
        for (int rr = 0; rr < rows; ++rr) o += red[rr * dim + d];
        orow[d] = o / l;
      }
    } else {
      float* part = a.partial + ((t * a.heads + h) * geo.splits + split) * (dim + 2);
      if (tid == 0) {
        part[0] = run_max[g];
        part[1] = run_sum[g];
      }
      for (int d = tid; d < dim; d += kGqaThreads) {
        float o = 0.0f;
        for (int rr = 0; rr < rows; ++rr) o += red[rr * dim + d];
        part[2 + d] = o;
      }
    }
    __syncthreads();  // red is rewritten for the next head
  }
}

// grid (heads, n), 128 threads: merges the splits of one (token, head). Split 0 is never empty, so the maximum
// is finite; an empty split (a token before the last, whose keys end before the split) has max -inf, weight 0.
// Nothing to do when the past it reads has one split (the decode kernel wrote `out`).
template <typename KV>
__global__ void __launch_bounds__(kDecThreads) AttentionCombineKernel(AttentionArgs<KV> a) {
  __shared__ float weight[kMaxSplits];
  const int splits = DecodeSplits(a.n, DecodePast(a), a.split_limit).splits;
  if (splits == 1) return;
  const int64_t h = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int dim = a.head_dim;
  const int stride = dim + 2;
  const float* part = a.partial + (t * a.heads + h) * splits * stride;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, part[s * stride]);
  const int tid = threadIdx.x;
  if (tid < splits) weight[tid] = expf(part[tid * stride] - m);
  __syncthreads();
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) l += part[s * stride + 1] * weight[s];
  float* orow = a.out + (t * a.heads + h) * dim;
  for (int d = tid; d < dim; d += kDecThreads) {
    float o = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) o += part[s * stride + 2 + d] * weight[s];
    orow[d] = o / l;
  }
}

// Group g of four floats as four KV: elements 4g .. 4g + 3 of `cache`, in one 16-byte (float) or 8-byte store.
// (Indexing the vector type from the kernel's pointer lets the compiler see the alignment: one store, not four.)
__device__ __forceinline__ void StoreKv4(float4 v, float* cache, int64_t g) { reinterpret_cast<float4*>(cache)[g] = v; }
__device__ __forceinline__ uint32_t KvBits(__half h) { return __half_as_ushort(h); }
__device__ __forceinline__ uint32_t KvBits(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }
template <typename KV>
__device__ __forceinline__ void StoreKv4(float4 v, KV* cache, int64_t g) {
  KV e[4];
  StoreAs(v.x, &e[0]);
  StoreAs(v.y, &e[1]);
  StoreAs(v.z, &e[2]);
  StoreAs(v.w, &e[3]);
  reinterpret_cast<uint2*>(cache)[g] =
      make_uint2(KvBits(e[0]) | KvBits(e[1]) << 16, KvBits(e[2]) | KvBits(e[3]) << 16);  // element 0 lowest
}

constexpr int kStoreThreads = 256;

// grid (ceil(kv_size / (256 * kVec)), min(n, 65535), 2), 256 threads: thread x of a block converts the x-th
// group of kVec elements of rows blockIdx.y, blockIdx.y + gridDim.y, ... of K (blockIdx.z 0) or V (1). kVec 4:
// rows 16-byte aligned, caches aligned to 4 KV, kv_size % 4 == 0 (one 16-byte load and one 4-element store per
// row).
template <typename KV, int kVec>
__global__ void __launch_bounds__(kStoreThreads)
    AttentionKvStoreKernel(const float* k_rows, const float* v_rows, const int32_t* positions, int64_t n,
                           int64_t kv_size, KV* k_cache, KV* v_cache, int64_t capacity) {
  const int64_t groups = kv_size / kVec;
  const int64_t x = static_cast<int64_t>(blockIdx.x) * kStoreThreads + threadIdx.x;
  if (x >= groups) return;
  const float* rows = blockIdx.z == 0 ? k_rows : v_rows;
  KV* cache = blockIdx.z == 0 ? k_cache : v_cache;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    const int64_t pos = positions[i];
    if (pos < 0 || pos >= capacity) continue;
    if constexpr (kVec == 1) {
      StoreAs(rows[i * kv_size + x], cache + pos * kv_size + x);
    } else {
      StoreKv4(reinterpret_cast<const float4*>(rows)[i * groups + x], cache, pos * groups + x);
    }
  }
}

constexpr int kPreThreads = 128;
constexpr int kPreQueries = 16;
constexpr int kPreKeys = 32;
constexpr int kQueriesPerWarp = kPreQueries / (kPreThreads / 32);
constexpr int kMaxDimsPerLane = kMaxHeadDim / 32;

size_t PrefillSharedBytes(int dim) {
  return sizeof(float) * (static_cast<size_t>(kPreQueries) * dim + static_cast<size_t>(kPreKeys) * (dim + 1) +
                          static_cast<size_t>(kPreKeys) * dim);
}

template <typename KV>
__global__ void __launch_bounds__(kPreThreads) AttentionPrefillKernel(AttentionArgs<KV> a) {
  extern __shared__ float smem[];
  const int dim = a.head_dim;
  float* qs = smem;                       // [16][dim]
  float* ks = qs + kPreQueries * dim;     // [32][dim + 1]
  float* vs = ks + kPreKeys * (dim + 1);  // [32][dim]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t h = blockIdx.x;
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kPreQueries;
  const int64_t kvh = h / (a.heads / a.kv_heads);
  const int64_t row_stride = a.kv_heads * dim;

  for (int idx = tid; idx < kPreQueries * dim; idx += kPreThreads) {
    const int qi = idx / dim;
    const int d = idx - qi * dim;
    const int64_t t = q0 + qi;
    qs[idx] = t < a.n ? a.q[(t * a.heads + h) * dim + d] : 0.0f;
  }
  const int64_t q_last = min(q0 + kPreQueries, a.n) - 1;
  const int64_t kv_end = a.past + q_last + 1;

  float m[kQueriesPerWarp];
  float l[kQueriesPerWarp];
  float acc[kQueriesPerWarp][kMaxDimsPerLane];
#pragma unroll
  for (int r = 0; r < kQueriesPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c) acc[r][c] = 0.0f;
  }

  for (int64_t kt = 0; kt < kv_end; kt += kPreKeys) {
    __syncthreads();  // the previous tile is no longer read (and, the first time, qs is written)
    for (int idx = tid; idx < kPreKeys * dim; idx += kPreThreads) {
      const int j = idx / dim;
      const int d = idx - j * dim;
      const int64_t key = kt + j;
      float kv = 0.0f;
      float vv = 0.0f;
      if (key < kv_end) {
        const int64_t off = key * row_stride + kvh * dim + d;
        kv = ToFloat(a.k[off]);
        vv = ToFloat(a.v[off]);
      }
      ks[j * (dim + 1) + d] = kv;
      vs[j * dim + d] = vv;
    }
    __syncthreads();
    const int64_t key = kt + lane;
#pragma unroll
    for (int r = 0; r < kQueriesPerWarp; ++r) {
      const int qi = warp * kQueriesPerWarp + r;
      const int64_t t = q0 + qi;
      if (t >= a.n || kt > a.past + t) continue;  // warp-uniform: no key of this tile is visible to query t
      const bool valid = key <= a.past + t;
      float sc = -INFINITY;
      if (valid) {
        const float* qv = qs + qi * dim;
        const float* kv = ks + lane * (dim + 1);
        float dot = 0.0f;
        for (int d = 0; d < dim; ++d) dot += qv[d] * kv[d];
        sc = dot * a.scale;
      }
      const float m_new = fmaxf(m[r], WarpMax(sc));  // finite: key kt is visible
      const float corr = expf(m[r] - m_new);
      const float p = valid ? expf(sc - m_new) : 0.0f;
      l[r] = l[r] * corr + WarpSum(p);
      const int jmax = static_cast<int>(min(static_cast<int64_t>(kPreKeys), a.past + t - kt + 1));
#pragma unroll
      for (int c = 0; c < kMaxDimsPerLane; ++c) acc[r][c] *= corr;
      for (int j = 0; j < jmax; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        const float* vrow = vs + j * dim + lane;
#pragma unroll
        for (int c = 0; c < kMaxDimsPerLane; ++c) {
          if (c * 32 + lane < dim) acc[r][c] += pj * vrow[c * 32];
        }
      }
      m[r] = m_new;
    }
  }

#pragma unroll
  for (int r = 0; r < kQueriesPerWarp; ++r) {
    const int64_t t = q0 + warp * kQueriesPerWarp + r;
    if (t >= a.n) continue;
    float* orow = a.out + (t * a.heads + h) * dim;
    const float inv = 1.0f / l[r];
#pragma unroll
    for (int c = 0; c < kMaxDimsPerLane; ++c) {
      const int d = c * 32 + lane;
      if (d < dim) orow[d] = acc[r][c] * inv;
    }
  }
}

bool ValidShapes(int64_t n, int64_t past, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return n > 0 && past >= 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 &&
         head_dim <= kMaxHeadDim && heads <= 0x7fffffff && n <= 0xffff * int64_t{kPreQueries};
}

// Arguments without sequence splits.
template <typename KV>
AttentionArgs<KV> MakeArgs(const float* q, const KV* k, const KV* v, int64_t n, int64_t past, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, float scale, float* out) {
  AttentionArgs<KV> a{};
  a.q = q;
  a.k = k;
  a.v = v;
  a.out = out;
  a.partial = nullptr;
  a.n = n;
  a.past = past;
  a.past_at = nullptr;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = static_cast<int>(head_dim);
  a.scale = scale;
  a.split_limit = 1;
  return a;
}

// The number of sequence splits the decode kernels prefer (see kTargetHeadSplits): what they aim at with a
// workspace large enough. A function of n, past and heads only: never of the batch, the dtype or the alignment.
// Non-decreasing in past.
int64_t PreferredSplits(int64_t n, int64_t past, int64_t heads) {
  return std::max<int64_t>(1, TargetSplits(n, past, SplitLimit(n, heads, kMaxSplits)));
}

// Whether AttentionDecodeGqaKernel can read these K/V: 16-byte chunks of whole rows.
template <typename KV>
bool GqaReadable(const KV* k, const KV* v, int64_t head_dim) {
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return head_dim % Vec16<KV>::kElems == 0 && aligned(k) && aligned(v);
}

template <typename KV, int kGroup>
void LaunchGqa(const AttentionArgs<KV>& a, int64_t splits, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.kv_heads * a.head_blocks), static_cast<unsigned>(splits),
                  static_cast<unsigned>(a.n));
  AttentionDecodeGqaKernel<KV, kGroup><<<grid, kGqaThreads, 0, stream>>>(a);
}

// Both decode launchers. past_at null: past is the past; otherwise past is max_past and the kernels read *past_at.
template <typename KV>
cudaError_t LaunchDecode(const float* q, const KV* k_cache, const KV* v_cache, int64_t n, int64_t past,
                         const int32_t* past_at, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                         float* out, float* workspace, size_t workspace_floats, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!ValidShapes(n, past, heads, kv_heads, head_dim) || n > 0xffff) return cudaErrorInvalidValue;
  const int64_t per_split = n * heads * (head_dim + 2);
  const int64_t cap = workspace == nullptr ? 0 : static_cast<int64_t>(workspace_floats) / per_split;
  AttentionArgs<KV> a = MakeArgs(q, k_cache, v_cache, n, past, heads, kv_heads, head_dim, scale, out);
  a.partial = workspace;
  a.past_at = past_at;
  a.split_limit = SplitLimit(n, heads, cap);
  // The kernels compute the geometry themselves; the grid has its splits (by value) or the most any past up to
  // max_past has (TargetSplits is non-decreasing in past, the actual splits at most TargetSplits).
  const int64_t splits = past_at == nullptr ? DecodeSplits(n, past, a.split_limit).splits
                                            : std::max<int64_t>(1, TargetSplits(n, past, a.split_limit));
  if (GqaReadable(k_cache, v_cache, head_dim)) {
    a.group = static_cast<int>(heads / kv_heads);
    a.head_blocks = static_cast<int>(CeilDiv(a.group, kGqaMaxGroup));
    a.block_heads = static_cast<int>(CeilDiv(a.group, a.head_blocks));
    if (a.block_heads <= 1) {
      LaunchGqa<KV, 1>(a, splits, stream);
    } else if (a.block_heads <= 2) {
      LaunchGqa<KV, 2>(a, splits, stream);
    } else if (a.block_heads <= 4) {
      LaunchGqa<KV, 4>(a, splits, stream);
    } else {
      LaunchGqa<KV, kGqaMaxGroup>(a, splits, stream);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(n), static_cast<unsigned>(splits));
    AttentionDecodeScalarKernel<KV><<<grid, kDecThreads, 0, stream>>>(a);
  }
  if (splits > 1) {
    AttentionCombineKernel<KV>
        <<<dim3(static_cast<unsigned>(heads), static_cast<unsigned>(n)), kDecThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

size_t AttentionDecodeWorkspaceFloats(int64_t n, int64_t past, int64_t heads, int64_t head_dim) {
  if (n <= 0 || heads <= 0) return 0;
  const int64_t splits = PreferredSplits(n, past, heads);
  if (splits <= 1) return 0;
  return static_cast<size_t>(n * heads * splits * (head_dim + 2));
}

size_t AttentionDecodeAtWorkspaceFloats(int64_t n, int64_t max_past, int64_t heads, int64_t head_dim) {
  return AttentionDecodeWorkspaceFloats(n, max_past, heads, head_dim);  // PreferredSplits grows with past
}

template <typename KV>
cudaError_t LaunchAttentionDecode(const float* q, const KV* k_cache, const KV* v_cache, int64_t n, int64_t past,
                                  int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out,
                                  float* workspace, size_t workspace_floats, cudaStream_t stream) {
  return LaunchDecode(q, k_cache, v_cache, n, past, nullptr, heads, kv_heads, head_dim, scale, out, workspace,
                      workspace_floats, stream);
}

template <typename KV>
cudaError_t LaunchAttentionDecodeAt(const float* q, const KV* k_cache, const KV* v_cache, int64_t n,
                                    const int32_t* past, int64_t max_past, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, float scale, float* out, float* workspace,
                                    size_t workspace_floats, cudaStream_t stream) {
  if (n != 0 && past == nullptr) return cudaErrorInvalidValue;
  return LaunchDecode(q, k_cache, v_cache, n, max_past, past, heads, kv_heads, head_dim, scale, out, workspace,
                      workspace_floats, stream);
}

template <typename KV>
cudaError_t LaunchAttentionPrefill(const float* q, const KV* k_cache, const KV* v_cache, int64_t n, int64_t past,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!ValidShapes(n, past, heads, kv_heads, head_dim)) return cudaErrorInvalidValue;
  const size_t smem = PrefillSharedBytes(static_cast<int>(head_dim));
  if (const cudaError_t err = AllowDynamicShared(AttentionPrefillKernel<KV>, smem); err != cudaSuccess) return err;
  const AttentionArgs<KV> a = MakeArgs(q, k_cache, v_cache, n, past, heads, kv_heads, head_dim, scale, out);
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(CeilDiv(n, kPreQueries)));
  AttentionPrefillKernel<KV><<<grid, kPreThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename KV>
cudaError_t LaunchKvStore(const float* k_rows, const float* v_rows, const int32_t* positions, int64_t n,
                          int64_t kv_size, KV* k_cache, KV* v_cache, int64_t capacity, cudaStream_t stream) {
  if (n < 0 || kv_size < 0 || capacity < 0) return cudaErrorInvalidValue;
  if (n == 0 || kv_size == 0) return cudaSuccess;
  if (k_rows == nullptr || v_rows == nullptr || positions == nullptr || k_cache == nullptr || v_cache == nullptr) {
    return cudaErrorInvalidValue;
  }
  const auto aligned = [](const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; };
  const bool vec = kv_size % 4 == 0 && aligned(k_rows, 16) && aligned(v_rows, 16) && aligned(k_cache, 4 * sizeof(KV)) &&
                   aligned(v_cache, 4 * sizeof(KV));
  const int64_t per_block = kStoreThreads * (vec ? 4 : 1);
  const int64_t blocks = CeilDiv(kv_size, per_block);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(std::min<int64_t>(n, 0xffff)), 2);
  if (vec) {
    AttentionKvStoreKernel<KV, 4>
        <<<grid, kStoreThreads, 0, stream>>>(k_rows, v_rows, positions, n, kv_size, k_cache, v_cache, capacity);
  } else {
    AttentionKvStoreKernel<KV, 1>
        <<<grid, kStoreThreads, 0, stream>>>(k_rows, v_rows, positions, n, kv_size, k_cache, v_cache, capacity);
  }
  return cudaGetLastError();
}

#define ODMOE_INSTANTIATE_KV(KV)                                                                                      \
  template cudaError_t LaunchAttentionDecode<KV>(const float*, const KV*, const KV*, int64_t, int64_t, int64_t,       \
                                                 int64_t, int64_t, float, float*, float*, size_t, cudaStream_t);      \
  template cudaError_t LaunchAttentionPrefill<KV>(const float*, const KV*, const KV*, int64_t, int64_t, int64_t,      \
                                                  int64_t, int64_t, float, float*, cudaStream_t);                     \
  template cudaError_t LaunchAttentionDecodeAt<KV>(const float*, const KV*, const KV*, int64_t, const int32_t*,       \
                                                   int64_t, int64_t, int64_t, int64_t, float, float*, float*, size_t, \
                                                   cudaStream_t);                                                     \
  template cudaError_t LaunchKvStore<KV>(const float*, const float*, const int32_t*, int64_t, int64_t, KV*, KV*,      \
                                         int64_t, cudaStream_t);
ODMOE_INSTANTIATE_KV(float)
ODMOE_INSTANTIATE_KV(__half)
ODMOE_INSTANTIATE_KV(__nv_bfloat16)
#undef ODMOE_INSTANTIATE_KV

}  // namespace odmoe::kernels
