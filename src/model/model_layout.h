// Tensor names and shapes of each architecture's canonical Hugging Face checkpoint layout, and which tensors a
// given config needs. Every node asks this one place: main for the non-expert tensors, a worker for the
// experts it serves, the shadow for everything.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/model/model_config.h"

namespace odmoe {

enum class TensorRole {
  kEmbed,
  kLmHead,
  kFinalNorm,
  kInputNorm,
  kPostNorm,
  kQ,
  kK,
  kV,
  kO,
  kQBias,
  kKBias,
  kVBias,
  kOBias,
  kQNorm,
  kKNorm,
  kRouter,
  kExpertGate,  // w1 / gate_proj
  kExpertUp,    // w3 / up_proj
  kExpertDown,  // w2 / down_proj
  kSharedGate,
  kSharedUp,
  kSharedDown,
  kSharedExpertGate,  // the sigmoid gate of the shared expert: [1, hidden]
  kDenseGate,
  kDenseUp,
  kDenseDown,
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorRole role;
  int64_t layer = -1;   // -1 for model-level tensors
  int64_t expert = -1;  // -1 for non-expert tensors
};

// The checkpoint name of a tensor, e.g. "model.layers.3.block_sparse_moe.experts.5.w1.weight".
std::string TensorName(const ModelConfig& config, TensorRole role, int64_t layer = -1, int64_t expert = -1);

// Every non-expert tensor the config needs (embedding, attention, norms, routers, shared experts, dense MLPs,
// lm_head unless tied), in a stable order.
std::vector<TensorSpec> NonExpertTensors(const ModelConfig& config);
// The gate, up and down projections of one routed expert.
std::vector<TensorSpec> ExpertTensors(const ModelConfig& config, int64_t layer, int64_t expert);
// All routed-expert tensors of the model.
std::vector<TensorSpec> AllExpertTensors(const ModelConfig& config);

// True if `name` is a routed expert's tensor (under any supported architecture's naming).
bool IsExpertTensorName(std::string_view name);

}  // namespace odmoe
