// The work table of op_cost.h.
#include "src/backend/op_cost.h"

#include "src/backend/quantize.h"
#include "src/common/status.h"

namespace odmoe {
namespace {

// Bytes of `count` 4-byte elements (fp32 activations, int32 ids).
uint64_t Bytes4(int64_t count) { return static_cast<uint64_t>(count) * 4; }
uint64_t DenseBytes(DType dtype, int64_t count) {
  ODMOE_CHECK(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16);
  return static_cast<uint64_t>(count) * DTypeSize(dtype);
}
// Bytes of a [rows, cols] weight's data and scales, dense or quantized (quantize.h layouts).
uint64_t MatrixBytes(DType dtype, int64_t rows, int64_t cols) {
  if (dtype == DType::kI8) return static_cast<uint64_t>(rows * cols) + Bytes4(rows);
  if (dtype == DType::kU8)
    return static_cast<uint64_t>(rows * Nf4RowBytes(cols)) + Bytes4(rows * Nf4BlocksPerRow(cols));
  return DenseBytes(dtype, rows * cols);
}
double D(int64_t v) { return static_cast<double>(v); }

}  // namespace

std::string_view OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kEmbedding:
      return "Embedding";
    case OpKind::kRmsNorm:
      return "RmsNorm";
    case OpKind::kMatMul:
      return "MatMul";
    case OpKind::kRope:
      return "Rope";
    case OpKind::kAttention:
      return "Attention";
    case OpKind::kRouterTopK:
      return "RouterTopK";
    case OpKind::kSwiGlu:
      return "SwiGlu";
    case OpKind::kAdd:
      return "Add";
    case OpKind::kGatherRows:
      return "GatherRows";
    case OpKind::kScatterAddScaled:
      return "ScatterAddScaled";
    case OpKind::kConvert:
      return "Convert";
    case OpKind::kSelectTokens:
      return "SelectTokens";
    case OpKind::kChangeLogits:
      return "ChangeLogits";
  }
  return "?";
}

OpWork WorkOf(const OpShape& s) {
  ODMOE_CHECK(s.n >= 0 && s.dim >= 0 && s.in_dim >= 0 && s.out_dim >= 0 && s.heads >= 0 && s.kv_heads >= 0 &&
              s.head_dim >= 0 && s.past >= 0 && s.experts >= 0 && s.k >= 0 && s.count >= 0);
  switch (s.kind) {
    case OpKind::kEmbedding:
      return {0, Bytes4(s.n) + DenseBytes(s.weight, s.n * s.dim) + Bytes4(s.n * s.dim)};
    case OpKind::kRmsNorm:
      return {4.0 * D(s.n) * D(s.dim), 2 * Bytes4(s.n * s.dim) + DenseBytes(s.weight, s.dim)};
    case OpKind::kMatMul: {
      double flops = 2.0 * D(s.n) * D(s.in_dim) * D(s.out_dim);
      uint64_t bytes = MatrixBytes(s.weight, s.out_dim, s.in_dim) + Bytes4(s.n * s.in_dim) + Bytes4(s.n * s.out_dim);
      if (s.has_bias) {
        flops += D(s.n) * D(s.out_dim);
        bytes += DenseBytes(s.bias, s.out_dim);
      }
      return {flops, bytes};
    }
    case OpKind::kRope: {
      const int64_t count = s.n * s.heads * s.head_dim;
      return {6.0 * D(count), 2 * Bytes4(count) + Bytes4(s.n)};
    }
    case OpKind::kAttention: {
      // Sum over the new tokens i of the rows each one sees, past + i + 1.
      const double visible = D(s.n) * D(s.past) + D(s.n) * D(s.n + 1) / 2.0;
      return {4.0 * D(s.heads) * D(s.head_dim) * visible,
              2 * Bytes4(s.n * s.heads * s.head_dim) + 2 * Bytes4((s.past + s.n) * s.kv_heads * s.head_dim)};
    }
    case OpKind::kRouterTopK:
      return {4.0 * D(s.n) * D(s.experts), Bytes4(s.n * s.experts) + 2 * Bytes4(s.n * s.k)};
    case OpKind::kSwiGlu:
      return {5.0 * D(s.count), 3 * Bytes4(s.count)};
    case OpKind::kAdd:
      return {D(s.count), 3 * Bytes4(s.count)};
    case OpKind::kGatherRows:
      return {0, 2 * Bytes4(s.n * s.dim) + Bytes4(s.n)};
    case OpKind::kScatterAddScaled:
      return {2.0 * D(s.n) * D(s.dim), 3 * Bytes4(s.n * s.dim) + 2 * Bytes4(s.n)};
    case OpKind::kConvert:
      return {0, DenseBytes(s.weight, s.count) + DenseBytes(s.dst, s.count)};
    case OpKind::kSelectTokens:
      return {D(s.n) * D(s.dim), Bytes4(s.n * s.dim) + 6 * Bytes4(s.n)};
    case OpKind::kChangeLogits:
      return {2.0 * D(s.n), 5 * Bytes4(s.n)};
  }
  return {};
}

}  // namespace odmoe
