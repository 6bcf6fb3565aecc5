// RoPE (HF rotate_half), in place. One block per token: the first threads compute the token's cos/sin table
// (half = head_dim / 2 entries; inv_freq from the caller's table, or in float32 like torch with the power
// evaluated in double and rounded once, i.e. the correctly rounded float32 power), then the block rotates the
// (head, pair) elements of all heads.
#include "kernels/rope.h"

namespace odmoe::kernels {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads)
    RopeKernel(float* x, const int32_t* __restrict__ positions, int64_t heads, int head_dim, float theta,
               const float* __restrict__ inv_freq_table) {
  extern __shared__ float table[];  // [half] cos, then [half] sin
  const int half = head_dim / 2;
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    float inv_freq;
    if (inv_freq_table != nullptr) {
      inv_freq = inv_freq_table[i];
    } else {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
      const float power = static_cast<float>(pow(static_cast<double>(theta), static_cast<double>(exponent)));
      inv_freq = 1.0f / power;
    }
    const float angle = __fmul_rn(pos, inv_freq);
    table[i] = cosf(angle);
    table[half + i] = sinf(angle);
  }
  __syncthreads();
  float* xt = x + t * heads * head_dim;
  const int64_t pairs = heads * half;
  for (int64_t e = threadIdx.x; e < pairs; e += kThreads) {
    const int64_t h = e / half;
    const int i = static_cast<int>(e - h * half);
    float* xh = xt + h * head_dim;
    const float x1 = xh[i];
    const float x2 = xh[i + half];
    const float c = table[i];
    const float s = table[half + i];
    xh[i] = x1 * c - x2 * s;
    xh[i + half] = x2 * c + x1 * s;
  }
}

}  // namespace

cudaError_t LaunchRope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                       const float* inv_freq, cudaStream_t stream) {
  if (n <= 0 || heads <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > 8192 || n > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(head_dim) * sizeof(float);
  RopeKernel<<<static_cast<unsigned>(n), kThreads, smem, stream>>>(x, positions, heads, static_cast<int>(head_dim),
                                                                   static_cast<float>(theta), inv_freq);
  return cudaGetLastError();
}

}  // namespace odmoe::kernels
