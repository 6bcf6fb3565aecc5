// The worker daemon's service: routed-expert computation of one sparse layer at a time, with no expert cache
// (OD-MoE, ../shared/DESIGN.md). A worker memory-maps the checkpoint, and for each expert it is asked to compute
// copies the expert's gate/up/down projections to its device (on demand, or ahead of time by Prefetch),
// computes SwiGLU on the rows main sent, returns the unweighted outputs and frees the expert again.
//
// Exactness: every output is computed with the same device ops as LocalExpertExecutor (GatherRows of the
// requested rows, skipped only when the request and the hidden state both have one row, then RunMlp), so main,
// scattering the outputs with ScatterAddScaled in ascending expert order, gets bit for bit what the
// single-process engine computes.
//
// Memory: the device holds, at most, the fixed workspace allocated at start (with two staging slots), the
// experts prefetched, loaded ahead or kept for another mini-batch and not yet used, and the one expert being
// loaded on demand. The budget is the node's gpu_budget_bytes (the device's own
// capacity when none is set); a worker refuses to start when the budget cannot hold the workspace plus one
// expert. When an on-demand load does not fit, idle prefetched experts (predicted, not yet used) are evicted,
// those not needed by the current request first.
//
// Predictions: a Prefetch is for one (request, decode position, layer); its experts stay resident for that
// position (several positions of one expert may be resident at once), and main's ComputeExperts takes the one
// of its own position (else the newest earlier one: the same weights). Every ComputeExperts with a request id
// records how far main has got: idle prefetched experts of an earlier (position, layer), or of another request,
// are then freed unused (counted), and a Prefetch for a (position, layer) main has already asked for is late:
// nothing is loaded (counted). Requests without an id (0) are not tracked.
//
// Host memory (ExpertStore, expert_store.h): at start the worker packs the experts it serves (those of its
// group's decode layers, and expert e of every sparse layer when e mod N_W is its index: prefill) contiguously,
// one block per expert, registered with the device, so one CopyToDevice moves an expert. By default the store is
// a shared-memory segment holding every routed expert, shared by all workers of the host (the first one packs
// it; `[cluster] share_host_experts = false` or WorkerOptions::share_host_experts turns sharing off). Experts
// outside the store (taken over after another worker failed) are read from the weight source, slower but
// correct.
//
// Weight access: the worker reads only routed-expert tensors (Checkpoint::Read, or synthetic generation when the
// cluster file's [model] is synthetic); the model fingerprint reads metadata only.
//
// Pipelining (prefill mini-batches, OD-MoE fig. 7): a ComputeExperts call is staged as soon as it arrives
// (Stage: validated, its hidden rows and row indices uploaded into one of two staging slots on the staging
// stream, and the experts it needs that are neither resident nor loading loaded there as far as the budget
// allows without evicting), then computed in arrival order of the computation lock (Finish). Main keeps two
// calls in flight per worker, so the next mini-batch's rows and its expert travel to the device while the
// current one computes. A task's expert_calls says how many calls of its (request, position, layer) compute
// that expert; the worker keeps it resident until it has computed them all (in whatever order they come), so an
// expert is loaded once per prefill layer however many mini-batches it takes.
//
// Threads: the gRPC server's handler threads call the RPC methods concurrently; the class starts no thread.
// Expert computation is serialized by `compute_mu_` (one device budget, one workspace); Prefetch loads outside
// it (serialized among themselves by `load_mu_`), so a prefetch never waits for a computation; staging is
// serialized by `stage_mu_`. Residency and counters are guarded by `mu_`; a ComputeExperts that needs an expert
// a Prefetch is still loading waits for it (`resident_changed_`). Lock order: `compute_mu_`, then `load_mu_` or
// `stage_mu_`; `alloc_mu_` and `mu_` are leaves, never held together.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/backend/device.h"
#include "src/backend/mock_gpu_device.h"
#include "src/common/cluster_config.h"
#include "src/engine/model_weights.h"
#include "src/engine/moe_units.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/tensor_source.h"
#include "src/worker_node/expert_store.h"

namespace odmoe {

// Most token rows (the first dimension of ComputeExpertsRequest.hidden) one ComputeExperts call may carry by
// default; main splits larger batches into several calls. Equal to EngineOptions::max_tokens_per_forward's
// default, so main's prefill chunks fit one call.
inline constexpr int64_t kWorkerMaxRowsPerCall = 256;

struct WorkerOptions {
  int64_t max_rows_per_call = kWorkerMaxRowsPerCall;  // sizes the workspace allocated at start
  // Share one host copy of the experts with the host's other workers (also needs the cluster file's
  // share_host_experts); false: a private store of the served experts.
  bool share_host_experts = true;
  std::string shm_dir = "/dev/shm";  // where shared segments and their lock files live
  // Tests: the mock GPU's speeds and timeline recording (its capacity is still the node's budget); ignored for
  // other devices. Unset: the defaults, without a timeline.
  std::optional<MockGpuOptions> mock_gpu;
};

class WorkerNode final : public v1::Worker::Service {
 public:
  // Opens `model_dir` (config + memory-mapped checkpoint, every expert tensor validated), or, when `model_dir` is
  // empty and the cluster's [model] is synthetic, the synthetic spec; computes the model fingerprint, packs the
  // expert store (see the class comment), creates the device of `self` with its GPU budget and allocates the
  // workspace. `self` must be a worker of `cluster`. Errors: those of the model loader; InvalidArgument for a
  // bad device spec, a node that is not a worker, or a group size the worker count does not allow;
  // ResourceExhausted (naming the budget) when the budget cannot hold the workspace and one expert.
  static absl::StatusOr<std::unique_ptr<WorkerNode>> Create(const ClusterConfig& cluster, const NodeConfig& self,
                                                            const std::string& model_dir,
                                                            const WorkerOptions& options = {});
  ~WorkerNode() override;

  // ---- gRPC (odmoe.v1.Worker) -------------------------------------------------------------------------------
  grpc::Status ComputeExperts(grpc::ServerContext* context, const v1::ComputeExpertsRequest* request,
                              v1::ComputeExpertsResponse* response) override;
  grpc::Status Prefetch(grpc::ServerContext* context, const v1::PrefetchRequest* request,
                        v1::PrefetchResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                        v1::WorkerStats* response) override;
  grpc::Status GetMembership(grpc::ServerContext* context, const v1::MembershipRequest* request,
                             v1::Membership* response) override;

  // ---- the same operations as absl::Status (what the handlers call) -------------------------------------------
  // A call between its two halves: see Stage. Move-only; destroying it without Finish frees what it loaded ahead
  // and gives its slot back.
  class StagedCall;
  // Validates the whole request first (FailedPrecondition for a header of another epoch or model;
  // InvalidArgument naming the field for anything else), then computes every task in order. On error the
  // response is cleared and no expert stays loaded by this call. Compute = Stage, then Finish.
  absl::Status Compute(const v1::ComputeExpertsRequest& request, v1::ComputeExpertsResponse* response);
  // The first half of Compute, run as the call arrives: validates the request, waits for a free staging slot
  // (two: at most two calls are staged at once), enqueues the upload of its hidden rows and row indices, and
  // starts loading the experts it needs that are neither resident nor loading (those that fit the budget next
  // to what is resident; the others are loaded on demand by Finish). Blocks the host on none of these copies.
  // `request` must outlive the StagedCall.
  absl::StatusOr<StagedCall> Stage(const v1::ComputeExpertsRequest& request);
  // The second half: computes the staged call's tasks in order (serialized with other calls), fills `response`.
  absl::Status Finish(StagedCall staged, v1::ComputeExpertsResponse* response);
  // Loads the listed experts that are neither resident nor loading, synchronously; returns how many loads it
  // started. ResourceExhausted, naming the budget, when they do not fit next to what is resident.
  // A prediction for a (request, position, layer) main has already asked for (or gone past) is late: nothing is
  // loaded, 0 is returned and `*late` (optional) is set.
  absl::StatusOr<int32_t> DoPrefetch(const v1::PrefetchRequest& request, bool* late = nullptr);
  // The counters since start (or the last reset) and the device memory; `reset` zeroes the counters and the
  // device's peak after reading them.
  v1::WorkerStats Stats(bool reset);
  v1::Membership MembershipInfo() const;

  // ---- for main.cc and tests --------------------------------------------------------------------------------
  const NodeConfig& self() const { return self_; }
  const ModelConfig& config() const { return config_; }
  const std::string& fingerprint() const { return fingerprint_; }
  uint64_t epoch() const { return cluster_.epoch; }
  Device& device() { return *device_; }
  // The mapped checkpoint; ReadNames() lists every tensor this worker has read. REQUIRES: has_checkpoint().
  const Checkpoint& checkpoint() const { return *checkpoint_; }
  bool has_checkpoint() const { return checkpoint_ != nullptr; }
  // The packed host copy of the experts.
  const ExpertStore& store() const { return *store_; }
  int64_t max_rows_per_call() const { return options_.max_rows_per_call; }
  // Device bytes held for the whole life of the worker (MLP workspace, hidden state, gathered rows, outputs).
  uint64_t workspace_bytes() const { return workspace_bytes_; }
  // Device bytes one loaded expert occupies.
  uint64_t expert_bytes() const { return expert_bytes_; }
  // The memory budget the worker keeps to (0: unlimited).
  uint64_t budget_bytes() const { return budget_bytes_; }
  // Model layer indices of the sparse layers this worker's group serves in decode (Placement).
  const std::vector<int64_t>& decode_layers() const { return decode_layers_; }
  // How many experts are resident (prefetched or kept, not yet used), loading, or being computed now.
  int64_t ResidentExperts() const;

 private:
  using ExpertKey = std::pair<int64_t, int64_t>;  // (layer, expert)
  using ResidentKey = std::tuple<int64_t, int64_t, int64_t>;  // (layer, expert, position)
  static constexpr int kStagingSlots = 2;

  // One expert's projections in device memory (one allocation: gate, up, down at aligned offsets).
  struct LoadedExpert {
    std::unique_ptr<Buffer> buffer;
    MlpWeights mlp;
    uint64_t tensor_bytes = 0;  // bytes copied host-to-device
    double load_ms = 0;         // an asynchronous load: the time to enqueue it (the wait is added when used)
    std::unique_ptr<Event> ready;  // an asynchronous load: recorded after its copy (null: already complete)
  };
  // Why an expert is resident: predicted (Prefetch), loaded as its call was staged, or kept for the next call.
  enum class Origin { kPrefetch, kStaged, kKept };
  struct ResidentEntry {
    bool loading = true;  // a Prefetch is copying it; `expert` is set when done
    bool in_use = false;  // a computation is using it (not evictable)
    int32_t uses = 0;     // calls that have computed with it
    Origin origin = Origin::kPrefetch;
    std::unique_ptr<LoadedExpert> expert;
    uint64_t sequence = 0;  // order of arrival, for eviction (oldest first)
    // The request it was loaded for (0: untracked, never stale); the position is the key's.
    uint64_t request_id = 0;
  };
  // Main's progress: the (request, position, layer) of its latest ComputeExperts with a request id.
  struct Progress {
    uint64_t request_id = 0;
    int64_t position = -1;
    int64_t layer = -1;
  };
  // True when main has already asked for (position, layer) of `request_id` or gone past it (or on to another
  // request): a prediction for it is late, a prefetched expert for it stale.
  static bool Passed(const Progress& progress, uint64_t request_id, int64_t position, int64_t layer);

  // One staging slot: device buffers for a call's hidden rows and row indices, the host copies they are
  // uploaded from (alive until `uploaded` has completed), and whether a call holds it.
  struct StagingSlot {
    std::unique_ptr<Buffer> hidden;   // [max_rows, hidden]
    std::unique_ptr<Buffer> rows;     // [max_rows * num_experts] int32
    std::unique_ptr<Event> uploaded;  // recorded after the uploads
    std::vector<float> host_hidden;
    std::vector<int32_t> host_rows;
  };
  // Gives slot `slot` back once its uploads have completed.
  void ReleaseSlot(int slot);
  // What Finish takes for one task: the expert (owned by its resident entry, marked in use) and its key.
  struct Taken {
    LoadedExpert* expert = nullptr;  // null: neither resident nor loading
    ResidentKey key;
    Origin origin = Origin::kPrefetch;
  };

  struct Counters {
    uint64_t experts_computed = 0;
    uint64_t rows_computed = 0;
    uint64_t loads = 0;
    uint64_t loads_on_demand = 0;
    uint64_t bytes_loaded = 0;
    double load_ms_total = 0;
    double on_demand_load_ms_total = 0;
    double compute_ms_total = 0;
    uint64_t evictions = 0;
    uint64_t prefetches = 0;
    uint64_t prefetches_late = 0;
    uint64_t prefetches_unused = 0;
    uint64_t experts_kept = 0;
    uint64_t loads_ahead = 0;
    uint64_t calls_in_flight_peak = 0;
  };

  WorkerNode(const ClusterConfig& cluster, const NodeConfig& self, const WorkerOptions& options)
      : cluster_(cluster), self_(self), options_(options) {}

  absl::Status Init(const std::string& model_dir);
  // dtype and size of an expert tensor from the checkpoint's metadata or the synthetic config.
  absl::StatusOr<ExpertTensorMeta> TensorMeta(const TensorSpec& spec) const;
  // InvalidArgument unless `layer` is a sparse layer of the model.
  absl::Status CheckLayer(int64_t layer) const;
  // Copies expert (layer, e) from the mapped checkpoint to a new device allocation on `stream` and waits for
  // the copies (with `async`, records LoadedExpert::ready instead, when the bytes come from the store). On
  // ResourceExhausted, evicts idle resident experts (those not in `keep` first) and retries. Prefetch and
  // staging pass `may_evict` false: they never displace another resident expert.
  absl::StatusOr<std::unique_ptr<LoadedExpert>> LoadExpert(int64_t layer, int64_t e, Stream* stream, bool may_evict,
                                                           const std::vector<ExpertKey>& keep, bool async = false);
  // Allocates `bytes` within the budget (atomically with the budget check).
  absl::StatusOr<std::unique_ptr<Buffer>> AllocateWithinBudget(size_t bytes, std::string_view tag);
  absl::Status BudgetError(std::string_view what, uint64_t bytes) const;
  // Frees idle resident experts, oldest first, those not in `keep` before those in it, until `bytes` more fit
  // in the budget (or none is left). Returns how many were evicted.
  int EvictIdle(uint64_t bytes, const std::vector<ExpertKey>& keep);
  // Finds expert (layer, e) among the resident entries, waiting for an in-flight prefetch of it, and marks it in
  // use; Taken::expert is null when it is neither resident nor loading. `waited_ms` gets the time spent waiting.
  // Prefers the entry for `position`, else the newest one for an earlier position (the same weights).
  Taken TakeResident(const ExpertKey& key, int64_t position, double* waited_ms);
  // Ends a use of a taken entry: keeps it resident (idle, Origin::kKept) until it has been used by
  // `expert_calls` calls, then frees it.
  void ReleaseResident(const ResidentKey& key, int32_t expert_calls);
  // Makes `entry` hold `expert`, idle and ready, newest in eviction order.
  void SetReadyLocked(ResidentEntry& entry, Origin origin, uint64_t request_id, std::unique_ptr<LoadedExpert> expert)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The resident entry of expert `key` usable at `position` (TakeResident's choice), or end().
  std::map<ResidentKey, ResidentEntry>::iterator FindResident(const ExpertKey& key, int64_t position)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records main's progress and frees the idle prefetched experts it made stale. Returns how many were freed.
  int AdvanceProgress(uint64_t request_id, int64_t position, int64_t layer);
  absl::Status ComputeLocked(const StagedCall& staged, v1::ComputeExpertsResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(compute_mu_);
  // Frees the idle entries `staged` loaded ahead (its Finish failed, or it was dropped without one).
  void DropStagedLoads(const StagedCall& staged);

  const ClusterConfig cluster_;
  const NodeConfig self_;
  const WorkerOptions options_;
  ModelConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;  // null for synthetic weights
  // Where expert bytes come from: the checkpoint, or a SyntheticSource. Reads of a source that is not stable
  // are serialized by `source_mu_` (and copied before it is released).
  std::unique_ptr<TensorSource> source_;
  absl::Mutex source_mu_;
  DType synthetic_dtype_ = DType::kBF16;
  std::unique_ptr<ExpertStore> store_;
  std::string fingerprint_;
  std::unique_ptr<Device> device_;
  uint64_t budget_bytes_ = 0;
  uint64_t expert_bytes_ = 0;
  uint64_t workspace_bytes_ = 0;
  std::vector<int64_t> decode_layers_;

  // Serializes computation; owns the workspace and the compute stream.
  absl::Mutex compute_mu_;
  std::unique_ptr<Stream> compute_stream_ ABSL_GUARDED_BY(compute_mu_);
  std::unique_ptr<MlpWorkspace> ws_ ABSL_GUARDED_BY(compute_mu_);
  std::unique_ptr<Buffer> gathered_ ABSL_GUARDED_BY(compute_mu_);  // [max_rows, hidden]
  std::unique_ptr<Buffer> output_ ABSL_GUARDED_BY(compute_mu_);    // [max_rows, hidden]

  // Staging: the slots (each used by the one call that holds it), which are free, and the stream the uploads
  // and the loads started by Stage go on.
  std::array<StagingSlot, kStagingSlots> slots_;
  absl::Mutex stage_mu_;
  absl::CondVar slot_freed_;
  std::array<bool, kStagingSlots> slot_busy_ ABSL_GUARDED_BY(stage_mu_) = {};
  std::unique_ptr<Stream> stage_stream_ ABSL_GUARDED_BY(stage_mu_);
  int64_t calls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;

  // Serializes Prefetch loads; owns their stream.
  absl::Mutex load_mu_;
  std::unique_ptr<Stream> load_stream_ ABSL_GUARDED_BY(load_mu_);

  // Makes the budget check and the allocation one step.
  absl::Mutex alloc_mu_;

  mutable absl::Mutex mu_;
  absl::CondVar resident_changed_;  // signalled when a loading entry becomes ready or is dropped
  // Keyed by (layer, expert, position): predictions of one expert for several positions may be resident.
  std::map<ResidentKey, ResidentEntry> resident_ ABSL_GUARDED_BY(mu_);
  Progress progress_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

class WorkerNode::StagedCall {
 public:
  StagedCall(StagedCall&& other) noexcept { *this = std::move(other); }
  StagedCall& operator=(StagedCall&& other) noexcept {
    if (this != &other) {
      Reset();
      node_ = std::exchange(other.node_, nullptr);
      request_ = other.request_;
      n_ = other.n_;
      slot_ = other.slot_;
      ahead_ = std::move(other.ahead_);
    }
    return *this;
  }
  ~StagedCall() { Reset(); }

 private:
  friend class WorkerNode;
  StagedCall() = default;
  // Frees what Stage loaded ahead (unless Finish consumed it) and gives the slot back.
  void Reset() {
    if (node_ == nullptr) return;
    WorkerNode* node = std::exchange(node_, nullptr);
    node->DropStagedLoads(*this);
    ahead_.clear();
    node->ReleaseSlot(slot_);
  }

  WorkerNode* node_ = nullptr;  // set while the slot is held
  const v1::ComputeExpertsRequest* request_ = nullptr;
  int64_t n_ = 0;  // rows of hidden
  int slot_ = -1;
  std::vector<ResidentKey> ahead_;  // the entries Stage started loading
};

}  // namespace odmoe
