// Rotary position embedding in the Hugging Face "rotate_half" layout.
//
// The angle of pair i (i < head_dim / 2) for a token at position p is float(p) * inv_freq[i], with
// inv_freq[i] = 1.0f / float(theta ** (float(2 i) / float(head_dim))) computed in float32 the way torch does
// (the power rounded once to float32), and cos/sin taken in float32. Then, in place,
//   x[i]        = x[i] * cos - x[i + half] * sin
//   x[i + half] = x[i + half] * cos + x[i] * sin.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// x: [n, heads, head_dim] fp32, rotated in place; positions: [n] int32 (device memory). head_dim even.
// inv_freq: [head_dim / 2] (device memory) to use a table computed elsewhere (e.g. by the CPU reference, so
// that both backends rotate by bitwise the same frequencies), or null to compute it as above.
// One block per token; the block computes the cos/sin table of its position once for all heads.
cudaError_t LaunchRope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                       const float* inv_freq, cudaStream_t stream);

}  // namespace odmoe::kernels
