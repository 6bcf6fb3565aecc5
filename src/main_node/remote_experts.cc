#include "src/main_node/remote_experts.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/backend/mock_gpu_device.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/model_layout.h"
#include "src/rpc/request_id.h"

namespace odmoe {
namespace {

size_t F32Bytes(int64_t count) { return static_cast<size_t>(count) * sizeof(float); }

}  // namespace

// The calls of one layer, owned by its Layer. Each worker's calls form a queue started in order with at most
// `window` in flight: a call's callback starts the worker's next unstarted call (unless a call has failed).
//
// The callbacks only borrow it: Dispatch returns once every callback has finished with it (`callbacks_running`),
// so it (with its ClientContexts, which keep the workers' channels) is never freed on a gRPC callback thread
// (rpc::MakeChannel says why that matters).
struct LayerCalls {
  struct Call {
    v1::Worker::Stub* stub = nullptr;
    int32_t worker = 0;  // its index
    int64_t timeout_ms = 0;
    absl::Time request_deadline = absl::InfiniteFuture();  // the client's, for the whole request
    bool client_deadline = false;  // the attempt in flight's deadline is request_deadline (set before it starts)
    std::string trace_id;                                  // the client's request id, sent as x-request-id metadata
    size_t queue = 0;                                      // index into `queues` (the worker's)
    v1::ComputeExpertsRequest request;
    v1::ComputeExpertsResponse response;  // written by the attempt in flight
    grpc::Status status;                  // of the last attempt
    int attempts = 0;
    // One per attempt, the last one current; never freed before the layer is (a callback may still be
    // returning from an older attempt). Guarded by `mu` of the LayerCalls.
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    bool done = false;  // its last attempt has ended (guarded by `mu`)
  };
  struct Queue {
    std::vector<size_t> calls;  // in order
    size_t next = 0;            // the first not yet started
    int in_flight = 0;
    int peak_in_flight = 0;
  };
  std::vector<std::unique_ptr<Call>> calls;  // fixed before the first call starts
  int window = 1;
  PeerHealth* health = nullptr;  // told each call's outcome, when set

  absl::Mutex mu;
  std::vector<Queue> queues ABSL_GUARDED_BY(mu);
  int in_flight ABSL_GUARDED_BY(mu) = 0;
  size_t finished ABSL_GUARDED_BY(mu) = 0;                  // calls that succeeded
  std::optional<size_t> first_failure ABSL_GUARDED_BY(mu);  // the call that failed first
  int callbacks_running ABSL_GUARDED_BY(mu) = 0;             // attempts started whose callback has not returned
  std::vector<size_t> to_retry ABSL_GUARDED_BY(mu);         // calls the worker had no thread for
  // Set when the layer was failed from outside (a worker went down while its calls were in flight): the layer's
  // error, instead of the cancelled call's status.
  std::optional<absl::Status> aborted ABSL_GUARDED_BY(mu);

  // Fails the layer with `why` if worker `w` has a call that has not ended; true if it did.
  bool AbortWorker(int32_t w, const absl::Status& why) {
    absl::MutexLock lock(&mu);
    if (first_failure.has_value()) return false;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (calls[i]->worker != w || calls[i]->done) continue;
      first_failure = i;
      aborted = why;
      return true;
    }
    return false;
  }

  // Takes the next call of queue `q` to start, if the window and the failures allow; marks it in flight.
  std::optional<size_t> NextLocked(size_t q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Queue& queue = queues[q];
    if (first_failure.has_value() || queue.next >= queue.calls.size() || queue.in_flight >= window) return {};
    ++queue.in_flight;
    ++in_flight;
    queue.peak_in_flight = std::max(queue.peak_in_flight, queue.in_flight);
    return queue.calls[queue.next++];
  }
};

namespace {

// A gRPC synchronous server answers this, without running the handler, when it momentarily has no thread for
// the call (a thread that is exiting still holds its quota). Safe to retry: Run does, after a short backoff.
constexpr int kMaxAttempts = 10;
bool IsThreadpoolExhausted(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
         status.error_message() == "Server Threadpool Exhausted";
}

// What a call's end says about its worker, for PeerHealth: an answer (whatever its status) shows it alive; a
// transport failure or a missed rpc_timeout, that it did not answer; a cancellation (ours) or the client's
// deadline passing first (`client_deadline`: the call's deadline was the client's), nothing.
enum class CallEvidence { kAlive, kFailed, kNone };
CallEvidence EvidenceOf(const grpc::Status& status, bool client_deadline) {
  switch (status.error_code()) {
    case grpc::StatusCode::CANCELLED:
      return CallEvidence::kNone;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return client_deadline ? CallEvidence::kNone : CallEvidence::kFailed;
    case grpc::StatusCode::UNAVAILABLE:
      return CallEvidence::kFailed;
    default:
      return CallEvidence::kAlive;
  }
}

// Starts (or retries) call `i` of `state`, already counted in flight. Its callback starts the next call of the
// worker's queue, or queues the call for a retry; its last step is to leave `callbacks_running`.
void StartCall(LayerCalls* state, size_t i) {
  LayerCalls::Call* call = state->calls[i].get();
  grpc::ClientContext* ctx = nullptr;
  {
    absl::MutexLock lock(&state->mu);
    if (state->first_failure.has_value()) {
      --state->queues[call->queue].in_flight;
      --state->in_flight;
      return;
    }
    call->contexts.push_back(std::make_unique<grpc::ClientContext>());
    ctx = call->contexts.back().get();
    ++call->attempts;
    ++state->callbacks_running;
  }
  call->client_deadline = rpc::SetDeadline(*ctx, call->timeout_ms, call->request_deadline);
  rpc::AttachRequestId(*ctx, call->trace_id);
  call->response.Clear();
  call->stub->async()->ComputeExperts(ctx, &call->request, &call->response, [state, i](grpc::Status status) {
    std::optional<size_t> next;
    const CallEvidence evidence = EvidenceOf(status, state->calls[i]->client_deadline);
    const std::string message = status.error_message();
    int32_t worker = 0;
    {
      absl::MutexLock lock(&state->mu);
      LayerCalls::Call* done = state->calls[i].get();
      worker = done->worker;
      if (IsThreadpoolExhausted(status) && done->attempts < kMaxAttempts && !state->first_failure.has_value()) {
        state->to_retry.push_back(i);  // Run restarts it after a backoff; it keeps its place in the window
      } else {
        --state->queues[done->queue].in_flight;
        --state->in_flight;
        done->status = std::move(status);
        done->done = true;
        if (!done->status.ok() && !state->first_failure.has_value()) state->first_failure = i;
        if (done->status.ok()) ++state->finished;
        next = state->NextLocked(done->queue);
      }
    }
    // Outside the lock: a change of the worker's state is delivered on this thread (OnPeerEvent locks `mu`).
    if (state->health != nullptr && evidence == CallEvidence::kAlive) {
      state->health->ReportAlive(worker, "answered an expert call");
    } else if (state->health != nullptr && evidence == CallEvidence::kFailed) {
      state->health->ReportFailure(worker, StrCat("an expert call failed: ", message));
    }
    if (next.has_value()) StartCall(state, *next);
    absl::MutexLock lock(&state->mu);
    --state->callbacks_running;  // `state` may be freed from here on
  });
}

}  // namespace

void WorkerCallStats::Add(const WorkerCallStats& o) {
  calls += o.calls;
  experts_computed += o.experts_computed;
  rows_computed += o.rows_computed;
  loads_on_demand += o.loads_on_demand;
  bytes_loaded += o.bytes_loaded;
  on_demand_load_ms += o.on_demand_load_ms;
  compute_ms += o.compute_ms;
  busy_retries += o.busy_retries;
  peak_calls_in_flight = std::max(peak_calls_in_flight, o.peak_calls_in_flight);
  gpu_peak_bytes = std::max(gpu_peak_bytes, o.gpu_peak_bytes);
}

void WorkerCallStats::ToProto(const std::string& node, v1::WorkerRequestStats* p) const {
  p->set_node(node);
  p->set_experts_computed(experts_computed);
  p->set_rows_computed(rows_computed);
  p->set_calls(calls);
  p->set_bytes_loaded(bytes_loaded);
  p->set_loads_on_demand(loads_on_demand);
  p->set_on_demand_load_ms(on_demand_load_ms);
  p->set_compute_ms(compute_ms);
  p->set_busy_retries(busy_retries);
  p->set_peak_calls_in_flight(peak_calls_in_flight);
  p->set_gpu_peak_bytes(gpu_peak_bytes);
}

std::vector<PlannedCall> PlanCalls(const std::vector<ExpertBatch>& batches, const std::vector<int32_t>& worker_of,
                                   int64_t max_rows, int64_t max_task_rows) {
  ODMOE_CHECK(max_rows >= 1 && max_task_rows >= 1 && worker_of.size() == batches.size());
  const size_t cap = static_cast<size_t>(max_rows), task_cap = static_cast<size_t>(max_task_rows);
  const size_t piece = std::min(cap, task_cap);
  std::vector<int32_t> workers(worker_of.begin(), worker_of.end());
  std::sort(workers.begin(), workers.end());
  workers.erase(std::unique(workers.begin(), workers.end()), workers.end());

  std::vector<PlannedCall> calls;
  for (int32_t w : workers) {
    PlannedCall current;
    current.worker = w;
    size_t task_rows = 0;  // (token, expert) rows of `current`
    auto close = [&]() {
      if (current.tasks.empty()) return;
      calls.push_back(std::move(current));
      current = PlannedCall();
      current.worker = w;
      task_rows = 0;
    };
    for (size_t b = 0; b < batches.size(); ++b) {
      if (worker_of[b] != w) continue;
      const std::vector<int32_t>& rows = batches[b].rows;
      for (size_t begin = 0; begin < rows.size(); begin += piece) {
        const size_t end = std::min(rows.size(), begin + piece);
        const auto first = rows.begin() + static_cast<std::ptrdiff_t>(begin);
        const auto last = rows.begin() + static_cast<std::ptrdiff_t>(end);
        std::vector<int32_t> merged;  // current.rows + this piece's rows (both ascending)
        std::set_union(current.rows.begin(), current.rows.end(), first, last, std::back_inserter(merged));
        if (merged.size() > cap || task_rows + (end - begin) > task_cap) {
          close();
          merged.assign(first, last);
        }
        current.rows = std::move(merged);
        current.tasks.push_back({b, begin, end});
        task_rows += end - begin;
      }
    }
    close();
  }
  return calls;
}

absl::StatusOr<std::unique_ptr<RemoteExpertExecutor>> RemoteExpertExecutor::Create(
    Device& device, const ModelConfig& config, uint64_t expert_bytes, std::vector<WorkerEndpoint> workers,
    int32_t group_size, RemoteExpertOptions options) {
  if (workers.empty()) return absl::InvalidArgumentError("main needs at least one worker to compute experts");
  if (options.max_tokens < 1 || options.max_tensor_bytes_per_call < 1 || options.max_rows_per_call < 1 ||
      options.rpc_timeout_ms < 1 || options.calls_in_flight_per_worker < 1 || options.prefill_minibatch_rows < 0) {
    return absl::InvalidArgumentError(
        "RemoteExpertOptions: max_tokens, max_tensor_bytes_per_call, max_rows_per_call, rpc_timeout_ms and "
        "calls_in_flight_per_worker must be positive, prefill_minibatch_rows not negative");
  }
  ODMOE_ASSIGN_OR_RETURN(Placement placement, Placement::Create(static_cast<int32_t>(workers.size()), group_size));
  std::unique_ptr<RemoteExpertExecutor> ex(
      new RemoteExpertExecutor(device, config, expert_bytes, std::move(workers), placement, std::move(options)));
  const int64_t hidden = config.hidden_size, k = std::max<int64_t>(1, config.top_k);
  const int64_t t = ex->options_.max_tokens;
  ODMOE_ASSIGN_OR_RETURN(ex->yg_, device.Allocate(F32Bytes(t * hidden), "remote expert outputs"));
  ODMOE_ASSIGN_OR_RETURN(ex->index_, device.Allocate(2 * F32Bytes(t * k), "expert routing index"));
  ex->host_h_.resize(static_cast<size_t>(t * hidden));
  ex->host_out_.resize(static_cast<size_t>(t * k * hidden));
  return ex;
}

RemoteExpertExecutor::RemoteExpertExecutor(Device& device, const ModelConfig& config, uint64_t expert_bytes,
                                           std::vector<WorkerEndpoint> workers, Placement placement,
                                           RemoteExpertOptions options)
    : device_(device),
      config_(config),
      expert_bytes_(expert_bytes),
      workers_(std::move(workers)),
      placement_(placement),
      options_(std::move(options)) {
  for (const WorkerEndpoint& w : workers_) stubs_.push_back(v1::Worker::NewStub(rpc::MakeChannel(w.address)));
  stats_.resize(workers_.size());
  decode_ms_.resize(workers_.size());
  if (options_.health != nullptr) {
    ODMOE_CHECK(options_.health->size() >= workers_.size());  // peer i is worker i
    health_subscription_ = options_.health->Subscribe([this](const PeerEvent& e) { OnPeerEvent(e); });
  }
}

RemoteExpertExecutor::~RemoteExpertExecutor() {
  if (health_subscription_ != 0) options_.health->Unsubscribe(health_subscription_);
}

void RemoteExpertExecutor::OnPeerEvent(const PeerEvent& event) {
  if (event.to != PeerState::kDown || static_cast<size_t>(event.peer) >= workers_.size()) return;
  const absl::Status why = options_.health->CheckReachable(event.peer, "worker");
  if (why.ok()) return;
  // Under active_mu_, so that Dispatch cannot end the layer meanwhile; it wakes on the failure and cancels the
  // layer's calls.
  absl::MutexLock lock(&active_mu_);
  if (active_ != nullptr) active_->AbortWorker(event.peer, why);
}

void RemoteExpertExecutor::BeginStep(StepContext context) {
  step_ = std::move(context);
  stats_.assign(workers_.size(), WorkerCallStats());
  calls_reissued_ = 0;
  timing_ = DecodeTiming();
  if (step_.fresh) {
    last_layer_end_.reset();
    last_layer_busy_ms_.reset();
  }
}

void RemoteExpertExecutor::BeginForward(std::span<const ForwardSegment> segments, ForwardKind kind) {
  decode_ = kind == ForwardKind::kDecode;
  predicted_rows_.clear();
  if (!decode_) return;
  int64_t row = 0;
  for (const ForwardSegment& s : segments) {
    if (auto it = step_.boards.find(s.tag); it != step_.boards.end() && it->second != nullptr) {
      predicted_rows_.push_back({row, s.first_position, it->second});
    }
    row += s.n;
  }
}

// One layer's work as Run's phases hand it on.
struct RemoteExpertExecutor::Layer {
  int64_t layer = 0;
  int64_t sparse_index = 0;
  int64_t n = 0;
  bool decode = false;  // a decode step (its rows: one token of each request)
  // Per PredictedRow of the forward: the row's own experts, ascending (its outcome is recorded).
  std::vector<std::vector<int32_t>> row_actual;
  std::vector<ExpertBatch> batches;  // ascending expert id
  std::vector<int32_t> experts;      // the actual set, ascending (batches[b].expert)
  std::vector<int32_t> worker_of;    // per batch
  std::vector<PlannedCall> plan;
  std::unique_ptr<LayerCalls> calls;   // one per planned call, same order
  absl::Time sent, received;           // the round trip
  MembershipView view;                 // the membership the layer was placed under, in every call's header
  bool detect_slow = false;            // Dispatch cancels a call slower than its worker's SlowBound
  std::optional<int32_t> slow_worker;  // set by Dispatch when it did
};

Membership::Snapshot RemoteExpertExecutor::CurrentMembership() const {
  if (options_.membership != nullptr) return options_.membership->Current();
  return {MembershipView{}, placement_};
}

namespace {

// A layer that failed for want of a worker (gone, hung, cut off): worth sending again under a new membership.
bool WorkerWasLost(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s); }

// A worker's failed call, as the request's error. A refusal (the worker runs another cluster epoch or model, or
// finds main's call malformed) is never the client's fault: main validated the request and made the call. So
// only a lost worker, a cancellation and a busy worker keep their code; everything else is INTERNAL (HTTP 500),
// with the worker's words and `what` (which worker, which layer).
absl::Status WorkerCallError(const grpc::Status& status, std::string_view what) {
  absl::Status s = rpc::FromGrpc(status, what);
  switch (s.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kResourceExhausted:
      return s;
    default:
      return absl::InternalError(StrCat(s.message(), " (", absl::StatusCodeToString(s.code()), " from the worker)"));
  }
}

}  // namespace

absl::Status RemoteExpertExecutor::Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                                       std::span<const float> weights, float* out, Stream* stream) {
  const absl::Time entered = absl::Now();
  if (n < 1 || n > options_.max_tokens) {
    return absl::InternalError(StrCat("remote expert executor got ", n, " tokens; it takes 1..", options_.max_tokens));
  }
  // Each worker can be lost once, and a slow one left out once: the attempts are bounded.
  const int max_attempts = static_cast<int>(workers_.size()) + 2;
  std::vector<int32_t> slow;  // workers this layer leaves out for slowness (still members)
  for (int attempt = 1;; ++attempt) {
    const Membership::Snapshot m = CurrentMembership();
    membership_epoch_ = m.view.epoch;
    if (!m.placement.servable()) {
      const std::string what = StrCat("layer ", layer);
      absl::Status why = options_.membership->CheckServable(what);
      return why.ok() ? absl::UnavailableError(StrCat(what, " cannot be served: no worker takes work")) : why;
    }
    std::vector<int32_t> leave_out = m.view.absent;
    leave_out.insert(leave_out.end(), slow.begin(), slow.end());
    const Placement placement = slow.empty() ? m.placement : m.placement.Without(leave_out).value();
    Layer work;
    work.layer = layer;
    work.n = n;
    work.view = m.view;
    // Slow calls are looked for in decode, once per layer, and only where another worker can take over.
    work.detect_slow = decode_ && slow.empty() && options_.membership != nullptr && placement.num_members() > 1;
    const absl::Status status = Attempt(work, h, ids, weights, placement, out, stream, entered);
    if (status.ok()) return status;
    const uint64_t resent = work.plan.size();
    if (work.slow_worker.has_value()) {
      slow.push_back(*work.slow_worker);
      calls_reissued_ += resent;
      reissued_slow_total_.fetch_add(resent, std::memory_order_relaxed);
      spdlog::warn("layer {}: re-issuing {} expert call(s) without worker {}: {}", layer, resent,
                   workers_[static_cast<size_t>(*work.slow_worker)].name, std::string(status.message()));
      continue;
    }
    const bool lost = options_.membership != nullptr && WorkerWasLost(status) && attempt < max_attempts &&
                      absl::Now() < step_.deadline && !(step_.cancelled && step_.cancelled());
    if (!lost) return status;
    // Main's verdict takes the worker out: at once for a refused or reset connection, within PeerHealth's
    // silence bound for a hang; a failure it does not share (a momentary one) is tried again after that.
    const absl::Duration verdict =
        options_.health != nullptr ? 2 * options_.health->options().down_after : absl::Seconds(1);
    const Membership::Snapshot next =
        options_.membership->AwaitNewer(m.view.epoch, std::min(step_.deadline, absl::Now() + verdict));
    calls_reissued_ += resent;
    reissued_down_total_.fetch_add(resent, std::memory_order_relaxed);
    spdlog::warn("layer {}: re-issuing {} expert call(s) under membership epoch {} after: {}", layer, resent,
                 next.view.epoch, std::string(status.message()));
  }
}

absl::Status RemoteExpertExecutor::Attempt(Layer& work, const float* h, std::span<const int32_t> ids,
                                           std::span<const float> weights, const Placement& placement, float* out,
                                           Stream* stream, absl::Time entered) {
  ODMOE_RETURN_IF_ERROR(Place(work, ids, weights, placement));
  Encode(work, h, stream);
  ODMOE_RETURN_IF_ERROR(Dispatch(work));
  RecordRoundTrip(work, entered);
  LearnLatency(work);
  ODMOE_RETURN_IF_ERROR(CollectOutputs(work));
  return Combine(work, out, stream);
}

absl::Status RemoteExpertExecutor::Place(Layer& work, std::span<const int32_t> ids, std::span<const float> weights,
                                         const Placement& placement) {
  const int64_t k = config_.top_k, layer = work.layer, n = work.n;
  work.sparse_index = config_.SparseIndex(layer);
  if (work.sparse_index < 0) return absl::InternalError(StrCat("layer ", layer, " has no routed experts"));
  if (step_.cancelled && step_.cancelled()) return absl::CancelledError("the request was cancelled by the client");
  for (int64_t i = 0; i < n * k; ++i) {
    const int32_t e = ids[static_cast<size_t>(i)];
    if (e < 0 || e >= config_.num_experts) {
      return absl::InternalError(StrCat("router of layer ", layer, " chose expert ", e, " of ", config_.num_experts));
    }
  }
  work.batches = GroupByExpert(ids, weights, n, k);
  for (const ExpertBatch& b : work.batches) work.experts.push_back(b.expert);
  work.worker_of.resize(work.batches.size());
  work.decode = decode_;
  // A decode step, and a one-token prompt chunk, go to the layer's group; decode steps use and record the
  // predictions of their rows.
  if (!decode_ && n > 1) {
    // A prefill chunk spreads expert e to worker e mod N_W.
    for (size_t b = 0; b < work.batches.size(); ++b) {
      work.worker_of[b] = placement.PrefillWorkerOf(work.batches[b].expert);
    }
    return absl::OkStatus();
  }
  // The layer's group, the actual set (the union over the step's rows) assigned one-to-one up to G experts,
  // round-robin beyond. With predictions, the experts they announced (the union over the rows) run where they
  // had them loaded; misses go to the workers whose predicted expert went unused (they load on demand).
  std::optional<std::vector<int32_t>> predicted;
  for (const PredictedRow& r : predicted_rows_) {
    const auto first = ids.begin() + static_cast<std::ptrdiff_t>(r.row * k);
    std::vector<int32_t> actual(first, first + k);
    std::sort(actual.begin(), actual.end());
    actual.erase(std::unique(actual.begin(), actual.end()), actual.end());
    work.row_actual.push_back(std::move(actual));
    r.board->SetProgress(r.position, work.sparse_index);
    if (std::optional<std::vector<int32_t>> p = r.board->Get(r.position, work.sparse_index); p.has_value()) {
      if (!predicted.has_value()) predicted.emplace();
      predicted->insert(predicted->end(), p->begin(), p->end());
    }
  }
  if (predicted.has_value()) {
    std::sort(predicted->begin(), predicted->end());
    predicted->erase(std::unique(predicted->begin(), predicted->end()), predicted->end());
  }
  const std::vector<Assignment> assigned = predicted.has_value()
                                               ? placement.Resolve(work.sparse_index, *predicted, work.experts)
                                               : placement.Assign(work.sparse_index, work.experts);
  ODMOE_CHECK(assigned.size() == work.batches.size());
  for (size_t b = 0; b < work.batches.size(); ++b) {
    ODMOE_CHECK(assigned[b].expert == work.batches[b].expert);
    work.worker_of[b] = assigned[b].worker;
  }
  return absl::OkStatus();
}

void RemoteExpertExecutor::Encode(Layer& work, const float* h, Stream* stream) {
  const int64_t hidden = config_.hidden_size, n = work.n;
  // Rows and scales of every (token, expert) pair, exactly as LocalExpertExecutor uploads them.
  PackRowsAndScales(work.batches, n, config_.top_k, &packed_);
  device_.CopyToDevice(index_->data(), packed_.host.data(), packed_.host.size() * sizeof(int32_t), stream);
  // The layer's input to the host (this synchronizes the stream).
  device_.CopyToHost(host_h_.data(), h, F32Bytes(n * hidden), stream);

  const int64_t rows_per_bytes =
      std::max<int64_t>(1, options_.max_tensor_bytes_per_call / static_cast<int64_t>(F32Bytes(hidden)));
  // A prefill chunk goes in mini-batches of at most prefill_minibatch_rows (token, expert) rows per call, so a
  // worker computes one while the next travels (OD-MoE fig. 7).
  int64_t max_rows = std::min(options_.max_rows_per_call, rows_per_bytes), max_task_rows = rows_per_bytes;
  if (!work.decode && n > 1 && options_.prefill_minibatch_rows > 0) {
    max_rows = std::min(max_rows, options_.prefill_minibatch_rows);
    max_task_rows = std::min(max_task_rows, options_.prefill_minibatch_rows);
  }
  work.plan = PlanCalls(work.batches, work.worker_of, max_rows, max_task_rows);
  std::vector<int32_t> expert_calls(work.batches.size(), 0);  // per batch: the calls computing it (mini-batches)
  for (const PlannedCall& pc : work.plan) {
    for (const PlannedCall::Task& task : pc.tasks) ++expert_calls[task.batch];
  }
  work.calls = std::make_unique<LayerCalls>();
  work.calls->window = static_cast<int>(options_.calls_in_flight_per_worker);
  work.calls->health = options_.health;
  for (const PlannedCall& pc : work.plan) {
    auto call = std::make_unique<LayerCalls::Call>();
    v1::ComputeExpertsRequest& req = call->request;
    rpc::FillHeader(req.mutable_header(), options_.epoch, options_.fingerprint, options_.sender, step_.request_id,
                    work.view.epoch != 0 ? &work.view : nullptr);
    req.set_layer(static_cast<int32_t>(work.layer));
    req.set_position(step_.position);
    v1::Tensor* t = req.mutable_hidden();
    t->set_dtype(v1::DTYPE_F32);
    t->add_shape(static_cast<int64_t>(pc.rows.size()));
    t->add_shape(hidden);
    std::string* data = t->mutable_data();
    data->resize(pc.rows.size() * F32Bytes(hidden));
    for (size_t r = 0; r < pc.rows.size(); ++r) {
      std::memcpy(data->data() + r * F32Bytes(hidden), host_h_.data() + static_cast<int64_t>(pc.rows[r]) * hidden,
                  F32Bytes(hidden));
    }
    req.mutable_padding()->resize(
        PayloadScale::Padding(data->size(), options_.payload_scale, rpc::RoomAfter(data->size())));
    for (const PlannedCall::Task& task : pc.tasks) {
      const ExpertBatch& b = work.batches[task.batch];
      v1::ExpertTask* et = req.add_tasks();
      et->set_expert(b.expert);
      et->set_expert_calls(expert_calls[task.batch]);
      for (size_t i = task.begin; i < task.end; ++i) {
        const auto local = std::lower_bound(pc.rows.begin(), pc.rows.end(), b.rows[i]) - pc.rows.begin();
        et->add_rows(static_cast<int32_t>(local));
      }
    }
    call->stub = stubs_[static_cast<size_t>(pc.worker)].get();
    call->worker = pc.worker;
    call->timeout_ms = options_.rpc_timeout_ms;
    call->request_deadline = step_.deadline;
    call->trace_id = step_.trace_id;
    work.calls->calls.push_back(std::move(call));
  }
}

std::string RemoteExpertExecutor::Where(const Layer& work, size_t call) const {
  const WorkerEndpoint& w = workers_[static_cast<size_t>(work.plan[call].worker)];
  return StrCat("worker ", w.name, " at ", w.address, " (layer ", work.layer, ")");
}

absl::Status RemoteExpertExecutor::CheckWorkersReachable(const Layer& work) const {
  if (options_.health == nullptr) return absl::OkStatus();
  for (const PlannedCall& pc : work.plan) {
    if (absl::Status s = options_.health->CheckReachable(pc.worker, "worker"); !s.ok()) {
      return absl::UnavailableError(StrCat(s.message(), "; layer ", work.layer, " needs it"));
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteExpertExecutor::Dispatch(Layer& work) {
  LayerCalls* const state = work.calls.get();
  const std::vector<PlannedCall>& plan = work.plan;
  // A worker known to be down fails the layer at once, before anything is sent.
  ODMOE_RETURN_IF_ERROR(CheckWorkersReachable(work));
  {
    absl::MutexLock lock(&active_mu_);
    active_ = state;
  }
  // One that goes down from here on fails it through OnPeerEvent; the check above may have just missed one.
  if (absl::Status s = CheckWorkersReachable(work); !s.ok()) {
    absl::MutexLock lock(&active_mu_);
    active_ = nullptr;
    return s;
  }
  // One queue per worker (the plan lists a worker's calls consecutively), `window` calls in flight each.
  std::vector<size_t> heads;
  {
    absl::MutexLock lock(&state->mu);
    for (size_t i = 0; i < plan.size(); ++i) {
      if (i == 0 || plan[i - 1].worker != plan[i].worker) state->queues.emplace_back();
      state->calls[i]->queue = state->queues.size() - 1;
      state->queues.back().calls.push_back(i);
    }
    for (size_t q = 0; q < state->queues.size(); ++q) {
      while (std::optional<size_t> i = state->NextLocked(q)) heads.push_back(*i);
    }
  }
  work.sent = absl::Now();
  for (size_t i : heads) StartCall(state, i);

  // The bound of each call before it counts as slow (decode, work.detect_slow), from its worker's history.
  std::vector<absl::Time> slow_at(plan.size(), absl::InfiniteFuture());
  if (work.detect_slow) {
    for (size_t i = 0; i < plan.size(); ++i) slow_at[i] = work.sent + SlowBound(plan[i].worker);
  }
  // Wait until every call has succeeded, restarting those turned away after a backoff (1, 2, 4, .. 64 ms).
  std::optional<size_t> failure;
  for (;;) {
    std::vector<size_t> retry;
    int attempts = 0;
    {
      absl::MutexLock lock(&state->mu);
      auto wake = [&state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) {
        return state->finished == state->calls.size() || state->first_failure.has_value() || !state->to_retry.empty();
      };
      for (;;) {
        absl::Time next_slow = absl::InfiniteFuture();  // the earliest bound of a call still out
        for (size_t i = 0; i < plan.size(); ++i) {
          if (!state->calls[i]->done) next_slow = std::min(next_slow, slow_at[i]);
        }
        if (state->mu.AwaitWithDeadline(absl::Condition(&wake), next_slow)) break;
        const absl::Time now = absl::Now();
        for (size_t i = 0; i < plan.size() && !state->first_failure.has_value(); ++i) {
          if (state->calls[i]->done || now < slow_at[i]) continue;
          state->first_failure = i;
          work.slow_worker = plan[i].worker;
          state->aborted = absl::AbortedError(StrCat(
              Where(work, i), " has not answered in ", absl::ToInt64Milliseconds(now - work.sent),
              " ms (its bound: ", absl::ToInt64Milliseconds(slow_at[i] - work.sent), " ms, 10x its p99 or the floor)"));
        }
      }
      failure = state->first_failure;
      if (failure.has_value()) break;
      retry.swap(state->to_retry);
      if (retry.empty()) break;  // every call has succeeded
      for (size_t i : retry) attempts = std::max(attempts, state->calls[i]->attempts);
    }
    for (size_t i : retry) ++stats_[static_cast<size_t>(plan[i].worker)].busy_retries;
    absl::SleepFor(absl::Milliseconds(1 << std::min(attempts - 1, 6)));
    for (size_t i : retry) StartCall(state, i);
  }
  if (failure.has_value()) CancelInFlight(*state);
  {
    absl::MutexLock lock(&state->mu);
    // Every call ended and every callback returned: nothing uses `state` after this.
    auto all_ended = [state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) {
      return state->in_flight == 0 && state->callbacks_running == 0;
    };
    state->mu.Await(absl::Condition(&all_ended));
    failure = state->first_failure;
    for (const LayerCalls::Queue& queue : state->queues) {
      WorkerCallStats& st = stats_[static_cast<size_t>(plan[queue.calls.front()].worker)];
      st.peak_calls_in_flight =
          std::max<uint64_t>(st.peak_calls_in_flight, static_cast<uint64_t>(queue.peak_in_flight));
    }
  }
  {
    absl::MutexLock lock(&active_mu_);
    active_ = nullptr;
  }
  if (failure.has_value()) {
    absl::MutexLock lock(&state->mu);
    if (state->aborted.has_value()) {
      return absl::Status(state->aborted->code(),
                          StrCat(state->aborted->message(), "; layer ", work.layer, " was waiting for it"));
    }
    return WorkerCallError(state->calls[*failure]->status, Where(work, *failure));
  }
  work.received = absl::Now();
  return absl::OkStatus();
}

void RemoteExpertExecutor::CancelInFlight(LayerCalls& state) {
  // No attempt starts after the failure was recorded, so these are all the current ones; TryCancel is
  // thread-safe against an attempt that is just starting. It may run their callbacks: called outside the lock.
  std::vector<grpc::ClientContext*> current;
  {
    absl::MutexLock lock(&state.mu);
    for (const auto& call : state.calls) {
      if (!call->contexts.empty()) current.push_back(call->contexts.back().get());
    }
    // Calls waiting for a retry will not be restarted: they leave the window.
    for (size_t i : state.to_retry) {
      --state.queues[state.calls[i]->queue].in_flight;
      --state.in_flight;
    }
    state.to_retry.clear();
  }
  for (grpc::ClientContext* ctx : current) ctx->TryCancel();
}

namespace {
constexpr size_t kLatencyHistory = 64;  // decode round trips kept per worker
constexpr size_t kLatencyMinimum = 16;  // before a worker's calls are judged slow
}  // namespace

absl::Duration RemoteExpertExecutor::SlowBound(int32_t worker) const {
  const std::deque<double>& history = decode_ms_[static_cast<size_t>(worker)];
  if (history.size() < kLatencyMinimum) return absl::InfiniteDuration();
  std::vector<double> sorted(history.begin(), history.end());
  std::sort(sorted.begin(), sorted.end());
  const size_t p99 = (sorted.size() * 99 + 99) / 100 - 1;  // ceil(0.99 n) - 1
  return std::max(absl::Milliseconds(options_.reissue_floor_ms), absl::Milliseconds(10 * sorted[p99]));
}

void RemoteExpertExecutor::LearnLatency(const Layer& work) {
  if (!work.decode) return;
  const double ms = absl::ToDoubleMilliseconds(work.received - work.sent);
  for (size_t i = 0; i < work.plan.size(); ++i) {
    if (i > 0 && work.plan[i].worker == work.plan[i - 1].worker) continue;  // a worker's calls are consecutive
    std::deque<double>& history = decode_ms_[static_cast<size_t>(work.plan[i].worker)];
    history.push_back(ms);
    if (history.size() > kLatencyHistory) history.pop_front();
  }
}

void RemoteExpertExecutor::RecordRoundTrip(const Layer& work, absl::Time entered) {
  if (!work.decode) return;  // t_M and t_W are measured on decode steps only
  if (last_layer_end_.has_value()) {
    timing_.main_ms += absl::ToDoubleMilliseconds(entered - *last_layer_end_);
    ++timing_.main_layers;
  }
  timing_.worker_ms += absl::ToDoubleMilliseconds(work.received - work.sent);
  ++timing_.worker_layers;
}

absl::Status RemoteExpertExecutor::CollectOutputs(const Layer& work) {
  const int64_t hidden = config_.hidden_size;
  std::vector<bool> resident(work.batches.size(), true);  // per batch: no piece of it was loaded on demand
  double stall_ms = 0;                                    // load time of the experts loaded on demand
  for (size_t i = 0; i < work.plan.size(); ++i) {
    const PlannedCall& pc = work.plan[i];
    const v1::ComputeExpertsResponse& resp = work.calls->calls[i]->response;
    if (resp.outputs_size() != static_cast<int>(pc.tasks.size())) {
      return absl::DataLossError(StrCat(Where(work, i), ": returned ", resp.outputs_size(), " expert outputs for ",
                                        pc.tasks.size(), " tasks"));
    }
    WorkerCallStats& st = stats_[static_cast<size_t>(pc.worker)];
    ++st.calls;
    st.gpu_peak_bytes = std::max(st.gpu_peak_bytes, resp.gpu_peak_bytes());
    for (size_t t = 0; t < pc.tasks.size(); ++t) {
      const PlannedCall::Task& task = pc.tasks[t];
      const ExpertBatch& b = work.batches[task.batch];
      const v1::ExpertOutput& o = resp.outputs(static_cast<int>(t));
      if (o.expert() != b.expert) {
        return absl::DataLossError(
            StrCat(Where(work, i), ": output ", t, " is of expert ", o.expert(), ", expected ", b.expert));
      }
      const int64_t m = static_cast<int64_t>(task.end - task.begin);
      const int64_t shape[] = {m, hidden};
      ODMOE_ASSIGN_OR_RETURN(
          std::vector<float> values,
          rpc::DecodeF32(o.output(), shape, StrCat(Where(work, i), ": output of expert ", b.expert)));
      std::memcpy(host_out_.data() + static_cast<int64_t>(packed_.offsets[task.batch] + task.begin) * hidden,
                  values.data(), F32Bytes(m * hidden));
      ++st.experts_computed;
      st.rows_computed += static_cast<uint64_t>(m);
      st.compute_ms += o.compute_ms();
      if (o.loaded_on_demand()) {
        resident[task.batch] = false;
        stall_ms += o.load_ms();
        timing_.load_ms += o.load_ms();
        ++timing_.loads;
        ++st.loads_on_demand;
        st.on_demand_load_ms += o.load_ms();
        st.bytes_loaded += expert_bytes_;
      }
    }
  }
  // Each predicted row's outcome: whether each of its experts was resident.
  for (size_t i = 0; i < predicted_rows_.size() && i < work.row_actual.size(); ++i) {
    const std::vector<int32_t>& actual = work.row_actual[i];
    std::vector<bool> row_resident;
    for (int32_t e : actual) {
      const auto b = std::lower_bound(work.experts.begin(), work.experts.end(), e) - work.experts.begin();
      row_resident.push_back(resident[static_cast<size_t>(b)]);
    }
    predicted_rows_[i].board->Record(predicted_rows_[i].position, work.sparse_index, actual, std::move(row_resident),
                                     stall_ms);
  }
  return absl::OkStatus();
}

absl::Status RemoteExpertExecutor::Combine(const Layer& work, float* out, Stream* stream) {
  const int64_t hidden = config_.hidden_size;
  // The sum, in LocalExpertExecutor's order: experts ascending, each one's rows in order.
  ODMOE_RETURN_IF_ERROR(CombineExpertOutputs(
      device_, work.batches, packed_, index_->as<int32_t>(), hidden,
      [&](size_t b) -> absl::StatusOr<const float*> {
        const int64_t m = static_cast<int64_t>(work.batches[b].rows.size());
        device_.CopyToDevice(yg_->data(), host_out_.data() + static_cast<int64_t>(packed_.offsets[b]) * hidden,
                             F32Bytes(m * hidden), stream);
        return yg_->as<float>();
      },
      out, stream));
  // host_out_ and packed_ must stay untouched until the copies are done.
  device_.Synchronize(stream);
  RecordLayerEnd(work);
  return absl::OkStatus();
}

void RemoteExpertExecutor::RecordLayerEnd(const Layer& work) {
  if (!work.decode) {  // prefill: t_M is measured in decode only
    last_layer_end_.reset();
    last_layer_busy_ms_.reset();
    return;
  }
  const absl::Time now = absl::Now();
  const std::optional<double> busy = ModeledBusyMs(device_);
  if (last_layer_end_.has_value() && last_layer_busy_ms_.has_value() && busy.has_value()) {
    const double ms = absl::ToDoubleMilliseconds(now - *last_layer_end_);
    const auto index = static_cast<size_t>(work.sparse_index);
    if (timing_.layer_ms.size() <= index) timing_.layer_ms.resize(index + 1);
    timing_.layer_ms[index] += ms;
    timing_.modeled_main_ms += *busy - *last_layer_busy_ms_;
    double slowest_call_ms = 0;
    for (const auto& call : work.calls->calls) {
      slowest_call_ms = std::max(slowest_call_ms, call->response.modeled_busy_ms());
    }
    timing_.modeled_worker_ms += slowest_call_ms;
    ++timing_.modeled_layers;
  }
  last_layer_end_ = now;
  last_layer_busy_ms_ = busy;
}

}  // namespace odmoe
