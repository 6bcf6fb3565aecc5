#include "src/model/open_model.h"

#include <utility>
#include <vector>

#include "src/common/status.h"
#include "src/model/fingerprint.h"
#include "src/model/model_layout.h"

namespace odmoe {

absl::StatusOr<OpenedModel> OpenModel(const ModelSource& model, const std::string& model_dir) {
  OpenedModel m;
  if (model_dir.empty() && model.is_synthetic()) {
    const SyntheticSpec spec = SyntheticSpecOf(model);
    ODMOE_ASSIGN_OR_RETURN(m.config, SyntheticModelConfig(spec));
    ODMOE_ASSIGN_OR_RETURN(m.fingerprint, SyntheticFingerprint(spec));
    m.source = std::make_unique<SyntheticSource>(m.config, spec.seed);
    return m;
  }
  ODMOE_ASSIGN_OR_RETURN(m.config, LoadModelConfig(model_dir));
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

}  // namespace odmoe
