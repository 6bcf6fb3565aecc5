// The fp32 reference kernels. See cpu_kernels.h for the numerics.
//
// Dot products (MatMul, Attention) accumulate in 8 fp32 lanes (lane j sums the products of elements
// k = j mod 8 in increasing k), then the tail, then the lanes combine in a fixed tree. The order depends only on
// the length, so results are reproducible bit for bit, and the compiler can vectorise the lanes without
// -ffast-math. On x86-64 with GCC, MatMul is also built for AVX2 and the copy the CPU supports is picked at load
// time (target_clones): each lane does the same IEEE multiply and add in either (no FMA: ISO C++ mode keeps
// -ffp-contract=off), so the bits are the same on every x86-64. RmsNorm's mean of squares is summed in double and
// rounded to fp32 (torch's cascade sum is accurate to about that).
#include "src/backend/cpu_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "src/backend/quantize.h"
#include "src/common/dtype.h"
#include "src/common/status.h"
#include "src/common/tsan_ranges.h"

// MatMul's AVX2 copy (see the top of the file).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ODMOE_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ODMOE_CPU_CLONES
#endif

namespace odmoe::cpu {
namespace {

constexpr int kLanes = 8;

// The fp32 value of every f16 bit pattern (256 KiB), built once.
const float* F16Table() {
  static const std::vector<float>* table = [] {
    auto* t = new std::vector<float>(65536);
    for (uint32_t i = 0; i < 65536; ++i) (*t)[i] = F16ToF32(static_cast<uint16_t>(i));
    return t;
  }();
  return table->data();
}

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float CombineLanes(const float* acc) {
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// Eight fp32 lanes as one value (GCC/Clang vector extension): SSE does it in two halves, AVX in one, each lane
// the same IEEE multiply and add.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// (Vectors go by reference: passed by value, an 8-lane vector's ABI differs with and without AVX.)
inline void Load(Lanes& v, const float* p) { std::memcpy(&v, p, sizeof(v)); }

// The lanes of `acc` with the products of a tail (elements main..len-1 to lanes 0..), combined.
inline float Finish(const Lanes& acc, const float* a, const float* b, int64_t main, int64_t len) {
  float lanes[kLanes];
  std::memcpy(lanes, &acc, sizeof(lanes));
  for (int64_t k = main; k < len; ++k) lanes[k - main] += a[k] * b[k];
  return CombineLanes(lanes);
}

// sum_k a[k] * b[k] in the fixed lane order described at the top of the file.
inline float Dot(const float* a, const float* b, int64_t len) {
  Lanes acc = {};
  const int64_t main = len - len % kLanes;
  for (int64_t k = 0; k < main; k += kLanes) {
    Lanes x, w;
    Load(x, a + k);
    Load(w, b + k);
    acc += x * w;
  }
  return Finish(acc, a, b, main, len);
}

// Four dots of `a` with b0..b3 at once (one pass over `a`); out[r] is bit-identical to Dot(a, b_r, len).
inline void Dot4(const float* a, const float* b0, const float* b1, const float* b2, const float* b3, int64_t len,
                 float* out) {
  Lanes acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  const int64_t main = len - len % kLanes;
  for (int64_t k = 0; k < main; k += kLanes) {
    Lanes x, w0, w1, w2, w3;
    Load(x, a + k);
    Load(w0, b0 + k);
    Load(w1, b1 + k);
    Load(w2, b2 + k);
    Load(w3, b3 + k);
    acc0 += x * w0;
    acc1 += x * w1;
    acc2 += x * w2;
    acc3 += x * w3;
  }
  out[0] = Finish(acc0, a, b0, main, len);
  out[1] = Finish(acc1, a, b1, main, len);
  out[2] = Finish(acc2, a, b2, main, len);
  out[3] = Finish(acc3, a, b3, main, len);
}

// Dot4 of two rows a0 and a1 at once (each weight chunk loaded once for both); bit-identical to two Dot4 calls.
inline void Dot4x2(const float* a0, const float* a1, const float* b0, const float* b1, const float* b2, const float* b3,
                   int64_t len, float* out0, float* out1) {
  Lanes p0 = {}, p1 = {}, p2 = {}, p3 = {}, q0 = {}, q1 = {}, q2 = {}, q3 = {};
  const int64_t main = len - len % kLanes;
  for (int64_t k = 0; k < main; k += kLanes) {
    Lanes x0, x1, w0, w1, w2, w3;
    Load(x0, a0 + k);
    Load(x1, a1 + k);
    Load(w0, b0 + k);
    Load(w1, b1 + k);
    Load(w2, b2 + k);
    Load(w3, b3 + k);
    p0 += x0 * w0;
    p1 += x0 * w1;
    p2 += x0 * w2;
    p3 += x0 * w3;
    q0 += x1 * w0;
    q1 += x1 * w1;
    q2 += x1 * w2;
    q3 += x1 * w3;
  }
  out0[0] = Finish(p0, a0, b0, main, len);
  out0[1] = Finish(p1, a0, b1, main, len);
  out0[2] = Finish(p2, a0, b2, main, len);
  out0[3] = Finish(p3, a0, b3, main, len);
  out1[0] = Finish(q0, a1, b0, main, len);
  out1[1] = Finish(q1, a1, b1, main, len);
  out1[2] = Finish(q2, a1, b2, main, len);
  out1[3] = Finish(q3, a1, b3, main, len);
}

inline float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

void CheckWeight(WeightRef w) {
  ODMOE_CHECK(w.data != nullptr);
  ODMOE_CHECK(w.dtype == DType::kF32 || w.dtype == DType::kF16 || w.dtype == DType::kBF16);
}

// Each kernel declares the buffers it reads and writes on entry to ThreadSanitizer, which does not instrument
// this file (src/common/tsan_ranges.h); nothing without TSan. (For the same reason the element loops index
// scratch buffers through raw pointers: a std::vector's operator[] stays instrumented, a call per element.)
using tsan::Reads;
using tsan::Writes;
// Elements [first, first + count) of a dense weight.
void ReadsDense(WeightRef w, int64_t first, int64_t count) {
  const size_t each = DTypeSize(w.dtype);
  tsan::ReadBytes(static_cast<const uint8_t*>(w.data) + static_cast<size_t>(first) * each,
                  static_cast<size_t>(count) * each);
}
// All of w: [rows, cols], with its scales when it is quantized (the layouts of quantize.h).
void ReadsMatrix(WeightRef w, int64_t rows, int64_t cols) {
  if (w.dtype == DType::kI8) {
    Reads(static_cast<const int8_t*>(w.data), rows * cols);
    Reads(w.scales, rows);
  } else if (w.dtype == DType::kU8) {
    Reads(static_cast<const uint8_t*>(w.data), rows * Nf4RowBytes(cols));
    Reads(w.scales, rows * Nf4BlocksPerRow(cols));
  } else {
    ReadsDense(w, 0, rows * cols);
  }
}

}  // namespace

void WidenWeights(WeightRef w, int64_t first, int64_t count, float* out) {
  CheckWeight(w);
  ODMOE_CHECK(first >= 0 && count >= 0);
  ReadsDense(w, first, count);
  Writes(out, count);
  const auto* base = static_cast<const uint8_t*>(w.data);
  switch (w.dtype) {
    case DType::kF32:
      std::memcpy(out, base + first * 4, static_cast<size_t>(count) * 4);
      return;
    case DType::kBF16: {
      const uint8_t* p = base + first * 2;
      for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToF32(LoadU16(p + 2 * i));
      return;
    }
    case DType::kF16: {
      const float* table = F16Table();
      const uint8_t* p = base + first * 2;
      for (int64_t i = 0; i < count; ++i) out[i] = table[LoadU16(p + 2 * i)];
      return;
    }
    default:
      ODMOE_CHECK(false && "unsupported weight dtype");
  }
}

float WeightAt(WeightRef w, int64_t index) {
  float v;
  WidenWeights(w, index, 1, &v);
  return v;
}

void Embedding(const int32_t* ids, int64_t n, WeightRef table, int64_t dim, float* out) {
  ODMOE_CHECK(n >= 0 && dim >= 0);
  if (n == 0 || dim == 0) return;
  ODMOE_CHECK(ids != nullptr && out != nullptr);
  Reads(ids, n);  // the table's rows and out: in WidenWeights
  for (int64_t i = 0; i < n; ++i) {
    ODMOE_CHECK(ids[i] >= 0);
    WidenWeights(table, static_cast<int64_t>(ids[i]) * dim, dim, out + i * dim);
  }
}

void RmsNorm(const float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out) {
  ODMOE_CHECK(rows >= 0 && dim > 0);
  if (rows == 0) return;
  ODMOE_CHECK(x != nullptr && out != nullptr);
  Reads(x, rows * dim);
  Writes(out, rows * dim);
  std::vector<float> widened(static_cast<size_t>(dim));  // [dim]
  float* w = widened.data();
  WidenWeights(weight, 0, dim, w);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    double sum_sq = 0.0;
    for (int64_t c = 0; c < dim; ++c) sum_sq += static_cast<double>(xr[c]) * xr[c];
    const float variance = static_cast<float>(sum_sq / static_cast<double>(dim));
    const float inv_rms = 1.0f / std::sqrt(variance + eps);
    for (int64_t c = 0; c < dim; ++c) yr[c] = w[c] * (xr[c] * inv_rms);
  }
}

ODMOE_CPU_CLONES void MatMul(const float* x, WeightRef w, WeightRef bias, int64_t n, int64_t in_dim, int64_t out_dim,
                             float* y) {
  ODMOE_CHECK(n >= 0 && in_dim >= 0 && out_dim >= 0);
  if (n == 0 || out_dim == 0) return;
  ODMOE_CHECK(x != nullptr && y != nullptr);
  if (w.quantized()) {
    ODMOE_CHECK(w.data != nullptr && w.scales != nullptr);
  } else {
    CheckWeight(w);
  }
  Reads(x, n * in_dim);
  ReadsMatrix(w, out_dim, in_dim);
  Writes(y, n * out_dim);
  std::vector<float> b;  // [out_dim]
  if (!bias.empty()) {
    b.resize(static_cast<size_t>(out_dim));
    WidenWeights(bias, 0, out_dim, b.data());
  }
  // F32 weights that are suitably aligned are read in place; anything else is widened (or dequantized, with
  // the very functions of quantize.h, so a quantized w gives bitwise what its fp32 dequantization gives), a
  // tile of rows at a time.
  const bool direct = w.dtype == DType::kF32 && reinterpret_cast<uintptr_t>(w.data) % alignof(float) == 0;
  constexpr int64_t kRowTile = 4;
  std::vector<float> tile;  // [kRowTile, in_dim]
  if (!direct) tile.resize(static_cast<size_t>(kRowTile * in_dim));
  for (int64_t o0 = 0; o0 < out_dim; o0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, out_dim - o0);
    const float* wr[kRowTile];
    if (w.dtype == DType::kI8) {
      DequantizeInt8Rows(static_cast<const int8_t*>(w.data) + o0 * in_dim, w.scales + o0, rows, in_dim, tile.data());
    } else if (w.dtype == DType::kU8) {
      DequantizeNf4(static_cast<const uint8_t*>(w.data) + o0 * Nf4RowBytes(in_dim),
                    w.scales + o0 * Nf4BlocksPerRow(in_dim), rows, in_dim, tile.data());
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (direct) {
        wr[r] = static_cast<const float*>(w.data) + (o0 + r) * in_dim;
      } else {
        if (!w.quantized()) WidenWeights(w, (o0 + r) * in_dim, in_dim, tile.data() + r * in_dim);
        wr[r] = tile.data() + r * in_dim;
      }
    }
    const float* bo = b.empty() ? nullptr : b.data() + o0;
    auto store = [&](int64_t t, const float* dots) {
      float* yt = y + t * out_dim + o0;
      for (int64_t r = 0; r < rows; ++r) yt[r] = bo == nullptr ? dots[r] : dots[r] + bo[r];
    };
    int64_t t = 0;
    if (rows == kRowTile) {  // two tokens at a time: each weight chunk loaded once for both
      for (; t + 1 < n; t += 2) {
        float dots0[kRowTile], dots1[kRowTile];
        Dot4x2(x + t * in_dim, x + (t + 1) * in_dim, wr[0], wr[1], wr[2], wr[3], in_dim, dots0, dots1);
        store(t, dots0);
        store(t + 1, dots1);
      }
    }
    for (; t < n; ++t) {
      const float* xt = x + t * in_dim;
      float dots[kRowTile];
      if (rows == kRowTile) {
        Dot4(xt, wr[0], wr[1], wr[2], wr[3], in_dim, dots);
      } else {
        for (int64_t r = 0; r < rows; ++r) dots[r] = Dot(xt, wr[r], in_dim);
      }
      store(t, dots);
    }
  }
}

void RopeInvFreq(int64_t head_dim, double theta, float* inv_freq) {
  ODMOE_CHECK(head_dim > 0 && head_dim % 2 == 0);
  // torch: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), all in float32.
  Writes(inv_freq, head_dim / 2);
  const float base = static_cast<float>(theta);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
}

void Rope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta) {
  ODMOE_CHECK(n >= 0 && heads >= 0 && head_dim > 0 && head_dim % 2 == 0);
  if (n == 0 || heads == 0) return;
  ODMOE_CHECK(x != nullptr && positions != nullptr);
  Reads(positions, n);
  Writes(x, n * heads * head_dim);
  const int64_t half = head_dim / 2;
  std::vector<float> scratch(static_cast<size_t>(3 * half));  // inv_freq, cos_v, sin_v: [half] each
  float* inv_freq = scratch.data();
  float* cos_v = inv_freq + half;
  float* sin_v = cos_v + half;
  RopeInvFreq(head_dim, theta, inv_freq);
  for (int64_t t = 0; t < n; ++t) {
    const float pos = static_cast<float>(positions[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cos_v[i] = std::cos(angle);
      sin_v[i] = std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i];
        const float b = v[i + half];
        v[i] = a * cos_v[i] - b * sin_v[i];
        v[i + half] = b * cos_v[i] + a * sin_v[i];
      }
    }
  }
}

void Attention(const float* q, const float* k_cache, const float* v_cache, int64_t n, int64_t past, int64_t heads,
               int64_t kv_heads, int64_t head_dim, float scale, float* out) {
  ODMOE_CHECK(n >= 0 && past >= 0 && heads > 0 && kv_heads > 0 && head_dim > 0);
  ODMOE_CHECK(heads % kv_heads == 0);
  if (n == 0) return;
  ODMOE_CHECK(q != nullptr && k_cache != nullptr && v_cache != nullptr && out != nullptr);
  Reads(q, n * heads * head_dim);
  Reads(k_cache, (past + n) * kv_heads * head_dim);
  Reads(v_cache, (past + n) * kv_heads * head_dim);
  Writes(out, n * heads * head_dim);
  const int64_t group = heads / kv_heads;
  std::vector<float> scores(static_cast<size_t>(past + n));  // [past + n]
  float* probs = scores.data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t visible = past + i + 1;  // cache rows 0..past+i
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      const float* qv = q + (i * heads + h) * head_dim;
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        const float s = Dot(qv, k_cache + (j * kv_heads + g) * head_dim, head_dim) * scale;
        probs[j] = s;
        max_score = std::max(max_score, s);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < visible; ++j) {
        probs[j] = std::exp(probs[j] - max_score);
        sum += probs[j];
      }
      for (int64_t j = 0; j < visible; ++j) probs[j] /= sum;
      float* ov = out + (i * heads + h) * head_dim;
      std::fill(ov, ov + head_dim, 0.0f);
      for (int64_t j = 0; j < visible; ++j) {
        const float p = probs[j];
        const float* vv = v_cache + (j * kv_heads + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) ov[d] += p * vv[d];
      }
    }
  }
}

void RouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize, int32_t* ids,
                float* weights) {
  ODMOE_CHECK(n >= 0 && num_experts > 0 && k >= 1 && k <= num_experts);
  if (n == 0) return;
  ODMOE_CHECK(logits != nullptr && ids != nullptr && weights != nullptr);
  Reads(logits, n * num_experts);
  Writes(ids, n * k);
  Writes(weights, n * k);
  std::vector<float> probs(static_cast<size_t>(num_experts));  // [num_experts]
  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < n; ++t) {
    const float* lt = logits + t * num_experts;
    float max_logit = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < num_experts; ++e) max_logit = std::max(max_logit, lt[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) {
      probs[e] = std::exp(lt[e] - max_logit);
      sum += probs[e];
    }
    for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
    // Best first; equal probabilities by lower id; NaN last (a total order, whatever the values).
    auto key = [&](int32_t e) { return std::isnan(probs[e]) ? -std::numeric_limits<float>::infinity() : probs[e]; };
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      const float ka = key(a), kb = key(b);
      if (ka != kb) return ka > kb;
      return a < b;
    });
    int32_t* it = ids + t * k;
    float* wt = weights + t * k;
    float top_sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      it[j] = order[j];
      wt[j] = probs[order[j]];
      top_sum += wt[j];
    }
    if (renormalize) {
      for (int64_t j = 0; j < k; ++j) wt[j] /= top_sum;
    }
  }
}

void SwiGlu(const float* gate, const float* up, int64_t count, float* out) {
  ODMOE_CHECK(count >= 0);
  if (count == 0) return;
  ODMOE_CHECK(gate != nullptr && up != nullptr && out != nullptr);
  Reads(gate, count);
  Reads(up, count);
  Writes(out, count);
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void Convert(const void* src, DType src_dtype, int64_t count, void* dst, DType dst_dtype) {
  ODMOE_CHECK(count >= 0);
  if (count == 0) return;
  ODMOE_CHECK(src != nullptr && dst != nullptr);
  const auto is_16 = [](DType d) { return d == DType::kF16 || d == DType::kBF16; };
  tsan::ReadBytes(src, static_cast<size_t>(count) * DTypeSize(src_dtype));
  tsan::WriteBytes(dst, static_cast<size_t>(count) * DTypeSize(dst_dtype));
  if (src_dtype == dst_dtype) {
    ODMOE_CHECK(src_dtype == DType::kF32 || is_16(src_dtype));
    std::memcpy(dst, src, static_cast<size_t>(count) * DTypeSize(src_dtype));
    return;
  }
  if (src_dtype == DType::kF32 && is_16(dst_dtype)) {
    const float* s = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] = dst_dtype == DType::kBF16 ? F32ToBf16(s[i]) : F32ToF16(s[i]);
    return;
  }
  ODMOE_CHECK(is_16(src_dtype) && dst_dtype == DType::kF32);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  float* d = static_cast<float*>(dst);
  for (int64_t i = 0; i < count; ++i) d[i] = src_dtype == DType::kBF16 ? Bf16ToF32(s[i]) : F16ToF32(s[i]);
}

void Add(const float* x, int64_t count, float* y) {
  ODMOE_CHECK(count >= 0);
  if (count == 0) return;
  ODMOE_CHECK(x != nullptr && y != nullptr);
  Reads(x, count);
  Writes(y, count);
  for (int64_t i = 0; i < count; ++i) y[i] += x[i];
}

void GatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst) {
  ODMOE_CHECK(n >= 0 && dim >= 0);
  if (n == 0 || dim == 0) return;
  ODMOE_CHECK(src != nullptr && rows != nullptr && dst != nullptr);
  Reads(rows, n);  // the rows themselves: memmove, which TSan intercepts
  for (int64_t i = 0; i < n; ++i) {
    ODMOE_CHECK(rows[i] >= 0);
    std::memmove(dst + i * dim, src + static_cast<int64_t>(rows[i]) * dim, static_cast<size_t>(dim) * sizeof(float));
  }
}

void ScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                      bool sigmoid_scale, float* dst) {
  ODMOE_CHECK(n >= 0 && dim >= 0);
  if (n == 0 || dim == 0) return;
  ODMOE_CHECK(src != nullptr && rows != nullptr && scale != nullptr && dst != nullptr);
  Reads(src, n * dim);
  Reads(rows, n);
  Reads(scale, n);
  for (int64_t i = 0; i < n; ++i) {
    ODMOE_CHECK(rows[i] >= 0);
    const float f = sigmoid_scale ? Sigmoid(scale[i]) : scale[i];
    const float* s = src + i * dim;
    float* d = dst + static_cast<int64_t>(rows[i]) * dim;
    Writes(d, dim);
    for (int64_t c = 0; c < dim; ++c) d[c] += f * s[c];
  }
}

int32_t ArgMax(const float* logits, int64_t vocab) {
  ODMOE_CHECK(logits != nullptr && vocab >= 1);
  Reads(logits, vocab);
  int64_t best = -1;
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(std::max<int64_t>(best, 0));
}

namespace {

// One row of SelectTokens: the steps of kernels/sampling_rule.h in order, sequentially.
int32_t SelectToken(const float* l, int64_t vocab, const TokenChoice& c) {
  using kernels::MulFraction;
  if (kernels::IsGreedy(c)) return ArgMax(l, vocab);
  const size_t v = static_cast<size_t>(vocab);
  std::vector<float> z_values(v);  // [vocab]
  float* z = z_values.data();
  float zmax = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < v; ++i) {
    z[i] = kernels::SampleZ(l[i], c.temperature);
    zmax = std::max(zmax, z[i]);
  }
  std::vector<uint64_t> masses(v);  // [vocab]
  uint64_t* mass = masses.data();
  for (size_t i = 0; i < v; ++i) mass[i] = kernels::SampleMass(z[i] - zmax);

  // Steps 3 and 5 keep a prefix of the order (z descending, id ascending): sorted only as far as a cut needs.
  const bool top_k = c.top_k > 0 && c.top_k < vocab;
  const bool top_p = c.top_p < 1.0f;
  std::vector<uint8_t> kept_flags(v, 1);  // [vocab]
  uint8_t* kept = kept_flags.data();
  if (top_k || top_p) {
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    const auto before = [&](int32_t a, int32_t b) { return z[a] != z[b] ? z[a] > z[b] : a < b; };
    size_t keep = top_k ? static_cast<size_t>(c.top_k) : v;
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(), before);
    uint64_t kept_mass = 0;
    for (size_t j = 0; j < keep; ++j) kept_mass += mass[order[j]];
    if (top_p && kept_mass > 0) {
      const uint64_t target = MulFraction(kept_mass, kernels::Fraction24(c.top_p));
      uint64_t cum = 0;
      for (size_t j = 0; j < keep; ++j) {
        cum += mass[order[j]];
        if (cum >= target) {
          keep = j + 1;
          break;
        }
      }
    }
    std::fill(kept, kept + v, 0);
    for (size_t j = 0; j < keep; ++j) kept[order[j]] = 1;
  }
  // Step 5b: min-p.
  if (const uint64_t least = kernels::MinPMass(c, zmax); least > 0) {
    for (size_t i = 0; i < v; ++i) kept[i] = kept[i] && mass[i] >= least;
  }

  // Step 6: the inverse CDF over the kept tokens in id order.
  uint64_t total = 0;
  for (size_t i = 0; i < v; ++i) total += kept[i] ? mass[i] : 0;
  const uint64_t need = MulFraction(total, kernels::Fraction24(c.uniform));
  uint64_t run = 0;
  int32_t last = 0;
  for (size_t i = 0; i < v; ++i) {
    if (!kept[i]) continue;
    run += mass[i];
    last = static_cast<int32_t>(i);
    if (run > need) return last;
  }
  return last;
}

}  // namespace

void ChangeLogits(float* logits, const LogitChange* changes, int64_t n) {
  ODMOE_CHECK(n >= 0);
  if (n == 0) return;
  ODMOE_CHECK(logits != nullptr && changes != nullptr);
  Reads(changes, n);
  for (int64_t i = 0; i < n; ++i) {
    const LogitChange& c = changes[i];
    ODMOE_CHECK(c.index >= 0);
    Writes(logits + c.index, 1);
    logits[c.index] = kernels::ChangedLogit(logits[c.index], c.penalty, c.delta);
  }
}

void SelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices, int32_t* ids) {
  ODMOE_CHECK(rows >= 0 && vocab >= 1 && vocab <= kernels::kSampleMaxVocab);
  if (rows == 0) return;
  ODMOE_CHECK(logits != nullptr && choices != nullptr && ids != nullptr);
  Reads(logits, rows * vocab);
  Reads(choices, rows);
  Writes(ids, rows);
  for (int64_t r = 0; r < rows; ++r) ids[r] = SelectToken(logits + r * vocab, vocab, choices[r]);
}

}  // namespace odmoe::cpu
