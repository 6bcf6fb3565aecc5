// ExpertLoader: one routed expert from host memory to a device allocation.
//
// The bytes come from the worker's ExpertStore when it holds the expert (one packed block: one copy), else from
// the weight source (an expert taken over from another worker: for a mapped checkpoint one copy per projection
// straight from the mapping, pageable; for a generator, packed into a host buffer first). Either way the
// projections sit at the offsets ExpertStore::LayoutOf gives, so one allocation of the block's size holds them.
//
// The device memory comes from the caller (`allocate`), so the budget and any eviction stay the worker's
// decision.
//
// Thread safety: Load may be called concurrently; reads of a source that is not stable() are serialized by
// `source_mu_` (and copied before it is released). The store, source and device must outlive the loader.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "src/backend/device.h"
#include "src/engine/moe_units.h"
#include "src/model/model_config.h"
#include "src/model/tensor_source.h"
#include "src/worker_node/expert_store.h"
#include "src/worker_node/residency.h"

namespace odmoe {

// One expert's projections in device memory (one allocation: gate, up, down at aligned offsets).
struct LoadedExpert final : ResidentPayload {
  ~LoadedExpert() override;  // waits for `ready` first: the copy must not outlive the memory it writes

  Device* device = nullptr;
  std::unique_ptr<Buffer> buffer;
  MlpWeights mlp;
  uint64_t tensor_bytes = 0;     // bytes copied host-to-device
  double load_ms = 0;            // an asynchronous load: the time to enqueue it (the wait is added when used)
  std::unique_ptr<Event> ready;  // an asynchronous load: recorded after its copy (null: complete)
};

class ExpertLoader {
 public:
  using Allocate = absl::FunctionRef<absl::StatusOr<std::unique_ptr<Buffer>>(size_t bytes, std::string_view tag)>;

  // Computes the largest expert's device bytes from the source's metadata (nothing is read).
  static absl::StatusOr<std::unique_ptr<ExpertLoader>> Create(const ModelConfig& config, TensorSource& source,
                                                              const ExpertStore& store, Device& device);

  // Device bytes of the largest expert of the model (the block an allocation must hold).
  uint64_t expert_bytes() const { return expert_bytes_; }

  // Copies expert (layer, e) into a buffer from `allocate` on `stream`. Synchronous (waits for the copies, so
  // the expert is usable from any stream), unless `async` and the bytes come from the store: then
  // LoadedExpert::ready is recorded after the copy and whoever uses the expert waits for it. Errors: those of
  // `allocate` (returned as they are) and of the source.
  absl::StatusOr<std::unique_ptr<LoadedExpert>> Load(int64_t layer, int64_t e, Stream* stream, Allocate allocate,
                                                     bool async = false);

 private:
  ExpertLoader(const ModelConfig& config, TensorSource& source, const ExpertStore& store, Device& device)
      : config_(config), source_(source), store_(store), device_(device) {}

  const ModelConfig& config_;
  TensorSource& source_;
  const ExpertStore& store_;
  Device& device_;
  uint64_t expert_bytes_ = 0;  // constant after construction
  absl::Mutex source_mu_;      // serializes Reads of the source (copied before it is released)
};

}  // namespace odmoe
