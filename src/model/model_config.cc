#include "src/common/strings.h"
#include "src/model/model_config.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"

namespace odmoe {
namespace {

// What HF Transformers assumes when a field is absent, per architecture.
struct ArchDefaults {
  int64_t vocab_size, hidden_size, intermediate_size, num_layers, num_heads;
  std::optional<int64_t> num_kv_heads;  // nullopt: same as num_heads
  int64_t max_position_embeddings;
  double rms_norm_eps, rope_theta;
  int64_t top_k, num_experts, moe_intermediate_size, shared_expert_intermediate_size;
  bool norm_topk_prob, qkv_bias;
  std::optional<int64_t> bos, eos;
};

ArchDefaults DefaultsFor(Architecture arch) {
  switch (arch) {
    case Architecture::kMixtral:
      return {32000, 4096, 14336, 32, 32, 8, 4096 * 32, 1e-5, 1e6, 2, 8, 0, 0, true, false, 1, 2};
    case Architecture::kQwen2Moe:
      return {151936, 2048, 5632, 24, 16, 16, 32768, 1e-6, 1e4, 4, 60, 1408, 5632, false, true, {}, {}};
    case Architecture::kQwen3Moe:
      return {151936, 2048, 6144, 24, 32, 4, 32768, 1e-6, 1e4, 8, 128, 768, 0, false, false, {}, {}};
    case Architecture::kOlmoe:
      return {50304, 2048, 2048, 16, 16, std::nullopt, 4096, 1e-5, 1e4, 8, 64, 0, 0, false, false, {}, 50279};
  }
  return {};
}

struct ArchName {
  const char* class_name;
  const char* model_type;
  Architecture arch;
};
constexpr ArchName kArchNames[] = {
    {"MixtralForCausalLM", "mixtral", Architecture::kMixtral},
    {"Qwen2MoeForCausalLM", "qwen2_moe", Architecture::kQwen2Moe},
    {"Qwen3MoeForCausalLM", "qwen3_moe", Architecture::kQwen3Moe},
    {"OlmoeForCausalLM", "olmoe", Architecture::kOlmoe},
};

absl::Status Unsupported(const std::string& where, std::string_view field, std::string_view why) {
  return absl::UnimplementedError(StrCat(where, ": field '", field, "': ", why));
}

absl::StatusOr<Architecture> DetectArchitecture(const JsonFields& f) {
  std::vector<std::string> supported;
  for (const auto& a : kArchNames) supported.push_back(a.class_name);
  if (const Json* archs = f.Get("architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
      return f.FieldError("architectures", "expected a non-empty list of class names");
    }
    const std::string name = (*archs)[0].get<std::string>();
    for (const auto& a : kArchNames) {
      if (name == a.class_name) return a.arch;
    }
    return Unsupported(f.where(), "architectures",
                       StrCat(name, " is not supported (supported: ", absl::StrJoin(supported, ", "), ")"));
  }
  ODMOE_ASSIGN_OR_RETURN(std::string type, f.String("model_type", ""));
  if (type.empty()) return f.FieldError("architectures", "missing, and no 'model_type' either");
  for (const auto& a : kArchNames) {
    if (type == a.model_type) return a.arch;
  }
  return Unsupported(f.where(), "model_type",
                     StrCat("'", type, "' is not supported (supported: ", absl::StrJoin(supported, ", "), ")"));
}

absl::Status RequirePositive(const JsonFields& f, std::string_view field, int64_t v) {
  if (v <= 0) return f.FieldError(field, StrCat("must be positive, got ", v));
  return absl::OkStatus();
}

// rope_theta may sit at the top level (classic layout) or inside rope_parameters (newer layout). Only the
// default rope is implemented: any scaling type is refused.
absl::StatusOr<double> ReadRope(const JsonFields& f, double fallback) {
  double theta = fallback;
  ODMOE_ASSIGN_OR_RETURN(theta, f.Number("rope_theta", fallback));
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const Json* rp = f.Get(key);
    if (rp == nullptr) continue;
    if (!rp->is_object()) return f.FieldError(key, StrCat("expected an object, got ", JsonTypeName(*rp)));
    JsonFields rf(*rp, f.where());
    ODMOE_ASSIGN_OR_RETURN(std::string type, rf.String("rope_type", ""));
    if (type.empty()) {
      ODMOE_ASSIGN_OR_RETURN(type, rf.String("type", "default"));
    }
    if (type != "default") {
      return Unsupported(f.where(), StrCat(key, ".rope_type"),
                         StrCat("rope scaling '", type, "' is not implemented (only 'default')"));
    }
    ODMOE_ASSIGN_OR_RETURN(double partial, rf.Number("partial_rotary_factor", 1.0));
    if (partial != 1.0) {
      return Unsupported(f.where(), StrCat(key, ".partial_rotary_factor"), "partial rotary embedding");
    }
    if (rf.Has("rope_theta")) {
      ODMOE_ASSIGN_OR_RETURN(theta, rf.Number("rope_theta"));
    }
  }
  ODMOE_ASSIGN_OR_RETURN(double partial, f.Number("partial_rotary_factor", 1.0));
  if (partial != 1.0) return Unsupported(f.where(), "partial_rotary_factor", "partial rotary embedding");
  if (!(theta > 0) || !std::isfinite(theta)) return f.FieldError("rope_theta", "must be a positive number");
  return theta;
}

// The attention window that applies, if any. Mixtral: `sliding_window`. Qwen: only when use_sliding_window
// (or layer_types lists a sliding layer).
absl::StatusOr<std::optional<int64_t>> ReadSlidingWindow(const JsonFields& f, Architecture arch) {
  if (arch == Architecture::kOlmoe) return std::optional<int64_t>{};
  ODMOE_ASSIGN_OR_RETURN(int64_t window, f.Int("sliding_window", 0));
  bool in_effect = false;
  if (arch == Architecture::kMixtral) {
    in_effect = window > 0;
  } else {
    ODMOE_ASSIGN_OR_RETURN(bool use, f.Bool("use_sliding_window", false));
    in_effect = use;
    if (const Json* types = f.Get("layer_types"); types != nullptr && types->is_array()) {
      for (const Json& t : *types) {
        if (t.is_string() && t.get<std::string>() == "sliding_attention") in_effect = true;
      }
    }
    if (in_effect && window <= 0) window = 4096;  // HF's default window when enabled without a size
  }
  if (!in_effect) return std::optional<int64_t>{};
  return std::optional<int64_t>{window};
}

}  // namespace

std::string_view ArchitectureName(Architecture arch) {
  for (const auto& a : kArchNames) {
    if (a.arch == arch) return a.class_name;
  }
  return "?";
}

bool ModelConfig::IsSparseLayer(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

std::vector<int64_t> ModelConfig::SparseLayers() const {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < num_layers; ++l) {
    if (IsSparseLayer(l)) out.push_back(l);
  }
  return out;
}

int64_t ModelConfig::SparseIndex(int64_t layer) const {
  if (!IsSparseLayer(layer)) return -1;
  int64_t idx = 0;
  for (int64_t l = 0; l < layer; ++l) idx += IsSparseLayer(l) ? 1 : 0;
  return idx;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const Json& json, const std::string& where) {
  if (!json.is_object()) {
    return absl::FailedPreconditionError(StrCat(where, ": expected a JSON object, got ", JsonTypeName(json)));
  }
  JsonFields f(json, where);
  ModelConfig c;
  ODMOE_ASSIGN_OR_RETURN(c.arch, DetectArchitecture(f));
  const ArchDefaults d = DefaultsFor(c.arch);

  if (f.Has("quantization_config")) {
    return Unsupported(where, "quantization_config", "pre-quantized checkpoints are not supported");
  }
  ODMOE_ASSIGN_OR_RETURN(std::string act, f.String("hidden_act", "silu"));
  if (act != "silu") return Unsupported(where, "hidden_act", StrCat("'", act, "' (only 'silu')"));
  if (f.Has("clip_qkv")) return Unsupported(where, "clip_qkv", "clipping of q/k/v is not implemented");

  ODMOE_ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size", d.vocab_size));
  ODMOE_ASSIGN_OR_RETURN(c.hidden_size, f.Int("hidden_size", d.hidden_size));
  ODMOE_ASSIGN_OR_RETURN(c.num_layers, f.Int("num_hidden_layers", d.num_layers));
  ODMOE_ASSIGN_OR_RETURN(c.num_heads, f.Int("num_attention_heads", d.num_heads));
  ODMOE_ASSIGN_OR_RETURN(c.num_kv_heads, f.Int("num_key_value_heads", d.num_kv_heads.value_or(c.num_heads)));
  ODMOE_ASSIGN_OR_RETURN(c.max_position_embeddings, f.Int("max_position_embeddings", d.max_position_embeddings));
  ODMOE_ASSIGN_OR_RETURN(c.rms_norm_eps, f.Number("rms_norm_eps", d.rms_norm_eps));
  ODMOE_ASSIGN_OR_RETURN(c.rope_theta, ReadRope(f, d.rope_theta));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "vocab_size", c.vocab_size));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "hidden_size", c.hidden_size));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "num_hidden_layers", c.num_layers));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "num_attention_heads", c.num_heads));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "num_key_value_heads", c.num_kv_heads));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "max_position_embeddings", c.max_position_embeddings));
  if (!(c.rms_norm_eps > 0)) return f.FieldError("rms_norm_eps", "must be positive");
  if (c.num_heads % c.num_kv_heads != 0) {
    return f.FieldError("num_key_value_heads", StrCat(c.num_kv_heads, " does not divide num_attention_heads (",
                                                            c.num_heads, ")"));
  }
  if (f.Has("head_dim")) {
    ODMOE_ASSIGN_OR_RETURN(c.head_dim, f.Int("head_dim"));
    ODMOE_RETURN_IF_ERROR(RequirePositive(f, "head_dim", c.head_dim));
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      return f.FieldError("head_dim", StrCat("absent, and hidden_size (", c.hidden_size,
                                                   ") is not a multiple of num_attention_heads (", c.num_heads, ")"));
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2 != 0) return f.FieldError("head_dim", StrCat("must be even for rotary embedding, got ",
                                                                         c.head_dim));

  // Expert count: `num_local_experts` (Mixtral) or `num_experts` (Qwen, OLMoE); HF maps one name to the other.
  const bool has_local = f.Has("num_local_experts"), has_num = f.Has("num_experts");
  ODMOE_ASSIGN_OR_RETURN(int64_t n_local, f.Int("num_local_experts", d.num_experts));
  ODMOE_ASSIGN_OR_RETURN(int64_t n_num, f.Int("num_experts", d.num_experts));
  if (has_local && has_num && n_local != n_num) {
    return f.FieldError("num_experts", StrCat(n_num, " disagrees with num_local_experts (", n_local, ")"));
  }
  c.num_experts = has_local ? n_local : n_num;
  ODMOE_ASSIGN_OR_RETURN(c.top_k, f.Int("num_experts_per_tok", d.top_k));
  if (c.num_experts < 0) return f.FieldError("num_experts", "must not be negative");
  if (c.num_experts > 0) {
    ODMOE_RETURN_IF_ERROR(RequirePositive(f, "num_experts_per_tok", c.top_k));
    if (c.top_k > c.num_experts) {
      return f.FieldError("num_experts_per_tok",
                          StrCat(c.top_k, " exceeds the number of experts (", c.num_experts, ")"));
    }
  }

  ODMOE_ASSIGN_OR_RETURN(int64_t intermediate, f.Int("intermediate_size", d.intermediate_size));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "intermediate_size", intermediate));
  c.dense_intermediate_size = intermediate;
  switch (c.arch) {
    case Architecture::kMixtral: {
      c.expert_intermediate_size = intermediate;
      c.norm_topk_prob = true;  // Mixtral always renormalises its top-k weights
      break;
    }
    case Architecture::kOlmoe: {
      c.expert_intermediate_size = intermediate;
      c.qk_norm = QkNorm::kFull;
      ODMOE_ASSIGN_OR_RETURN(c.norm_topk_prob, f.Bool("norm_topk_prob", d.norm_topk_prob));
      ODMOE_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
      c.o_bias = c.qkv_bias;
      break;
    }
    case Architecture::kQwen2Moe: {
      ODMOE_ASSIGN_OR_RETURN(c.expert_intermediate_size, f.Int("moe_intermediate_size", d.moe_intermediate_size));
      ODMOE_ASSIGN_OR_RETURN(c.shared_expert_intermediate_size,
                             f.Int("shared_expert_intermediate_size", d.shared_expert_intermediate_size));
      ODMOE_ASSIGN_OR_RETURN(c.norm_topk_prob, f.Bool("norm_topk_prob", d.norm_topk_prob));
      ODMOE_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("qkv_bias", d.qkv_bias));
      break;
    }
    case Architecture::kQwen3Moe: {
      ODMOE_ASSIGN_OR_RETURN(c.expert_intermediate_size, f.Int("moe_intermediate_size", d.moe_intermediate_size));
      ODMOE_ASSIGN_OR_RETURN(c.norm_topk_prob, f.Bool("norm_topk_prob", d.norm_topk_prob));
      ODMOE_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
      c.o_bias = c.qkv_bias;
      c.qk_norm = QkNorm::kPerHead;
      break;

    }
  }
  if (c.num_experts > 0) {
    ODMOE_RETURN_IF_ERROR(RequirePositive(f, c.arch == Architecture::kQwen2Moe || c.arch == Architecture::kQwen3Moe
                                                 ? "moe_intermediate_size"
                                                 : "intermediate_size",
                                          c.expert_intermediate_size));
  }
  if (c.shared_expert_intermediate_size < 0) {
    return f.FieldError("shared_expert_intermediate_size", "must not be negative");
  }

  if (c.arch == Architecture::kQwen2Moe || c.arch == Architecture::kQwen3Moe) {
    ODMOE_ASSIGN_OR_RETURN(c.decoder_sparse_step, f.Int("decoder_sparse_step", 1));
    ODMOE_RETURN_IF_ERROR(RequirePositive(f, "decoder_sparse_step", c.decoder_sparse_step));
    ODMOE_ASSIGN_OR_RETURN(c.mlp_only_layers, f.IntList("mlp_only_layers"));
    for (int64_t l : c.mlp_only_layers) {
      if (l < 0 || l >= c.num_layers) {
        return f.FieldError("mlp_only_layers", StrCat("layer ", l, " is outside [0, ", c.num_layers, ")"));
      }
    }
  }
  ODMOE_ASSIGN_OR_RETURN(c.sliding_window, ReadSlidingWindow(f, c.arch));

  ODMOE_ASSIGN_OR_RETURN(c.tie_word_embeddings, f.Bool("tie_word_embeddings", false));
  if (f.Has("bos_token_id")) {
    ODMOE_ASSIGN_OR_RETURN(int64_t bos, f.Int("bos_token_id"));
    c.bos_token_id = bos;
  } else if (!json.contains("bos_token_id")) {
    c.bos_token_id = d.bos;
  }
  if (json.contains("eos_token_id")) {
    ODMOE_ASSIGN_OR_RETURN(c.eos_token_ids, f.IntOrIntList("eos_token_id"));
  } else if (d.eos) {
    c.eos_token_ids = {*d.eos};
  }
  for (int64_t id : c.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return f.FieldError("eos_token_id", StrCat(id, " is outside the vocabulary [0, ", c.vocab_size, ")"));
    }
  }

  std::string dtype;
  ODMOE_ASSIGN_OR_RETURN(dtype, f.String("dtype", ""));
  if (dtype.empty()) {
    ODMOE_ASSIGN_OR_RETURN(dtype, f.String("torch_dtype", "float32"));
  }
  if (dtype != "float32" && dtype != "float16" && dtype != "bfloat16" && dtype != "auto") {
    return Unsupported(where, "dtype", StrCat("'", dtype, "' (supported: float32, float16, bfloat16)"));
  }
  c.torch_dtype = dtype;
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ODMOE_ASSIGN_OR_RETURN(Json json, ParseJson(text, path));
  ODMOE_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(json, path));

  const std::string gen_path = dir + "/generation_config.json";
  if (FileExists(gen_path)) {
    ODMOE_ASSIGN_OR_RETURN(std::string gen_text, ReadFileToString(gen_path));
    ODMOE_ASSIGN_OR_RETURN(Json gen, ParseJson(gen_text, gen_path));
    if (!gen.is_object()) return absl::FailedPreconditionError(StrCat(gen_path, ": expected a JSON object"));
    JsonFields gf(gen, gen_path);
    ODMOE_ASSIGN_OR_RETURN(std::vector<int64_t> eos, gf.IntOrIntList("eos_token_id"));
    for (int64_t id : eos) {
      if (id < 0 || id >= config.vocab_size) {
        return gf.FieldError("eos_token_id", StrCat(id, " is outside the vocabulary [0, ", config.vocab_size, ")"));
      }
      if (std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), id) == config.eos_token_ids.end()) {
        config.eos_token_ids.push_back(id);
      }
    }
  }
  return config;
}

absl::Status CheckSequenceLength(const ModelConfig& config, int64_t total_tokens) {
  if (total_tokens > config.max_position_embeddings) {
    return absl::OutOfRangeError(StrCat("sequence of ", total_tokens,
                                              " tokens exceeds the model's max_position_embeddings (",
                                              config.max_position_embeddings, ")"));
  }
  if (config.sliding_window && total_tokens > *config.sliding_window) {
    return absl::UnimplementedError(StrCat("config.json: field 'sliding_window': a sequence of ", total_tokens,
                                                 " tokens exceeds the window of ", *config.sliding_window,
                                                 ", and sliding-window attention is not implemented"));
  }
  return absl::OkStatus();
}

}  // namespace odmoe
