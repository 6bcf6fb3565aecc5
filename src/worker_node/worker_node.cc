#include "src/worker_node/worker_node.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <span>

#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"
#include "src/backend/cpu_device.h"
#include "src/backend/device_factory.h"
#include "src/backend/mock_gpu_device.h"
#include "src/common/placement.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/fingerprint.h"
#include "src/model/model_layout.h"
#include "src/model/synthetic.h"
#include "src/rpc/daemon.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {
namespace {

using Clock = std::chrono::steady_clock;

// Offsets of the three projections inside one expert allocation (as cudaMalloc aligns).
constexpr size_t kAlignment = 256;
size_t AlignUp(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::string Mib(uint64_t bytes) { return absl::StrFormat("%.2f MiB", static_cast<double>(bytes) / (1 << 20)); }

// Room left in a response for everything but the output tensors' data.
constexpr int64_t kResponseHeadroomBytes = 1 << 20;

// The node's device with its budget as the capacity where the backend takes one. A mock GPU records no timeline
// here: a daemon runs for long.
absl::StatusOr<std::unique_ptr<Device>> CreateWorkerDevice(const std::string& spec, uint64_t budget,
                                                           const std::optional<MockGpuOptions>& mock_options) {
  if (spec == "cpu") return std::unique_ptr<Device>(new CpuDevice(budget));
  if (spec.starts_with("mock-gpu")) {
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> probe, CreateDevice(spec));  // validates "mock-gpu[:MB]"
    MockGpuOptions options = mock_options.value_or(MockGpuOptions{.record_timeline = false});
    const uint64_t spec_capacity = probe->memory_info().capacity;
    options.capacity_bytes = budget == 0 ? spec_capacity : std::min(budget, spec_capacity);
    // Copies from memory the worker did not register (experts outside its store) run at pageable speed.
    options.h2d_pageable_bytes_per_s = options.h2d_bytes_per_s * MockGpuOptions::kPageableFraction;
    return std::unique_ptr<Device>(new MockGpuDevice(options));
  }
  // A CUDA device takes the budget (whole MiB, rounded up) as its own capacity, so the backend itself refuses
  // to allocate past it.
  if (spec == "cuda" && budget != 0) return CreateDevice(StrCat("cuda:", (budget + (1u << 20) - 1) >> 20));
  return CreateDevice(spec);
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerNode>> WorkerNode::Create(const ClusterConfig& cluster, const NodeConfig& self,
                                                               const std::string& model_dir,
                                                               const WorkerOptions& options) {
  if (self.role != NodeRole::kWorker) {
    return absl::InvalidArgumentError(
        StrCat("node '", self.name, "' has role ", NodeRoleName(self.role), "; a worker daemon needs a worker node"));
  }
  if (options.max_rows_per_call < 1) {
    return absl::InvalidArgumentError(StrCat("max_rows_per_call must be >= 1, got ", options.max_rows_per_call));
  }
  std::unique_ptr<WorkerNode> node(new WorkerNode(cluster, self, options));
  ODMOE_RETURN_IF_ERROR(node->Init(model_dir));
  return node;
}

// The store unregisters its memory from the device: it goes first.
WorkerNode::~WorkerNode() { store_.reset(); }

absl::Status WorkerNode::Init(const std::string& model_dir) {
  const std::vector<const NodeConfig*> workers = cluster_.workers();
  if (self_.worker_index < 0 || self_.worker_index >= static_cast<int32_t>(workers.size())) {
    return absl::InvalidArgumentError(StrCat("node '", self_.name, "' has worker index ", self_.worker_index,
                                             " but the cluster has ", workers.size(), " workers"));
  }
  if (model_dir.empty() && cluster_.model.is_synthetic()) {
    const SyntheticSpec spec{cluster_.model.synthetic, cluster_.model.layers, cluster_.model.seed};
    ODMOE_ASSIGN_OR_RETURN(config_, SyntheticModelConfig(spec));
    ODMOE_ASSIGN_OR_RETURN(fingerprint_, SyntheticFingerprint(spec));
    source_ = std::make_unique<SyntheticSource>(config_, spec.seed);
    synthetic_dtype_ = SyntheticDType(config_);
  } else {
    if (model_dir.empty()) return absl::InvalidArgumentError(StrCat("no model: [model] in ", cluster_.file));
    ODMOE_ASSIGN_OR_RETURN(config_, LoadModelConfig(model_dir));
    ODMOE_ASSIGN_OR_RETURN(checkpoint_, Checkpoint::Open(model_dir));
    ODMOE_ASSIGN_OR_RETURN(fingerprint_, ModelFingerprint(model_dir, *checkpoint_));
    source_ = std::make_unique<CheckpointSource>(*checkpoint_);
  }
  // Every expert is checked now (metadata only: nothing is read) so a bad checkpoint fails at start, not in
  // the middle of a request.
  const std::vector<TensorSpec> experts = AllExpertTensors(config_);
  ODMOE_RETURN_IF_ERROR(source_->Validate(experts));
  for (size_t i = 0; i + 2 < experts.size(); i += 3) {
    uint64_t bytes = 0;
    for (size_t j = i; j < i + 3; ++j) {
      ODMOE_ASSIGN_OR_RETURN(ExpertTensorMeta meta, TensorMeta(experts[j]));
      bytes += AlignUp(meta.nbytes);
    }
    expert_bytes_ = std::max(expert_bytes_, bytes);
  }

  const int32_t group_size =
      cluster_.group_size > 0 ? cluster_.group_size : static_cast<int32_t>(std::max<int64_t>(1, config_.top_k));
  absl::StatusOr<Placement> placement = Placement::Create(static_cast<int32_t>(workers.size()), group_size);
  if (!placement.ok()) {
    return absl::InvalidArgumentError(StrCat("cluster ", cluster_.file, ": group size ", group_size,
                                             (cluster_.group_size > 0 ? "" : " (the model's top-k)"), ": ",
                                             placement.status().message()));
  }
  const std::vector<int64_t> sparse = config_.SparseLayers();
  for (int64_t s : placement->DecodeLayersOf(self_.worker_index, static_cast<int64_t>(sparse.size()))) {
    decode_layers_.push_back(sparse[static_cast<size_t>(s)]);
  }

  ODMOE_ASSIGN_OR_RETURN(device_, CreateWorkerDevice(self_.device, self_.gpu_budget_bytes, options_.mock_gpu));

  // The host copy: the experts of the decode layers, and expert e of every sparse layer when this worker
  // computes e in prefill.
  ExpertStoreOptions store_options;
  auto served_by = [&](int32_t worker, std::vector<std::pair<int64_t, int64_t>>* out) {
    for (int64_t s : placement->DecodeLayersOf(worker, static_cast<int64_t>(sparse.size()))) {
      for (int64_t e = 0; e < config_.num_experts; ++e) out->emplace_back(sparse[static_cast<size_t>(s)], e);
    }
    for (int64_t l : sparse) {
      for (int64_t e = 0; e < config_.num_experts; ++e) {
        if (placement->PrefillWorkerOf(static_cast<int32_t>(e)) == worker) out->emplace_back(l, e);
      }
    }
  };
  served_by(self_.worker_index, &store_options.served);
  // The shared segment holds what the workers of this host serve together (all of them on a one-host cluster,
  // this worker's own on a LAN testbed with one worker per host); every one of them computes the same set.
  const auto host_of = [](const std::string& address) { return address.substr(0, address.rfind(':')); };
  for (const NodeConfig* w : workers) {
    if (host_of(w->address) == host_of(self_.address)) served_by(w->worker_index, &store_options.shared_keys);
  }
  store_options.share = cluster_.share_host_experts && options_.share_host_experts;
  store_options.shm_dir = options_.shm_dir;
  store_options.segment_name = StrCat("odmoe-", cluster_.name, "-e", cluster_.epoch, "-", fingerprint_.substr(0, 8));
  store_options.fingerprint = fingerprint_;
  {
    absl::MutexLock source_lock(&source_mu_);
    ODMOE_ASSIGN_OR_RETURN(
        store_, ExpertStore::Open(
                    config_, *source_, [this](const TensorSpec& spec) { return TensorMeta(spec); }, store_options,
                    device_.get()));
  }
  const uint64_t capacity = device_->memory_info().capacity;
  budget_bytes_ = self_.gpu_budget_bytes == 0 ? capacity
                  : capacity == 0             ? self_.gpu_budget_bytes
                                              : std::min(capacity, self_.gpu_budget_bytes);

  // The workspace: MLP scratch, gathered rows and one expert's output, all for max_rows rows, and per staging
  // slot the received hidden state and the row indices of every task of a call.
  const int64_t rows = options_.max_rows_per_call;
  const int64_t h = config_.hidden_size;
  const int64_t inter = std::max<int64_t>(1, config_.expert_intermediate_size);
  const uint64_t activation_bytes = static_cast<uint64_t>(rows * h) * sizeof(float);
  const uint64_t index_bytes = static_cast<uint64_t>(rows * std::max<int64_t>(1, config_.num_experts)) * 4;
  const uint64_t ws_bytes = 2 * static_cast<uint64_t>(rows * inter) * sizeof(float);
  const uint64_t needed = ws_bytes + 2 * activation_bytes + kStagingSlots * (activation_bytes + index_bytes);
  absl::MutexLock compute_lock(&compute_mu_);
  absl::MutexLock load_lock(&load_mu_);
  absl::MutexLock stage_lock(&stage_mu_);
  compute_stream_ = device_->CreateStream();
  load_stream_ = device_->CreateStream();
  stage_stream_ = device_->CreateStream();
  // The compute stream's own workspace (CUDA: the cuBLAS workspace and the GEMM scratch), allocated now so it
  // counts against the budget and no op allocates later.
  const absl::Status prepared = device_->PrepareStream(compute_stream_.get(), rows, std::max(h, inter));
  const uint64_t stream_bytes = device_->memory_info().in_use;
  if (!prepared.ok() || (budget_bytes_ != 0 && needed + stream_bytes + expert_bytes_ > budget_bytes_)) {
    const std::string library = stream_bytes > 0 ? StrCat(", plus ", Mib(stream_bytes), " of library workspace") : "";
    const std::string detail = prepared.ok() ? "" : StrCat(" (", prepared.message(), ")");
    return absl::ResourceExhaustedError(StrCat("worker '", self_.name, "': its GPU budget of ", Mib(budget_bytes_),
                                               " cannot hold the workspace (", Mib(needed), " for ", rows,
                                               " rows per call", library, ") plus one expert (", Mib(expert_bytes_),
                                               "); raise gpu_budget_mb in ", cluster_.file, detail));
  }
  ODMOE_ASSIGN_OR_RETURN(ws_, MlpWorkspace::Create(*device_, rows, inter));
  ODMOE_ASSIGN_OR_RETURN(gathered_, AllocateWithinBudget(activation_bytes, "worker gathered rows"));
  ODMOE_ASSIGN_OR_RETURN(output_, AllocateWithinBudget(activation_bytes, "worker expert output"));
  for (StagingSlot& slot : slots_) {
    ODMOE_ASSIGN_OR_RETURN(slot.hidden, AllocateWithinBudget(activation_bytes, "worker hidden state"));
    ODMOE_ASSIGN_OR_RETURN(slot.rows, AllocateWithinBudget(index_bytes, "worker row indices"));
    slot.uploaded = device_->CreateEvent();
  }
  workspace_bytes_ =
      stream_bytes + ws_->bytes() + 2 * activation_bytes + kStagingSlots * (activation_bytes + index_bytes);
  return absl::OkStatus();
}

absl::StatusOr<ExpertTensorMeta> WorkerNode::TensorMeta(const TensorSpec& spec) const {
  if (checkpoint_ == nullptr) {
    uint64_t numel = 1;
    for (int64_t d : spec.shape) numel *= static_cast<uint64_t>(d);
    return ExpertTensorMeta{synthetic_dtype_, numel * DTypeSize(synthetic_dtype_)};
  }
  const TensorInfo* info = checkpoint_->Find(spec.name);
  if (info == nullptr || !info->dtype.has_value()) {
    return absl::NotFoundError(StrCat("tensor ", spec.name, " is missing or of an unsupported dtype"));
  }
  return ExpertTensorMeta{*info->dtype, info->nbytes};
}

// ---- memory ----------------------------------------------------------------------------------------------------

absl::Status WorkerNode::BudgetError(std::string_view what, uint64_t bytes) const {
  const MemoryInfo mi = device_->memory_info();
  return absl::ResourceExhaustedError(StrCat(
      "worker '", self_.name, "': ", what, " needs ", Mib(bytes), " but its GPU budget of ", Mib(budget_bytes_),
      " has ", Mib(mi.in_use), " in use (workspace ", Mib(workspace_bytes_), ", one expert ", Mib(expert_bytes_), ")"));
}

absl::StatusOr<std::unique_ptr<Buffer>> WorkerNode::AllocateWithinBudget(size_t bytes, std::string_view tag) {
  absl::MutexLock lock(&alloc_mu_);
  if (budget_bytes_ != 0) {
    const uint64_t in_use = device_->memory_info().in_use;
    if (in_use > budget_bytes_ || bytes > budget_bytes_ - in_use) return BudgetError(tag, bytes);
  }
  return device_->Allocate(bytes, tag);
}

int WorkerNode::EvictIdle(uint64_t bytes, const std::vector<ExpertKey>& keep) {
  std::vector<std::unique_ptr<LoadedExpert>> victims;
  {
    absl::MutexLock lock(&mu_);
    // Candidates: ready entries, those this request does not need first, then oldest first.
    std::vector<std::pair<std::pair<bool, uint64_t>, ResidentKey>> order;
    for (const auto& [key, entry] : resident_) {
      if (entry.loading || entry.in_use) continue;
      const ExpertKey expert_key{std::get<0>(key), std::get<1>(key)};
      const bool kept = std::find(keep.begin(), keep.end(), expert_key) != keep.end();
      order.push_back({{kept, entry.sequence}, key});
    }
    std::sort(order.begin(), order.end());
    const uint64_t limit = budget_bytes_ != 0 ? budget_bytes_ : device_->memory_info().capacity;
    uint64_t in_use = device_->memory_info().in_use;
    for (const auto& [rank, key] : order) {
      if (limit != 0 && in_use <= limit && bytes <= limit - in_use) break;
      auto it = resident_.find(key);
      in_use -= std::min<uint64_t>(in_use, it->second.expert->buffer->size());
      if (it->second.origin == Origin::kPrefetch) counters_.prefetches_unused += 1;
      victims.push_back(std::move(it->second.expert));
      resident_.erase(it);
    }
    counters_.evictions += victims.size();
  }
  return static_cast<int>(victims.size());  // the buffers are freed here, outside the lock
}

bool WorkerNode::Passed(const Progress& progress, uint64_t request_id, int64_t position, int64_t layer) {
  if (request_id == 0 || progress.request_id == 0) return false;
  if (request_id != progress.request_id) return true;
  return std::pair(position, layer) <= std::pair(progress.position, progress.layer);
}

int WorkerNode::AdvanceProgress(uint64_t request_id, int64_t position, int64_t layer) {
  if (request_id == 0) return 0;
  std::vector<std::unique_ptr<LoadedExpert>> victims;
  {
    absl::MutexLock lock(&mu_);
    progress_ = Progress{request_id, position, layer};
    for (auto it = resident_.begin(); it != resident_.end();) {
      const ResidentEntry& entry = it->second;
      const int64_t entry_layer = std::get<0>(it->first), entry_position = std::get<2>(it->first);
      // Stale: predicted for a (position, layer) main has gone past. The current layer's own entries stay: the
      // request being computed takes them.
      const bool current = entry.request_id == request_id && entry_position == position && entry_layer == layer;
      if (!entry.loading && !entry.in_use && !current &&
          Passed(progress_, entry.request_id, entry_position, entry_layer)) {
        if (entry.origin == Origin::kPrefetch) counters_.prefetches_unused += 1;
        victims.push_back(std::move(it->second.expert));
        it = resident_.erase(it);
      } else {
        ++it;
      }
    }
    counters_.evictions += victims.size();
  }
  return static_cast<int>(victims.size());
}

absl::StatusOr<std::unique_ptr<WorkerNode::LoadedExpert>> WorkerNode::LoadExpert(int64_t layer, int64_t e,
                                                                                 Stream* stream, bool may_evict,
                                                                                 const std::vector<ExpertKey>& keep,
                                                                                 bool async) {
  const Clock::time_point start = Clock::now();
  const std::vector<TensorSpec> specs = ExpertTensors(config_, layer, e);
  // The packed block when the store holds the expert (one copy); else the source's tensors: for a mapped
  // checkpoint, one copy per projection straight from the mapping; for a generator, packed into `staging`
  // first (it lives until the copy has been synchronized below).
  const ExpertStore::Expert* packed = store_->Find(layer, e);
  std::array<const uint8_t*, 3> host{};
  std::array<uint64_t, 3> nbytes{};
  std::array<uint64_t, 3> offsets{};
  std::array<DType, 3> dtypes{};
  std::vector<uint8_t> staging;
  size_t total = 0;
  if (packed != nullptr) {
    total = packed->block_bytes;
    for (size_t i = 0; i < 3; ++i) {
      offsets[i] = packed->offsets[i];
      dtypes[i] = packed->dtypes[i];
    }
  } else {
    absl::MutexLock source_lock(&source_mu_);
    for (size_t i = 0; i < specs.size() && i < 3; ++i) {
      ODMOE_ASSIGN_OR_RETURN(SourceTensor t, source_->Read(specs[i]));
      offsets[i] = total;
      nbytes[i] = t.nbytes;
      dtypes[i] = t.dtype;
      total += AlignUp(t.nbytes);
      if (source_->stable()) {
        host[i] = t.data;
      } else {
        staging.resize(total);
        std::memcpy(staging.data() + offsets[i], t.data, t.nbytes);
      }
    }
    if (!source_->stable()) {
      for (size_t i = 0; i < 3; ++i) host[i] = staging.data() + offsets[i];
    }
  }
  const std::string tag = StrCat("expert ", e, " of layer ", layer);
  absl::StatusOr<std::unique_ptr<Buffer>> buffer = AllocateWithinBudget(total, tag);
  if (!buffer.ok() && absl::IsResourceExhausted(buffer.status()) && may_evict && EvictIdle(total, keep) > 0) {
    buffer = AllocateWithinBudget(total, tag);
  }
  if (!buffer.ok()) return buffer.status();
  auto loaded = std::make_unique<LoadedExpert>();
  loaded->buffer = std::move(buffer).value();
  uint8_t* base = loaded->buffer->as<uint8_t>();
  if (packed != nullptr) {
    device_->CopyToDevice(base, packed->data, packed->copy_bytes, stream);  // one copy moves the expert
    loaded->tensor_bytes = packed->tensor_bytes;
  } else {
    for (size_t i = 0; i < 3; ++i) {
      device_->CopyToDevice(base + offsets[i], host[i], nbytes[i], stream);
      loaded->tensor_bytes += nbytes[i];
    }
  }
  for (size_t i = 0; i < specs.size() && i < 3; ++i) {
    const WeightRef ref{base + offsets[i], dtypes[i]};
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
    loaded->ready = device_->CreateEvent();
    device_->RecordEvent(*loaded->ready, stream);
  } else {
    // Waiting here makes the expert usable from any stream, times the load, and lets `staging` go.
    device_->Synchronize(stream);
  }
  loaded->load_ms = MsSince(start);
  return loaded;
}

std::map<WorkerNode::ResidentKey, WorkerNode::ResidentEntry>::iterator WorkerNode::FindResident(const ExpertKey& key,
                                                                                             int64_t position) {
  // The entry for `position`, else the newest for an earlier one (entries for later positions are kept for
  // their own turn).
  auto it = resident_.upper_bound(ResidentKey{key.first, key.second, position});
  if (it == resident_.begin()) return resident_.end();
  --it;
  if (std::get<0>(it->first) != key.first || std::get<1>(it->first) != key.second) return resident_.end();
  return it;
}

WorkerNode::Taken WorkerNode::TakeResident(const ExpertKey& key, int64_t position, double* waited_ms) {
  const Clock::time_point start = Clock::now();
  absl::MutexLock lock(&mu_);
  auto it = FindResident(key, position);
  while (it != resident_.end() && (it->second.loading || it->second.in_use)) {
    resident_changed_.Wait(&mu_);
    it = FindResident(key, position);
  }
  *waited_ms = MsSince(start);
  Taken taken;
  if (it == resident_.end()) return taken;
  it->second.in_use = true;
  taken.expert = it->second.expert.get();
  taken.key = it->first;
  taken.origin = it->second.origin;
  return taken;
}

void WorkerNode::ReleaseResident(const ResidentKey& key, int32_t expert_calls) {
  std::unique_ptr<LoadedExpert> freed;
  {
    absl::MutexLock lock(&mu_);
    auto it = resident_.find(key);
    ODMOE_CHECK(it != resident_.end() && it->second.in_use);
    it->second.uses += 1;
    if (it->second.uses < expert_calls) {
      it->second.in_use = false;
      if (it->second.origin != Origin::kKept) counters_.experts_kept += 1;
      it->second.origin = Origin::kKept;
      it->second.sequence = next_sequence_++;
    } else {
      freed = std::move(it->second.expert);
      resident_.erase(it);
      counters_.evictions += 1;
    }
    resident_changed_.SignalAll();
  }
  // `freed` goes here, outside the lock: no expert cache.
}

int64_t WorkerNode::ResidentExperts() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(resident_.size());
}

// ---- requests --------------------------------------------------------------------------------------------------

absl::Status WorkerNode::CheckLayer(int64_t layer) const {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        StrCat("layer ", layer, " does not exist (the model has layers 0..", config_.num_layers - 1, ")"));
  }
  if (!config_.IsSparseLayer(layer)) {
    return absl::InvalidArgumentError(
        StrCat("layer ", layer, " is a dense MLP layer (it has no experts; main computes it)"));
  }
  return absl::OkStatus();
}

absl::Status WorkerNode::Compute(const v1::ComputeExpertsRequest& request, v1::ComputeExpertsResponse* response) {
  response->Clear();
  {
    absl::MutexLock lock(&mu_);
    counters_.calls_in_flight_peak =
        std::max<uint64_t>(counters_.calls_in_flight_peak, static_cast<uint64_t>(++calls_in_flight_));
  }
  absl::StatusOr<StagedCall> staged = Stage(request);
  absl::Status status = staged.ok() ? Finish(std::move(staged).value(), response) : staged.status();
  absl::MutexLock lock(&mu_);
  --calls_in_flight_;
  return status;
}

absl::StatusOr<WorkerNode::StagedCall> WorkerNode::Stage(const v1::ComputeExpertsRequest& request) {
  ODMOE_RETURN_IF_ERROR(rpc::CheckHeader(request.header(), cluster_.epoch, fingerprint_));
  ODMOE_RETURN_IF_ERROR(CheckLayer(request.layer()));
  if (request.tasks_size() == 0) return absl::InvalidArgumentError("tasks: empty (no expert to compute)");
  const int64_t h = config_.hidden_size;
  const int64_t shape[] = {-1, h};
  std::vector<int64_t> dims;
  ODMOE_ASSIGN_OR_RETURN(std::vector<float> hidden, rpc::DecodeF32(request.hidden(), shape, "hidden", &dims));
  const int64_t n = dims[0];
  if (n > options_.max_rows_per_call) {
    return absl::InvalidArgumentError(StrCat("hidden: ", n, " rows, more than this worker's limit of ",
                                             options_.max_rows_per_call,
                                             " rows per call; split the batch into several calls"));
  }
  std::vector<bool> seen(static_cast<size_t>(config_.num_experts), false);
  int64_t total_rows = 0;
  for (int i = 0; i < request.tasks_size(); ++i) {
    const v1::ExpertTask& task = request.tasks(i);
    const std::string where = StrCat("tasks[", i, "] (expert ", task.expert(), ")");
    if (task.expert() < 0 || task.expert() >= config_.num_experts) {
      return absl::InvalidArgumentError(
          StrCat(where, ": no such expert (layer ", request.layer(), " has experts 0..", config_.num_experts - 1, ")"));
    }
    if (seen[static_cast<size_t>(task.expert())]) {
      return absl::InvalidArgumentError(StrCat(where, ": the expert appears twice in one request"));
    }
    seen[static_cast<size_t>(task.expert())] = true;
    if (task.rows_size() == 0) return absl::InvalidArgumentError(StrCat(where, ": rows: empty"));
    for (int j = 0; j < task.rows_size(); ++j) {
      const int32_t r = task.rows(j);
      if (r < 0 || r >= n) {
        return absl::InvalidArgumentError(
            StrCat(where, ": rows[", j, "] = ", r, " is out of range [0, ", n, ") of hidden's rows"));
      }
      if (j > 0 && r <= task.rows(j - 1)) {
        return absl::InvalidArgumentError(
            StrCat(where, ": rows must be strictly ascending; rows[", j, "] = ", r, " follows ", task.rows(j - 1)));
      }
    }
    total_rows += task.rows_size();
  }
  const int64_t output_bytes = total_rows * h * static_cast<int64_t>(sizeof(float));
  if (output_bytes > rpc::kMaxMessageBytes - kResponseHeadroomBytes) {
    return absl::InvalidArgumentError(StrCat("the outputs of this request would take ", output_bytes,
                                             " bytes, more than one message carries; split the tasks over "
                                             "several calls"));
  }

  const uint64_t request_id = request.header().request_id();
  AdvanceProgress(request_id, request.position(), request.layer());

  StagedCall staged;
  staged.request_ = &request;
  staged.n_ = n;
  absl::MutexLock stage_lock(&stage_mu_);
  auto slot_free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stage_mu_) {
    return std::find(slot_busy_.begin(), slot_busy_.end(), false) != slot_busy_.end();
  };
  stage_mu_.Await(absl::Condition(&slot_free));
  staged.slot_ = static_cast<int>(std::find(slot_busy_.begin(), slot_busy_.end(), false) - slot_busy_.begin());
  slot_busy_[static_cast<size_t>(staged.slot_)] = true;
  staged.node_ = this;
  StagingSlot& slot = slots_[static_cast<size_t>(staged.slot_)];
  // The hidden rows, then every task's row indices back to back; the host vectors live in the slot until the
  // copies are done.
  slot.host_hidden = std::move(hidden);
  slot.host_rows.clear();
  for (const v1::ExpertTask& task : request.tasks()) {
    slot.host_rows.insert(slot.host_rows.end(), task.rows().begin(), task.rows().end());
  }
  Stream* stream = stage_stream_.get();
  device_->CopyToDevice(slot.hidden->data(), slot.host_hidden.data(), slot.host_hidden.size() * sizeof(float), stream);
  device_->CopyToDevice(slot.rows->data(), slot.host_rows.data(), slot.host_rows.size() * sizeof(int32_t), stream);
  device_->RecordEvent(*slot.uploaded, stream);

  // Load ahead what is neither resident nor loading, as far as the budget allows without evicting anything.
  // Untracked calls (request id 0) load on demand only: nothing would free an entry they left behind.
  if (request_id == 0) return staged;
  for (const v1::ExpertTask& task : request.tasks()) {
    const ResidentKey key{request.layer(), task.expert(), request.position()};
    {
      absl::MutexLock lock(&mu_);
      if (FindResident({request.layer(), task.expert()}, request.position()) != resident_.end()) continue;
      if (budget_bytes_ != 0) {
        const uint64_t in_use = device_->memory_info().in_use;
        if (in_use > budget_bytes_ || expert_bytes_ > budget_bytes_ - in_use) break;
      }
    }
    absl::StatusOr<std::unique_ptr<LoadedExpert>> loaded =
        LoadExpert(request.layer(), task.expert(), stream, /*may_evict=*/false, {}, /*async=*/true);
    if (!loaded.ok()) break;  // the budget is full after all (a concurrent load): Finish loads on demand
    absl::MutexLock lock(&mu_);
    counters_.loads += 1;
    counters_.loads_on_demand += 1;
    counters_.loads_ahead += 1;
    counters_.bytes_loaded += loaded.value()->tensor_bytes;
    SetReadyLocked(resident_[key], Origin::kStaged, request_id, std::move(loaded).value());
    staged.ahead_.push_back(key);
  }
  return staged;
}

void WorkerNode::SetReadyLocked(ResidentEntry& entry, Origin origin, uint64_t request_id,
                                std::unique_ptr<LoadedExpert> expert) {
  entry.loading = false;
  entry.origin = origin;
  entry.sequence = next_sequence_++;
  entry.request_id = request_id;
  entry.expert = std::move(expert);
  resident_changed_.SignalAll();
}

void WorkerNode::ReleaseSlot(int slot) {
  StagingSlot& s = slots_[static_cast<size_t>(slot)];
  device_->SynchronizeEvent(*s.uploaded);  // the uploads read the host vectors
  absl::MutexLock stage_lock(&stage_mu_);
  slot_busy_[static_cast<size_t>(slot)] = false;
}

void WorkerNode::DropStagedLoads(const StagedCall& staged) {
  std::vector<std::unique_ptr<LoadedExpert>> victims;
  {
    absl::MutexLock lock(&mu_);
    for (const ResidentKey& key : staged.ahead_) {
      auto it = resident_.find(key);
      if (it == resident_.end() || it->second.in_use || it->second.loading) continue;
      victims.push_back(std::move(it->second.expert));
      resident_.erase(it);
    }
    counters_.evictions += victims.size();
  }
  // Each victim's copy may still be in flight: wait for it before its memory goes.
  for (const auto& victim : victims) {
    if (victim->ready != nullptr) device_->SynchronizeEvent(*victim->ready);
  }
}

absl::Status WorkerNode::Finish(StagedCall staged, v1::ComputeExpertsResponse* response) {
  ODMOE_CHECK(staged.node_ == this);
  response->Clear();
  absl::Status status;
  {
    absl::MutexLock lock(&compute_mu_);
    status = ComputeLocked(staged, response);
  }
  if (status.ok()) {
    staged.ahead_.clear();  // used: freed, or kept for the next call
    const MemoryInfo m = device_->memory_info();
    response->set_gpu_peak_bytes(m.peak);
    response->set_gpu_in_use_bytes(m.in_use);
  } else {
    response->Clear();
  }
  return status;  // `staged` frees what it still holds (after a failure) and gives its slot back here
}

absl::Status WorkerNode::ComputeLocked(const StagedCall& staged, v1::ComputeExpertsResponse* response) {
  Stream* stream = compute_stream_.get();
  const v1::ComputeExpertsRequest& request = *staged.request_;
  const int64_t layer = request.layer();
  const int64_t h = config_.hidden_size;
  const int64_t n = staged.n_;
  const bool may_keep = request.header().request_id() != 0;
  StagingSlot& slot = slots_[static_cast<size_t>(staged.slot_)];
  device_->WaitEvent(stream, *slot.uploaded);
  std::vector<ExpertKey> keys;
  for (const v1::ExpertTask& task : request.tasks()) keys.emplace_back(layer, task.expert());
  const int32_t* dev_rows = slot.rows->as<int32_t>();

  size_t offset = 0;
  for (int i = 0; i < request.tasks_size(); ++i) {
    const v1::ExpertTask& task = request.tasks(i);
    const int64_t e = task.expert();
    double load_ms = 0;
    Taken taken = TakeResident(keys[static_cast<size_t>(i)], request.position(), &load_ms);
    // Staged ahead as a call arrived: still an on-demand load (it was not resident when the call arrived).
    const bool on_demand = taken.expert == nullptr || taken.origin == Origin::kStaged;
    std::unique_ptr<LoadedExpert> own;  // loaded here, on demand
    const LoadedExpert* expert = taken.expert;
    if (taken.expert == nullptr) {
      const std::vector<ExpertKey> later(keys.begin() + i + 1, keys.end());
      absl::StatusOr<std::unique_ptr<LoadedExpert>> loaded = LoadExpert(layer, e, stream, /*may_evict=*/true, later);
      if (!loaded.ok()) {
        device_->Synchronize(stream);  // earlier tasks' work is done before the error returns
        return absl::Status(loaded.status().code(), StrCat("loading expert ", e, " of layer ", layer,
                                                           " on demand: ", loaded.status().message()));
      }
      own = std::move(loaded).value();
      expert = own.get();
      load_ms = own->load_ms;
      absl::MutexLock counters_lock(&mu_);
      counters_.loads += 1;
      counters_.loads_on_demand += 1;
      counters_.bytes_loaded += own->tensor_bytes;
      counters_.load_ms_total += load_ms;
      counters_.on_demand_load_ms_total += load_ms;
    } else if (taken.expert->ready != nullptr) {
      // Loaded asynchronously as a call was staged (only those loads are): wait for the copy, whose time is
      // part of the load. Later users (it may be kept) find it complete.
      const Clock::time_point wait_start = Clock::now();
      device_->SynchronizeEvent(*taken.expert->ready);
      load_ms = taken.expert->load_ms + MsSince(wait_start);
      taken.expert->ready.reset();
      taken.expert->load_ms = 0;
      absl::MutexLock counters_lock(&mu_);
      counters_.load_ms_total += load_ms;
      counters_.on_demand_load_ms_total += load_ms;
    }

    const Clock::time_point start = Clock::now();
    const int64_t m = task.rows_size();
    // Exactly LocalExpertExecutor's ops: gather the rows (an exact copy), then the SwiGLU MLP.
    const float* x = slot.hidden->as<float>();
    if (!(m == n && n == 1)) {
      device_->GatherRows(slot.hidden->as<float>(), dev_rows + offset, m, h, gathered_->as<float>(), stream);
      x = gathered_->as<float>();
    }
    RunMlp(*device_, expert->mlp, x, m, h, *ws_, output_->as<float>(), stream);
    v1::ExpertOutput* out = response->add_outputs();
    out->set_expert(task.expert());
    v1::Tensor* tensor = out->mutable_output();
    tensor->set_dtype(v1::DTYPE_F32);
    tensor->add_shape(m);
    tensor->add_shape(h);
    std::string* data = tensor->mutable_data();
    data->resize(static_cast<size_t>(m * h) * sizeof(float));
    device_->CopyToHost(data->data(), output_->data(), data->size(), stream);  // synchronizes the stream
    const double compute_ms = MsSince(start);
    const int32_t expert_calls = may_keep ? std::max(1, task.expert_calls()) : 1;
    if (own != nullptr) {
      absl::MutexLock lock(&mu_);
      if (expert_calls > 1) {
        // Resident for the other mini-batches of this expert (unless a staged load of it got there first).
        auto [it, inserted] = resident_.try_emplace(ResidentKey{layer, e, request.position()});
        it->second.uses += 1;
        if (inserted) {
          SetReadyLocked(it->second, Origin::kKept, request.header().request_id(), std::move(own));
          counters_.experts_kept += 1;
        }
      }
      if (own != nullptr) counters_.evictions += 1;
    } else {
      ReleaseResident(taken.key, expert_calls);
    }
    own.reset();  // evict (when not kept): no expert cache
    out->set_loaded_on_demand(on_demand);
    out->set_load_ms(load_ms);
    out->set_compute_ms(compute_ms);
    offset += static_cast<size_t>(m);

    absl::MutexLock counters_lock(&mu_);
    counters_.experts_computed += 1;
    counters_.rows_computed += static_cast<uint64_t>(m);
    counters_.compute_ms_total += compute_ms;
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> WorkerNode::DoPrefetch(const v1::PrefetchRequest& request, bool* late) {
  if (late != nullptr) *late = false;
  ODMOE_RETURN_IF_ERROR(rpc::CheckHeader(request.header(), cluster_.epoch, fingerprint_));
  ODMOE_RETURN_IF_ERROR(CheckLayer(request.layer()));
  if (request.experts_size() == 0) return absl::InvalidArgumentError("experts: empty (nothing to prefetch)");
  std::vector<bool> seen(static_cast<size_t>(config_.num_experts), false);
  for (int i = 0; i < request.experts_size(); ++i) {
    const int32_t e = request.experts(i);
    if (e < 0 || e >= config_.num_experts) {
      return absl::InvalidArgumentError(StrCat("experts[", i, "] = ", e, ": no such expert (layer ", request.layer(),
                                               " has experts 0..", config_.num_experts - 1, ")"));
    }
    if (seen[static_cast<size_t>(e)]) {
      return absl::InvalidArgumentError(StrCat("experts[", i, "] = ", e, ": listed twice"));
    }
    seen[static_cast<size_t>(e)] = true;
  }

  const int64_t layer = request.layer();
  const uint64_t request_id = request.header().request_id();
  const int64_t position = request.position();
  absl::MutexLock load_lock(&load_mu_);
  std::vector<ResidentKey> started;
  {
    absl::MutexLock lock(&mu_);
    if (Passed(progress_, request_id, position, layer)) {
      // Main already asked for this layer (or went past it): loading now would only waste the link.
      counters_.prefetches_late += 1;
      if (late != nullptr) *late = true;
      return 0;
    }
    for (int32_t e : request.experts()) {
      if (!resident_.contains({layer, e, position})) started.emplace_back(layer, e, position);
    }
    const uint64_t needed = started.size() * expert_bytes_;
    const uint64_t in_use = device_->memory_info().in_use;
    if (budget_bytes_ != 0 && (in_use > budget_bytes_ || needed > budget_bytes_ - in_use)) {
      return BudgetError(StrCat("prefetching ", started.size(), " experts of layer ", layer), needed);
    }
    for (const ResidentKey& key : started) {
      ResidentEntry& entry = resident_[key];
      entry.loading = true;
      entry.sequence = next_sequence_++;
      entry.request_id = request_id;
    }
  }

  for (size_t i = 0; i < started.size(); ++i) {
    absl::StatusOr<std::unique_ptr<LoadedExpert>> loaded =
        LoadExpert(layer, std::get<1>(started[i]), load_stream_.get(), /*may_evict=*/false, {});
    absl::MutexLock lock(&mu_);
    if (!loaded.ok()) {
      // Drop this and the remaining placeholders; a waiting ComputeExperts then loads on demand.
      for (size_t j = i; j < started.size(); ++j) resident_.erase(started[j]);
      resident_changed_.SignalAll();
      return absl::Status(loaded.status().code(), StrCat("prefetching expert ", std::get<1>(started[i]), " of layer ", layer,
                                                         ": ", loaded.status().message()));
    }
    ResidentEntry& entry = resident_[started[i]];
    entry.expert = std::move(loaded).value();
    entry.loading = false;
    counters_.loads += 1;
    counters_.prefetches += 1;
    counters_.bytes_loaded += entry.expert->tensor_bytes;
    counters_.load_ms_total += entry.expert->load_ms;
    resident_changed_.SignalAll();
  }
  return static_cast<int32_t>(started.size());
}

v1::WorkerStats WorkerNode::Stats(bool reset) {
  v1::WorkerStats s;
  s.set_node(self_.name);
  {
    absl::MutexLock lock(&mu_);
    s.set_experts_computed(counters_.experts_computed);
    s.set_rows_computed(counters_.rows_computed);
    s.set_loads(counters_.loads);
    s.set_loads_on_demand(counters_.loads_on_demand);
    s.set_bytes_loaded(counters_.bytes_loaded);
    s.set_load_ms_total(counters_.load_ms_total);
    s.set_on_demand_load_ms_total(counters_.on_demand_load_ms_total);
    s.set_compute_ms_total(counters_.compute_ms_total);
    s.set_evictions(counters_.evictions);
    s.set_prefetches(counters_.prefetches);
    s.set_prefetches_late(counters_.prefetches_late);
    s.set_prefetches_unused(counters_.prefetches_unused);
    s.set_host_bytes_packed(store_->host_bytes());
    s.set_host_experts_shared(store_->shared());
    s.set_host_bytes_pinned(store_->pinned_bytes());
    s.set_host_experts_packed(static_cast<uint64_t>(store_->experts()));
    s.set_host_packed_here(store_->packed_here());
    s.set_experts_kept(counters_.experts_kept);
    s.set_loads_ahead(counters_.loads_ahead);
    s.set_calls_in_flight_peak(counters_.calls_in_flight_peak);
    if (reset) counters_ = Counters{};
  }
  rpc::FillDeviceMemory(*device_, budget_bytes_, s.mutable_memory());
  if (reset) device_->ResetPeak();
  for (int64_t l : decode_layers_) s.add_layers(static_cast<int32_t>(l));
  return s;
}

v1::Membership WorkerNode::MembershipInfo() const {
  v1::Membership m;
  rpc::FillMembership(cluster_, self_.name, fingerprint_, &m);
  return m;
}

// ---- gRPC handlers ---------------------------------------------------------------------------------------------

grpc::Status WorkerNode::ComputeExperts(grpc::ServerContext* /*context*/, const v1::ComputeExpertsRequest* request,
                                        v1::ComputeExpertsResponse* response) {
  const absl::Status status = Compute(*request, response);
  if (!status.ok()) spdlog::warn("{}: ComputeExperts refused: {}", self_.name, status.ToString());
  return rpc::ToGrpc(status);
}

grpc::Status WorkerNode::Prefetch(grpc::ServerContext* /*context*/, const v1::PrefetchRequest* request,
                                  v1::PrefetchResponse* response) {
  bool late = false;
  absl::StatusOr<int32_t> accepted = DoPrefetch(*request, &late);
  if (!accepted.ok()) {
    spdlog::warn("{}: Prefetch refused: {}", self_.name, accepted.status().ToString());
    return rpc::ToGrpc(accepted.status());
  }
  response->set_accepted(*accepted);
  response->set_late(late);
  return grpc::Status::OK;
}

grpc::Status WorkerNode::GetStats(grpc::ServerContext* /*context*/, const v1::StatsRequest* request,
                                  v1::WorkerStats* response) {
  *response = Stats(request->reset());
  return grpc::Status::OK;
}

grpc::Status WorkerNode::GetMembership(grpc::ServerContext* /*context*/, const v1::MembershipRequest* /*request*/,
                                       v1::Membership* response) {
  *response = MembershipInfo();
  return grpc::Status::OK;
}

}  // namespace odmoe
