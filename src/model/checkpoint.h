// A Hugging Face checkpoint folder: one model.safetensors, or shards listed in model.safetensors.index.json.
// Every shard is memory-mapped and validated when the checkpoint is opened; tensors are handed out only after
// their dtype and shape are checked against what the caller expects.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "src/model/model_layout.h"
#include "src/model/safetensors.h"

namespace odmoe {

// A checked view of one tensor's bytes inside a mapped shard. Valid while the Checkpoint lives.
struct TensorData {
  const TensorInfo* info = nullptr;
  const uint8_t* data = nullptr;
  DType dtype = DType::kF32;
  const std::string* file = nullptr;  // the shard's path
};

// Thread safety: all methods may be called concurrently.
class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // The file that lists the tensors: DIR/model.safetensors.index.json, or DIR/model.safetensors.
  const std::string& source() const { return source_; }
  // The validated shards, in the order they were opened.
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }
  // Metadata lookup (records nothing). nullptr if absent.
  const TensorInfo* Find(std::string_view name) const;
  // The shard that holds `name`; nullptr if absent.
  const SafetensorsFile* ShardOf(std::string_view name) const;

  // Checks and returns tensor `name`: present (NotFound otherwise), of a dtype odmoe computes with (F32, F16,
  // BF16; Unimplemented otherwise) and of shape `expected` (FailedPrecondition otherwise). Records the read.
  absl::StatusOr<TensorData> Read(std::string_view name, std::span<const int64_t> expected);
  absl::StatusOr<TensorData> Read(const TensorSpec& spec) { return Read(spec.name, spec.shape); }

  // Checks every tensor in `specs` without recording reads: presence, dtype, shape.
  absl::Status Validate(const std::vector<TensorSpec>& specs) const;

  // Names of the tensors handed out by Read so far (sorted).
  std::vector<std::string> ReadNames() const;
  // How many tensors handed out so far belong to routed experts.
  int64_t ExpertTensorsRead() const;

  std::vector<std::string> TensorNames() const;
  // Bytes of all shards together.
  uint64_t TotalBytes() const;

 private:
  Checkpoint() = default;
  absl::StatusOr<TensorData> Check(std::string_view name, std::span<const int64_t> expected) const;

  std::string dir_;
  std::string source_;  // model.safetensors.index.json or model.safetensors: named when a tensor is missing
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::unordered_map<std::string, const SafetensorsFile*> where_;  // tensor name -> shard
  mutable std::mutex mu_;
  std::set<std::string> read_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odmoe
