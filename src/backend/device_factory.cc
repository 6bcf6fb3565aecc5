// CreateDevice: the one place that turns a device spec into a Device. A library of its own so that the CUDA
// backend, which builds on odmoe_backend, can be linked in where the toolchain exists.
#include "src/backend/device_factory.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string_view>

#include "absl/strings/numbers.h"
#include "spdlog/spdlog.h"
#include "src/backend/cpu_device.h"
#include "src/backend/mock_gpu_device.h"
#include "src/backend/timed_device.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/open_model.h"
#include "src/model/synthetic.h"

#ifdef ODMOE_HAVE_CUDA
#include "src/backend/cuda_device.h"
#endif

namespace odmoe {

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec) {
  constexpr std::string_view kChoices =
      "cpu, mock-gpu, mock-gpu:CAPACITY_MB, cuda, cuda:CAPACITY_MB, timed:PROFILE (a node of a cluster file)";
  if (spec == "cpu") return std::unique_ptr<Device>(new CpuDevice());
  if (spec == "mock-gpu") return std::unique_ptr<Device>(new MockGpuDevice());
  constexpr std::string_view kMockPrefix = "mock-gpu:";
  if (spec.starts_with(kMockPrefix)) {
    const std::string_view mb_text = spec.substr(kMockPrefix.size());
    uint64_t mb = 0;
    if (!absl::SimpleAtoi(ToAbslView(mb_text), &mb) || mb == 0 ||
        mb > std::numeric_limits<uint64_t>::max() / (uint64_t{1} << 20)) {
      return absl::InvalidArgumentError(
          StrCat("device '", spec,
                 "': the capacity after 'mock-gpu:' must be a positive number of MiB, e.g. "
                 "mock-gpu:8192"));
    }
    MockGpuOptions options;
    options.capacity_bytes = mb << 20;
    return std::unique_ptr<Device>(new MockGpuDevice(options));
  }
  if (spec == "cuda" || spec.starts_with("cuda:")) {
    uint64_t mb = 0;
    if (spec != "cuda") {
      const std::string_view mb_text = spec.substr(5);
      if (!absl::SimpleAtoi(ToAbslView(mb_text), &mb) || mb == 0 ||
          mb > std::numeric_limits<uint64_t>::max() / (uint64_t{1} << 20)) {
        return absl::InvalidArgumentError(
            StrCat("device '", spec, "': the capacity after 'cuda:' must be a positive number of MiB, e.g. cuda:1024"));
      }
    }
#ifdef ODMOE_HAVE_CUDA
    // The CUDA backend (src/backend/cuda_device.h): GPU 0; its whole memory, or the given budget.
    return CreateCudaDevice(/*ordinal=*/0, /*capacity_bytes=*/mb << 20);
#else
    return absl::InvalidArgumentError(
        StrCat("device '", spec, "': this build has no CUDA backend (configure with ODMOE_CUDA=ON where nvcc is)"));
#endif
  }
  if (spec.starts_with("timed:")) {
    return absl::InvalidArgumentError(StrCat("device '", spec,
                                             "': a timed device takes its profile from a cluster file's "
                                             "[[device_profile]] tables; give it as a node's device there"));
  }
  return absl::InvalidArgumentError(StrCat("unknown device '", spec, "'; choose one of: ", kChoices));
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec, uint64_t capacity_bytes) {
  if (spec == "cpu") return std::unique_ptr<Device>(new CpuDevice(capacity_bytes));
  if (spec.starts_with("mock-gpu")) {
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> probe, CreateDevice(spec));  // validates "mock-gpu[:MB]"
    MockGpuOptions options;
    options.record_timeline = false;
    const uint64_t spec_capacity = probe->memory_info().capacity;
    options.capacity_bytes = capacity_bytes == 0 ? spec_capacity : std::min(capacity_bytes, spec_capacity);
    // Copies from host memory the daemon did not register run at pageable speed.
    options.h2d_pageable_bytes_per_s = options.h2d_bytes_per_s * MockGpuOptions::kPageableFraction;
    return std::unique_ptr<Device>(new MockGpuDevice(options));
  }
  if (spec == "cuda" && capacity_bytes != 0) {
    return CreateDevice(StrCat("cuda:", (capacity_bytes + (uint64_t{1} << 20) - 1) >> 20));
  }
  return CreateDevice(spec);
}

ModelDims ModelDimsOf(const ModelConfig& config, uint64_t expert_bytes) {
  ModelDims d;
  d.hidden = config.hidden_size;
  d.expert_intermediate = config.expert_intermediate_size;
  d.shared_intermediate = config.shared_expert_intermediate_size;
  d.dense_intermediate =
      config.mlp_only_layers.empty() && config.decoder_sparse_step <= 1 ? 0 : config.dense_intermediate_size;
  d.heads = config.num_heads;
  d.kv_heads = config.num_kv_heads;
  d.head_dim = config.head_dim;
  d.vocab = config.vocab_size;
  d.experts = config.num_experts;
  d.weight_dtype = SyntheticDType(config);  // the config's torch_dtype (bf16 when it names none)
  d.expert_bytes = expert_bytes != 0
                       ? expert_bytes
                       : 3 * static_cast<uint64_t>(config.hidden_size) *
                             static_cast<uint64_t>(config.expert_intermediate_size) * DTypeSize(d.weight_dtype);
  return d;
}

absl::StatusOr<ShapeMap> TimingShapes(const ModelConfig& running, uint64_t running_expert_bytes,
                                      const std::string& running_name, const std::string& timing_model) {
  ODMOE_ASSIGN_OR_RETURN(const ModelConfig target, SyntheticModelConfig(SyntheticSpec{timing_model, 0, 0}));
  return ShapeMap::Between(ModelDimsOf(running, running_expert_bytes), ModelDimsOf(target), running_name, timing_model);
}

size_t PayloadScale::Padding(size_t bytes, double scale, size_t room) {
  if (scale <= 1.0) return 0;
  return std::min(room, static_cast<size_t>(static_cast<double>(bytes) * (scale - 1.0)));
}

absl::StatusOr<PayloadScale> PayloadScaleOf(const ClusterConfig& cluster, const ModelConfig& running) {
  PayloadScale scale;
  if (cluster.timing_model.empty()) return scale;
  absl::StatusOr<ModelConfig> target = SyntheticModelConfig(SyntheticSpec{cluster.timing_model, 0, 0});
  if (!target.ok()) {
    return absl::Status(target.status().code(),
                        StrCat(cluster.file, ": [cluster] timing_model: ", target.status().message()));
  }
  auto kv_bytes = [](const ModelConfig& c) {
    return static_cast<double>(c.num_layers) * static_cast<double>(c.num_kv_heads * c.head_dim);
  };
  scale.hidden = static_cast<double>(target->hidden_size) / static_cast<double>(running.hidden_size);
  scale.kv = kv_bytes(*target) / kv_bytes(running);
  return scale;
}

absl::StatusOr<std::unique_ptr<Device>> CreateNodeDevice(const ClusterConfig& cluster, const NodeConfig& node,
                                                         const std::string& model_dir,
                                                         std::optional<uint64_t> capacity_bytes) {
  constexpr std::string_view kTimed = "timed:";
  if (!std::string_view(node.device).starts_with(kTimed)) {
    return capacity_bytes ? CreateDevice(node.device, *capacity_bytes) : CreateDevice(node.device);
  }
  const std::string where = StrCat(cluster.file, ": node '", node.name, "': device '", node.device, "'");
  const DeviceProfile* profile = cluster.FindProfile(node.device.substr(kTimed.size()));
  if (profile == nullptr) return absl::InvalidArgumentError(StrCat(where, ": no such device profile"));
  TimedDeviceOptions options;
  options.profile = *profile;
  options.time_scale = cluster.time_scale;
  options.capacity_bytes = capacity_bytes.value_or(0);
  options.wall_clock = NewSteadyWallClock();
  if (!cluster.timing_model.empty()) {
    absl::StatusOr<OpenedModel> running = OpenModel(cluster.model, model_dir);
    if (!running.ok()) {
      return absl::Status(running.status().code(), StrCat(where, ": opening the model: ", running.status().message()));
    }
    const std::string running_name = model_dir.empty() ? cluster.model.synthetic : model_dir;
    absl::StatusOr<ShapeMap> shapes =
        TimingShapes(running->config, running->ExpertBytes(), running_name, cluster.timing_model);
    if (!shapes.ok()) {
      return absl::Status(shapes.status().code(),
                          StrCat(cluster.file, ": [cluster] timing_model: ", shapes.status().message()));
    }
    for (const std::string& clash : shapes->ambiguous()) {
      spdlog::warn("{}: running width {} in the target: charged at the larger", where, clash);
    }
    options.shapes = *std::move(shapes);
  }
  return std::unique_ptr<Device>(CreateTimedDevice(options));
}

}  // namespace odmoe
