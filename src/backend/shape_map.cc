// ShapeMap: the rules of shape_map.h.
#include "src/backend/shape_map.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "src/common/strings.h"

namespace odmoe {
namespace {

// Adds running -> target to `map`; a running value already there keeps the larger target, and `ambiguous`
// notes the clash once.
void Insert(std::map<int64_t, int64_t>* map, int64_t running, int64_t target, std::vector<std::string>* ambiguous) {
  if (running <= 0) return;
  auto [it, fresh] = map->emplace(running, target);
  if (fresh || it->second == target) return;
  const std::string note = StrCat(running, " -> ", std::min(it->second, target), " or ", std::max(it->second, target));
  if (std::find(ambiguous->begin(), ambiguous->end(), note) == ambiguous->end()) ambiguous->push_back(note);
  it->second = std::max(it->second, target);
}

absl::Status CheckDims(const ModelDims& d, const std::string& name) {
  const std::pair<const char*, int64_t> required[] = {
      {"hidden_size", d.hidden},        {"expert intermediate size", d.expert_intermediate},
      {"num_attention_heads", d.heads}, {"num_key_value_heads", d.kv_heads},
      {"head_dim", d.head_dim},         {"vocab_size", d.vocab},
      {"number of experts", d.experts}, {"expert bytes", static_cast<int64_t>(d.expert_bytes)}};
  for (const auto& [field, value] : required) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          StrCat(name, ": ", field, " is ", value, "; a timing model needs MoE models on both sides"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ShapeMap> ShapeMap::Between(const ModelDims& running, const ModelDims& target,
                                           const std::string& running_name, const std::string& target_name) {
  if (absl::Status s = CheckDims(running, running_name); !s.ok()) return s;
  if (absl::Status s = CheckDims(target, target_name); !s.ok()) return s;
  for (auto [field, r, t] : {std::tuple{"a shared expert", running.shared_intermediate, target.shared_intermediate},
                             std::tuple{"dense MLP layers", running.dense_intermediate, target.dense_intermediate}}) {
    if ((r > 0) != (t > 0)) {
      return absl::InvalidArgumentError(StrCat(r > 0 ? running_name : target_name, " has ", field, " and ",
                                               r > 0 ? target_name : running_name,
                                               " has none: its ops could not be charged at the other's shapes"));
    }
  }
  ShapeMap m;
  m.mapped_ = true;
  m.running_ = running;
  m.target_ = target;
  const std::pair<int64_t, int64_t> widths[] = {
      {running.hidden, target.hidden},
      {running.expert_intermediate, target.expert_intermediate},
      {running.shared_intermediate, target.shared_intermediate},
      {running.dense_intermediate, target.dense_intermediate},
      {running.heads * running.head_dim, target.heads * target.head_dim},
      {running.kv_heads * running.head_dim, target.kv_heads * target.head_dim},
      {running.head_dim, target.head_dim},
      {running.vocab, target.vocab},
      {running.experts, target.experts}};
  for (const auto& [r, t] : widths) Insert(&m.widths_, r, t, &m.ambiguous_);
  Insert(&m.heads_, running.heads, target.heads, &m.ambiguous_);
  Insert(&m.heads_, running.kv_heads, target.kv_heads, &m.ambiguous_);
  return m;
}

int64_t ShapeMap::Width(int64_t running) const {
  auto it = widths_.find(running);
  return it == widths_.end() ? running : it->second;
}

int64_t ShapeMap::Heads(int64_t running) const {
  auto it = heads_.find(running);
  return it == heads_.end() ? running : it->second;
}

int64_t ShapeMap::Elements(int64_t count, std::initializer_list<std::pair<int64_t, int64_t>> widths) const {
  for (const auto& [r, t] : widths) {
    if (r > 0 && count % r == 0) return count / r * t;
  }
  return count;
}

DType ShapeMap::Weight(DType running) const {
  return running == DType::kI8 || running == DType::kU8 ? running : target_.weight_dtype;
}

OpShape ShapeMap::Charge(const OpShape& shape) const {
  if (!mapped_) return shape;
  OpShape c = shape;
  auto exact = [](int64_t value, int64_t running, int64_t target) { return value == running ? target : value; };
  switch (shape.kind) {
    case OpKind::kEmbedding:
    case OpKind::kRmsNorm:
      c.dim = Width(shape.dim);
      c.weight = Weight(shape.weight);
      break;
    case OpKind::kMatMul:
      c.in_dim = Width(shape.in_dim);
      c.out_dim = Width(shape.out_dim);
      c.weight = Weight(shape.weight);
      if (shape.has_bias) c.bias = Weight(shape.bias);
      break;
    case OpKind::kRope:
      c.heads = Heads(shape.heads);
      c.head_dim = exact(shape.head_dim, running_.head_dim, target_.head_dim);
      break;
    case OpKind::kAttention:
      c.heads = exact(shape.heads, running_.heads, target_.heads);
      c.kv_heads = exact(shape.kv_heads, running_.kv_heads, target_.kv_heads);
      c.head_dim = exact(shape.head_dim, running_.head_dim, target_.head_dim);
      break;
    case OpKind::kRouterTopK:
      c.experts = exact(shape.experts, running_.experts, target_.experts);
      break;
    case OpKind::kSwiGlu:
      c.count = Elements(shape.count, {{running_.expert_intermediate, target_.expert_intermediate},
                                       {running_.shared_intermediate, target_.shared_intermediate},
                                       {running_.dense_intermediate, target_.dense_intermediate}});
      break;
    case OpKind::kAdd:
      c.count = Elements(shape.count, {{running_.hidden, target_.hidden}});
      break;
    case OpKind::kGatherRows:
    case OpKind::kScatterAddScaled:
    case OpKind::kSelectTokens:
      c.dim = Width(shape.dim);
      break;
    case OpKind::kChangeLogits:  // per change, whatever the vocabulary
      break;
    case OpKind::kConvert:  // a K or V row of the cache
      c.count = Elements(shape.count, {{running_.kv_heads * running_.head_dim, target_.kv_heads * target_.head_dim}});
      break;
  }
  return c;
}

uint64_t ShapeMap::CopyBytes(uint64_t bytes) const {
  if (!mapped_) return bytes;
  const double ratio = bytes * 3 >= running_.expert_bytes
                           ? static_cast<double>(target_.expert_bytes) / static_cast<double>(running_.expert_bytes)
                           : static_cast<double>(target_.hidden) / static_cast<double>(running_.hidden);
  return static_cast<uint64_t>(static_cast<double>(bytes) * ratio + 0.5);
}

}  // namespace odmoe
