// Routed experts computed on remote workers: main's ExpertExecutor.
//
// For each sparse layer main sends the post-attention hidden state of the tokens that chose an expert to the
// worker that serves it (src/common/placement.h: a decode step, one token of each request in the batch, goes to
// the layer's group with the actual expert set, the union over its rows, assigned one-to-one up to G experts and
// round-robin beyond, "load after routing"; a prefill chunk of several tokens sends expert e to worker e mod N_W;
// one expert computation serves every row routed to it), gets back each expert's unweighted output rows, and
// sums them on its own device in the fixed order of LocalExpertExecutor (experts in ascending id order, an
// expert's rows in order, ScatterAddScaled with the router weights). Since a worker computes expert(h[rows])
// with the same rows and the same ops as the single-process engine, and every row is computed independently of
// the others, the sum is bitwise identical to it wherever the experts ran and whatever the batch (given the same
// device kind on both sides).
//
// Every call carries the request header (epoch, model fingerprint, sender, request id) and a deadline
// (the cluster's rpc_timeout_ms). A call never carries more than max_tensor_bytes_per_call of hidden state, nor
// asks for more than that of outputs: a large prefill is split into several calls (as is one of more than
// max_rows_per_call token rows, the workers' limit), keeping an expert's rows in one call whenever they fit.
//
// Prefill mini-batches (OD-MoE fig. 7): a prefill chunk is further split into calls of at most
// prefill_minibatch_rows (token, expert) rows, expert after expert for each worker, so that a worker computes
// one mini-batch while the next one travels. The calls of one layer run concurrently across workers (gRPC
// callback stubs, no threads of ours) and in order for each worker with at most calls_in_flight_per_worker (2)
// of them in flight: the worker stages the next call (its rows and its expert on their way to the device) while
// it computes the current one. Every task says in how many calls its expert is computed (expert_calls), so the
// worker loads that expert once for all its mini-batches. A failed call fails the layer with the worker's
// status code and a message naming the worker; the other calls of the layer are cancelled.
//
// With a PeerHealth (options.health, main's verdict on each worker: src/main_node/peer_health.h) the executor
// refuses a layer at once, Unavailable naming the worker, when a worker it needs is down; cancels the layer's
// calls as soon as one of its workers goes down while they are in flight (the same error, not the deadline);
// and reports each call's outcome as evidence (an answer: alive; a transport failure or a missed deadline: down).
// Every call's deadline is the earlier of rpc_timeout_ms and the client's deadline for the request.
//
// Failover (Operations 4/4), with a Membership (options.membership): each layer is placed over the workers of
// the current membership and every call carries its view. A layer whose calls fail because a worker is gone
// (a transport failure, a missed deadline, or the worker marked down while they were in flight) waits for
// main's verdict to take that worker out of the placement, then is sent again, whole, under the new epoch:
// an expert's output is a pure function of its rows and weights, so the sum is the same, bit for bit, wherever
// the experts ran. A decode call slower than its worker's learnt bound (10x the worker's p99 round trip over its
// recent decode layers, at least reissue_floor_ms) is cancelled and the layer sent once more without that
// worker, without waiting for a deadline ("The Tail at Scale"); the worker stays a member. Both count as
// re-issued calls (stats and odmoe_expert_calls_reissued_total{reason=worker_down|slow}). When no worker is a
// member, a layer fails at once with Unavailable naming it and every worker.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "odmoe/v1/main.pb.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/backend/device.h"
#include "src/common/limits.h"
#include "src/common/placement.h"
#include "src/engine/engine.h"
#include "src/main_node/membership.h"
#include "src/main_node/peer_health.h"
#include "src/main_node/prediction.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {

// A worker as main dials it: its name in the cluster file and its address. Index in the vector = worker index.
struct WorkerEndpoint {
  std::string name;
  std::string address;
};

// What one request cost on one worker, summed from the workers' ExpertOutput fields.
struct WorkerCallStats {
  uint64_t calls = 0;             // ComputeExperts calls
  uint64_t experts_computed = 0;  // (expert, call) pairs
  uint64_t rows_computed = 0;     // (token, expert) pairs: token rows through experts
  uint64_t loads_on_demand = 0;   // experts that were not resident when their call arrived
  uint64_t bytes_loaded = 0;      // checkpoint bytes of the experts loaded on demand
  double on_demand_load_ms = 0;   // the workers' load time for them
  double compute_ms = 0;
  uint64_t busy_retries = 0;          // calls the worker's server turned away for want of a thread, then retried
  uint64_t peak_calls_in_flight = 0;  // most calls of one layer in flight to the worker at once
  uint64_t gpu_peak_bytes = 0;        // the worker's device peak, as its latest reply said (ComputeExpertsResponse)

  // Sums the counters; the peaks take the larger value.
  void Add(const WorkerCallStats& o);
  // The one conversion to the request stats of worker `node`.
  void ToProto(const std::string& node, v1::WorkerRequestStats* p) const;
};

// Where decode time goes (OD-MoE eq. 1), since BeginStep: t_M, main's own time per sparse layer (from the
// end of one layer's expert round trip to the start of the next: attention, routing, the sum, and at a
// position's first layer the embedding and sampling); t_W, a layer's expert round trip (send, the workers'
// loads and compute, receive); the workers' time per expert load (every on-demand load, prefill included).
//
// Under emulation (timed devices), the same decode layers' wall time from one layer's end to the next's, against
// the modelled busy time of main's device and of each layer's slowest call (v1::RequestStats.modeled_*).
struct DecodeTiming {
  double main_ms = 0, worker_ms = 0, load_ms = 0;  // sums
  uint64_t main_layers = 0, worker_layers = 0, loads = 0;
  double modeled_main_ms = 0, modeled_worker_ms = 0;  // sums over modeled_layers
  uint64_t modeled_layers = 0;
  // The same layers' wall time by sparse layer index: index 0 also carries the work between positions (the
  // LM head, sampling, the embedding), so a deeper model's time per token is index 0 plus the others scaled.
  std::vector<double> layer_ms;
  double measured_layers_ms() const { return std::accumulate(layer_ms.begin(), layer_ms.end(), 0.0); }
  double t_m_ms() const { return main_layers > 0 ? main_ms / static_cast<double>(main_layers) : 0; }
  double t_w_ms() const { return worker_layers > 0 ? worker_ms / static_cast<double>(worker_layers) : 0; }
  double load_ms_per_expert() const { return loads > 0 ? load_ms / static_cast<double>(loads) : 0; }
  // The most time one expert may take to load without stalling compute: (N_G) t_M + (N_G - 1) t_W with N_G
  // groups taking the sparse layers round-robin.
  double t_maxload_ms(int32_t groups) const { return groups * t_m_ms() + (groups - 1) * t_w_ms(); }
  bool io_bound(int32_t groups) const { return loads > 0 && load_ms_per_expert() > t_maxload_ms(groups); }

  void Add(const DecodeTiming& o) {
    main_ms += o.main_ms;
    worker_ms += o.worker_ms;
    load_ms += o.load_ms;
    main_layers += o.main_layers;
    worker_layers += o.worker_layers;
    loads += o.loads;
    modeled_main_ms += o.modeled_main_ms;
    modeled_worker_ms += o.modeled_worker_ms;
    modeled_layers += o.modeled_layers;
    if (layer_ms.size() < o.layer_ms.size()) layer_ms.resize(o.layer_ms.size());
    for (size_t i = 0; i < o.layer_ms.size(); ++i) layer_ms[i] += o.layer_ms[i];
  }
  // The one conversion to a proto with the timing fields (v1::RequestStats, v1::MainStats).
  template <typename Proto>
  void ToProto(int32_t groups, Proto* p) const {
    p->set_t_m_ms(t_m_ms());
    p->set_t_w_ms(t_w_ms());
    p->set_expert_load_ms(load_ms_per_expert());
    p->set_t_maxload_ms(t_maxload_ms(groups));
    p->set_io_bound(io_bound(groups));
  }
};

struct RemoteExpertOptions {
  std::string sender = "main";  // this node's name, in every request header
  uint64_t epoch = 1;
  std::string fingerprint;  // the model fingerprint (src/model/fingerprint.h)
  int64_t rpc_timeout_ms = 30000;
  int64_t max_tokens = kMaxTokenRows;  // the most tokens one Run gets (the engine's max_tokens_per_forward)
  int64_t max_tensor_bytes_per_call = rpc::kMaxTensorBytesPerCall;
  int64_t max_rows_per_call = kMaxTokenRows;  // the workers' limit on token rows per call
  // Prefill: the most (token, expert) rows one call carries (a mini-batch); 0: calls as large as the limits
  // above allow. From the cluster file's [cluster] prefill_minibatch_rows.
  int64_t prefill_minibatch_rows = 0;
  int64_t calls_in_flight_per_worker = 2;  // a worker's calls of one layer in flight at once (>= 1)
  // Emulation: each call's hidden states padded to this many times their bytes (PayloadScale::hidden, src/backend/
  // device_factory.h; 1: no padding).
  double payload_scale = 1.0;
  // Main's verdict on the workers (peer i = worker i for i < number of workers; further peers are ignored), or
  // nullptr. Must outlive the executor.
  PeerHealth* health = nullptr;
  // Main's membership of the workers (failover), or nullptr: every worker takes work, always, and a failed
  // call fails the request. Must outlive the executor.
  const Membership* membership = nullptr;
  // The least time a decode call may take before it is re-issued to another worker (see the file comment).
  int64_t reissue_floor_ms = 250 * kBuildSlowdown;
};

// One ComputeExperts call of a layer's plan: the tokens it sends and the experts it asks for.
struct PlannedCall {
  struct Task {
    size_t batch = 0;  // index into the layer's ExpertBatch list
    size_t begin = 0;  // this task covers batch.rows[begin, end)
    size_t end = 0;
  };
  int32_t worker = 0;
  std::vector<int32_t> rows;  // token indices sent (ascending, distinct): the request's hidden is h[rows]
  std::vector<Task> tasks;
};

// Splits a layer's work into calls: batch b (an expert and its rows) goes to worker `worker_of[b]`; a call
// sends at most `max_rows` distinct token rows and asks for at most `max_task_rows` (token, expert) rows in
// all (its outputs). An expert's rows stay in one call unless they alone exceed the smaller limit (then they
// are split into pieces of that size). Calls are ordered by worker, then by their first batch.
// REQUIRES: max_rows >= 1, max_task_rows >= 1, worker_of.size() == batches.size().
std::vector<PlannedCall> PlanCalls(const std::vector<ExpertBatch>& batches, const std::vector<int32_t>& worker_of,
                                   int64_t max_rows, int64_t max_task_rows);

// Thread safety: Run, BeginStep and stats are called by one thread at a time (the engine's owner, main's batch
// loop); the gRPC callbacks of a layer's calls touch only that layer's call state, under its
// own mutex, and Run returns only after every call of the layer has finished.
struct LayerCalls;  // the gRPC calls of one layer (remote_experts.cc)

class RemoteExpertExecutor : public ExpertExecutor {
 public:
  // Dials nothing yet: channels connect on first use, so workers may come up later. `expert_bytes`: the bytes of
  // one routed expert (its three projections) as stored, for the stats. `device` must outlive the executor.
  // InvalidArgument for an empty worker list or a group size that does not divide it.
  static absl::StatusOr<std::unique_ptr<RemoteExpertExecutor>> Create(Device& device, const ModelConfig& config,
                                                                      uint64_t expert_bytes,
                                                                      std::vector<WorkerEndpoint> workers,
                                                                      int32_t group_size, RemoteExpertOptions options);
  ~RemoteExpertExecutor() override;

  absl::Status Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                   std::span<const float> weights, float* out, Stream* stream) override;
  void BeginForward(std::span<const ForwardSegment> segments, ForwardKind kind) override;

  // What the next forward's calls carry, and when they stop. Continuous batching: a forward may carry the rows
  // of several requests (ForwardSegment::tag = main's request id); the workers know main's steps as positions
  // of one stream (src/worker_node/residency.h follows main's progress through it):
  //  - `request_id`, `position`: what every call of the step carries (main's batch stream and its step number);
  //  - `boards`: the prediction boards of the step's requests by tag (a request without one is not predicted).
  //    At a decode step the executor places the union of the step's experts where the union of its rows'
  //    predictions (each row's from its board, if one arrived) had them loaded (Placement::Resolve: what the
  //    shadow's union prefetch did; misses go where that rule sends them), else by Placement::Assign, and
  //    records each predicted row's own experts, and whether the workers had them, in its board;
  //  - `trace_id`: the client's request id of the step (x-request-id metadata; "" for none);
  //  - `deadline`: the latest of its requests' (no call outlives it); `cancelled` (optional, polled before each
  //    layer: true fails the step with Cancelled);
  //  - `fresh`: the engine was idle before this step (t_M is not measured across the gap).
  // BeginStep zeroes the step's stats.
  struct StepContext {
    uint64_t request_id = 0;
    int64_t position = 0;
    std::map<uint64_t, PredictionBoard*> boards;
    std::string trace_id;
    absl::Time deadline = absl::InfiniteFuture();
    std::function<bool()> cancelled;
    bool fresh = false;
  };
  void BeginStep(StepContext context);
  // Drops the step's `cancelled` hook and boards (which may be about to die); the stats stay.
  void EndStep() {
    step_.cancelled = nullptr;
    step_.boards.clear();
  }
  // Per worker (index = worker index), since BeginStep.
  const std::vector<WorkerCallStats>& stats() const { return stats_; }
  // Calls sent again since BeginStep (failover), and the membership epoch of the last layer run.
  uint64_t calls_reissued() const { return calls_reissued_; }
  uint64_t membership_epoch() const { return membership_epoch_; }
  // Since the executor was made, by reason; may be read from any thread (the metrics).
  uint64_t reissued_worker_down_total() const { return reissued_down_total_.load(std::memory_order_relaxed); }
  uint64_t reissued_slow_total() const { return reissued_slow_total_.load(std::memory_order_relaxed); }
  const DecodeTiming& timing() const { return timing_; }
  const std::vector<WorkerEndpoint>& workers() const { return workers_; }
  const Placement& placement() const { return placement_; }

 private:
  struct Layer;  // one layer's work as the phases of Run hand it on
  RemoteExpertExecutor(Device& device, const ModelConfig& config, uint64_t expert_bytes,
                       std::vector<WorkerEndpoint> workers, Placement placement, RemoteExpertOptions options);
  // The membership a layer is placed under: options_.membership's, or every worker at epoch 0.
  Membership::Snapshot CurrentMembership() const;
  // One attempt at a layer (`work`: its layer, size, membership view and whether to look for slow calls set):
  // the phases below, in order, placed by `placement` (the membership's, or that less a slow worker).
  absl::Status Attempt(Layer& work, const float* h, std::span<const int32_t> ids, std::span<const float> weights,
                       const Placement& placement, float* out, Stream* stream, absl::Time entered);
  // Validates the layer's routing, groups it by expert and decides which worker computes each expert.
  absl::Status Place(Layer& work, std::span<const int32_t> ids, std::span<const float> weights,
                     const Placement& placement);
  // Uploads the packed rows and scales, copies the layer's input to the host and builds one request per
  // planned call.
  void Encode(Layer& work, const float* h, Stream* stream);
  // Sends the calls (a window per worker), retries those turned away, waits for all; on a failure cancels the
  // rest and returns the worker's status naming it. With work.detect_slow, a call that outlives its worker's
  // SlowBound fails the layer (Aborted) with work.slow_worker set.
  absl::Status Dispatch(Layer& work);
  // The longest a decode call to `worker` may take before it is re-issued (InfiniteDuration until the worker
  // has enough history).
  absl::Duration SlowBound(int32_t worker) const;
  // A decode layer's round trip, into the history of each worker it called.
  void LearnLatency(const Layer& work);
  void CancelInFlight(LayerCalls& state);
  // Unavailable naming the first worker of the plan that options_.health says is down; else OK.
  absl::Status CheckWorkersReachable(const Layer& work) const;
  // A PeerHealth event: a worker went down; the layer in flight, if it has calls to it, fails at once.
  void OnPeerEvent(const PeerEvent& event);
  void RecordRoundTrip(const Layer& work, absl::Time entered);
  // A layer's end (its outputs combined, synchronized): the next decode layer's t_M starts here, and a decode
  // layer's wall and modelled time join timing_.
  void RecordLayerEnd(const Layer& work);
  // Checks the replies, gathers the outputs into host_out_, counts the stats, records the decode outcome.
  absl::Status CollectOutputs(const Layer& work);
  // Adds the outputs to `out` with CombineExpertOutputs (the local executor's order) and synchronizes.
  absl::Status Combine(const Layer& work, float* out, Stream* stream);
  std::string Where(const Layer& work, size_t call) const;

  Device& device_;
  const ModelConfig& config_;
  const uint64_t expert_bytes_;
  const std::vector<WorkerEndpoint> workers_;
  const Placement placement_;
  const RemoteExpertOptions options_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;  // one per worker

  int64_t health_subscription_ = 0;  // options_.health's listener id (0: none)
  // The calls of the layer being dispatched, for OnPeerEvent (which runs on another thread); set and cleared by
  // Dispatch, which frees them only after clearing it.
  absl::Mutex active_mu_;  // before LayerCalls::mu
  LayerCalls* active_ ABSL_GUARDED_BY(active_mu_) = nullptr;

  StepContext step_;
  // Of the current forward: whether it is a decode step, and its rows whose boards predict them.
  struct PredictedRow {
    int64_t row = 0;
    int64_t position = 0;
    PredictionBoard* board = nullptr;
  };
  bool decode_ = false;
  std::vector<PredictedRow> predicted_rows_;
  DecodeTiming timing_;
  std::optional<absl::Time> last_layer_end_;  // when the previous decode layer's round trip ended
  std::optional<double> last_layer_busy_ms_;  // main's device's ModeledBusyMs then (timed and mock devices)
  std::vector<WorkerCallStats> stats_;
  uint64_t calls_reissued_ = 0;
  uint64_t membership_epoch_ = 0;
  std::atomic<uint64_t> reissued_down_total_{0};
  std::atomic<uint64_t> reissued_slow_total_{0};
  std::vector<std::deque<double>> decode_ms_;  // per worker: the round trips of its last decode layers

  // Host staging and device buffers, reused across layers.
  std::vector<float> host_h_;      // [n, hidden]: the layer's input, copied from the device
  std::vector<float> host_out_;    // [n * k, hidden]: expert outputs, batch after batch
  PackedRouting packed_;           // the layer's rows and scales (host side of index_)
  std::unique_ptr<Buffer> yg_;     // [max_tokens, hidden]: one expert's outputs on the device
  std::unique_ptr<Buffer> index_;  // rows + scales of every (token, expert) pair: 2 x [max_tokens * k]
};

}  // namespace odmoe
