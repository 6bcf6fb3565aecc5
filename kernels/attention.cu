// Causal GQA attention, fp32 arithmetic, online softmax, over a KV cache stored as KV (float, __half or
// __nv_bfloat16: each value read as fp32).
//
// AttentionDecodeKernel: grid (heads, n, splits), 128 threads. The block walks keys [split * keys_per_split,
//   min(past + t + 1, (split + 1) * keys_per_split)) in tiles of 64: each warp computes the scores of every
//   4th key of the tile (lanes split head_dim, a warp sum), then the block updates its running max / sum and
//   each thread its 1-2 output dimensions (coalesced V reads). One split writes `out` directly; several write
//   (max, sum, acc[head_dim]) per split to the workspace and AttentionCombineKernel merges them.
// AttentionPrefillKernel: grid (heads, ceil(n / 16)), 128 threads, dynamic shared memory. The 16 queries of the
//   block sit in shared memory; K (padded rows, conflict-free) and V tiles of 32 keys are staged there. Each warp
//   owns 4 queries; lane j scores key j of the tile, the warp updates max / sum with shuffles, and every lane
//   accumulates the output dimensions lane, lane + 32, ... for its warp's queries.
#include "kernels/attention.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::CeilDiv;
using internal::ToFloat;
using internal::WarpMax;
using internal::WarpSum;

constexpr int kDecThreads = 128;
constexpr int kDecWarps = kDecThreads / 32;
constexpr int kDecTile = 64;
constexpr int kDecDimsPerThread = kMaxHeadDim / kDecThreads;
constexpr int64_t kMaxSplits = 64;
constexpr int64_t kMinKeysPerSplit = 256;
constexpr int64_t kTargetBlocks = 512;

template <typename KV>
struct AttentionArgs {
  const float* q;
  const KV* k;
  const KV* v;
  float* out;
  float* partial;  // [n, heads, splits, head_dim + 2] when splits > 1
  int64_t n;
  int64_t past;
  int64_t heads;
  int64_t kv_heads;
  int head_dim;
  float scale;
  int64_t keys_per_split;
  int splits;
};

template <typename KV>
__global__ void __launch_bounds__(kDecThreads) AttentionDecodeKernel(AttentionArgs<KV> a) {
  __shared__ float qs[kMaxHeadDim];
  __shared__ float scores[kDecTile];
  __shared__ float probs[kDecTile];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t h = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int split = blockIdx.z;
  const int dim = a.head_dim;
  const int64_t kvh = h / (a.heads / a.kv_heads);
  const int64_t len = a.past + t + 1;
  const int64_t begin = split * a.keys_per_split;
  const int64_t end = min(len, begin + a.keys_per_split);
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

  if (a.splits == 1) {
    float* orow = a.out + (t * a.heads + h) * dim;
#pragma unroll
    for (int c = 0; c < kDecDimsPerThread; ++c) {
      const int d = tid + c * kDecThreads;
      if (d < dim) orow[d] = acc[c] / l;
    }
  } else {
    float* part = a.partial + ((t * a.heads + h) * a.splits + split) * (dim + 2);
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

// grid (heads, n), 128 threads: merges the splits of one (token, head).
template <typename KV>
__global__ void __launch_bounds__(kDecThreads) AttentionCombineKernel(AttentionArgs<KV> a) {
  const int64_t h = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int dim = a.head_dim;
  const int stride = dim + 2;
  const float* part = a.partial + (t * a.heads + h) * a.splits * stride;
  float m = -INFINITY;
  for (int s = 0; s < a.splits; ++s) m = fmaxf(m, part[s * stride]);
  float l = 0.0f;
  for (int s = 0; s < a.splits; ++s) l += part[s * stride + 1] * expf(part[s * stride] - m);
  float* orow = a.out + (t * a.heads + h) * dim;
  for (int d = threadIdx.x; d < dim; d += kDecThreads) {
    float o = 0.0f;
    for (int s = 0; s < a.splits; ++s) o += part[s * stride + 2 + d] * expf(part[s * stride] - m);
    orow[d] = o / l;
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
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = static_cast<int>(head_dim);
  a.scale = scale;
  a.keys_per_split = past + n;
  a.splits = 1;
  return a;
}

// The number of sequence splits the decode kernel prefers: about kTargetBlocks blocks in all, slices of at
// least kMinKeysPerSplit keys, at most kMaxSplits.
int64_t PreferredSplits(int64_t n, int64_t past, int64_t heads) {
  const int64_t max_len = past + n;
  int64_t splits = std::min(CeilDiv(max_len, kMinKeysPerSplit), kMaxSplits);
  splits = std::min(splits, std::max<int64_t>(1, CeilDiv(kTargetBlocks, heads * n)));
  return std::max<int64_t>(1, splits);
}

}  // namespace

size_t AttentionDecodeWorkspaceFloats(int64_t n, int64_t past, int64_t heads, int64_t head_dim) {
  if (n <= 0 || heads <= 0) return 0;
  const int64_t splits = PreferredSplits(n, past, heads);
  if (splits <= 1) return 0;
  return static_cast<size_t>(n * heads * splits * (head_dim + 2));
}

template <typename KV>
cudaError_t LaunchAttentionDecode(const float* q, const KV* k_cache, const KV* v_cache, int64_t n, int64_t past,
                                  int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out,
                                  float* workspace, size_t workspace_floats, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!ValidShapes(n, past, heads, kv_heads, head_dim) || n > 0xffff) return cudaErrorInvalidValue;
  int64_t splits = PreferredSplits(n, past, heads);
  const int64_t per_split = n * heads * (head_dim + 2);
  if (workspace == nullptr) workspace_floats = 0;
  splits = std::min<int64_t>(splits, static_cast<int64_t>(workspace_floats) / per_split);
  const int64_t max_len = past + n;
  int64_t keys_per_split = max_len;
  if (splits > 1) {
    keys_per_split = CeilDiv(CeilDiv(max_len, splits), kDecTile) * kDecTile;
    splits = CeilDiv(max_len, keys_per_split);
  }
  splits = std::max<int64_t>(splits, 1);
  if (splits == 1) keys_per_split = max_len;
  AttentionArgs<KV> a = MakeArgs(q, k_cache, v_cache, n, past, heads, kv_heads, head_dim, scale, out);
  a.partial = workspace;
  a.keys_per_split = keys_per_split;
  a.splits = static_cast<int>(splits);
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(n), static_cast<unsigned>(splits));
  AttentionDecodeKernel<KV><<<grid, kDecThreads, 0, stream>>>(a);
  if (splits > 1) {
    AttentionCombineKernel<KV>
        <<<dim3(static_cast<unsigned>(heads), static_cast<unsigned>(n)), kDecThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename KV>
cudaError_t LaunchAttentionPrefill(const float* q, const KV* k_cache, const KV* v_cache, int64_t n, int64_t past,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!ValidShapes(n, past, heads, kv_heads, head_dim)) return cudaErrorInvalidValue;
  const size_t smem = PrefillSharedBytes(static_cast<int>(head_dim));
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(AttentionPrefillKernel<KV>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const AttentionArgs<KV> a = MakeArgs(q, k_cache, v_cache, n, past, heads, kv_heads, head_dim, scale, out);
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(CeilDiv(n, kPreQueries)));
  AttentionPrefillKernel<KV><<<grid, kPreThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

#define ODMOE_INSTANTIATE_KV(KV)                                                                                 \
  template cudaError_t LaunchAttentionDecode<KV>(const float*, const KV*, const KV*, int64_t, int64_t, int64_t,  \
                                                 int64_t, int64_t, float, float*, float*, size_t, cudaStream_t); \
  template cudaError_t LaunchAttentionPrefill<KV>(const float*, const KV*, const KV*, int64_t, int64_t, int64_t, \
                                                  int64_t, int64_t, float, float*, cudaStream_t);
ODMOE_INSTANTIATE_KV(float)
ODMOE_INSTANTIATE_KV(__half)
ODMOE_INSTANTIATE_KV(__nv_bfloat16)
#undef ODMOE_INSTANTIATE_KV

}  // namespace odmoe::kernels
