// Memory-bound elementwise and row-movement kernels of the MoE layer, fp32 activations.
//
// W is float, __half or __nv_bfloat16 (explicitly instantiated in elementwise.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace odmoe::kernels {

// out[i, :] = float(table[ids[i], :]). ids: [n] (device memory); table: [vocab, dim]; out: [n, dim].
template <typename W>
cudaError_t LaunchEmbedding(const int32_t* ids, int64_t n, const W* table, int64_t dim, float* out,
                            cudaStream_t stream);

// out = gate / (1 + exp(-gate)) * up over `count` values (out may alias gate or up).
cudaError_t LaunchSwiGlu(const float* gate, const float* up, int64_t count, float* out, cudaStream_t stream);

// y += x over `count` values (float4 loads where aligned).
cudaError_t LaunchAdd(const float* x, int64_t count, float* y, cudaStream_t stream);

// y[i, :] += float(bias[:]) for i < n. y: [n, dim]; bias: [dim].
template <typename W>
cudaError_t LaunchAddBias(const W* bias, int64_t n, int64_t dim, float* y, cudaStream_t stream);

// dst[i, :] = src[rows[i], :]. src: [*, dim]; rows: [n] (device memory); dst: [n, dim].
cudaError_t LaunchGatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst,
                             cudaStream_t stream);

// dst[rows[i], :] += s_i * src[i, :] for i = 0, 1, .., n - 1 in that order, s_i = scale[i] or, when
// `sigmoid_scale`, 1 / (1 + exp(-scale[i])). The product is rounded before the sum (no fused multiply-add), so
// for the same factors the result is bitwise that of the sequential fp32 loop of the CPU reference (with
// `sigmoid_scale` a factor may differ from the CPU's in expf's last bit). Each thread owns one column and walks
// i in order (8 rows in flight, repeated rows resolved in registers): deterministic whatever `rows` holds.
cudaError_t LaunchScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                                   bool sigmoid_scale, float* dst, cudaStream_t stream);

// Splits the fp32 rows x[rows, cols] into pairs of 16-bit floats of type T (__half or __nv_bfloat16):
// hi = T(x * 2^-e), lo = T(x * 2^-e - float(hi)), so that hi + lo carries about twice T's mantissa. e >= 0 is
// chosen per row: 0 unless the row holds a value past T's range (fp16: |x| >= 2^15; bf16 never), then the
// smallest that brings every value of the row within it. row_scale[r] = 2^e (rows floats): multiply the
// row of a GEMM over (hi, lo) by it (LaunchScaleRows) to undo the scaling, exactly.
template <typename T>
cudaError_t LaunchSplitToPair(const float* x, int64_t rows, int64_t cols, T* hi, T* lo, float* row_scale,
                              cudaStream_t stream);

// dst[i] = src[i] for `count` values, between fp32 and a 16-bit type (S -> D: float -> __half or __nv_bfloat16,
// rounding to nearest even as HF's .to(dtype); __half or __nv_bfloat16 -> float, exact). src, dst must not overlap.
template <typename S, typename D>
cudaError_t LaunchConvert(const S* src, int64_t count, D* dst, cudaStream_t stream);

// y[r, :] *= scale[r] for the rows of y[rows, cols].
cudaError_t LaunchScaleRows(float* y, int64_t rows, int64_t cols, const float* scale, cudaStream_t stream);

}  // namespace odmoe::kernels
