// Grouped routed experts (moe_grouped.h), 256 threads (8 warps) per block for the GEMVs:
//  - GroupedGateUpKernel: grid (ceil(inter / 8), n * k); warp w of block (b, s) computes intermediate row
//    8b + w of slot s's expert: the gate row and the up row in one RowDot (both rows' weights in flight per lane
//    and step, x loaded once for both), then silu(gate) * up. The expert id is read from ids[s].
//  - GroupedDownKernel: grid (ceil(hidden / 16), n * k); GemvKernel<W, 1>'s layout (two rows per warp) over
//    slot s's expert and activations act[s].
//  - CombineExpertsKernel: grid (ceil(hidden / 128), n); one thread per column of token i, walking i's k slots
//    in ascending expert id (a selection over k ids: no sort, no local memory).
// The dot products go through RowDot (gemv_row.cuh) with the GEMV's choice of the vector or the scalar path and
// its `sum + bias` with a bias of 0, so each value is bitwise what LaunchGemv gives for that expert alone.
#include "kernels/moe_grouped.h"

#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/gemv_row.cuh"

namespace odmoe::kernels {
namespace {

using internal::CeilDiv;
using internal::GemvVectorized;
using internal::RowDot;
using internal::WarpSum;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kDownRowsPerWarp = 2;  // GemvKernel<W, 1, 2>'s (a layout choice: the order of additions is RowDot's)
constexpr int kCombineThreads = 128;

// A warp's dot product as GemvKernel stores it: the butterfly sum plus the bias, here none (0.0f, which also
// turns a -0 sum into +0 as the GEMV does).
__device__ __forceinline__ float GemvResult(float partial) { return WarpSum(partial) + 0.0f; }

template <typename W>
__global__ void __launch_bounds__(kThreads)
    GroupedGateUpKernel(const float* __restrict__ x, const ExpertPointers* __restrict__ experts,
                        const int32_t* __restrict__ ids, int k, int64_t hidden, int64_t inter,
                        float* __restrict__ act) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= inter) return;  // the same for the whole warp
  const int64_t s = blockIdx.y;
  const ExpertPointers e = experts[ids[s]];
  const W* gate = static_cast<const W*>(e.gate) + row * hidden;
  const W* up = static_cast<const W*>(e.up) + row * hidden;
  const float* xt = x + (s / k) * hidden;
  // The GEMV decides the path per call from the call's first activation row and the weight's base.
  const bool vec_gate = GemvVectorized(x, e.gate, hidden);
  const bool vec_up = GemvVectorized(x, e.up, hidden);
  float acc[2][1] = {{0.0f}, {0.0f}};
  if (vec_gate == vec_up) {
    const W* rows[2] = {gate, up};
    RowDot<W, 2, 1>(xt, rows, 1, hidden, vec_gate, lane, acc);
  } else {
    float g[1][1] = {{0.0f}}, u[1][1] = {{0.0f}};
    const W* gate_rows[1] = {gate};
    const W* up_rows[1] = {up};
    RowDot<W, 1, 1>(xt, gate_rows, 1, hidden, vec_gate, lane, g);
    RowDot<W, 1, 1>(xt, up_rows, 1, hidden, vec_up, lane, u);
    acc[0][0] = g[0][0];
    acc[1][0] = u[0][0];
  }
  const float gv = GemvResult(acc[0][0]);
  const float uv = GemvResult(acc[1][0]);
  // SwiGluKernel's expression, on the values the two GEMVs would have stored.
  if (lane == 0) act[s * inter + row] = gv / (1.0f + expf(-gv)) * uv;
}

template <typename W>
__global__ void __launch_bounds__(kThreads)
    GroupedDownKernel(const float* __restrict__ act, const ExpertPointers* __restrict__ experts,
                      const int32_t* __restrict__ ids, int64_t inter, int64_t hidden, float* __restrict__ y) {
  constexpr int kRows = kDownRowsPerWarp;
  const int lane = threadIdx.x & 31;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kRows;
  if (row0 >= hidden) return;
  const int64_t s = blockIdx.y;
  const W* down = static_cast<const W*>(experts[ids[s]].down);
  // A row past the end (the last warp's) reads the last row, and its result is not stored.
  const W* rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) rows[r] = down + min(row0 + r, hidden - 1) * inter;
  float acc[kRows][1];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r][0] = 0.0f;
  RowDot<W, kRows, 1>(act + s * inter, rows, 1, inter, GemvVectorized(act, down, inter), lane, acc);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r;
    if (row >= hidden) break;  // the same for the whole warp
    const float v = GemvResult(acc[r][0]);
    if (lane == 0) y[s * hidden + row] = v;
  }
}

__global__ void __launch_bounds__(kCombineThreads)
    CombineExpertsKernel(const float* __restrict__ y, const int32_t* __restrict__ ids,
                         const float* __restrict__ weights, int k, int64_t hidden, float* __restrict__ out) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (d >= hidden) return;
  const int64_t i = blockIdx.y;
  const int32_t* row_ids = ids + i * k;
  float v = 0.0f;     // the row a caller would have zeroed for ScatterAddScaledKernel
  int64_t last = -1;  // the expert id added last
  for (int step = 0; step < k; ++step) {
    int pick = -1;
    int64_t pick_id = 0;
    for (int j = 0; j < k; ++j) {
      const int64_t e = row_ids[j];
      if (e > last && (pick < 0 || e < pick_id)) {
        pick = j;
        pick_id = e;
      }
    }
    if (pick < 0) break;  // only with repeated ids, which top-k never gives
    const int64_t s = i * k + pick;
    // ScatterAddScaledKernel's update: the product rounded, then the sum.
    v = __fadd_rn(v, __fmul_rn(weights[s], y[s * hidden + d]));
    last = pick_id;
  }
  out[i * hidden + d] = v;
}

}  // namespace

template <typename W>
cudaError_t LaunchGroupedGateUp(const float* x, const ExpertPointers* experts, const int32_t* ids, int64_t n, int64_t k,
                                int64_t hidden, int64_t inter, float* act, cudaStream_t stream) {
  if (n <= 0 || k <= 0 || inter <= 0) return cudaSuccess;
  if (hidden <= 0 || n * k > 65535 || k > 0x7fffffff || CeilDiv(inter, kWarps) > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(inter, kWarps)), static_cast<unsigned>(n * k));
  GroupedGateUpKernel<W><<<grid, kThreads, 0, stream>>>(x, experts, ids, static_cast<int>(k), hidden, inter, act);
  return cudaGetLastError();
}

template <typename W>
cudaError_t LaunchGroupedDown(const float* act, const ExpertPointers* experts, const int32_t* ids, int64_t slots,
                              int64_t inter, int64_t hidden, float* y, cudaStream_t stream) {
  if (slots <= 0 || hidden <= 0) return cudaSuccess;
  const int64_t blocks = CeilDiv(hidden, kWarps * kDownRowsPerWarp);
  if (inter <= 0 || slots > 65535 || blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(slots));
  GroupedDownKernel<W><<<grid, kThreads, 0, stream>>>(act, experts, ids, inter, hidden, y);
  return cudaGetLastError();
}

cudaError_t LaunchCombineExperts(const float* y, const int32_t* ids, const float* weights, int64_t n, int64_t k,
                                 int64_t hidden, float* out, cudaStream_t stream) {
  if (n <= 0 || k <= 0 || hidden <= 0) return cudaSuccess;
  const int64_t blocks = CeilDiv(hidden, kCombineThreads);
  if (n > 65535 || k > kGroupedMaxTopK || blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(n));
  CombineExpertsKernel<<<grid, kCombineThreads, 0, stream>>>(y, ids, weights, static_cast<int>(k), hidden, out);
  return cudaGetLastError();
}

#define ODMOE_INSTANTIATE_W(W)                                                                                       \
  template cudaError_t LaunchGroupedGateUp<W>(const float*, const ExpertPointers*, const int32_t*, int64_t, int64_t, \
                                              int64_t, int64_t, float*, cudaStream_t);                               \
  template cudaError_t LaunchGroupedDown<W>(const float*, const ExpertPointers*, const int32_t*, int64_t, int64_t,   \
                                            int64_t, float*, cudaStream_t);
ODMOE_INSTANTIATE_W(float)
ODMOE_INSTANTIATE_W(__half)
ODMOE_INSTANTIATE_W(__nv_bfloat16)
#undef ODMOE_INSTANTIATE_W

}  // namespace odmoe::kernels
