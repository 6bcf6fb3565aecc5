// The hyperparameters of a Hugging Face MoE checkpoint, read from its config.json (and generation_config.json).
// config.json is the only source of model hyperparameters; a field the file omits takes the default that HF
// Transformers uses for that architecture. Features odmoe does not implement are refused with an error that
// names the field, never ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/common/json.h"

namespace odmoe {

enum class Architecture { kMixtral, kQwen2Moe, kQwen3Moe, kOlmoe };

// Where q/k RMSNorm applies: not at all, per head over head_dim (Qwen3-MoE), or over the whole projection
// before the heads are split (OLMoE).
enum class QkNorm { kNone, kPerHead, kFull };

std::string_view ArchitectureName(Architecture arch);  // "MixtralForCausalLM", ...

struct ModelConfig {
  Architecture arch = Architecture::kMixtral;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  // The longest sequence (prompt plus answer) served, when the cluster file's [model] max_model_len caps
  // max_position_embeddings (OpenModel sets it); 0: not capped. Read it through context_length().
  int64_t max_model_len = 0;
  double rope_theta = 0;
  double rms_norm_eps = 0;

  // Experts.
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t expert_intermediate_size = 0;  // rows of one expert's gate/up projection
  bool norm_topk_prob = false;           // renormalise the top-k probabilities to sum to 1
  int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert
  // Dense MLP layers (Qwen mlp_only_layers / decoder_sparse_step); their width.
  int64_t dense_intermediate_size = 0;
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;

  // Attention details.
  bool qkv_bias = false;  // q/k/v projections have biases
  bool o_bias = false;    // o projection has a bias
  QkNorm qk_norm = QkNorm::kNone;
  // The window of the layers that slide, only set when at least one does (Mixtral: sliding_window not null;
  // Qwen: use_sliding_window, and for Qwen2-MoE layer_types / max_window_layers). Not implemented: a request
  // longer than the window is refused by CheckSequenceLength.
  std::optional<int64_t> sliding_window;

  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // any of them ends generation
  std::string torch_dtype;             // as declared ("bfloat16", ...); tensors carry their own dtype

  // True if layer `layer` has a router and experts (otherwise a dense MLP runs there).
  bool IsSparseLayer(int64_t layer) const;
  // Indices of the sparse layers, in order.
  std::vector<int64_t> SparseLayers() const;
  // Position of `layer` among the sparse layers, or -1 for a dense layer.
  int64_t SparseIndex(int64_t layer) const;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
  // The most positions a sequence may have: max_model_len when set, else max_position_embeddings.
  int64_t context_length() const { return max_model_len > 0 ? max_model_len : max_position_embeddings; }
  // context_length() for messages: "the model's 2048 positions (max_position_embeddings)", or "the 512 positions
  // served ([model] max_model_len)".
  std::string ContextLengthText() const;
};

// Parses a config.json object. `where` names the file in messages.
absl::StatusOr<ModelConfig> ParseModelConfig(const Json& config, const std::string& where);

// Reads DIR/config.json and, when present, DIR/generation_config.json (whose eos_token_id is merged in).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

// Checks that a request of `total_tokens` positions fits the model: context_length(), and a sliding window (which
// odmoe does not implement) only matters when the sequence is longer than it.
absl::Status CheckSequenceLength(const ModelConfig& config, int64_t total_tokens);

}  // namespace odmoe
