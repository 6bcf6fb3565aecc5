// Router softmax + top-k. One warp per token (up to 4 tokens per block, fewer for many experts so that the
// probabilities fit in shared memory). The warp computes max and sum with shuffles, stores the probabilities in
// shared memory, then selects k times the largest remaining one (warp argmax, ties to the lower id, NaN after
// every number, as the CPU reference) and marks it taken. Renormalisation divides by the sum of the chosen
// probabilities, summed best first.
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/router.h"

namespace odmoe::kernels {
namespace {

using internal::WarpMax;
using internal::WarpSum;

constexpr int64_t kMaxExperts = 8192;
constexpr size_t kSharedBudget = 32 * 1024;
constexpr float kTaken = -1.0f;  // marks a chosen expert's probability (probabilities are >= 0 or NaN)

// The order of selection, as the CPU reference's: larger probabilities first, NaN after every number.
__device__ __forceinline__ float SelectionKey(float probability) {
  return isnan(probability) ? -INFINITY : probability;
}

__global__ void RouterTopKKernel(const float* __restrict__ logits, int64_t n, int num_experts, int k, bool renormalize,
                                 int32_t* __restrict__ ids, float* __restrict__ weights) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (row >= n) return;  // no block-wide synchronisation below
  float* p = smem + static_cast<int64_t>(warp) * num_experts;
  const float* lr = logits + row * num_experts;
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

  int32_t* row_ids = ids + row * k;
  float* row_w = weights + row * k;
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

}  // namespace odmoe::kernels
