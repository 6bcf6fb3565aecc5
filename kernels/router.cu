// Router softmax + top-k. One warp per token (up to 4 tokens per block, fewer for many experts so that the
// probabilities fit in shared memory). The warp computes max and sum with shuffles, stores the probabilities in
// shared memory, then selects k times the largest remaining one (warp argmax, ties to the lower id, NaN after
// every number, as the CPU reference) and marks it taken. Renormalisation divides by the sum of the chosen
// probabilities, summed best first (WarpTopK).
// AddRmsNormRouterKernel<W, kPerThread>: a sparse layer's post-attention norm, router GEMV and top-k for one token
// per block, each step the shared device function of the kernel it replaces (HeldRowNorm, RowDot, WarpTopK), so
// that one launch gives the three launches' bits.
#include <algorithm>
#include <type_traits>

#include "kernels/router.h"

#include "kernels/common.cuh"
#include "kernels/gemv_row.cuh"
#include "kernels/norm_row.cuh"

namespace odmoe::kernels {
namespace {

using internal::HeldRowNorm;
using internal::RowDot;
using internal::WarpMax;
using internal::WarpSum;

constexpr int64_t kMaxExperts = 8192;
constexpr size_t kSharedBudget = 32 * 1024;
constexpr float kTaken = -1.0f;  // marks a chosen expert's probability (probabilities are >= 0 or NaN)

// The order of selection, as the CPU reference's: larger probabilities first, NaN after every number.
__device__ __forceinline__ float SelectionKey(float probability) {
  return isnan(probability) ? -INFINITY : probability;
}

// Softmax and top-k of one token's logits lr[0, num_experts) by one warp: p (num_experts floats of scratch, shared
// memory) takes the probabilities; ids / weights get the k chosen. REQUIRES: all 32 lanes call it.
__device__ __forceinline__ void WarpTopK(const float* lr, float* p, int num_experts, int k, bool renormalize,
                                         int32_t* row_ids, float* row_w, int lane) {
  float mx = -INFINITY;
  for (int e = lane; e < num_experts; e += 32) mx = fmaxf(mx, lr[e]);
  mx = WarpMax(mx);
  float sum = 0.0f;
  for (int e = lane; e < num_experts; e += 32) {
    const float v = expf(lr[e] - mx);
    p[e] = v;
    sum += v;
  }
  sum = WarpSum(sum);
  for (int e = lane; e < num_experts; e += 32) p[e] = p[e] / sum;
  __syncwarp();

  float chosen_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    // Each lane's best untaken expert by (key, lower id), then the warp's: a total order, so every lane agrees.
    float best_key = -INFINITY;
    int best_id = num_experts;  // none seen yet
    for (int e = lane; e < num_experts; e += 32) {
      const float v = p[e];
      if (v == kTaken) continue;
      const float key = SelectionKey(v);
      if (best_id == num_experts || key > best_key) {  // strictly larger: the lower id wins ties
        best_key = key;
        best_id = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other_key = __shfl_xor_sync(0xffffffffu, best_key, o);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (other_id < num_experts &&
          (best_id == num_experts || other_key > best_key || (other_key == best_key && other_id < best_id))) {
        best_key = other_key;
        best_id = other_id;
      }
    }
    // Keys are probabilities (>= 0) except a NaN's -inf, so the key gives back the probability.
    const float best = best_key == -INFINITY ? NAN : best_key;
    if (lane == 0) {
      row_ids[j] = best_id;
      row_w[j] = best;
      p[best_id] = kTaken;
    }
    chosen_sum += best;
    __syncwarp();
  }
  if (renormalize) {
    for (int j = lane; j < k; j += 32) row_w[j] = row_w[j] / chosen_sum;
  }
}

__global__ void RouterTopKKernel(const float* __restrict__ logits, int64_t n, int num_experts, int k, bool renormalize,
                                 int32_t* __restrict__ ids, float* __restrict__ weights) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (row >= n) return;  // no block-wide synchronisation below
  WarpTopK(logits + row * num_experts, smem + static_cast<int64_t>(warp) * num_experts, num_experts, k, renormalize,
           ids + row * k, weights + row * k, lane);
}

// One block of the held norm's threads per token row: x += delta and h = RmsNorm(x) (HeldRowNorm, h also into
// shared memory), then warp e < num_experts computes logit e (RowDot from shared memory, as GemvKernel<W, 1, 1>
// computes that row for this token), and warp 0 the top k (WarpTopK).
template <typename W, int kPerThread>
__global__ void __launch_bounds__(internal::kNormThreads, 1)  // 1: without it ptxas spills the 8-element tier
    AddRmsNormRouterKernel(const float* delta, float* x, const W* __restrict__ norm_w, int64_t dim, float eps, float* h,
                           const W* __restrict__ router, int num_experts, int k, bool renormalize, bool vec,
                           float* __restrict__ logits, int32_t* __restrict__ ids, float* __restrict__ weights) {
  __shared__ __align__(16) float hs[internal::kNormThreads * kPerThread];
  __shared__ float ls[kAddRmsNormRouterMaxExperts];
  __shared__ float ps[kAddRmsNormRouterMaxExperts];
  const int64_t row = blockIdx.x;
  const int64_t at = row * dim;
  float y[kPerThread];
  HeldRowNorm<W, kPerThread>(x + at, delta + at, x + at, norm_w, dim, eps, h + at, y);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * internal::kNormThreads;
    if (i < dim) hs[i] = y[j];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (warp < num_experts) {
    const W* rows[1] = {router + warp * dim};
    float acc[1][1] = {{0.0f}};
    RowDot<W, 1, 1, /*kSharedX=*/true>(hs, rows, 1, dim, vec, lane, acc);
    const float logit = WarpSum(acc[0][0]) + 0.0f;  // GemvKernel's sum plus a zero bias (-0 becomes +0)
    if (lane == 0) {
      logits[row * num_experts + warp] = logit;
      ls[warp] = logit;
    }
  }
  __syncthreads();
  if (warp == 0) WarpTopK(ls, ps, num_experts, k, renormalize, ids + row * k, weights + row * k, lane);
}

// Launches AddRmsNormRouterKernel<W, kPerThread>, a block per row.
template <typename W, int kPerThread, typename... Args>
void LaunchAddRmsNormRouterTier(int64_t rows, cudaStream_t stream, Args... args) {
  AddRmsNormRouterKernel<W, kPerThread><<<static_cast<unsigned>(rows), internal::kNormThreads, 0, stream>>>(args...);
}

}  // namespace

cudaError_t LaunchRouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize,
                             int32_t* ids, float* weights, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (num_experts <= 0 || num_experts > kMaxExperts || k <= 0 || k > num_experts) return cudaErrorInvalidValue;
  const size_t per_warp = static_cast<size_t>(num_experts) * sizeof(float);
  const int warps = static_cast<int>(std::clamp<size_t>(kSharedBudget / per_warp, 1, 4));
  const int64_t blocks = (n + warps - 1) / warps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  RouterTopKKernel<<<static_cast<unsigned>(blocks), warps * 32, per_warp * warps, stream>>>(
      logits, n, static_cast<int>(num_experts), static_cast<int>(k), renormalize, ids, weights);
  return cudaGetLastError();
}

template <typename W>
cudaError_t LaunchAddRmsNormRouter(const float* delta, float* x, const W* norm_weight, int64_t rows, int64_t dim,
                                   float eps, float* h, const W* router, int64_t num_experts, int64_t k,
                                   bool renormalize, float* logits, int32_t* ids, float* weights, cudaStream_t stream) {
  if (dim <= 0 || dim > kAddRmsNormRouterMaxDim || num_experts <= 0 || num_experts > kAddRmsNormRouterMaxExperts ||
      k <= 0 || k > num_experts || rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (rows <= 0) return cudaSuccess;
  // As LaunchGemv decides its vector path for (h, router).
  const bool vec = dim % 8 == 0 && internal::Aligned16(h) && internal::Aligned16(router);
  const auto launch = [&](auto per_thread) {  // a std::integral_constant
    LaunchAddRmsNormRouterTier<W, decltype(per_thread)::value>(rows, stream, delta, x, norm_weight, dim, eps, h, router,
                                                               static_cast<int>(num_experts), static_cast<int>(k),
                                                               renormalize, vec, logits, ids, weights);
  };
  // LaunchAddRmsNorm's register tiers (the row's sum does not depend on them).
  if (dim <= internal::kNormThreads) {
    launch(std::integral_constant<int, 1>{});
  } else if (dim <= internal::kNormThreads * 8) {
    launch(std::integral_constant<int, 8>{});
  } else if (dim <= internal::kNormThreads * 16) {
    launch(std::integral_constant<int, 16>{});
  } else {
    static_assert(kAddRmsNormRouterMaxDim == internal::kNormThreads * 32);
    launch(std::integral_constant<int, 32>{});
  }
  return cudaGetLastError();
}

#define ODMOE_INSTANTIATE(W)                                                                                      \
  template cudaError_t LaunchAddRmsNormRouter<W>(const float*, float*, const W*, int64_t, int64_t, float, float*, \
                                                 const W*, int64_t, int64_t, bool, float*, int32_t*, float*,      \
                                                 cudaStream_t);
ODMOE_INSTANTIATE(float)
ODMOE_INSTANTIATE(__half)
ODMOE_INSTANTIATE(__nv_bfloat16)
#undef ODMOE_INSTANTIATE

}  // namespace odmoe::kernels
