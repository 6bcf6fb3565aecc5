// RoPE (HF rotate_half), in place. One block per token: the first threads compute the token's cos/sin table
// (half = head_dim / 2 entries; inv_freq from the caller's table, or in float32 like torch with the power
// evaluated in double and rounded once, i.e. the correctly rounded float32 power), then the block rotates the
// (head, pair) elements of all heads, kBatch pairs per thread at a time with every load of a batch issued before
// its stores (x is rotated in place, so the compiler cannot move a load above an earlier store; one pair at a
// time cost a memory latency per pair: about 9 us for 32 heads of 128 on an H200, under Nsight Compute). The
// first batch is loaded before the table is computed, so that its memory latency and the table's arithmetic
// overlap; with 256 threads of 8 pairs, one decode token's q and k of up to 2048 pairs (e.g. 32 heads of 128)
// are one batch. RopeKernel<KV> (LaunchRopeKvStore) also writes each rotated k pair, and the token's v row, into
// the KV caches as it goes: the bits LaunchKvStore stores from the rotated rows, without a launch of its own.
//
// HeadNormRopeKernel<W, KV> (Qwen3's per-head q / k norms, then RoPE): one 256-thread block per (token, head), a
// thread per element; the norm is RmsNormHeldKernel<W, 1>'s (kernels/norm_row.cuh's HeldRowNorm, into shared
// memory), the rotation RopeKernel's (CosSin, RotatePair), so one launch gives the bits of three; with KV, a block
// of a k head also stores that head of k and of v into the caches.
#include "kernels/rope.h"

#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/norm_row.cuh"

namespace odmoe::kernels {
namespace {

using internal::HeldRowNorm;
using internal::StoreAs;

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

// The rotation of one (x1, x2) pair: the one expression of both kernels, spelled with __fmul_rn / __fadd_rn so
// that nvcc cannot contract it into an FMA: which of the two products it fused depended on the kernel around it,
// and the fused kernel's bits then differed from RopeKernel's (seen on an H200; the emulator never contracts). Each
// product and sum rounded once is also what the CPU's cpu::Rope computes.
__device__ __forceinline__ void RotatePair(float x1, float x2, float c, float s, float* y1, float* y2) {
  *y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  *y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// Where a RoPE kernel also puts a token's K and V (KV = void: nowhere): k's rotated rows and v's rows ([n, kv_heads
// * head_dim]) into the caches' row positions[t], converted by StoreAs (LaunchKvStore's rule: a position outside
// [0, capacity) stores nothing).
template <typename KV>
struct KvDest {
  const float* v;
  KV* k_cache;
  KV* v_cache;
  int64_t capacity;
};

// Whether the kernel stores K and V at `position`.
template <typename KV>
__device__ __forceinline__ bool Stores(const KvDest<KV>& kv, int32_t position) {
  if constexpr (std::is_void<KV>::value) {
    return false;
  } else {
    return position >= 0 && position < kv.capacity;
  }
}

// Block t rotates token t's q heads (at q + t * heads * head_dim), then its k heads (at k + t * kv_heads * head_dim;
// none when kv_heads is 0), and stores them and v's row as `kv` says.
template <typename KV>
__global__ void __launch_bounds__(kThreads)
    RopeKernel(float* q, float* k, int64_t heads, int64_t kv_heads, const int32_t* __restrict__ positions, int head_dim,
               float theta, const float* __restrict__ inv_freq_table, KvDest<KV> kv) {
  constexpr bool kStore = !std::is_void<KV>::value;
  extern __shared__ float table[];  // [half] cos, then [half] sin
  const int half = head_dim / 2;
  const int64_t t = blockIdx.x;
  const int64_t q_elems = heads * head_dim;
  const int64_t kv_size = kv_heads * head_dim;
  float* qt = q + t * q_elems;
  float* kt = kv_heads > 0 ? k + t * kv_size : nullptr;
  const int64_t pairs = (heads + kv_heads) * half;
  // Element a of the token's [q's heads | k's heads].
  auto element = [&](int64_t a) { return a < q_elems ? qt + a : kt + (a - q_elems); };
  // One batch of this thread's pairs: pair e of the token (e = head * half + column) at element(at) and
  // element(at) + half.
  float x1[kBatch];
  float x2[kBatch];
  int64_t at[kBatch];  // the pair's first element
  int col[kBatch];     // its index in the head's first half
  auto load = [&](int64_t e0) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t e = e0 + j * kThreads;
      const int64_t h = e / half;
      col[j] = static_cast<int>(e - h * half);
      at[j] = h * head_dim + col[j];
      if (e < pairs) {
        const float* p = element(at[j]);
        x1[j] = p[0];
        x2[j] = p[half];
      }
    }
  };
  // A batch of the token's v row, for the V cache: elements i0, i0 + kThreads, ...
  float vb[kStore ? kBatch : 1];
  auto load_v = [&](int64_t i0) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = i0 + j * kThreads;
      if (i < kv_size) vb[j] = kv.v[t * kv_size + i];
    }
  };
  // The first batches are in flight while the table is computed.
  load(threadIdx.x);
  if constexpr (kStore) load_v(threadIdx.x);
  const int32_t position = positions[t];
  const float pos = static_cast<float>(position);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    CosSin(pos, i, head_dim, theta, inv_freq_table, &table[i], &table[half + i]);
  }
  __syncthreads();
  const bool store = Stores(kv, position);
  for (int64_t e0 = threadIdx.x; e0 < pairs; e0 += kThreads * kBatch) {
    if (e0 != threadIdx.x) load(e0);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (e0 + j * kThreads < pairs) {
        const float c = table[col[j]];
        const float s = table[half + col[j]];
        float y1, y2;
        RotatePair(x1[j], x2[j], c, s, &y1, &y2);
        float* p = element(at[j]);
        p[0] = y1;
        p[half] = y2;
        if constexpr (kStore) {
          if (store && at[j] >= q_elems) {
            KV* dst = kv.k_cache + position * kv_size + (at[j] - q_elems);
            StoreAs(y1, dst);
            StoreAs(y2, dst + half);
          }
        }
      }
    }
  }
  if constexpr (kStore) {
    if (!store) return;
    KV* vc = kv.v_cache + position * kv_size;
    for (int64_t i0 = threadIdx.x; i0 < kv_size; i0 += kThreads * kBatch) {
      if (i0 != threadIdx.x) load_v(i0);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t i = i0 + j * kThreads;
        if (i < kv_size) StoreAs(vb[j], vc + i);
      }
    }
  }
}

// Heads of up to kThreads elements: a thread per element, as RmsNormHeldKernel<W, 1> holds them.
constexpr int kMaxNormedHeadDim = kThreads;
static_assert(kMaxNormedHeadDim == kHeadNormRopeMaxHeadDim);

// Block b: token b / (heads + kv_heads), head b % (heads + kv_heads) of q, then of k; a block of k's head also
// stores it and v's head of that token as `kv` says.
template <typename W, typename KV>
__global__ void __launch_bounds__(kThreads)
    HeadNormRopeKernel(float* q, float* k, const W* __restrict__ q_weight, const W* __restrict__ k_weight,
                       const int32_t* __restrict__ positions, int64_t heads, int64_t kv_heads, int head_dim, float eps,
                       float theta, const float* __restrict__ inv_freq_table, KvDest<KV> kv) {
  __shared__ float normed[kMaxNormedHeadDim];
  __shared__ float table[kMaxNormedHeadDim];  // [half] cos, then [half] sin
  const int64_t t = blockIdx.x / (heads + kv_heads);
  const int64_t h = blockIdx.x % (heads + kv_heads);
  float* row = h < heads ? q + (t * heads + h) * head_dim : k + (t * kv_heads + (h - heads)) * head_dim;
  const W* weight = h < heads ? q_weight : k_weight;
  const int i = threadIdx.x;
  const int half = head_dim / 2;
  const int32_t position = positions[t];
  if (i < half) CosSin(static_cast<float>(position), i, head_dim, theta, inv_freq_table, &table[i], &table[half + i]);
  float y[1];
  HeldRowNorm<W, 1>(row, nullptr, nullptr, weight, head_dim, eps, normed, y);
  __syncthreads();  // the normed head and the table
  float y1 = 0.0f, y2 = 0.0f;
  if (i < half) {
    RotatePair(normed[i], normed[i + half], table[i], table[half + i], &y1, &y2);
    row[i] = y1;
    row[i + half] = y2;
  }
  if constexpr (!std::is_void<KV>::value) {
    if (h < heads || !Stores(kv, position)) return;
    const int64_t kv_size = kv_heads * head_dim;
    const int64_t at = position * kv_size + (h - heads) * head_dim;  // the head's first element in a cache
    if (i < half) {
      StoreAs(y1, kv.k_cache + at + i);
      StoreAs(y2, kv.k_cache + at + i + half);
    }
    if (i < head_dim) StoreAs(kv.v[t * kv_size + (h - heads) * head_dim + i], kv.v_cache + at + i);
  }
}

// The checks both KV-storing launchers make: cudaErrorInvalidValue for a missing pointer or a bad capacity.
template <typename KV>
cudaError_t CheckKvDest(float* k, const KvDest<KV>& kv, int64_t kv_heads) {
  if (kv.capacity < 0) return cudaErrorInvalidValue;
  if (kv_heads > 0 && (k == nullptr || kv.v == nullptr || kv.k_cache == nullptr || kv.v_cache == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// LaunchRope of q's heads and k's, storing K and V as `kv` says. REQUIRES: heads, kv_heads >= 0.
template <typename KV>
cudaError_t LaunchRopeInto(float* q, float* k, const int32_t* positions, int64_t n, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, double theta, const float* inv_freq, const KvDest<KV>& kv,
                           cudaStream_t stream) {
  if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > 8192 || n > 0x7fffffff) return cudaErrorInvalidValue;
  if (n <= 0 || heads + kv_heads == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(n);
  const size_t smem = static_cast<size_t>(head_dim) * sizeof(float);
  const int dim = static_cast<int>(head_dim);
  // Two launch sites, so that the emulator's counters tell the rotation alone from the one that stores.
  if constexpr (std::is_void<KV>::value) {
    RopeKernel<void><<<blocks, kThreads, smem, stream>>>(q, k, heads, kv_heads, positions, dim,
                                                         static_cast<float>(theta), inv_freq, kv);
  } else {
    RopeKernel<KV><<<blocks, kThreads, smem, stream>>>(q, k, heads, kv_heads, positions, dim, static_cast<float>(theta),
                                                       inv_freq, kv);
  }
  return cudaGetLastError();
}

// LaunchHeadNormRope, storing K and V as `kv` says.
template <typename W, typename KV>
cudaError_t LaunchHeadNormRopeInto(float* q, float* k, const W* q_weight, const W* k_weight, const int32_t* positions,
                                   int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps,
                                   double theta, const float* inv_freq, const KvDest<KV>& kv, cudaStream_t stream) {
  if (heads < 0 || kv_heads < 0 || head_dim <= 0 || head_dim % 2 != 0 || head_dim > kMaxNormedHeadDim) {
    return cudaErrorInvalidValue;
  }
  if (n <= 0 || heads + kv_heads == 0) return cudaSuccess;
  if (n > 0x7fffffff / (heads + kv_heads)) return cudaErrorInvalidValue;
  HeadNormRopeKernel<W, KV><<<static_cast<unsigned>(n * (heads + kv_heads)), kThreads, 0, stream>>>(
      q, k, q_weight, k_weight, positions, heads, kv_heads, static_cast<int>(head_dim), eps, static_cast<float>(theta),
      inv_freq, kv);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchRope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                       const float* inv_freq, cudaStream_t stream) {
  if (n <= 0 || heads <= 0) return cudaSuccess;
  return LaunchRopeInto(x, nullptr, positions, n, heads, 0, head_dim, theta, inv_freq, KvDest<void>{}, stream);
}

template <typename KV>
cudaError_t LaunchRopeKvStore(float* q, float* k, const float* v, const int32_t* positions, int64_t n, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, double theta, const float* inv_freq, KV* k_cache,
                              KV* v_cache, int64_t capacity, cudaStream_t stream) {
  const KvDest<KV> kv{v, k_cache, v_cache, capacity};
  if (n < 0 || heads < 0 || kv_heads < 0 || CheckKvDest(k, kv, kv_heads) != cudaSuccess) return cudaErrorInvalidValue;
  if (n > 0 && heads + kv_heads > 0 && (positions == nullptr || (heads > 0 && q == nullptr))) {
    return cudaErrorInvalidValue;
  }
  return LaunchRopeInto(q, k, positions, n, heads, kv_heads, head_dim, theta, inv_freq, kv, stream);
}

template <typename W>
cudaError_t LaunchHeadNormRope(float* q, float* k, const W* q_weight, const W* k_weight, const int32_t* positions,
                               int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, double theta,
                               const float* inv_freq, cudaStream_t stream) {
  return LaunchHeadNormRopeInto(q, k, q_weight, k_weight, positions, n, heads, kv_heads, head_dim, eps, theta, inv_freq,
                                KvDest<void>{}, stream);
}

template <typename W, typename KV>
cudaError_t LaunchHeadNormRopeKvStore(float* q, float* k, const float* v, const W* q_weight, const W* k_weight,
                                      const int32_t* positions, int64_t n, int64_t heads, int64_t kv_heads,
                                      int64_t head_dim, float eps, double theta, const float* inv_freq, KV* k_cache,
                                      KV* v_cache, int64_t capacity, cudaStream_t stream) {
  const KvDest<KV> kv{v, k_cache, v_cache, capacity};
  if (n < 0 || CheckKvDest(k, kv, kv_heads) != cudaSuccess) return cudaErrorInvalidValue;
  if (n > 0 && positions == nullptr) return cudaErrorInvalidValue;
  return LaunchHeadNormRopeInto(q, k, q_weight, k_weight, positions, n, heads, kv_heads, head_dim, eps, theta, inv_freq,
                                kv, stream);
}

#define ODMOE_INSTANTIATE_KV(W, KV)                                                                                \
  template cudaError_t LaunchHeadNormRopeKvStore<W, KV>(float*, float*, const float*, const W*, const W*,          \
                                                        const int32_t*, int64_t, int64_t, int64_t, int64_t, float, \
                                                        double, const float*, KV*, KV*, int64_t, cudaStream_t);
#define ODMOE_INSTANTIATE(W)                                                                                         \
  template cudaError_t LaunchHeadNormRope<W>(float*, float*, const W*, const W*, const int32_t*, int64_t, int64_t,   \
                                             int64_t, int64_t, float, double, const float*, cudaStream_t);           \
  template cudaError_t LaunchRopeKvStore<W>(float*, float*, const float*, const int32_t*, int64_t, int64_t, int64_t, \
                                            int64_t, double, const float*, W*, W*, int64_t, cudaStream_t);           \
  ODMOE_INSTANTIATE_KV(W, float)                                                                                     \
  ODMOE_INSTANTIATE_KV(W, __half)                                                                                    \
  ODMOE_INSTANTIATE_KV(W, __nv_bfloat16)
ODMOE_INSTANTIATE(float)
ODMOE_INSTANTIATE(__half)
ODMOE_INSTANTIATE(__nv_bfloat16)
#undef ODMOE_INSTANTIATE
#undef ODMOE_INSTANTIATE_KV

}  // namespace odmoe::kernels
