#include "src/worker_node/expert_loader.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <vector>

#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/model_layout.h"

namespace odmoe {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

LoadedExpert::~LoadedExpert() {
  if (ready != nullptr) device->SynchronizeEvent(*ready);
}

absl::StatusOr<std::unique_ptr<ExpertLoader>> ExpertLoader::Create(const ModelConfig& config, TensorSource& source,
                                                                   const ExpertStore& store, Device& device) {
  std::unique_ptr<ExpertLoader> loader(new ExpertLoader(config, source, store, device));
  for (int64_t layer : config.SparseLayers()) {
    for (int64_t e = 0; e < config.num_experts; ++e) {
      ODMOE_ASSIGN_OR_RETURN(const ExpertStore::Expert layout, ExpertStore::LayoutOf(config, source, layer, e));
      loader->expert_bytes_ = std::max(loader->expert_bytes_, layout.block_bytes);
    }
  }
  return loader;
}

absl::StatusOr<std::unique_ptr<LoadedExpert>> ExpertLoader::Load(int64_t layer, int64_t e, Stream* stream,
                                                                 Allocate allocate, bool async) {
  const Clock::time_point start = Clock::now();
  const std::vector<TensorSpec> specs = ExpertTensors(config_, layer, e);
  // The packed block when the store holds the expert; else the layout of the source's tensors, with each
  // projection's host bytes: straight from a stable source, or packed into `staging` (alive until the copies
  // have been synchronized below).
  const ExpertStore::Expert* packed = store_.Find(layer, e);
  ExpertStore::Expert layout;
  std::array<const uint8_t*, 3> host{};
  std::array<uint64_t, 3> nbytes{};
  std::vector<uint8_t> staging;
  if (packed != nullptr) {
    layout = *packed;
  } else {
    ODMOE_ASSIGN_OR_RETURN(layout, ExpertStore::LayoutOf(config_, source_, layer, e));
    absl::MutexLock source_lock(&source_mu_);
    if (!source_.stable()) staging.resize(layout.block_bytes);
    for (size_t i = 0; i < specs.size() && i < 3; ++i) {
      ODMOE_ASSIGN_OR_RETURN(const SourceTensor t, source_.Read(specs[i]));
      nbytes[i] = t.nbytes;
      if (source_.stable()) {
        host[i] = t.data;
      } else {
        std::memcpy(staging.data() + layout.offsets[i], t.data, t.nbytes);
        host[i] = staging.data() + layout.offsets[i];
      }
    }
  }
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> buffer,
                         allocate(layout.block_bytes, StrCat("expert ", e, " of layer ", layer)));
  auto loaded = std::make_unique<LoadedExpert>();
  loaded->device = &device_;
  loaded->buffer = std::move(buffer);
  uint8_t* base = loaded->buffer->as<uint8_t>();
  if (packed != nullptr) {
    device_.CopyToDevice(base, packed->data, packed->copy_bytes, stream);  // one copy moves the expert
    loaded->tensor_bytes = packed->tensor_bytes;
  } else {
    for (size_t i = 0; i < 3; ++i) {
      device_.CopyToDevice(base + layout.offsets[i], host[i], nbytes[i], stream);
      loaded->tensor_bytes += nbytes[i];
    }
  }
  for (size_t i = 0; i < specs.size() && i < 3; ++i) {
    const WeightRef ref{base + layout.offsets[i], layout.dtypes[i]};
    switch (specs[i].role) {
      case TensorRole::kExpertGate:
        loaded->mlp.gate = ref;
        break;
      case TensorRole::kExpertUp:
        loaded->mlp.up = ref;
        break;
      case TensorRole::kExpertDown:
        loaded->mlp.down = ref;
        break;
      default:
        return absl::InternalError(StrCat("unexpected tensor ", specs[i].name, " among an expert's"));
    }
  }
  loaded->mlp.intermediate = config_.expert_intermediate_size;
  if (async && packed != nullptr) {
    // The store's bytes stay valid; whoever uses the expert waits for `ready`.
    loaded->ready = device_.CreateEvent();
    device_.RecordEvent(*loaded->ready, stream);
  } else {
    // Waiting here makes the expert usable from any stream, times the load, and lets `staging` go.
    device_.Synchronize(stream);
  }
  loaded->load_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return loaded;
}

}  // namespace odmoe
