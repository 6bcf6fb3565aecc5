#include "src/worker_node/worker_node.h"

#include <algorithm>
#include <chrono>

#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/backend/mock_gpu_device.h"
#include "src/common/host_port.h"
#include "src/common/logging.h"
#include "src/common/placement.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/model_layout.h"
#include "src/rpc/daemon.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/rpc_util.h"
#include "src/rpc/security.h"

namespace odmoe {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Room left in a response for everything but the output tensors' data.
constexpr int64_t kResponseHeadroomBytes = 1 << 20;

// The rows of every task of `request`, back to back (as they are uploaded).
std::vector<int32_t> AllRows(const v1::ComputeExpertsRequest& request) {
  std::vector<int32_t> rows;
  for (const v1::ExpertTask& task : request.tasks()) rows.insert(rows.end(), task.rows().begin(), task.rows().end());
  return rows;
}

// InvalidArgument unless every row of `task` is in [0, n) and the rows ascend strictly.
absl::Status CheckRows(const v1::ExpertTask& task, int64_t n, const std::string& where) {
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
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerNode>> WorkerNode::Create(const ClusterConfig& cluster, const NodeConfig& self,
                                                               const std::string& model_dir,
                                                               std::unique_ptr<Device> device,
                                                               const WorkerOptions& options) {
  ODMOE_CHECK(device != nullptr);
  if (self.role != NodeRole::kWorker) {
    return absl::InvalidArgumentError(
        StrCat("node '", self.name, "' has role ", NodeRoleName(self.role), "; a worker daemon needs a worker node"));
  }
  if (options.max_rows_per_call < 1) {
    return absl::InvalidArgumentError(StrCat("max_rows_per_call must be >= 1, got ", options.max_rows_per_call));
  }
  std::unique_ptr<WorkerNode> node(new WorkerNode(cluster, self, std::move(device), options));
  node->metrics_ = std::make_unique<WorkerMetrics>(rpc::DaemonMetricLabels(cluster, self, model_dir));
  ODMOE_RETURN_IF_ERROR(node->Init(model_dir));
  WorkerNode* n = node.get();
  node->metrics_->registry().AddCollector([n](std::vector<metrics::MetricFamily>* out) {
    AppendWorkerFamilies({n->counters_.Totals(), n->residency_.totals(), n->residency_.size(),
                          n->device_->memory_info(), n->budget_->limit(), n->store_->host_bytes()},
                         out);
  });
  return node;
}

// Every part that holds device memory, or host memory registered with the device, is declared after device_,
// so it goes first.
WorkerNode::~WorkerNode() = default;

// ---- start-up --------------------------------------------------------------------------------------------------

absl::Status WorkerNode::Init(const std::string& model_dir) {
  const std::vector<const NodeConfig*> workers = cluster_.workers();
  if (self_.worker_index < 0 || self_.worker_index >= static_cast<int32_t>(workers.size())) {
    return absl::InvalidArgumentError(StrCat("node '", self_.name, "' has worker index ", self_.worker_index,
                                             " but the cluster has ", workers.size(), " workers"));
  }
  ODMOE_ASSIGN_OR_RETURN(model_, OpenModel(cluster_.model, model_dir));
  ODMOE_ASSIGN_OR_RETURN(const PayloadScale payload, PayloadScaleOf(cluster_, config()));
  payload_scale_ = payload.hidden;
  // Every expert is checked now (metadata only: nothing is read) so a bad checkpoint fails at start, not in the
  // middle of a request.
  ODMOE_RETURN_IF_ERROR(model_.source->Validate(AllExpertTensors(config())));
  ODMOE_ASSIGN_OR_RETURN(
      const Placement placement,
      Placement::ForCluster(cluster_.file, static_cast<int32_t>(workers.size()), cluster_.group_size, config().top_k));
  const std::vector<int64_t> sparse = config().SparseLayers();
  for (int64_t s : placement.DecodeLayersOf(self_.worker_index, static_cast<int64_t>(sparse.size()))) {
    decode_layers_.push_back(sparse[static_cast<size_t>(s)]);
  }
  ODMOE_RETURN_IF_ERROR(OpenStore(placement));
  ODMOE_ASSIGN_OR_RETURN(loader_, ExpertLoader::Create(config(), *model_.source, *store_, *device_));
  budget_ =
      std::make_unique<GpuBudget>(*device_, self_.gpu_budget_bytes, loader_->expert_bytes(), self_.name, cluster_.file);
  return AllocateWorkspace();
}

absl::Status WorkerNode::OpenStore(const Placement& placement) {
  // The host copy: the experts of the decode layers, and expert e of every sparse layer when this worker
  // computes e in prefill.
  const std::vector<int64_t> sparse = config().SparseLayers();
  ExpertStoreOptions store_options;
  auto served_by = [&](int32_t worker, std::vector<std::pair<int64_t, int64_t>>* out) {
    for (int64_t s : placement.DecodeLayersOf(worker, static_cast<int64_t>(sparse.size()))) {
      for (int64_t e = 0; e < config().num_experts; ++e) out->emplace_back(sparse[static_cast<size_t>(s)], e);
    }
    for (int64_t l : sparse) {
      for (int64_t e = 0; e < config().num_experts; ++e) {
        if (placement.PrefillWorkerOf(static_cast<int32_t>(e)) == worker) out->emplace_back(l, e);
      }
    }
  };
  served_by(self_.worker_index, &store_options.served);
  // The shared segment holds what the workers of this host serve together (all of them on a one-host cluster,
  // this worker's own on a LAN testbed with one worker per host); every one of them computes the same set.
  const auto host_of = [](const std::string& address) {
    const absl::StatusOr<HostPort> parsed = ParseHostPort(address);  // the cluster file's addresses parse
    return parsed.ok() ? parsed->host : address;
  };
  for (const NodeConfig* w : cluster_.workers()) {
    if (host_of(w->address) == host_of(self_.address)) served_by(w->worker_index, &store_options.shared_keys);
  }
  store_options.share = cluster_.share_host_experts && options_.share_host_experts;
  store_options.shm_dir = options_.shm_dir;
  store_options.segment_name =
      StrCat("odmoe-", cluster_.name, "-e", cluster_.epoch, "-", model_.fingerprint.substr(0, 8));
  store_options.fingerprint = model_.fingerprint;
  ODMOE_ASSIGN_OR_RETURN(store_, ExpertStore::Open(config(), *model_.source, store_options, device_.get()));
  return absl::OkStatus();
}

absl::Status WorkerNode::AllocateWorkspace() {
  // MLP scratch, gathered rows and one expert's output, all for max_rows rows, and the staging slots.
  const int64_t rows = options_.max_rows_per_call;
  const int64_t h = config().hidden_size;
  const int64_t inter = std::max<int64_t>(1, config().expert_intermediate_size);
  const uint64_t activation_bytes = static_cast<uint64_t>(rows * h) * sizeof(float);
  const uint64_t ws_bytes = 2 * static_cast<uint64_t>(rows * inter) * sizeof(float);
  const uint64_t needed = ws_bytes + 2 * activation_bytes + StagingSlots::Bytes(rows, h, config().num_experts);
  absl::MutexLock compute_lock(&compute_mu_);
  absl::MutexLock load_lock(&load_mu_);
  compute_stream_ = device_->CreateStream();
  load_stream_ = device_->CreateStream();
  // The compute stream's own workspace (CUDA: the cuBLAS workspace and the GEMM scratch), allocated now so it
  // counts against the budget and no op allocates later.
  ODMOE_RETURN_IF_ERROR(
      budget_->CheckWorkspace(needed, rows, device_->PrepareStream(compute_stream_.get(), rows, std::max(h, inter))));
  ODMOE_ASSIGN_OR_RETURN(ws_, MlpWorkspace::Create(*device_, rows, inter));
  ODMOE_ASSIGN_OR_RETURN(gathered_, budget_->Allocate(activation_bytes, "worker gathered rows"));
  ODMOE_ASSIGN_OR_RETURN(output_, budget_->Allocate(activation_bytes, "worker expert output"));
  staging_ = std::make_unique<StagingSlots>(*device_);
  return staging_->Allocate(*budget_, rows, h, config().num_experts);
}

// ---- validation ------------------------------------------------------------------------------------------------

absl::Status WorkerNode::CheckRequest(const v1::RequestHeader& header, int64_t layer,
                                      const std::vector<int32_t>& experts, std::string_view field,
                                      std::string_view member) const {
  ODMOE_RETURN_IF_ERROR(rpc::CheckHeader(header, cluster_.epoch, model_.fingerprint));
  ODMOE_RETURN_IF_ERROR(epochs_.Admit(header));
  if (layer < 0 || layer >= config().num_layers) {
    return absl::InvalidArgumentError(
        StrCat("layer ", layer, " does not exist (the model has layers 0..", config().num_layers - 1, ")"));
  }
  if (!config().IsSparseLayer(layer)) {
    return absl::InvalidArgumentError(
        StrCat("layer ", layer, " is a dense MLP layer (it has no experts; main computes it)"));
  }
  if (experts.empty()) return absl::InvalidArgumentError(StrCat(field, ": empty (no expert given)"));
  std::vector<bool> seen(static_cast<size_t>(config().num_experts), false);
  for (size_t i = 0; i < experts.size(); ++i) {
    const int64_t e = experts[i];
    const std::string where = StrCat(field, "[", i, "]", member, " = ", e);
    if (e < 0 || e >= config().num_experts) {
      return absl::InvalidArgumentError(
          StrCat(where, ": no such expert (layer ", layer, " has experts 0..", config().num_experts - 1, ")"));
    }
    if (seen[static_cast<size_t>(e)]) return absl::InvalidArgumentError(StrCat(where, ": listed twice"));
    seen[static_cast<size_t>(e)] = true;
  }
  return absl::OkStatus();
}

// ---- memory ----------------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Buffer>> WorkerNode::AllocateExpert(size_t bytes, std::string_view tag, bool may_evict,
                                                                   const std::vector<ExpertKey>& keep) {
  absl::StatusOr<std::unique_ptr<Buffer>> buffer = budget_->Allocate(bytes, tag);
  if (!buffer.ok() && absl::IsResourceExhausted(buffer.status()) && may_evict &&
      residency_.EvictIdle(budget_->Excess(bytes), keep) > 0) {
    buffer = budget_->Allocate(bytes, tag);
  }
  return buffer;
}

// ---- ComputeExperts --------------------------------------------------------------------------------------------

absl::Status WorkerNode::Compute(const v1::ComputeExpertsRequest& request, v1::ComputeExpertsResponse* response) {
  response->Clear();
  counters_.CallStarted();
  const std::optional<double> busy_before = ModeledBusyMs(*device_);
  absl::StatusOr<StagedCall> staged = Stage(request);
  const absl::Status status = staged.ok() ? Finish(std::move(staged).value(), response) : staged.status();
  if (status.ok() && busy_before.has_value()) response->set_modeled_busy_ms(*ModeledBusyMs(*device_) - *busy_before);
  if (status.ok() && payload_scale_ > 1.0) {
    size_t bytes = 0;
    for (const v1::ExpertOutput& o : response->outputs()) bytes += o.output().data().size();
    response->mutable_padding()->resize(PayloadScale::Padding(bytes, payload_scale_, rpc::RoomAfter(bytes)));
  }
  counters_.CallEnded();
  return status;
}

absl::StatusOr<WorkerNode::StagedCall> WorkerNode::Stage(const v1::ComputeExpertsRequest& request) {
  std::vector<int32_t> experts;
  for (const v1::ExpertTask& task : request.tasks()) experts.push_back(task.expert());
  ODMOE_RETURN_IF_ERROR(CheckRequest(request.header(), request.layer(), experts, "tasks", ".expert"));
  const int64_t h = config().hidden_size;
  const int64_t shape[] = {-1, h};
  std::vector<int64_t> dims;
  ODMOE_ASSIGN_OR_RETURN(std::vector<float> hidden, rpc::DecodeF32(request.hidden(), shape, "hidden", &dims));
  const int64_t n = dims[0];
  if (n > options_.max_rows_per_call) {
    return absl::InvalidArgumentError(StrCat("hidden: ", n, " rows, more than this worker's limit of ",
                                             options_.max_rows_per_call,
                                             " rows per call; split the batch into several calls"));
  }
  int64_t total_rows = 0;
  for (int i = 0; i < request.tasks_size(); ++i) {
    const v1::ExpertTask& task = request.tasks(i);
    ODMOE_RETURN_IF_ERROR(CheckRows(task, n, StrCat("tasks[", i, "] (expert ", task.expert(), ")")));
    total_rows += task.rows_size();
  }
  const int64_t output_bytes = total_rows * h * static_cast<int64_t>(sizeof(float));
  if (output_bytes > rpc::kMaxMessageBytes - kResponseHeadroomBytes) {
    return absl::InvalidArgumentError(StrCat("the outputs of this request would take ", output_bytes,
                                             " bytes, more than one message carries; split the tasks over "
                                             "several calls"));
  }

  residency_.Advance(request.header().request_id(), request.position(), request.layer());
  StagedCall staged;
  staged.request_ = &request;
  staged.n_ = n;
  staged.slot_ = staging_->Acquire();
  staged.node_ = this;
  staging_->Upload(staged.slot_, std::move(hidden), AllRows(request));
  // Untracked calls (request id 0) load on demand only: nothing would free an entry they left behind.
  if (request.header().request_id() != 0) LoadAhead(request, staged);
  return staged;
}

void WorkerNode::LoadAhead(const v1::ComputeExpertsRequest& request, StagedCall& staged) {
  Stream* stream = staging_->slot(staged.slot_).stream.get();
  for (const v1::ExpertTask& task : request.tasks()) {
    const ResidentKey key{request.layer(), task.expert(), request.position()};
    if (residency_.Has({request.layer(), task.expert()}, request.position())) continue;
    if (!budget_->Fits(budget_->expert_bytes())) break;
    auto allocate = [&](size_t bytes, std::string_view tag) { return budget_->Allocate(bytes, tag); };
    absl::StatusOr<std::unique_ptr<LoadedExpert>> loaded =
        loader_->Load(request.layer(), task.expert(), stream, allocate, /*async=*/true);
    if (!loaded.ok()) break;  // the budget is full after all (a concurrent load): Finish loads on demand
    const uint64_t tensor_bytes = (*loaded)->tensor_bytes, bytes = (*loaded)->buffer->size();
    if (!residency_.Insert(key, request.header().request_id(), std::move(loaded).value(), bytes)) continue;
    counters_.Add({.loads = 1, .loads_on_demand = 1, .loads_ahead = 1, .bytes_loaded = tensor_bytes});
    metrics_->Load(request.layer(), LoadReason::kOnDemand, std::nullopt);  // its time is known when it is used
    staged.ahead_.push_back(key);
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
  const v1::ComputeExpertsRequest& request = *staged.request_;
  device_->WaitEvent(compute_stream_.get(), *staging_->slot(staged.slot_).uploaded);
  std::vector<ExpertKey> keys;
  for (const v1::ExpertTask& task : request.tasks()) keys.emplace_back(request.layer(), task.expert());
  int64_t row_offset = 0;  // of task i's rows in the slot's row indices
  for (int i = 0; i < request.tasks_size(); ++i) {
    const absl::Status status = ComputeTask(staged, i, row_offset, keys, response->add_outputs());
    if (!status.ok()) {
      device_->Synchronize(compute_stream_.get());  // earlier tasks' work is done before the error returns
      return status;
    }
    row_offset += request.tasks(i).rows_size();
  }
  return absl::OkStatus();
}

absl::Status WorkerNode::ComputeTask(const StagedCall& staged, int i, int64_t row_offset,
                                     const std::vector<ExpertKey>& keys, v1::ExpertOutput* out) {
  const v1::ComputeExpertsRequest& request = *staged.request_;
  const v1::ExpertTask& task = request.tasks(i);
  const int64_t layer = request.layer(), e = task.expert(), h = config().hidden_size;
  Stream* stream = compute_stream_.get();
  WorkerCounters delta;

  // The expert: resident (prefetched, loaded ahead or kept; waiting for a load in flight), or loaded now.
  const Clock::time_point wait_start = Clock::now();
  const Residency::Taken taken = residency_.Take(keys[static_cast<size_t>(i)], request.position());
  double load_ms = MsSince(wait_start);
  // Loaded ahead as the call arrived: still an on-demand load (it was not resident when the call arrived).
  const bool on_demand = taken.payload == nullptr || taken.origin == ResidentOrigin::kStaged;
  std::unique_ptr<LoadedExpert> own;
  LoadedExpert* expert = static_cast<LoadedExpert*>(taken.payload);
  if (expert == nullptr) {
    const std::vector<ExpertKey> later(keys.begin() + i + 1, keys.end());
    auto allocate = [&](size_t bytes, std::string_view tag) {
      return AllocateExpert(bytes, tag, /*may_evict=*/true, later);
    };
    absl::StatusOr<std::unique_ptr<LoadedExpert>> loaded = loader_->Load(layer, e, stream, allocate);
    if (!loaded.ok()) {
      return absl::Status(loaded.status().code(),
                          StrCat("loading expert ", e, " of layer ", layer, " on demand: ", loaded.status().message()));
    }
    own = std::move(loaded).value();
    expert = own.get();
    load_ms = own->load_ms;
    delta.loads = delta.loads_on_demand = 1;
    delta.bytes_loaded = own->tensor_bytes;
    delta.load_ms_total = delta.on_demand_load_ms_total = load_ms;
    metrics_->Load(layer, LoadReason::kOnDemand, load_ms);
  } else if (expert->ready != nullptr) {
    // Loaded asynchronously as a call was staged (only those loads are): wait for the copy, whose time is part
    // of the load. Later users (it may be kept) find it complete.
    const Clock::time_point copy_start = Clock::now();
    device_->SynchronizeEvent(*expert->ready);
    load_ms = expert->load_ms + MsSince(copy_start);
    expert->ready.reset();
    expert->load_ms = 0;
    delta.load_ms_total = delta.on_demand_load_ms_total = load_ms;
    metrics_->LoadTime(LoadReason::kOnDemand, load_ms);
  }

  // Exactly the single-process engine's ops (ComputeExpertRows), so main combines the same bits.
  const Clock::time_point start = Clock::now();
  const int64_t m = task.rows_size();
  const StagingSlots::Slot& slot = staging_->slot(staged.slot_);
  ComputeExpertRows(*device_, expert->mlp, slot.hidden->as<float>(), staged.n_, slot.rows->as<int32_t>() + row_offset,
                    m, h, gathered_->as<float>(), *ws_, output_->as<float>(), stream);
  out->set_expert(task.expert());
  v1::Tensor* tensor = out->mutable_output();
  tensor->set_dtype(v1::DTYPE_F32);
  tensor->add_shape(m);
  tensor->add_shape(h);
  std::string* data = tensor->mutable_data();
  data->resize(static_cast<size_t>(m * h) * sizeof(float));
  device_->CopyToHost(data->data(), output_->data(), data->size(), stream);  // synchronizes the stream
  const double compute_ms = MsSince(start);

  // After the use: kept for the other calls of this (request, position, layer), else freed (no expert cache).
  const int32_t expert_calls = request.header().request_id() != 0 ? std::max(1, task.expert_calls()) : 1;
  if (own != nullptr) {
    const uint64_t bytes = own->buffer->size();
    residency_.KeepOrFree(ResidentKey{layer, e, request.position()}, request.header().request_id(), expert_calls,
                          std::move(own), bytes);
  } else {
    residency_.Release(taken.key, expert_calls);
  }
  out->set_loaded_on_demand(on_demand);
  out->set_load_ms(load_ms);
  out->set_compute_ms(compute_ms);
  delta.experts_computed = 1;
  delta.rows_computed = static_cast<uint64_t>(m);
  delta.compute_ms_total = compute_ms;
  counters_.Add(delta);
  metrics_->Computed(compute_ms);
  return absl::OkStatus();
}

// ---- Prefetch --------------------------------------------------------------------------------------------------

absl::StatusOr<int32_t> WorkerNode::DoPrefetch(const v1::PrefetchRequest& request, bool* late) {
  if (late != nullptr) *late = false;
  const std::vector<int32_t> experts(request.experts().begin(), request.experts().end());
  ODMOE_RETURN_IF_ERROR(CheckRequest(request.header(), request.layer(), experts, "experts", ""));
  const int64_t layer = request.layer();
  absl::MutexLock load_lock(&load_mu_);
  const Residency::Reservation reserved =
      residency_.Reserve(request.header().request_id(), request.position(), layer, experts,
                         [&](size_t count) { return budget_->Fits(count * budget_->expert_bytes()); });
  switch (reserved.outcome) {
    case Residency::ReserveOutcome::kLate:
      // Main already asked for this layer (or went past it): loading now would only waste the link.
      if (late != nullptr) *late = true;
      return 0;
    case Residency::ReserveOutcome::kNoRoom:
      return budget_->Error(StrCat("prefetching ", reserved.keys.size(), " experts of layer ", layer),
                            reserved.keys.size() * budget_->expert_bytes());
    case Residency::ReserveOutcome::kReserved:
      break;
  }
  auto allocate = [&](size_t bytes, std::string_view tag) { return budget_->Allocate(bytes, tag); };
  for (size_t i = 0; i < reserved.keys.size(); ++i) {
    const int64_t e = std::get<1>(reserved.keys[i]);
    absl::StatusOr<std::unique_ptr<LoadedExpert>> loaded = loader_->Load(layer, e, load_stream_.get(), allocate);
    if (!loaded.ok()) {
      // This and the remaining reservations go; a waiting ComputeExperts then loads on demand.
      residency_.Abandon({reserved.keys.begin() + static_cast<std::ptrdiff_t>(i), reserved.keys.end()});
      return absl::Status(loaded.status().code(),
                          StrCat("prefetching expert ", e, " of layer ", layer, ": ", loaded.status().message()));
    }
    counters_.Add({.loads = 1,
                   .prefetches = 1,
                   .hedge_loads = request.hedge() ? 1u : 0u,
                   .bytes_loaded = (*loaded)->tensor_bytes,
                   .load_ms_total = (*loaded)->load_ms});
    metrics_->Load(layer, LoadReason::kPrefetch, (*loaded)->load_ms);
    const uint64_t bytes = (*loaded)->buffer->size();
    residency_.Fill(reserved.keys[i], std::move(loaded).value(), bytes);
  }
  return static_cast<int32_t>(reserved.keys.size());
}

// ---- stats and membership --------------------------------------------------------------------------------------

v1::WorkerStats WorkerNode::Stats(bool reset) {
  v1::WorkerStats s;
  s.set_node(self_.name);
  WorkerCounters counters = counters_.Read(reset);
  counters.Add(residency_.counts(reset));
  counters.ToProto(&s);
  s.set_host_bytes_packed(store_->host_bytes());
  s.set_host_experts_shared(store_->shared());
  s.set_host_bytes_pinned(store_->pinned_bytes());
  s.set_host_experts_packed(static_cast<uint64_t>(store_->experts()));
  s.set_host_packed_here(store_->packed_here());
  rpc::FillDeviceMemory(*device_, budget_->limit(), s.mutable_memory());
  if (reset) device_->ResetPeak();
  for (int64_t l : decode_layers_) s.add_layers(static_cast<int32_t>(l));
  return s;
}

v1::Membership WorkerNode::MembershipInfo() const {
  v1::Membership m;
  rpc::FillMembership(cluster_, self_.name, model_.fingerprint, &m);
  return m;
}

// ---- gRPC handlers ---------------------------------------------------------------------------------------------

grpc::Status WorkerNode::ComputeExperts(grpc::ServerContext* context, const v1::ComputeExpertsRequest* request,
                                        v1::ComputeExpertsResponse* response) {
  if (grpc::Status admitted = rpc::AdmitMember(context, {NodeRole::kMain}); !admitted.ok()) return admitted;
  logging::ScopedRequestId scope(rpc::RequestIdOf(*context));
  if (requests_seen_.Insert(logging::CurrentRequestId())) {
    spdlog::info("{}: serving the request (#{} of {}): first call, layer {} position {}, {} experts", self_.name,
                 request->header().request_id(), request->header().sender(), request->layer(), request->position(),
                 request->tasks_size());
  }
  const absl::Status status = Compute(*request, response);
  if (!status.ok()) spdlog::warn("{}: ComputeExperts refused: {}", self_.name, status.ToString());
  return rpc::ToGrpc(status);
}

grpc::Status WorkerNode::Prefetch(grpc::ServerContext* context, const v1::PrefetchRequest* request,
                                  v1::PrefetchResponse* response) {
  // The shadow's predictions, or main's own (random prefetch).
  if (grpc::Status admitted = rpc::AdmitMember(context, {NodeRole::kMain, NodeRole::kShadow}); !admitted.ok()) {
    return admitted;
  }
  logging::ScopedRequestId scope(rpc::RequestIdOf(*context));
  if (requests_seen_.Insert(logging::CurrentRequestId())) {
    spdlog::info("{}: prefetching for the request (#{} of {}): first prediction, layer {} position {}", self_.name,
                 request->header().request_id(), request->header().sender(), request->layer(), request->position());
  }
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

grpc::Status WorkerNode::GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                                  v1::WorkerStats* response) {
  if (grpc::Status admitted = rpc::AdmitClient(context); !admitted.ok()) return admitted;
  *response = Stats(request->reset());
  return grpc::Status::OK;
}

grpc::Status WorkerNode::GetMembership(grpc::ServerContext* context, const v1::MembershipRequest* /*request*/,
                                       v1::Membership* response) {
  if (grpc::Status admitted = rpc::AdmitMember(context); !admitted.ok()) return admitted;
  *response = MembershipInfo();
  return grpc::Status::OK;
}

}  // namespace odmoe
