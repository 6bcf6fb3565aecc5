#include "src/model/tensor_source.h"

#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {

absl::StatusOr<TensorMeta> CheckpointSource::Meta(const TensorSpec& spec) const {
  ODMOE_RETURN_IF_ERROR(checkpoint_.Validate({spec}));
  const TensorInfo* info = checkpoint_.Find(spec.name);
  if (info == nullptr || !info->dtype.has_value()) {
    return absl::NotFoundError(StrCat("tensor ", spec.name, " is missing or of an unsupported dtype"));
  }
  return TensorMeta{*info->dtype, info->nbytes};
}

absl::StatusOr<SourceTensor> CheckpointSource::Read(const TensorSpec& spec) {
  ODMOE_ASSIGN_OR_RETURN(TensorData t, checkpoint_.Read(spec));
  return SourceTensor{t.data, static_cast<size_t>(t.info->nbytes), t.dtype};
}

}  // namespace odmoe
