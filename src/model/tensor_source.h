// Where weights come from: a TensorSource hands out checked tensors by TensorSpec. Two implementations: a
// Checkpoint (memory-mapped safetensors, through CheckpointSource) and synthetic seeded weights
// (SyntheticSource, src/model/synthetic.h). ModelWeights::Load reads through this interface only, so every node
// loads a real checkpoint and synthetic weights through the same code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/common/dtype.h"
#include "src/model/checkpoint.h"
#include "src/model/model_layout.h"

namespace odmoe {

// The bytes of one tensor, row-major, of the spec's shape, in `dtype`.
struct SourceTensor {
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  DType dtype = DType::kF32;
};

// dtype and byte size of one tensor, known without reading it.
struct TensorMeta {
  DType dtype = DType::kF32;
  uint64_t nbytes = 0;
};

// Thread safety: implementations say; ModelWeights::Load uses a source from one thread.
class TensorSource {
 public:
  virtual ~TensorSource() = default;

  // Checks every tensor in `specs` (presence, dtype, shape) without reading it; errors name the tensor and
  // where it was looked for.
  virtual absl::Status Validate(const std::vector<TensorSpec>& specs) const = 0;

  // The dtype and byte size of tensor `spec` (checked like Validate) without reading or generating it.
  virtual absl::StatusOr<TensorMeta> Meta(const TensorSpec& spec) const = 0;

  // The tensor `spec` names, checked like Validate. The bytes stay valid while the source lives when stable()
  // is true, and only until the next Read otherwise.
  virtual absl::StatusOr<SourceTensor> Read(const TensorSpec& spec) = 0;

  // True when the bytes of every Read stay valid while the source lives (a mapped file); false when a Read
  // reuses the memory of the previous one (a generator).
  virtual bool stable() const = 0;

  // What the weights are, for messages: a checkpoint's folder, "synthetic(seed 1, ...)".
  virtual std::string Describe() const = 0;
};

// A Checkpoint as a TensorSource. Reads are recorded by the checkpoint (Checkpoint::ReadNames). Holds a
// reference: the checkpoint must outlive the adapter. Thread safety: as Checkpoint (all methods concurrent).
class CheckpointSource : public TensorSource {
 public:
  explicit CheckpointSource(Checkpoint& checkpoint) : checkpoint_(checkpoint) {}

  absl::Status Validate(const std::vector<TensorSpec>& specs) const override { return checkpoint_.Validate(specs); }
  absl::StatusOr<TensorMeta> Meta(const TensorSpec& spec) const override;
  absl::StatusOr<SourceTensor> Read(const TensorSpec& spec) override;
  bool stable() const override { return true; }
  std::string Describe() const override { return checkpoint_.dir(); }

 private:
  Checkpoint& checkpoint_;
};

}  // namespace odmoe
