// The weights of a model, uploaded to one Device in their checkpoint dtype.
//
// Which tensors a process holds depends on its role: the single-process engine and the shadow hold everything,
// main holds everything but the routed experts, a worker holds only experts. `WeightSelection` says which.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/tensor_source.h"

namespace odmoe {

// A SwiGLU MLP: down(silu(gate(x)) * up(x)). Routed experts, the shared expert and dense MLP layers all have
// this shape. `intermediate` is 0 when the MLP is absent.
struct MlpWeights {
  WeightRef gate;  // [intermediate, hidden]
  WeightRef up;    // [intermediate, hidden]
  WeightRef down;  // [hidden, intermediate]
  // gate and up as one matrix [2 intermediate, hidden] whose row blocks they are: one MatMul gives a token's
  // [gate | up]. Set for shared experts and dense MLPs that could be stacked (ModelWeights::Stackable); empty
  // otherwise, and for routed experts.
  WeightRef gate_up;
  int64_t intermediate = 0;
  bool present() const { return intermediate > 0; }
};

struct AttentionWeights {
  WeightRef q, k, v, o;                      // [q_size, h], [kv_size, h], [kv_size, h], [h, q_size]
  WeightRef q_bias, k_bias, v_bias, o_bias;  // empty when the architecture has none
  WeightRef q_norm, k_norm;                  // [head_dim] (per head) or [q_size]/[kv_size] (whole projection)
  // q, k and v as one matrix [q_size + 2 kv_size, h] whose row blocks q, k and v are (and their biases likewise,
  // when the architecture has them): one MatMul gives a token's [q | k | v], each row bitwise what its own
  // matrix gives. Empty when they are stored apart (see ModelWeights::Stackable).
  WeightRef qkv, qkv_bias;
};

struct LayerWeights {
  WeightRef input_norm, post_norm;  // [hidden]
  AttentionWeights attn;
  bool sparse = false;
  WeightRef router;        // [num_experts, hidden] (sparse layers)
  MlpWeights shared;       // the shared expert (Qwen2-MoE), absent otherwise
  WeightRef shared_gate;   // [1, hidden]: sigmoid gate of the shared expert
  MlpWeights dense;        // dense MLP (layers without a router)
  std::vector<MlpWeights> experts;  // [num_experts]; an expert not held has intermediate == 0
};

// How the linear weights inside the decoder layers (attention projections, routers, experts, shared experts,
// dense MLPs) are stored on the device; embeddings, lm_head, norms and biases are always kept as they are.
// The shadow's replica: kFp16 rounds them to fp16; kInt8 / kNf4 quantize them at load time (src/backend/
// quantize.h) and MatMul dequantizes as it reads.
enum class WeightQuant { kNone, kFp16, kInt8, kNf4 };

// Which tensors to upload.
struct WeightSelection {
  bool non_expert = true;  // embeddings, attention, norms, routers, shared experts, dense MLPs, lm_head
  // Routed experts: all of them, none, or those for which `want_expert(layer, expert)` is true.
  enum class Experts { kAll, kNone, kSome } experts = Experts::kAll;
  std::vector<std::pair<int64_t, int64_t>> some;  // (layer, expert) pairs when kSome
  WeightQuant quant = WeightQuant::kNone;
  // With `quant`: these decoder-layer weights keep the checkpoint's precision ([shadow] keep_router,
  // keep_attention): the routers; the attention projections q, k, v, o.
  bool keep_router = false;
  bool keep_attention = false;

  // How the tensor `spec` is stored under this selection.
  WeightQuant QuantOf(const TensorSpec& spec) const;

  static WeightSelection All() { return {}; }
  static WeightSelection NonExpertOnly() { return {true, Experts::kNone, {}, WeightQuant::kNone}; }
  static WeightSelection Quantized(WeightQuant q) { return {true, Experts::kAll, {}, q}; }
};

// Thread safety: immutable after Load.
class ModelWeights {
 public:
  // Reads the selected tensors from `source` (validated first: presence, dtype, shape) and copies them to
  // `device`. Errors name the tensor and the source; ResourceExhausted when the device is too small. A source
  // whose bytes do not outlive the next Read (stable() false) is synchronized after each copy.
  static absl::StatusOr<std::unique_ptr<ModelWeights>> Load(const ModelConfig& config, TensorSource& source,
                                                            Device& device, const WeightSelection& selection);
  // The same from a checkpoint (through CheckpointSource).
  static absl::StatusOr<std::unique_ptr<ModelWeights>> Load(const ModelConfig& config, Checkpoint& checkpoint,
                                                            Device& device, const WeightSelection& selection);

  const ModelConfig& config() const { return config_; }
  WeightRef embed() const { return embed_; }        // [vocab, hidden]
  WeightRef final_norm() const { return final_norm_; }  // [hidden]
  WeightRef lm_head() const { return lm_head_; }    // [vocab, hidden] (the embedding when tied)
  const LayerWeights& layer(int64_t l) const { return layers_[static_cast<size_t>(l)]; }
  // The routed expert (layer, e), or nullptr when this process does not hold it.
  const MlpWeights* expert(int64_t layer, int64_t e) const;
  uint64_t device_bytes() const { return device_bytes_; }

 private:
  explicit ModelWeights(const ModelConfig& config) : config_(config) {}
  // One tensor in the form the device stores it, still in host memory (model_weights.cc).
  struct HostWeight;
  // Reads `spec` and converts it as `quant` says. own: copy bytes kept as they are out of the source (whose
  // memory the next Read may reuse).
  static absl::StatusOr<HostWeight> Encode(TensorSource& source, const TensorSpec& spec, WeightQuant quant, bool own);
  // Copies `parts` into one new device allocation (their scales into another, when quantized); returns the
  // allocation as a whole, then each part's view. Waits for the copies unless every part's bytes outlive them.
  absl::StatusOr<std::vector<WeightRef>> UploadParts(Device& device, const std::vector<HostWeight>& parts,
                                                     const std::string& tag, bool source_stable);
  // One tensor in an allocation of its own.
  absl::StatusOr<WeightRef> Upload(TensorSource& source, Device& device, const TensorSpec& spec, WeightQuant quant);
  // Whether `specs`, stored as `quant` says, can share one allocation (Load stacks them only then): their stored
  // dtypes agree and each one's bytes are a multiple of 16, so the next one keeps the 16-byte alignment the
  // GEMVs' vector loads want. Reads metadata only.
  static absl::StatusOr<bool> Stackable(const TensorSource& source, const std::vector<const TensorSpec*>& specs,
                                        WeightQuant quant);
  // Stores Stackable `specs` one after another in one allocation; returns the stack, then each tensor's view.
  absl::StatusOr<std::vector<WeightRef>> UploadStacked(TensorSource& source, Device& device,
                                                       const std::vector<const TensorSpec*>& specs, WeightQuant quant,
                                                       const std::string& tag);
  // Stores, from a layer's non-expert `specs`, what one token's projection reads together as one stack each, where
  // Stackable: q, k and v (with their biases, when the architecture has them: AttentionWeights::qkv, qkv_bias);
  // the gate and up of its shared expert or dense MLP (MlpWeights::gate_up). Sets their views in `lw` and adds
  // the specs stored to `stacked`; Load stores the others one by one.
  absl::Status StackLayer(TensorSource& source, Device& device, const std::map<TensorRole, const TensorSpec*>& specs,
                          const WeightSelection& selection, LayerWeights& lw, std::set<const TensorSpec*>& stacked);

  ModelConfig config_;
  WeightRef embed_, final_norm_, lm_head_;
  std::vector<LayerWeights> layers_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  uint64_t device_bytes_ = 0;
};

}  // namespace odmoe
