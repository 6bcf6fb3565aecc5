// Opening a model, decided in one place for every daemon and `odmoe generate`: a Hugging Face checkpoint
// (config.json + safetensors, memory-mapped), or synthetic weights generated from a config (seeded) when no
// checkpoint folder is given and the cluster file's [model] names one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "src/common/cluster_config.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/synthetic.h"
#include "src/model/tensor_source.h"
#include "src/model/tokenizer.h"

namespace odmoe {

struct OpenedModel {
  ModelConfig config;
  std::string fingerprint;                 // src/model/fingerprint.h
  std::unique_ptr<Checkpoint> checkpoint;  // nullptr with synthetic weights
  // The tensors: a CheckpointSource over `checkpoint`, or a SyntheticSource. Never nullptr.
  std::unique_ptr<TensorSource> source;
  bool synthetic() const { return checkpoint == nullptr; }
  // The bytes of one routed expert (its three projections) as stored; metadata only, nothing is read.
  // 0 for a model without sparse layers.
  uint64_t ExpertBytes() const;
};

// Synthetic weights when `model_dir` is empty and `model` names a synthetic config (model.synthetic,
// model.layers, model.seed); else the checkpoint in `model_dir`. The config's context is capped at
// model.max_model_len (ModelConfig::context_length; InvalidArgument when it exceeds max_position_embeddings).
// Errors name the file or field at fault.
absl::StatusOr<OpenedModel> OpenModel(const ModelSource& model, const std::string& model_dir);

// The tokenizer of `model` opened from `model_dir`: nullptr for synthetic weights or a folder that ships none;
// an error (naming the file) for one that is there but cannot be read.
absl::StatusOr<std::unique_ptr<Tokenizer>> OpenTokenizer(const OpenedModel& model, const std::string& model_dir);

// The synthetic spec of a cluster file's [model] section.
inline SyntheticSpec SyntheticSpecOf(const ModelSource& model) {
  return SyntheticSpec{model.synthetic, model.layers, model.seed};
}

}  // namespace odmoe
