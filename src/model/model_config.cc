#include "src/model/model_config.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"

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

// Sizes beyond these are not a real model; bounding them keeps every shape product far from int64 overflow.
constexpr int64_t kMaxSize = int64_t{1} << 24;
constexpr int64_t kMaxPositions = int64_t{1} << 40;

absl::Status RequirePositive(const JsonFields& f, std::string_view field, int64_t v, int64_t max = kMaxSize) {
  if (v <= 0) return f.FieldError(field, StrCat("must be positive, got ", v));
  if (v > max) return f.FieldError(field, StrCat(v, " is too large (at most ", max, ")"));
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
    JsonFields rf(*rp, StrCat(f.where(), ": ", key));
    for (const auto& [k, v] : rp->items()) {  // Transformers 5 nests parameters per layer type for some models
      if (v.is_object()) {
        return Unsupported(f.where(), StrCat(key, ".", k), "per-layer-type rope parameters are not implemented");
      }
    }
    const char* type_key = rf.Has("rope_type") ? "rope_type" : "type";  // "type": the legacy spelling
    ODMOE_ASSIGN_OR_RETURN(std::string type, rf.String(type_key, "default"));
    if (type != "default") {
      return Unsupported(f.where(), StrCat(key, ".", type_key),
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

// The attention window that applies, if any, following what HF Transformers' modeling code does:
//   Mixtral: every layer uses `sliding_window` when it is not null.
//   Qwen3-MoE: every layer uses `sliding_window` (default 4096) when `use_sliding_window` is true.
//   Qwen2-MoE: the layers that `layer_types` marks "sliding_attention" (when absent: the even layers below
//     `max_window_layers`, and only with `use_sliding_window`) use `sliding_window` (default 4096).
//   OLMoE: no sliding window.
absl::StatusOr<std::optional<int64_t>> ReadSlidingWindow(const JsonFields& f, Architecture arch, int64_t num_layers) {
  const std::optional<int64_t> none;
  if (arch == Architecture::kOlmoe) return none;
  const bool explicit_null = f.Contains("sliding_window") && !f.Has("sliding_window");
  // Absent: HF's default (Mixtral: none; Qwen: 4096). Explicit null: no window.
  ODMOE_ASSIGN_OR_RETURN(int64_t window, f.Int("sliding_window", arch == Architecture::kMixtral ? 0 : 4096));
  if (arch == Architecture::kMixtral) {
    if (!f.Has("sliding_window")) return none;
    if (window <= 0) return f.FieldError("sliding_window", StrCat("must be positive or null, got ", window));
    return std::optional<int64_t>{window};
  }
  ODMOE_ASSIGN_OR_RETURN(bool use, f.Bool("use_sliding_window", false));
  bool any_sliding = false;
  if (arch == Architecture::kQwen3Moe) {
    any_sliding = use && !explicit_null;
  } else if (const Json* types = f.Get("layer_types")) {  // Qwen2-MoE with explicit layer types
    if (!types->is_array()) return f.FieldError("layer_types", StrCat("expected a list, got ", JsonTypeName(*types)));
    if (static_cast<int64_t>(types->size()) != num_layers) {
      return f.FieldError("layer_types",
                          StrCat("lists ", types->size(), " layers but num_hidden_layers is ", num_layers));
    }
    for (const Json& t : *types) {
      if (!t.is_string()) return f.FieldError("layer_types", StrCat("expected strings, got ", JsonTypeName(t)));
      const std::string type = t.get<std::string>();
      if (type == "sliding_attention") {
        any_sliding = true;
      } else if (type != "full_attention") {
        return Unsupported(f.where(), "layer_types", StrCat("layer type '", type, "' is not implemented"));
      }
    }
  } else {  // Qwen2-MoE without layer_types: layers 0, 2, 4, ... below max_window_layers slide
    ODMOE_ASSIGN_OR_RETURN(int64_t max_window_layers, f.Int("max_window_layers", 28));
    any_sliding = use && max_window_layers > 0;
  }
  if (!any_sliding) return none;
  // Qwen2-MoE sets the window to 0 unless use_sliding_window is true; a null window has no size either.
  if ((arch == Architecture::kQwen2Moe && !use) || explicit_null) window = 0;
  if (window <= 0) {
    return Unsupported(f.where(), "sliding_window",
                       StrCat("sliding-window layers with a window of ", window, " tokens are not implemented"));
  }
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
  if (act != "silu" && act != "swish") {  // HF's ACT2FN maps both names to SiLU
    return Unsupported(where, "hidden_act", StrCat("'", act, "' is not implemented (only 'silu')"));
  }
  if (f.Has("clip_qkv")) return Unsupported(where, "clip_qkv", "clipping of q/k/v is not implemented");

  ODMOE_ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size", d.vocab_size));
  ODMOE_ASSIGN_OR_RETURN(c.hidden_size, f.Int("hidden_size", d.hidden_size));
  ODMOE_ASSIGN_OR_RETURN(c.num_layers, f.Int("num_hidden_layers", d.num_layers));
  ODMOE_ASSIGN_OR_RETURN(c.num_heads, f.Int("num_attention_heads", d.num_heads));
  // An explicit null means one kv head per attention head (HF's __post_init__), as does an omitted field for
  // the architectures whose default is None.
  if (f.Contains("num_key_value_heads") && !f.Has("num_key_value_heads")) {
    c.num_kv_heads = c.num_heads;
  } else {
    ODMOE_ASSIGN_OR_RETURN(c.num_kv_heads, f.Int("num_key_value_heads", d.num_kv_heads.value_or(c.num_heads)));
  }
  ODMOE_ASSIGN_OR_RETURN(c.max_position_embeddings, f.Int("max_position_embeddings", d.max_position_embeddings));
  ODMOE_ASSIGN_OR_RETURN(c.rms_norm_eps, f.Number("rms_norm_eps", d.rms_norm_eps));
  ODMOE_ASSIGN_OR_RETURN(c.rope_theta, ReadRope(f, d.rope_theta));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "vocab_size", c.vocab_size));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "hidden_size", c.hidden_size));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "num_hidden_layers", c.num_layers));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "num_attention_heads", c.num_heads));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "num_key_value_heads", c.num_kv_heads));
  ODMOE_RETURN_IF_ERROR(RequirePositive(f, "max_position_embeddings", c.max_position_embeddings, kMaxPositions));
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rms_norm_eps)) {
    return f.FieldError("rms_norm_eps", "must be a positive number");
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return f.FieldError("num_key_value_heads",
                        StrCat(c.num_kv_heads, " does not divide num_attention_heads (", c.num_heads, ")"));
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
  if (c.head_dim % 2 != 0) {
    return f.FieldError("head_dim", StrCat("must be even for rotary embedding, got ", c.head_dim));
  }
  // OLMoE normalises q over hidden_size and k over (hidden_size / heads) * kv_heads: HF only runs when the
  // projections have exactly those widths.
  if (c.arch == Architecture::kOlmoe && c.q_size() != c.hidden_size) {
    return Unsupported(where, "head_dim",
                       StrCat(c.head_dim, " x ", c.num_heads, " heads != hidden_size (", c.hidden_size,
                              "): OLMoE's q/k norm spans hidden_size"));
  }

  // Expert count: `num_local_experts` (Mixtral) or `num_experts` (Qwen, OLMoE); HF maps one name to the other.
  const bool has_local = f.Has("num_local_experts"), has_num = f.Has("num_experts");
  ODMOE_ASSIGN_OR_RETURN(int64_t n_local, f.Int("num_local_experts", d.num_experts));
  ODMOE_ASSIGN_OR_RETURN(int64_t n_num, f.Int("num_experts", d.num_experts));
  if (has_local && has_num && n_local != n_num) {
    return f.FieldError("num_experts", StrCat(n_num, " disagrees with num_local_experts (", n_local, ")"));
  }
  c.num_experts = has_local ? n_local : n_num;
  const char* experts_key = has_local ? "num_local_experts" : "num_experts";
  ODMOE_ASSIGN_OR_RETURN(c.top_k, f.Int("num_experts_per_tok", d.top_k));
  // Qwen's decoder layers fall back to a dense MLP when there are no experts; Mixtral and OLMoE always route.
  const bool may_be_dense = c.arch == Architecture::kQwen2Moe || c.arch == Architecture::kQwen3Moe;
  if (c.num_experts < 0 || (c.num_experts == 0 && !may_be_dense)) {
    return f.FieldError(experts_key, StrCat("must be positive, got ", c.num_experts));
  }
  if (c.num_experts > kMaxSize) return f.FieldError(experts_key, StrCat(c.num_experts, " is too large"));
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
    ODMOE_RETURN_IF_ERROR(RequirePositive(f,
                                          c.arch == Architecture::kQwen2Moe || c.arch == Architecture::kQwen3Moe
                                              ? "moe_intermediate_size"
                                              : "intermediate_size",
                                          c.expert_intermediate_size));
  }
  if (c.shared_expert_intermediate_size < 0 || c.shared_expert_intermediate_size > kMaxSize) {
    return f.FieldError("shared_expert_intermediate_size",
                        StrCat("must be in [0, ", kMaxSize, "], got ", c.shared_expert_intermediate_size));
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
  ODMOE_ASSIGN_OR_RETURN(c.sliding_window, ReadSlidingWindow(f, c.arch, c.num_layers));

  ODMOE_ASSIGN_OR_RETURN(c.tie_word_embeddings, f.Bool("tie_word_embeddings", false));
  // Token ids: an explicit value must lie in the vocabulary; an explicit null means none; an omitted field
  // takes HF's default for the architecture when that default fits the vocabulary.
  auto in_vocab = [&](int64_t id) { return id >= 0 && id < c.vocab_size; };
  if (f.Has("bos_token_id")) {
    ODMOE_ASSIGN_OR_RETURN(int64_t bos, f.Int("bos_token_id"));
    if (!in_vocab(bos)) {
      return f.FieldError("bos_token_id", StrCat(bos, " is outside the vocabulary [0, ", c.vocab_size, ")"));
    }
    c.bos_token_id = bos;
  } else if (!f.Contains("bos_token_id") && d.bos && in_vocab(*d.bos)) {
    c.bos_token_id = d.bos;
  }
  if (f.Contains("eos_token_id")) {
    ODMOE_ASSIGN_OR_RETURN(c.eos_token_ids, f.IntOrIntList("eos_token_id"));
    for (int64_t id : c.eos_token_ids) {
      if (!in_vocab(id)) {
        return f.FieldError("eos_token_id", StrCat(id, " is outside the vocabulary [0, ", c.vocab_size, ")"));
      }
    }
  } else if (d.eos && in_vocab(*d.eos)) {
    c.eos_token_ids = {*d.eos};
  }

  // The declared dtype: `dtype` (Transformers 5) or `torch_dtype` (4.x); float32 when neither is given.
  const char* dtype_key = f.Has("dtype") ? "dtype" : "torch_dtype";
  ODMOE_ASSIGN_OR_RETURN(std::string dtype, f.String(dtype_key, "float32"));
  if (dtype != "float32" && dtype != "float16" && dtype != "bfloat16" && dtype != "auto") {
    return Unsupported(where, dtype_key,
                       StrCat("'", dtype, "' is not supported (supported: float32, float16, bfloat16)"));
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

std::string ModelConfig::ContextLengthText() const {
  return max_model_len > 0 ? StrCat("the ", max_model_len, " positions served ([model] max_model_len)")
                           : StrCat("the model's ", max_position_embeddings, " positions (max_position_embeddings)");
}

absl::Status CheckSequenceLength(const ModelConfig& config, int64_t total_tokens) {
  if (total_tokens > config.context_length()) {
    return absl::OutOfRangeError(
        StrCat("a sequence of ", total_tokens, " tokens exceeds ", config.ContextLengthText()));
  }
  if (config.sliding_window && total_tokens > *config.sliding_window) {
    return absl::UnimplementedError(StrCat("config.json: field 'sliding_window': a sequence of ", total_tokens,
                                           " tokens exceeds the window of ", *config.sliding_window,
                                           ", and sliding-window attention is not implemented"));
  }
  return absl::OkStatus();
}

}  // namespace odmoe
