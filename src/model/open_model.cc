#include "src/model/open_model.h"

#include <filesystem>
#include <utility>
#include <vector>

#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/fingerprint.h"
#include "src/model/model_layout.h"

namespace odmoe {

namespace {

// Caps `config`'s context at `model.max_model_len` (when set). `config_file` names the model's config.json.
absl::Status ApplyMaxModelLen(const ModelSource& model, const std::string& config_file, ModelConfig* config) {
  if (model.max_model_len == 0) return absl::OkStatus();
  if (model.max_model_len > config->max_position_embeddings) {
    return absl::InvalidArgumentError(StrCat("[model] max_model_len ", model.max_model_len, " exceeds ", config_file,
                                             "'s max_position_embeddings (", config->max_position_embeddings, ")"));
  }
  config->max_model_len = model.max_model_len;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<OpenedModel> OpenModel(const ModelSource& model, const std::string& model_dir) {
  OpenedModel m;
  if (model_dir.empty() && model.is_synthetic()) {
    const SyntheticSpec spec = SyntheticSpecOf(model);
    ODMOE_ASSIGN_OR_RETURN(m.config, SyntheticModelConfig(spec));
    ODMOE_RETURN_IF_ERROR(ApplyMaxModelLen(model, model.synthetic, &m.config));
    ODMOE_ASSIGN_OR_RETURN(m.fingerprint, SyntheticFingerprint(spec));
    m.source = std::make_unique<SyntheticSource>(m.config, spec.seed);
    return m;
  }
  ODMOE_ASSIGN_OR_RETURN(m.config, LoadModelConfig(model_dir));
  ODMOE_RETURN_IF_ERROR(
      ApplyMaxModelLen(model, (std::filesystem::path(model_dir) / "config.json").string(), &m.config));
  ODMOE_ASSIGN_OR_RETURN(m.checkpoint, Checkpoint::Open(model_dir));
  ODMOE_ASSIGN_OR_RETURN(m.fingerprint, ModelFingerprint(model_dir, *m.checkpoint));
  m.source = std::make_unique<CheckpointSource>(*m.checkpoint);
  return m;
}

uint64_t OpenedModel::ExpertBytes() const {
  const std::vector<int64_t> sparse = config.SparseLayers();
  if (sparse.empty()) return 0;
  if (synthetic()) {
    return 3 * static_cast<uint64_t>(config.expert_intermediate_size * config.hidden_size) *
           DTypeSize(SyntheticDType(config));
  }
  uint64_t bytes = 0;
  for (const TensorSpec& spec : ExpertTensors(config, sparse[0], 0)) {
    if (const TensorInfo* info = checkpoint->Find(spec.name)) bytes += info->nbytes;
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> OpenTokenizer(const OpenedModel& model, const std::string& model_dir) {
  if (model.synthetic()) return nullptr;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Load(model_dir);
  if (!tokenizer.ok() && absl::IsNotFound(tokenizer.status())) return nullptr;
  return tokenizer;
}

}  // namespace odmoe
