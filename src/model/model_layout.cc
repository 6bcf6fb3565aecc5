#include "src/common/strings.h"
#include "src/model/model_layout.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace odmoe {
namespace {

bool IsMixtral(const ModelConfig& c) { return c.arch == Architecture::kMixtral; }

std::string LayerPrefix(int64_t layer) { return StrCat("model.layers.", layer, "."); }

std::string MoePrefix(const ModelConfig& c, int64_t layer) {
  return StrCat(LayerPrefix(layer), IsMixtral(c) ? "block_sparse_moe." : "mlp.");
}

}  // namespace

std::string TensorName(const ModelConfig& c, TensorRole role, int64_t layer, int64_t expert) {
  const std::string lp = LayerPrefix(layer);
  const std::string attn = lp + "self_attn.";
  switch (role) {
    case TensorRole::kEmbed:
      return "model.embed_tokens.weight";
    case TensorRole::kLmHead:
      return c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    case TensorRole::kFinalNorm:
      return "model.norm.weight";
    case TensorRole::kInputNorm:
      return lp + "input_layernorm.weight";
    case TensorRole::kPostNorm:
      return lp + "post_attention_layernorm.weight";
    case TensorRole::kQ:
      return attn + "q_proj.weight";
    case TensorRole::kK:
      return attn + "k_proj.weight";
    case TensorRole::kV:
      return attn + "v_proj.weight";
    case TensorRole::kO:
      return attn + "o_proj.weight";
    case TensorRole::kQBias:
      return attn + "q_proj.bias";
    case TensorRole::kKBias:
      return attn + "k_proj.bias";
    case TensorRole::kVBias:
      return attn + "v_proj.bias";
    case TensorRole::kOBias:
      return attn + "o_proj.bias";
    case TensorRole::kQNorm:
      return attn + "q_norm.weight";
    case TensorRole::kKNorm:
      return attn + "k_norm.weight";
    case TensorRole::kRouter:
      return MoePrefix(c, layer) + "gate.weight";
    case TensorRole::kExpertGate:
      return StrCat(MoePrefix(c, layer), "experts.", expert, IsMixtral(c) ? ".w1.weight" : ".gate_proj.weight");
    case TensorRole::kExpertUp:
      return StrCat(MoePrefix(c, layer), "experts.", expert, IsMixtral(c) ? ".w3.weight" : ".up_proj.weight");
    case TensorRole::kExpertDown:
      return StrCat(MoePrefix(c, layer), "experts.", expert, IsMixtral(c) ? ".w2.weight" : ".down_proj.weight");
    case TensorRole::kSharedGate:
      return lp + "mlp.shared_expert.gate_proj.weight";
    case TensorRole::kSharedUp:
      return lp + "mlp.shared_expert.up_proj.weight";
    case TensorRole::kSharedDown:
      return lp + "mlp.shared_expert.down_proj.weight";
    case TensorRole::kSharedExpertGate:
      return lp + "mlp.shared_expert_gate.weight";
    case TensorRole::kDenseGate:
      return lp + "mlp.gate_proj.weight";
    case TensorRole::kDenseUp:
      return lp + "mlp.up_proj.weight";
    case TensorRole::kDenseDown:
      return lp + "mlp.down_proj.weight";
  }
  return "";
}

std::vector<TensorSpec> NonExpertTensors(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  auto add = [&](TensorRole role, std::vector<int64_t> shape, int64_t layer = -1) {
    out.push_back({TensorName(c, role, layer), std::move(shape), role, layer, -1});
  };
  const int64_t h = c.hidden_size;
  add(TensorRole::kEmbed, {c.vocab_size, h});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    add(TensorRole::kInputNorm, {h}, l);
    add(TensorRole::kQ, {c.q_size(), h}, l);
    add(TensorRole::kK, {c.kv_size(), h}, l);
    add(TensorRole::kV, {c.kv_size(), h}, l);
    add(TensorRole::kO, {h, c.q_size()}, l);
    if (c.qkv_bias) {
      add(TensorRole::kQBias, {c.q_size()}, l);
      add(TensorRole::kKBias, {c.kv_size()}, l);
      add(TensorRole::kVBias, {c.kv_size()}, l);
    }
    if (c.o_bias) add(TensorRole::kOBias, {h}, l);
    if (c.qk_norm == QkNorm::kPerHead) {
      add(TensorRole::kQNorm, {c.head_dim}, l);
      add(TensorRole::kKNorm, {c.head_dim}, l);
    } else if (c.qk_norm == QkNorm::kFull) {
      add(TensorRole::kQNorm, {c.q_size()}, l);
      add(TensorRole::kKNorm, {c.kv_size()}, l);
    }
    add(TensorRole::kPostNorm, {h}, l);
    if (c.IsSparseLayer(l)) {
      add(TensorRole::kRouter, {c.num_experts, h}, l);
      if (c.shared_expert_intermediate_size > 0) {
        const int64_t s = c.shared_expert_intermediate_size;
        add(TensorRole::kSharedGate, {s, h}, l);
        add(TensorRole::kSharedUp, {s, h}, l);
        add(TensorRole::kSharedDown, {h, s}, l);
        add(TensorRole::kSharedExpertGate, {1, h}, l);
      }
    } else {
      const int64_t m = c.dense_intermediate_size;
      add(TensorRole::kDenseGate, {m, h}, l);
      add(TensorRole::kDenseUp, {m, h}, l);
      add(TensorRole::kDenseDown, {h, m}, l);
    }
  }
  add(TensorRole::kFinalNorm, {h});
  if (!c.tie_word_embeddings) add(TensorRole::kLmHead, {c.vocab_size, h});
  return out;
}

std::vector<TensorSpec> ExpertTensors(const ModelConfig& c, int64_t layer, int64_t expert) {
  const int64_t h = c.hidden_size, m = c.expert_intermediate_size;
  return {
      {TensorName(c, TensorRole::kExpertGate, layer, expert), {m, h}, TensorRole::kExpertGate, layer, expert},
      {TensorName(c, TensorRole::kExpertUp, layer, expert), {m, h}, TensorRole::kExpertUp, layer, expert},
      {TensorName(c, TensorRole::kExpertDown, layer, expert), {h, m}, TensorRole::kExpertDown, layer, expert},
  };
}

std::vector<TensorSpec> AllExpertTensors(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  for (int64_t l : c.SparseLayers()) {
    for (int64_t e = 0; e < c.num_experts; ++e) {
      for (auto& t : ExpertTensors(c, l, e)) out.push_back(std::move(t));
    }
  }
  return out;
}

bool IsExpertTensorName(std::string_view name) {
  return name.find(".experts.") != std::string_view::npos;
}

}  // namespace odmoe
