// Routed experts of one MoE layer for a few tokens with the expert ids read on the device: no host round trip
// between the router and the experts. A device table holds every expert's weight pointers; slot s of the layer
// (s < n * k: token s / k's (s % k)-th choice) computes expert ids[s] on token s / k:
//   1. LaunchGroupedGateUp: act[s, :] = silu(gate_e x) * (up_e x), both projections in one pass over x;
//   2. LaunchGroupedDown:   y[s, :] = down_e act[s, :];
//   3. LaunchCombineExperts: out[i, :] = the sum of weights[s] * y[s, :] over row i's slots in ascending expert id.
// Every dot product is summed in the one order of the dense GEMV (kernels/gemv_row.cuh), silu * up is
// SwiGluKernel's expression and the combine is ScatterAddScaledKernel's (product rounded, then the sum), so for
// n <= kGemvMaxTokens the result is bitwise that of computing each expert alone with LaunchGemv, LaunchSwiGlu
// and LaunchScatterAddScaled (experts in ascending id order, rows in order) onto zeros, the per-expert path of the
// engine.
// W is float, __half or __nv_bfloat16 (explicitly instantiated in moe_grouped.cu); one dtype for every expert.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// The most experts a token may choose in LaunchCombineExperts.
inline constexpr int64_t kGroupedMaxTopK = 64;

// One expert's weights in device memory, of the dtype W of the launch: gate and up [inter, hidden], down
// [hidden, inter]. An entry of the table is 24 bytes; a layer's experts are consecutive (index: the expert id).
struct ExpertPointers {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
};

// act[s, r] = silu(gate_e[r] . x[s / k]) * (up_e[r] . x[s / k]), e = ids[s], for s < n * k, r < inter.
// x: [n, hidden]; experts: [num_experts] (device memory); ids: [n, k] (device memory, each in [0, num_experts));
// act: [n * k, inter].
template <typename W>
cudaError_t LaunchGroupedGateUp(const float* x, const ExpertPointers* experts, const int32_t* ids, int64_t n, int64_t k,
                                int64_t hidden, int64_t inter, float* act, cudaStream_t stream);

// y[s, r] = down_e[r] . act[s], e = ids[s], for s < slots, r < hidden. act: [slots, inter]; y: [slots, hidden].
template <typename W>
cudaError_t LaunchGroupedDown(const float* act, const ExpertPointers* experts, const int32_t* ids, int64_t slots,
                              int64_t inter, int64_t hidden, float* y, cudaStream_t stream);

// out[i, :] = 0.0f + weights[i, j] * y[i * k + j, :] + ... for the j < k of row i in ascending order of ids[i, j],
// each product rounded before its sum: bitwise what ScatterAddScaledKernel adds onto a zeroed row, without
// reading `out` (so the caller zeroes nothing). ids, weights: [n, k] (device memory; REQUIRES the ids of a row
// distinct, as top-k's are, and k <= kGroupedMaxTopK); y: [n * k, hidden]; out: [n, hidden].
cudaError_t LaunchCombineExperts(const float* y, const int32_t* ids, const float* weights, int64_t n, int64_t k,
                                 int64_t hidden, float* out, cudaStream_t stream);

}  // namespace odmoe::kernels
