#include "src/model/tensor_source.h"

#include "src/common/status.h"

namespace odmoe {

absl::StatusOr<SourceTensor> CheckpointSource::Read(const TensorSpec& spec) {
  ODMOE_ASSIGN_OR_RETURN(TensorData t, checkpoint_.Read(spec));
  return SourceTensor{t.data, static_cast<size_t>(t.info->nbytes), t.dtype};
}

}  // namespace odmoe
