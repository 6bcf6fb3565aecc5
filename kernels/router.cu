// Router softmax + top-k. One warp per token (up to 4 tokens per block, fewer for many experts so that the
// probabilities fit in shared memory). The warp computes max and sum with shuffles, stores the probabilities in
// shared memory, then selects k times the largest remaining one (warp argmax, ties to the lower id) and marks it
// taken. Renormalisation divides by the sum of the chosen probabilities, summed best first.
#include "kernels/router.h"

#include <algorithm>

#include "kernels/common.cuh"

namespace odmoe::kernels {
namespace {

using internal::WarpMax;
using internal::WarpSum;

constexpr int64_t kMaxExperts = 8192;
constexpr size_t kSharedBudget = 32 * 1024;

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
    float best = -1.0f;  // probabilities are >= 0; taken ones are marked -1
    // best_id == num_experts: none seen yet
    int best_id = num_experts;
    for (int e = lane; e < num_experts; e += 32) {
      const float v = p[e];
      // The first untaken expert, then strictly larger ones: the lower id wins ties (and a NaN row still
      // yields k distinct ids in range).
      if (best_id == num_experts ? v != -1.0f : v > best) {
        best = v;
        best_id = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oid = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (best_id == num_experts ? oid < num_experts : (ov > best || (ov == best && oid < best_id))) {
        best = ov;
        best_id = oid;
      }
    }
    if (lane == 0) {
      row_ids[j] = best_id;
      row_w[j] = best;
      p[best_id] = -1.0f;
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
