// Creates a Device from a command-line spec.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/backend/shape_map.h"
#include "src/common/cluster_config.h"
#include "src/model/model_config.h"

namespace odmoe {

// Specs:
//   "cpu"                   CpuDevice (no capacity limit)
//   "mock-gpu"              MockGpuDevice with the default MockGpuOptions
//   "mock-gpu:CAPACITY_MB"  MockGpuDevice with a capacity of CAPACITY_MB MiB (CAPACITY_MB * 2^20 bytes, > 0)
//   "cuda"                  the CUDA backend (only in builds with ODMOE_HAVE_CUDA)
//   "timed:PROFILE"         only as a node's device in a cluster file: see CreateNodeDevice
// InvalidArgument for an unknown spec (naming it and the choices), a malformed capacity, or "cuda" in a build
// without CUDA.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec);

// A daemon's device: `spec` as above, with its memory capped at `capacity_bytes` where that is non-zero (a
// worker's GPU budget): a CpuDevice with that capacity; a MockGpuDevice with the smaller of it and the spec's,
// no timeline (a daemon runs for long) and pageable host-to-device copies at MockGpuOptions::kPageableFraction
// of the pinned rate; a CUDA device with the capacity rounded up to whole MiB, so that the backend itself
// refuses to allocate past it. Errors as CreateDevice(spec).
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec, uint64_t capacity_bytes);

// The device of the cluster file's node `node`, as a daemon creates it. "timed:PROFILE" (src/backend/timed_device.h)
// takes PROFILE from the file's device profiles, paces to the wall clock, stretches time by [cluster] time_scale
// and, with [cluster] timing_model, charges its work at that model's shapes (TimingShapes below, with the model
// the node computes opened from [model] / `model_dir` as OpenModel does); its capacity is the profile's memory, or
// `capacity_bytes` where that is smaller. Any other spec: CreateDevice(spec) without `capacity_bytes`,
// CreateDevice(spec, *capacity_bytes) with it. Errors name the cluster file, the node and the field or file at
// fault.
absl::StatusOr<std::unique_ptr<Device>> CreateNodeDevice(const ClusterConfig& cluster, const NodeConfig& node,
                                                         const std::string& model_dir,
                                                         std::optional<uint64_t> capacity_bytes = std::nullopt);

// The dimensions of `config` that a ShapeMap recognises; `expert_bytes`: one routed expert as stored (0: three
// projections at the config's torch_dtype, as a target model is charged).
ModelDims ModelDimsOf(const ModelConfig& config, uint64_t expert_bytes = 0);

// The one place that decides a timed device's target shapes: `running` (whose experts take `running_expert_bytes`
// as stored) charged as the model of `timing_model` (a config.json or a folder holding one). Errors name the
// files.
absl::StatusOr<ShapeMap> TimingShapes(const ModelConfig& running, uint64_t running_expert_bytes,
                                      const std::string& running_name, const std::string& timing_model);

// Emulation over shaped links (issue 28): how much larger the timing model's messages are than the running
// model's, so that nodes pad what they send to the target's bytes (the `padding` fields of worker.proto and
// shadow.proto) and the links carry what a deployment of the target would carry.
struct PayloadScale {
  double hidden = 1.0;  // hidden-state rows (expert calls and their outputs): target hidden / running hidden
  double kv = 1.0;      // one position's K/V of every layer: target (layers x kv size) / running's
  // The filler that makes `bytes` of the running model's payload as large as the target's at `scale`: bytes x
  // (scale - 1), 0 below a scale of 1, and at most `room` (a message stays within the gRPC limit).
  static size_t Padding(size_t bytes, double scale, size_t room);
};

// The scales of `cluster`'s [cluster] timing_model against `running`; 1 (no padding) without a timing model.
// Errors name the timing model's file.
absl::StatusOr<PayloadScale> PayloadScaleOf(const ClusterConfig& cluster, const ModelConfig& running);

}  // namespace odmoe
