// The rule that picks a token from a row of logits, written once for the CUDA kernel (kernels/sampling.cu) and the
// CPU reference (src/backend/cpu_kernels.cc), so that both pick the same id for the same row, bit for bit. A plain
// header: no CUDA, nothing from src/ (its functions are __host__ __device__ under nvcc).
//
// For a row l[0 .. vocab) and a TokenChoice c:
//  1. Greedy when c.temperature <= 0, c.top_k == 1 or c.top_p <= 0: the argmax, ties to the lowest id; NaN never
//     wins (a row of NaN gives 0).
//  2. z_i = SampleZ(l_i, temperature): l_i / temperature in fp32 (IEEE division), NaN as -inf, -0 as +0. Tokens
//     are ordered by (z descending, id ascending).
//  3. top-k (0 < top_k < vocab): keep the first top_k tokens of that order.
//  4. Each token's mass m_i = SampleMass(z_i - max z), exp(z_i - max z) in fixed point: an integer, 2^39 for the
//     largest z, 0 below exp(-32). SampleMass uses fp32 multiplies, fmas and rounding to an integer only (no
//     expf, whose last bits differ between libm and the GPU), so it is the same integer wherever fp32 is IEEE.
//  5. top-p (top_p < 1): keep the shortest non-empty prefix of the kept tokens, in that order, whose mass reaches
//     MulFraction(Z, Fraction24(top_p)), Z the mass of the kept tokens.
//  5b. min-p (min_p > 0, max z finite): keep only the kept tokens whose mass is at least MinPMass: the largest
//     token's mass (2^39, always kept) times min_p, as HF's MinPLogitsWarper after top-k and top-p (vLLM's min_p).
//  6. Pick the first kept token in ascending id order whose inclusive running mass exceeds
//     MulFraction(M, Fraction24(uniform)), M the mass of the kept tokens; the last kept token in id order if none
//     does (only when M is 0: a row whose largest z is +inf or -inf).
// Before the rule, a row's logits may be changed one by one (LogitChange, ChangedLogit: Device::ChangeLogits on
// every backend, Sampler::Next on the host), each by one fp32 multiply or divide and one fp32 add, rounded alike
// everywhere.
// Every sum is a sum of integers (at most 2^24 * 2^39 = 2^63, so vocab <= 2^24), which no order of additions
// changes: a parallel reduction and a sequential loop give the same sums, hence the same token. The kept set is the
// usual top-k / top-p nucleus; walking it in id order instead of probability order gives the same distribution.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define ODMOE_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define ODMOE_SAMPLING_HD inline
#endif

namespace odmoe {

// How one row's token is picked (Device::SelectTokens, kernels::LaunchSelectTokens), as the rule above reads it.
// 20 bytes, the same layout on the host and the device.
struct TokenChoice {
  float temperature = 0.0f;  // <= 0: greedy
  int32_t top_k = 0;         // <= 0 (or >= vocab): no top-k cut
  float top_p = 1.0f;        // >= 1: no nucleus cut; <= 0: greedy
  float uniform = 0.0f;      // the draw, in [0, 1) (values outside are clamped)
  float min_p = 0.0f;        // <= 0: no min-p cut
};

// A change to one logit before its row's pick: logits[index] = ChangedLogit(logits[index], penalty, delta).
// `index` counts over the rows of a [rows, vocab] buffer (row * vocab + id). 12 bytes, the same layout on the host
// and the device.
struct LogitChange {
  int32_t index = 0;
  float penalty = 1.0f;  // the repetition penalty; 1: none
  float delta = 0.0f;    // added after the penalty: a bias less the presence and frequency penalties, or -inf
};

namespace kernels {

inline constexpr int64_t kSampleMaxVocab = int64_t{1} << 24;   // masses sum below 2^64
inline constexpr uint64_t kSampleMassOne = uint64_t{1} << 39;  // SampleMass(0)

ODMOE_SAMPLING_HD bool IsGreedy(const TokenChoice& c) {
  return !(c.temperature > 0.0f) || c.top_k == 1 || !(c.top_p > 0.0f);
}

// l / temperature, NaN as -inf (never kept ahead of a number), -0 as +0 (one order key for zero).
ODMOE_SAMPLING_HD float SampleZ(float l, float temperature) {
  const float z = l / temperature;
  if (z != z) return -INFINITY;
  return z == 0.0f ? 0.0f : z;
}

// floor(exp(x) * 2^39) for x <= 0, to within a few fp32 ulps of exp (Taylor polynomial of degree 7 after
// x = n ln 2 + r, |r| <= ln 2 / 2); 0 for x < -32 (exp(-32) * 2^39 < 1) and NaN. Only IEEE fp32 operations that
// round once (multiply, fma, round to integer), written out so that no compiler may contract or reorder them.
ODMOE_SAMPLING_HD uint64_t SampleMass(float x) {
  if (!(x >= -32.0f)) return 0;
  if (x > 0.0f) x = 0.0f;
  const float n = rintf(x * 1.44269502f);     // in [-46, 0]
  float r = fmaf(n, -0.693145751953125f, x);  // ln 2, high part (exact times n)
  r = fmaf(n, -1.42860682e-06f, r);           // ln 2, low part
  float p = 1.98412701e-04f;                  // 1/7!
  p = fmaf(p, r, 1.38888892e-03f);            // 1/6!
  p = fmaf(p, r, 8.33333377e-03f);            // 1/5!
  p = fmaf(p, r, 4.16666679e-02f);            // 1/4!
  p = fmaf(p, r, 1.66666672e-01f);            // 1/3!
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  // 2^(n + 39), a normal float; the product is exact (a power of two) and at most 2^39.
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 39 + 127) << 23;
#if defined(__CUDA_ARCH__)
  const float scale = __uint_as_float(bits);
#else
  float scale;
  memcpy(&scale, &bits, sizeof(scale));
#endif
  return static_cast<uint64_t>(p * scale);
}

// floor(x * 2^24) for x in [0, 1), clamped to [0, 2^24 - 1] (NaN: 0).
ODMOE_SAMPLING_HD uint32_t Fraction24(float x) {
  if (!(x > 0.0f)) return 0;
  if (x >= 1.0f) return (uint32_t{1} << 24) - 1;
  return static_cast<uint32_t>(x * 16777216.0f);
}

// floor(total * fraction / 2^24), exactly, for total <= 2^63 (no product overflows).
ODMOE_SAMPLING_HD uint64_t MulFraction(uint64_t total, uint32_t fraction) {
  return (total >> 24) * fraction + (((total & 0xffffffu) * fraction) >> 24);
}

// A logit after its LogitChange: HF's RepetitionPenaltyLogitsProcessor first (a negative logit times the penalty,
// any other divided by it), then the delta added; each step one IEEE fp32 operation, never fused into an FMA. A
// penalty of 1 and a delta of 0 give back l, bit for bit.
ODMOE_SAMPLING_HD float ChangedLogit(float l, float penalty, float delta) {
#if defined(__CUDA_ARCH__)
  const float penalized = l < 0.0f ? __fmul_rn(l, penalty) : __fdiv_rn(l, penalty);
  return __fadd_rn(penalized, delta);
#else
  volatile float penalized = l < 0.0f ? l * penalty : l / penalty;  // volatile: no contraction with the add
  return penalized + delta;
#endif
}

// Step 5b: the least mass a token keeps, MulFraction(kSampleMassOne, Fraction24(min_p)); 0 (no cut) when min_p <= 0
// or the row's largest z is +-inf (every mass is then 0, and the cut would leave nothing).
ODMOE_SAMPLING_HD uint64_t MinPMass(const TokenChoice& c, float zmax) {
  if (!(c.min_p > 0.0f) || !(zmax > -INFINITY && zmax < INFINITY)) return 0;
  return MulFraction(kSampleMassOne, Fraction24(c.min_p));
}

}  // namespace kernels
}  // namespace odmoe
