#include "src/backend/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "src/common/status.h"
#include "src/common/tsan_ranges.h"

namespace odmoe {
namespace {

// Each function declares the buffers it reads and writes on entry to ThreadSanitizer, which does not instrument
// this file (src/common/tsan_ranges.h); nothing without TSan. (For the same reason the element loops index
// scratch buffers through raw pointers: a std::vector's operator[] stays instrumented, a call per element.)
using tsan::Reads;
using tsan::Writes;
void ReadsWeight(const void* w, DType dtype, int64_t rows, int64_t cols) {
  tsan::ReadBytes(w, static_cast<size_t>(rows * cols) * DTypeSize(dtype));
}

// Widens row `r` of w ([rows, cols] in dtype) to fp32 (exact for F16 and BF16).
void WidenRow(const void* w, DType dtype, int64_t r, int64_t cols, float* out) {
  const size_t first = static_cast<size_t>(r * cols);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(w) + first, static_cast<size_t>(cols) * sizeof(float));
      return;
    case DType::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w) + first;
      for (int64_t j = 0; j < cols; ++j) out[j] = F16ToF32(p[j]);
      return;
    }
    case DType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(w) + first;
      for (int64_t j = 0; j < cols; ++j) out[j] = Bf16ToF32(p[j]);
      return;
    }
    default:
      ODMOE_CHECK(false && "quantizers take F32, F16 or BF16 weights");
  }
}

}  // namespace

uint8_t Nf4Code(float v) {
  // The midpoints ascend, so counting those below v is the decision tree of bitsandbytes (NaN gives 0 there
  // and here).
  uint8_t code = 0;
  for (float m : kNf4Midpoints) code = static_cast<uint8_t>(code + (v > m ? 1 : 0));
  return code;
}

void QuantizeInt8Rows(const void* w, DType dtype, int64_t rows, int64_t cols, int8_t* q, float* absmax) {
  ODMOE_CHECK(rows >= 0 && cols >= 0);
  if (rows == 0 || cols == 0) return;
  ODMOE_CHECK(w != nullptr && q != nullptr && absmax != nullptr);
  ReadsWeight(w, dtype, rows, cols);
  Writes(q, rows * cols);
  Writes(absmax, rows);
  std::vector<float> widened(static_cast<size_t>(cols));
  float* row = widened.data();
  for (int64_t r = 0; r < rows; ++r) {
    WidenRow(w, dtype, r, cols, row);
    float m = 0.0f;
    for (int64_t j = 0; j < cols; ++j) m = std::fmax(m, std::fabs(row[j]));
    absmax[r] = m;
    int8_t* qr = q + r * cols;
    for (int64_t j = 0; j < cols; ++j) {
      float x = 0.0f;
      if (m > 0.0f) {
        const float ratio = row[j] / m;
        const float scaled = ratio * 127.0f;
        x = std::nearbyint(scaled);
      }
      x = std::fmin(std::fmax(x, -127.0f), 127.0f);
      qr[j] = static_cast<int8_t>(x);
    }
  }
}

void DequantizeInt8Rows(const int8_t* q, const float* absmax, int64_t rows, int64_t cols, float* w) {
  ODMOE_CHECK(rows >= 0 && cols >= 0);
  Reads(q, rows * cols);
  Reads(absmax, rows);
  Writes(w, rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float step = absmax[r] / 127.0f;
    for (int64_t j = 0; j < cols; ++j) w[r * cols + j] = static_cast<float>(q[r * cols + j]) * step;
  }
}

void QuantizeNf4(const void* w, DType dtype, int64_t rows, int64_t cols, uint8_t* codes, float* absmax) {
  ODMOE_CHECK(rows >= 0 && cols >= 0);
  if (rows == 0 || cols == 0) return;
  ODMOE_CHECK(w != nullptr && codes != nullptr && absmax != nullptr);
  const int64_t bpr = Nf4BlocksPerRow(cols);
  const int64_t row_bytes = Nf4RowBytes(cols);
  ReadsWeight(w, dtype, rows, cols);
  Writes(codes, rows * row_bytes);
  Writes(absmax, rows * bpr);
  std::vector<float> widened(static_cast<size_t>(cols));
  float* row = widened.data();
  for (int64_t r = 0; r < rows; ++r) {
    WidenRow(w, dtype, r, cols, row);
    uint8_t* cr = codes + r * row_bytes;
    for (int64_t b = 0; b < bpr; ++b) {
      const int64_t c0 = b * kNf4BlockSize;
      const int64_t c1 = std::min(cols, c0 + kNf4BlockSize);
      float m = 0.0f;
      for (int64_t j = c0; j < c1; ++j) m = std::fmax(m, std::fabs(row[j]));
      absmax[r * bpr + b] = m;
      const float inv = m > 0.0f ? 1.0f / m : 0.0f;
      for (int64_t j = c0; j < c0 + kNf4BlockSize; j += 2) {
        const uint8_t hi = j < cols ? Nf4Code(row[j] * inv) : 7;
        const uint8_t lo = j + 1 < cols ? Nf4Code(row[j + 1] * inv) : 7;
        cr[j / 2] = static_cast<uint8_t>((hi << 4) | lo);
      }
    }
  }
}

void DequantizeNf4(const uint8_t* codes, const float* absmax, int64_t rows, int64_t cols, float* w) {
  ODMOE_CHECK(rows >= 0 && cols >= 0);
  const int64_t bpr = Nf4BlocksPerRow(cols);
  const int64_t row_bytes = Nf4RowBytes(cols);
  Reads(codes, rows * row_bytes);
  Reads(absmax, rows * bpr);
  Writes(w, rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = codes[r * row_bytes + j / 2];
      const int code = (j & 1) ? (byte & 15) : (byte >> 4);
      w[r * cols + j] = kNf4CodeBook[code] * absmax[r * bpr + j / kNf4BlockSize];
    }
  }
}

}  // namespace odmoe
