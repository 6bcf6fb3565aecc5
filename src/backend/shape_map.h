// ShapeMap: how a timed device charges the ops of the model it computes (the running model, e.g. a small trained
// Mixtral) as if they had a target model's dimensions (e.g. Mixtral-8x7B), so that the math stays the small
// model's (tokens exact) while the clock runs at the target's scale. One map per device, built once at its
// creation from the two models' dimensions (src/backend/device_factory.h: CreateNodeDevice) and immutable after.
//
// Rules (a size the rules do not recognise is charged as it is):
//  - Widths of matrices and rows (MatMul in/out, Embedding/RmsNorm/GatherRows/ScatterAddScaled dim, SelectTokens'
//    vocab): the running model's hidden, expert / shared-expert / dense intermediate, q (heads*head_dim), kv
//    (kv_heads*head_dim), head_dim, vocab and expert count map to the target's. Where two of them are equal in the
//    running model but not in the target, the larger target value is charged (see ambiguous()).
//  - Head counts by role: Attention's heads and kv_heads, Rope's heads (the larger on a tie), and head_dim.
//  - RouterTopK's expert count; top-k and token counts (rows, past) are never mapped.
//  - Element counts: SwiGlu's count as rows x an intermediate width, Add's as rows x hidden.
//  - Dense weights are charged at the target's dtype (its torch_dtype); quantized weights (INT8, NF4) as they are.
//  - Copies: a copy of at least one running expert projection (expert_bytes / 3) is weights and is charged at
//    target expert_bytes / running expert_bytes; a smaller one is activations (hidden states, K/V rows) and is
//    charged at target hidden / running hidden. So a copy of activations of more rows than
//    expert_bytes / (3 * 4 * hidden) (256 for tiny-mixtral-kjv in bf16) counts as weights: keep prefill
//    mini-batches below that ([cluster] prefill_minibatch_rows, 32 by default).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend/op_cost.h"
#include "src/common/dtype.h"

namespace odmoe {

// The dimensions of a model that ShapeMap recognises. Optional widths are 0 when the model has none.
struct ModelDims {
  int64_t hidden = 0;
  int64_t expert_intermediate = 0;
  int64_t shared_intermediate = 0;  // optional
  int64_t dense_intermediate = 0;   // optional
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab = 0;
  int64_t experts = 0;
  uint64_t expert_bytes = 0;          // one routed expert's three projections: as stored (running), at weight_dtype
                                      // (target)
  DType weight_dtype = DType::kBF16;  // dense weights (target only)
};

class ShapeMap {
 public:
  ShapeMap() = default;  // the identity: every op charged at its own sizes

  // InvalidArgument naming `running_name` or `target_name` and the field when a required dimension (all but the
  // optional widths) is not positive, or when one model has a shared expert or dense layers and the other not.
  static absl::StatusOr<ShapeMap> Between(const ModelDims& running, const ModelDims& target,
                                          const std::string& running_name, const std::string& target_name);

  bool identity() const { return !mapped_; }
  // `shape` with its sizes and weight dtype as the target would run it.
  OpShape Charge(const OpShape& shape) const;
  // The bytes a copy of `bytes` moves in the target.
  uint64_t CopyBytes(uint64_t bytes) const;
  // Running widths that stand for several target widths (charged at the largest), as "256 -> 4096 or 14336".
  const std::vector<std::string>& ambiguous() const { return ambiguous_; }
  const ModelDims& running() const { return running_; }
  const ModelDims& target() const { return target_; }

 private:
  int64_t Width(int64_t running) const;
  int64_t Heads(int64_t running) const;
  // `count` as rows x the first of `widths` (running widths) that divides it, in the target; else unchanged.
  int64_t Elements(int64_t count, std::initializer_list<std::pair<int64_t, int64_t>> widths) const;
  DType Weight(DType running) const;

  bool mapped_ = false;
  ModelDims running_;
  ModelDims target_;
  std::map<int64_t, int64_t> widths_;  // running -> target
  std::map<int64_t, int64_t> heads_;
  std::vector<std::string> ambiguous_;
};

}  // namespace odmoe
