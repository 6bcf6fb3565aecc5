// The worker daemon's service: routed-expert computation of one sparse layer at a time, with no expert cache
// (OD-MoE, ../shared/DESIGN.md). A worker memory-maps the checkpoint, and for each expert it is asked to compute
// copies the expert's gate/up/down projections to its device (on demand, or ahead of time by Prefetch),
// computes SwiGLU on the rows main sent, returns the unweighted outputs and frees the expert again.
//
// Exactness: every output is computed by ComputeExpertRows (src/engine/moe_units.h), the function the
// single-process engine uses, so main, combining the outputs in ascending expert order (CombineExpertOutputs),
// gets bit for bit what the single-process engine computes.
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
// (Stage: validated, its hidden rows and row indices uploaded into one of two staging slots on the slot's
// stream, and the experts it needs that are neither resident nor loading loaded there as far as the budget
// allows without evicting), then computed in arrival order of the computation lock (Finish). Main keeps two
// calls in flight per worker, so the next mini-batch's rows and its expert travel to the device while the
// current one computes. A task's expert_calls says how many calls of its (request, position, layer) compute
// that expert; the worker keeps it resident until it has computed them all (in whatever order they come), so an
// expert is loaded once per prefill layer however many mini-batches it takes.
//
// Parts (each guards one kind of state; their headers give the contracts):
//  - Residency: which (request, position, layer, expert) entries are loading, ready or in use, and main's
//    progress; pure bookkeeping.
//  - GpuBudget: what fits in the GPU budget, and the allocation within it.
//  - ExpertLoader: one expert from the host store (or the weight source) to a device allocation.
//  - StagingSlots: the device buffers a call's inputs are uploaded into as it arrives.
//  - WorkerCounterSet: the counters GetStats reports.
//  - WorkerMetrics: what /metrics shows (per-layer loads, load and compute times; the counters at scrape time).
// WorkerNode wires them: it validates requests, orchestrates Stage / Finish and Prefetch, and serves the RPCs.
//
// Threads: the gRPC server's handler threads call the RPC methods concurrently; the class starts no thread.
// Expert computation is serialized by `compute_mu_` (one workspace, one compute stream); Prefetch loads outside
// it, serialized among themselves by `load_mu_` (their stream, and a budget check that sees the previous
// prefetch's loads), so a prefetch never waits for a computation. Staging takes a slot (StagingSlots) and needs
// neither. Lock order: `compute_mu_` before `load_mu_` (only Init holds both); the parts' own mutexes are
// leaves below them, except that Residency's may be held while GpuBudget is asked whether experts fit
// (Residency::Reserve), so Residency's comes before GpuBudget's.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/backend/device.h"
#include "src/common/cluster_config.h"
#include "src/common/limits.h"
#include "src/common/placement.h"
#include "src/engine/moe_units.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/open_model.h"
#include "src/model/tensor_source.h"
#include "src/rpc/request_id.h"
#include "src/rpc/rpc_util.h"
#include "src/worker_node/expert_loader.h"
#include "src/worker_node/expert_store.h"
#include "src/worker_node/gpu_budget.h"
#include "src/worker_node/residency.h"
#include "src/worker_node/staging_slots.h"
#include "src/worker_node/worker_counters.h"
#include "src/worker_node/worker_metrics.h"

namespace odmoe {

struct WorkerOptions {
  // Most token rows (the first dimension of ComputeExpertsRequest.hidden) one call may carry; sizes the
  // workspace allocated at start. By default the limit every node agrees on (main splits larger batches).
  int64_t max_rows_per_call = kMaxTokenRows;
  // Share one host copy of the experts with the host's other workers (also needs the cluster file's
  // share_host_experts); false: a private store of the served experts.
  bool share_host_experts = true;
  std::string shm_dir = "/dev/shm";  // where shared segments and their lock files live
};

class WorkerNode final : public v1::Worker::Service {
 public:
  // Opens `model_dir` (config + memory-mapped checkpoint, every expert tensor validated), or, when `model_dir` is
  // empty and the cluster's [model] is synthetic, the synthetic spec; computes the model fingerprint, packs the
  // expert store (see the class comment) and allocates the workspace on `device`, within self.gpu_budget_bytes
  // (a daemon makes its device with CreateDevice(self.device, self.gpu_budget_bytes), src/backend/
  // device_factory.h). `self` must be a worker of `cluster`. Errors: those of the model loader; InvalidArgument
  // for a node that is not a worker or a group size the worker count does not allow; ResourceExhausted (naming
  // the budget) when the budget cannot hold the workspace and one expert.
  static absl::StatusOr<std::unique_ptr<WorkerNode>> Create(const ClusterConfig& cluster, const NodeConfig& self,
                                                            const std::string& model_dir,
                                                            std::unique_ptr<Device> device,
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
  const ModelConfig& config() const { return model_.config; }
  const std::string& fingerprint() const { return model_.fingerprint; }
  uint64_t epoch() const { return cluster_.epoch; }
  Device& device() { return *device_; }
  // The mapped checkpoint; ReadNames() lists every tensor this worker has read. REQUIRES: has_checkpoint().
  const Checkpoint& checkpoint() const { return *model_.checkpoint; }
  bool has_checkpoint() const { return model_.checkpoint != nullptr; }
  // The packed host copy of the experts.
  const ExpertStore& store() const { return *store_; }
  int64_t max_rows_per_call() const { return options_.max_rows_per_call; }
  // Device bytes held for the whole life of the worker (MLP workspace, hidden state, gathered rows, outputs).
  uint64_t workspace_bytes() const { return budget_->workspace_bytes(); }
  // Device bytes one loaded expert occupies.
  uint64_t expert_bytes() const { return budget_->expert_bytes(); }
  // The memory budget the worker keeps to (0: unlimited).
  uint64_t budget_bytes() const { return budget_->limit(); }
  // Model layer indices of the sparse layers this worker's group serves in decode (Placement).
  const std::vector<int64_t>& decode_layers() const { return decode_layers_; }
  // How many experts are resident (prefetched or kept, not yet used), loading, or being computed now.
  int64_t ResidentExperts() const { return residency_.size(); }
  // The worker's metrics (served by rpc::MetricsServer, which must stop before the node is destroyed).
  const metrics::Registry& metrics() const { return metrics_->registry(); }
  metrics::Registry& mutable_metrics() { return metrics_->registry(); }  // the metrics server adds its connections

 private:
  WorkerNode(const ClusterConfig& cluster, const NodeConfig& self, std::unique_ptr<Device> device,
             const WorkerOptions& options)
      : cluster_(cluster), self_(self), options_(options), device_(std::move(device)) {}

  absl::Status Init(const std::string& model_dir);
  // Packs (or maps) the host copy of the experts this worker, and the workers of its host, serve.
  absl::Status OpenStore(const Placement& placement);
  // Prepares the compute stream and allocates the workspace within the budget.
  absl::Status AllocateWorkspace();

  // What ComputeExperts and Prefetch both check: the header (FailedPrecondition for another cluster-file epoch
  // or model, or a membership epoch older than one seen: rpc::EpochGate),
  // that `layer` is a sparse layer of the model, and that `experts` (the request's `field`, each element's id in
  // `member`) is not empty and lists experts of the layer once each (InvalidArgument naming field[i]member).
  absl::Status CheckRequest(const v1::RequestHeader& header, int64_t layer, const std::vector<int32_t>& experts,
                            std::string_view field, std::string_view member) const;
  // A buffer of `bytes` within the budget; when it does not fit and `may_evict`, idle resident experts are
  // evicted first (those not in `keep` before those in it).
  absl::StatusOr<std::unique_ptr<Buffer>> AllocateExpert(size_t bytes, std::string_view tag, bool may_evict,
                                                         const std::vector<ExpertKey>& keep);
  // Starts loading, on the staged call's stream, the experts of `request` that are neither resident nor loading,
  // as far as the budget allows without evicting anything.
  void LoadAhead(const v1::ComputeExpertsRequest& request, StagedCall& staged);
  // Computes task `i` of the staged call (the expert from residency, or loaded on demand) into `out`.
  // `row_offset`: where the task's rows start in the slot's row indices; `keys`: every task's expert.
  absl::Status ComputeTask(const StagedCall& staged, int i, int64_t row_offset, const std::vector<ExpertKey>& keys,
                           v1::ExpertOutput* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(compute_mu_);
  absl::Status ComputeLocked(const StagedCall& staged, v1::ComputeExpertsResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(compute_mu_);

  // The newest membership epoch of main's seen in a request (thread-safe).
  mutable rpc::EpochGate epochs_;
  // Constant after construction.
  const ClusterConfig cluster_;
  const NodeConfig self_;
  const WorkerOptions options_;
  const std::unique_ptr<Device> device_;
  // Constant after Init.
  OpenedModel model_;  // config, fingerprint, and where expert bytes come from: the checkpoint or a generator
  double payload_scale_ = 1.0;  // emulation: outputs padded to this many times their bytes (PayloadScale::hidden)
  std::vector<int64_t> decode_layers_;
  std::unique_ptr<ExpertStore> store_;
  std::unique_ptr<ExpertLoader> loader_;
  std::unique_ptr<GpuBudget> budget_;
  std::unique_ptr<StagingSlots> staging_;

  // Thread-safe parts.
  Residency residency_;
  WorkerCounterSet counters_;
  std::unique_ptr<WorkerMetrics> metrics_;  // set by Create; its collector reads the parts above
  // The client request ids of the latest calls: the first call of each request gets an info log line.
  rpc::RecentRequestIds requests_seen_;

  // Serializes computation; owns the workspace and the compute stream.
  absl::Mutex compute_mu_;
  std::unique_ptr<Stream> compute_stream_ ABSL_GUARDED_BY(compute_mu_);
  std::unique_ptr<MlpWorkspace> ws_ ABSL_GUARDED_BY(compute_mu_);
  std::unique_ptr<Buffer> gathered_ ABSL_GUARDED_BY(compute_mu_);  // [max_rows, hidden]
  std::unique_ptr<Buffer> output_ ABSL_GUARDED_BY(compute_mu_);    // [max_rows, hidden]

  // Serializes Prefetch loads; owns their stream.
  absl::Mutex load_mu_;
  std::unique_ptr<Stream> load_stream_ ABSL_GUARDED_BY(load_mu_);
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
    node->residency_.Drop(ahead_);
    ahead_.clear();
    node->staging_->Release(slot_);
  }

  WorkerNode* node_ = nullptr;  // set while the slot is held
  const v1::ComputeExpertsRequest* request_ = nullptr;
  int64_t n_ = 0;  // rows of hidden
  int slot_ = -1;
  std::vector<ResidentKey> ahead_;  // the entries Stage started loading
};

}  // namespace odmoe
