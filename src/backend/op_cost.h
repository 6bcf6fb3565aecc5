// What each device op costs: its shape (OpShape), the floating-point operations and bytes of device memory that
// shape reads and writes (WorkOf), and the cost model that turns work into time on a device's clock (CostModel).
// The mock GPU (src/backend/mock_gpu_device.h) charges its ops through a CostModel: by default a roofline over
// its MockGpuOptions; a timed device (src/backend/timed_device.h) a hardware profile's, at a target model's shapes.
//
// Work of each op (flops; bytes read + written, fp32 activations = 4 bytes, weights at their dtype's size w):
//   Embedding         0;                          n*4 + n*dim*w + n*dim*4
//   RmsNorm           4*rows*dim;                 2*rows*dim*4 + dim*w
//   MatMul            2*n*in*out (+ n*out bias);  out*in*w (+ out*w_bias) + n*in*4 + n*out*4; quantized w:
//                                                 its codes (out*in INT8, out*Nf4RowBytes(in) NF4) and scales
//   Rope              6*n*heads*head_dim;         2*n*heads*head_dim*4 + n*4
//   Attention         4*heads*head_dim*sum_i(past+i+1);  2*n*heads*head_dim*4 + 2*(past+n)*kv_heads*head_dim*4
//   RouterTopK        4*n*experts;                n*experts*4 + n*k*8
//   SwiGlu            5*count;                    3*count*4
//   Add               count;                      3*count*4
//   GatherRows        0;                          2*n*dim*4 + n*4
//   ScatterAddScaled  2*n*dim;                    3*n*dim*4 + n*8
//   Convert           0;                          count*(size of src dtype + size of dst dtype)
//   SelectTokens      n*dim;                      n*dim*4 + n*24 (the logits, each row's choice and id)
//   ChangeLogits      2*n;                        n*20 (each change, and its logit read and written)
#pragma once

#include <cstdint>
#include <string_view>

#include "src/common/dtype.h"

namespace odmoe {

enum class OpKind {
  kEmbedding,
  kRmsNorm,
  kMatMul,
  kRope,
  kAttention,
  kRouterTopK,
  kSwiGlu,
  kAdd,
  kGatherRows,
  kScatterAddScaled,
  kConvert,
  kSelectTokens,
  kChangeLogits
};
std::string_view OpKindName(OpKind kind);  // the Device method's name: "MatMul", ...

// The sizes of one op call that its cost depends on; fields an op does not have stay 0. Which field holds
// which of the Device method's arguments:
//   Embedding(n, dim), RmsNorm(rows -> n, dim), MatMul(n, in_dim, out_dim, has_bias), Rope(n, heads, head_dim),
//   Attention(n, past, heads, kv_heads, head_dim), RouterTopK(n, experts, k), SwiGlu(count), Add(count),
//   GatherRows(n, dim), ScatterAddScaled(n, dim), Convert(count), SelectTokens(rows -> n, vocab -> dim),
//   ChangeLogits(n).
// `weight` is the dtype of the op's weight (Embedding's table, RmsNorm's weight, MatMul's w) or Convert's source;
// `bias` MatMul's bias; `dst` Convert's destination.
struct OpShape {
  OpKind kind = OpKind::kAdd;
  int64_t n = 0;
  int64_t dim = 0;
  int64_t in_dim = 0;
  int64_t out_dim = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t past = 0;
  int64_t experts = 0;
  int64_t k = 0;
  int64_t count = 0;
  DType weight = DType::kF32;
  bool has_bias = false;
  DType bias = DType::kF32;
  DType dst = DType::kF32;
};

struct OpWork {
  double flops = 0;
  uint64_t bytes = 0;  // device memory read and written
};

// The table above. REQUIRES: the sizes are >= 0; `weight` is a dense dtype or, for MatMul only, kI8 / kU8.
OpWork WorkOf(const OpShape& shape);

// Which way a copy goes.
enum class CopyKind { kHostToDevice, kDeviceToHost, kOnDevice };

// Turns work into seconds on a device's clock. Implementations are immutable after construction, so a cost
// model may be called from any thread.
class CostModel {
 public:
  virtual ~CostModel() = default;
  // How long `shape` takes once it starts; OpWork is what the timeline records for it.
  virtual double OpSeconds(const OpShape& shape, OpWork* work) const = 0;
  // How long a copy of `bytes` takes once its link (or, on device, its stream) is free. `pinned`: a host-to-device
  // copy's source is registered host memory. `charged_bytes` (not null): the bytes the model charged for it.
  virtual double CopySeconds(CopyKind kind, uint64_t bytes, bool pinned, uint64_t* charged_bytes) const = 0;
};

}  // namespace odmoe
