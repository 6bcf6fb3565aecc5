// Bandwidth-oriented matrix-vector products for a few tokens: y[n, out] = x[n, in] * w[out, in]^T (+ bias).
//
// A warp reads its output rows once, 4 weights per lane and load (16 bytes fp32, 8 fp16/bf16), the warp's loads
// of weights and of x contiguous (kernels/gemv_row.cuh), and accumulates in fp32, x coming from L1/L2: one token
// runs a kernel of its own (four rows per warp for outputs of 8192 rows or more, else one; one accumulator each,
// x loaded once for the warp's rows), 2..kGemvMaxTokens tokens one row per warp for all of them. Rows whose start
// is not 16-byte aligned (in_dim not a multiple of 8, or unaligned pointers) take a scalar path.
// Meant for n <= kGemvMaxTokens (larger n loops over groups of tokens, reading the weights once per group).
// Every row is summed in the same order whatever n (explicit FMAs), so y's row t is bitwise what a call with
// token t alone gives: batching never changes a token's result.
// W is float, __half or __nv_bfloat16 (explicitly instantiated in gemv.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

inline constexpr int64_t kGemvMaxTokens = 8;

// x: [n, in_dim] fp32; w: [out_dim, in_dim]; bias: [out_dim] or null; y: [n, out_dim] (must not alias x).
template <typename W>
cudaError_t LaunchGemv(const float* x, const W* w, const W* bias, int64_t n, int64_t in_dim, int64_t out_dim, float* y,
                       cudaStream_t stream);

}  // namespace odmoe::kernels
