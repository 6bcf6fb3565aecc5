// The main node (odmoe-main): the client API of the cluster. It holds every non-expert weight (embeddings,
// attention, norms, routers, shared experts, dense MLPs, lm_head) on its device and the KV cache, runs attention
// and routing layer by layer, and has the routed experts computed by the workers (RemoteExpertExecutor). It
// never opens a routed expert's tensor (Checkpoint::ExpertTensorsRead() stays 0; reported in every request's
// stats). Expert prediction follows the cluster file's [shadow] mode: "shadow" streams each request to the
// shadow (ShadowLink: prompt, per-step token/KV alignment) and places experts where its predictions had them
// loaded; "random" predicts k random experts per layer itself and prefetches them (ablation case 5); "none"
// loads after routing. Recall and timely recall of every request are in its stats (PredictionBoard).
//
// Continuous batching: up to [cluster] max_running requests run at once, decoded together by one batch loop
// thread (src/engine/batching.h: a step is schedule -> run -> postprocess; a new prompt goes in chunks between
// decode steps); up to [cluster] max_queued more wait their turn in arrival order and the next is refused at
// once, busy (admission control, src/main_node/admission.h). A request is validated before it waits (bad
// requests are answered at once); its ttft_ms and total_ms count from its arrival, queue_ms the wait.
// Every running request is predicted: each has its own Follow stream to the shadow (ShadowLink: its prompt,
// each decode position with the batch step that decodes it, its alignment) and its own PredictionBoard (its
// recall); the shadow prefetches the union of the running requests' experts per layer. The workers know main's
// steps as positions of one stream (batch_id_, a random id per main process; decode steps numbered from 1, a
// prefill chunk at the number of the last decode step), so that a prediction for a step main has not reached
// waits for it however the requests come and go (src/worker_node/residency.h).
//
// Thread safety: the gRPC handlers may be called concurrently from the server's threads; each hands its
// request to the batch loop and streams what the loop posts back. The engine and the executor are used only by
// the batch loop thread; a request's shadow link by the loop while it runs, then by its own thread, which waits
// for the shadow's last predictions (FinishPrediction) without holding up the batch or the queue (its running
// place has gone to the next request by then).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "odmoe/v1/main.grpc.pb.h"
#include "src/backend/device.h"
#include "src/common/cluster_config.h"
#include "src/common/limits.h"
#include "src/engine/batching.h"
#include "src/engine/engine.h"
#include "src/engine/generator.h"
#include "src/engine/model_weights.h"
#include "src/main_node/admission.h"
#include "src/main_node/main_metrics.h"
#include "src/main_node/membership.h"
#include "src/main_node/peer_health.h"
#include "src/main_node/prediction.h"
#include "src/main_node/remote_experts.h"
#include "src/main_node/shadow_link.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/open_model.h"
#include "src/model/tokenizer.h"
#include "src/rpc/daemon.h"
#include "src/rpc/prefetch_sender.h"

namespace odmoe {

struct MainNodeOptions {
  EngineOptions engine;
  // Tests lower it to force chunked expert calls; production keeps rpc::kMaxTensorBytesPerCall.
  int64_t max_tensor_bytes_per_call = rpc::kMaxTensorBytesPerCall;
  int64_t max_rows_per_call = kMaxTokenRows;  // the workers' limit
};

class MainNode final : public v1::Inference::Service {
 public:
  // Loads the model's config, opens its checkpoint, uploads the non-expert weights to the device named by the
  // node's `device` spec, loads its tokenizer (tokenizer.model or tokenizer.json) when the model has one, and
  // prepares (without dialing) the channels to the workers of the cluster file. Errors name the file, tensor or
  // field at fault.
  static absl::StatusOr<std::unique_ptr<MainNode>> Create(const rpc::DaemonArgs& args, MainNodeOptions options = {});
  ~MainNode() override;

  // Streams one GenerateResponse per generated token (its id and, with a tokenizer, the text it completes) and
  // a final one (done = true) with the whole result and the request's stats.
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status GetMembership(grpc::ServerContext* context, const v1::MembershipRequest* request,
                             v1::Membership* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                        v1::MainStats* response) override;
  v1::MainStats Stats(bool reset);

  // One request as main's log line about its end reports it (Generate writes it, success or not).
  struct RequestRecord {
    std::string request_id;  // in: the client's request id (rpc/request_id.h), "" for none
    // in: `emit` returning false means the caller has what it wants (a stop string matched: the HTTP API), not
    // that the client went away: the request then ends OK (outcome ok) without its final message.
    bool emit_false_is_stop = false;
    absl::Time deadline = absl::InfiniteFuture();  // in: the client's deadline; no call to a peer outlives it
    // in: a place in the queue taken beforehand with Admit() (the HTTP API takes it before it answers 200 to a
    // stream), used instead of arriving now; nullptr: the request arrives when RunRequest is called. It stays the
    // caller's: RunRequest waits its turn on it and, as the request ends, yields its running place (so another
    // request may run on it later; Admission::Ticket::Yield), or leaves it when the request never ran.
    Admission::Ticket* admitted = nullptr;
    int64_t prompt_tokens = 0;  // out, as far as the request got
    int64_t generated_tokens = 0;
    double ttft_ms = 0;
    double decode_tokens_per_s = 0;
    double total_ms = 0;
  };

  // Generate without gRPC (the gRPC and HTTP APIs both serve through it). `emit` receives each message in order
  // and returns false when the client has gone (the request then stops); `stop` (optional) is polled while the
  // request waits and between its steps, and its status, once not OK, is the request's. `record` (optional)
  // carries the request id to every RPC made for the request and receives its figures. Logs the request's
  // "finished:" line, whatever its outcome. Errors: InvalidArgument / OutOfRange / FailedPrecondition for a bad
  // request (nothing emitted), a worker's status (Unavailable, DeadlineExceeded, ...) naming it, Cancelled when
  // the client went away, `stop`'s status.
  absl::Status RunRequest(const v1::GenerateRequest& request,
                          const std::function<bool(const v1::GenerateResponse&)>& emit, const StopCheck& stop = nullptr,
                          RequestRecord* record = nullptr);

  // A place in main's queue for a request about to be run (RequestRecord::admitted), or ServerBusyError when
  // the queue is full (src/main_node/admission.h).
  absl::StatusOr<Admission::Ticket> Admit() { return admission_->Arrive(); }
  // Requests main runs at once ([cluster] max_running).
  int32_t max_running() const { return admission_->max_running(); }

  // Routed-expert tensors this node has read from its checkpoint (0 unless something is wrong).
  int64_t expert_tensors_opened() const {
    return model_.checkpoint != nullptr ? model_.checkpoint->ExpertTensorsRead() : 0;
  }
  const std::string& fingerprint() const { return fingerprint_; }
  const ModelConfig& config() const { return config_; }
  const NodeConfig& self() const { return self_; }
  bool has_tokenizer() const { return tokenizer_ != nullptr; }
  // The model's tokenizer (nullptr when it has none); Encode/Decode are const and thread-safe.
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // Its tokens as bytes, for structured output (nullptr without a tokenizer).
  std::shared_ptr<const TokenVocabulary> vocabulary() const { return vocabulary_; }
  // The checkpoint folder ("" with synthetic weights).
  const std::string& model_dir() const { return model_dir_; }
  // The registry behind metrics(), for servers of the node that add their own families (the HTTP API's requests,
  // every HTTP server's connections).
  metrics::Registry& mutable_metrics() { return metrics_->registry(); }
  // The node's metrics (served by rpc::MetricsServer, which must stop before the node is destroyed).
  const metrics::Registry& metrics() const { return metrics_->registry(); }
  // Readiness as main's prober judged it, for /metrics (odmoe_ready).
  void SetReady(bool ready) { metrics_->Ready(ready); }
  // Shutdown's first step, before the server goes NOT_SERVING and closes its port: from here on a Generate call
  // is refused with UNAVAILABLE, so that none accepted in between runs. Calls already running are not affected.
  void StopAccepting() { refusing_calls_.store(true); }
  // Main's verdict on its peers: the workers (peer i = worker i of the cluster file), then the shadow when
  // predictions come from it. Probed from Create on (PeerProber); requests fail at once on a down worker.
  PeerHealth& peer_health() { return *health_; }

 private:
  MainNode() = default;
  // Makes the node's metrics: the request timelines, the peers' reachability and the counters below.
  void InitMetrics(const rpc::DaemonArgs& args);
  // The prompt ids of a request: prompt_ids, or the text prompt tokenized. InvalidArgument when both or neither
  // is given; FailedPrecondition for a text prompt when the model has no tokenizer.
  absl::StatusOr<std::vector<int32_t>> PromptOf(const v1::GenerateRequest& request) const;

  // The phases of RunRequest. RequestRun: one request's state (main_node.cc), shared by its thread and the
  // batch loop.
  struct RequestRun;
  // The batch loop (its thread's body): takes the requests handed over, runs batch steps until the node stops.
  void BatchLoop();
  // Hands `run` to the batch loop; it posts the tokens and the end to `run`.
  void Submit(RequestRun* run);
  // Loop side. The requests handed over join the batch in order (their KV caches allocated, their predictions
  // started) while their caches fit in main's device memory; the first that does not waits in waiting_, and the
  // rest behind it, until a running request leaves. One that would not fit even with no other request's cache
  // fails at once (ResourceExhausted), as does one whose Add fails otherwise. Its metrics' timeline starts as it
  // joins.
  void JoinWaiting();
  // Whether `run`'s KV cache fits in main's device capacity beside what main holds apart from the running
  // requests' caches (true when the capacity is not known).
  bool FitsWithoutOthers(const RequestRun& run) const;
  // A request leaves the batch with `status` (OK: it stopped); Finish posts a request's end to its thread.
  void Leave(RequestRun* run, absl::Status status);
  static void Finish(RequestRun* run, absl::Status status);
  // One step of the batch.
  void RunStep(bool fresh);
  // The running request whose batch request is `request` (it must be one).
  RequestRun* RunOf(const BatchRequest* request) const;
  // RunRequest but for its metrics (`timeline`: the request's, which RunRequest finishes) and its log line;
  // `record` is never null.
  absl::Status ServeRequest(const v1::GenerateRequest& request,
                            const std::function<bool(const v1::GenerateResponse&)>& emit, const StopCheck& stop,
                            RequestRecord* record, MainMetrics::Request& timeline);
  // The request's one "finished:" line: its outcome, tokens and times (at warn, with the error, when not OK).
  static void LogFinished(const absl::Status& status, const RequestRecord& record);
  // Request setup: the request checked against the model and turned into Generate's options.
  absl::StatusOr<GenerateOptions> OptionsOf(const v1::GenerateRequest& request, std::span<const int32_t> prompt) const;
  // The prediction source of a request joining the batch (its shadow stream, or none: main's random
  // predictions are made per step in RunStep), and its end, on the request's thread once the loop is done with
  // it (the shadow's last predictions awaited, up to [shadow] finish_wait_ms, unless the request failed; its
  // recall and alignment counts kept).
  void StartPrediction(RequestRun& run);
  void FinishPrediction(RequestRun& run, bool request_ok);
  // Random prediction (ablation case 5) for a decode step of `runs` at step number `step`: k random experts per
  // sparse layer for each request's row, on its board, and their union prefetched.
  void PredictAtRandom(const std::vector<RequestRun*>& runs, int64_t step);
  // The token callback (batch loop): posts the token to the request's thread and, unless it is the last one,
  // tells the shadow which position main decodes next, in which step (with the alignment due).
  void OnToken(RequestRun& run, int32_t id, bool last);
  // The final message, and its stats (also added to the node's counters).
  v1::GenerateResponse FinalResponse(RequestRun& run, const GenerateResult& result, IncrementalDecoder* decoder) const;
  void FillRequestStats(const RequestRun& run, const GenerateResult& result, v1::RequestStats* stats);

  ClusterConfig cluster_;
  NodeConfig self_;
  std::string model_dir_;
  std::string fingerprint_;
  ModelConfig config_;
  OpenedModel model_;  // its checkpoint is nullptr with synthetic weights
  std::unique_ptr<Device> device_;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<Tokenizer> tokenizer_;  // nullptr when the model ships no tokenizer
  std::shared_ptr<const TokenVocabulary> vocabulary_;  // tokenizer_'s, constant after construction
  std::atomic<uint64_t> next_request_id_{1};
  std::atomic<bool> refusing_calls_{false};  // StopAccepting
  // Before experts_ and metrics_, which subscribe to it; the prober stops first (~MainNode).
  std::unique_ptr<PeerHealth> health_;
  std::unique_ptr<PeerProber> prober_;
  // Which workers take work (failover); subscribes to health_, read by the executor and the shadow link.
  std::unique_ptr<Membership> membership_;

  std::unique_ptr<Admission> admission_;  // the bounded FCFS queue in front of the batch
  // Used by the batch loop thread only (and by Create and the destructor, when it is not running).
  std::unique_ptr<RemoteExpertExecutor> experts_;
  // experts_ for what may be read from other threads (its thread-safe totals, for the metrics).
  const RemoteExpertExecutor* experts_unguarded_ = nullptr;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<BatchRunner> runner_;
  std::vector<RequestRun*> running_;  // the requests in the batch, in arrival order
  // Handed over, not yet in the batch (JoinWaiting), in arrival order. Bounded by admission's places, which every
  // one of them holds.
  std::deque<RequestRun*> waiting_;
  // A request left the batch, or waiting_, since the head of waiting_ last failed to fit: it may fit now.
  bool memory_freed_ = true;
  // The workers' view of main's steps: the request id every expert call carries, and the decode steps run
  // (the number of the last one).
  uint64_t batch_id_ = 0;
  int64_t decode_steps_ = 0;
  // Expert prediction (cluster_.shadow_settings.mode): each request's shadow stream over one channel, or main's
  // own random predictions.
  std::shared_ptr<grpc::Channel> shadow_channel_;
  ShadowLinkOptions shadow_options_;
  std::unique_ptr<rpc::PrefetchSender> random_sender_;
  // The hand-over to the batch loop.
  absl::Mutex inbox_mu_;
  std::vector<RequestRun*> inbox_ ABSL_GUARDED_BY(inbox_mu_);
  bool stopping_ ABSL_GUARDED_BY(inbox_mu_) = false;
  std::thread batch_thread_;

  // Counters since the last reset (Stats): each request's are added once, as it ends.
  struct Counters {
    uint64_t requests = 0;
    uint64_t decode_layers = 0, correct = 0, timely = 0, predictions_missing = 0, loads_on_demand = 0;
    double stall_ms = 0;
    uint64_t tokens_aligned = 0, kv_aligned = 0, alignment_bytes = 0, kv_alignments_skipped = 0;
    uint64_t predictions_received = 0;
    double lead_layers_sum = 0;  // over the predictions received
    DecodeTiming timing;
    uint64_t hedge_loads = 0, hedges_used = 0;   // hedged prefetch
    uint64_t decode_steps = 0, decode_rows = 0;  // continuous batching: steps and the requests' rows in them
    // One request's counters.
    static Counters OfRequest(const RecallSummary& r, const AlignmentCounts& a);
    void Add(const Counters& o);
    // The one conversion to the node's stats (recall over decode_layers * top_k; N_G groups for t_maxload).
    void ToProto(int64_t top_k, int32_t groups, v1::MainStats* s) const;
    // The metrics' families of these counters (odmoe_prediction_*, odmoe_on_demand_*, odmoe_alignment_*, ...).
    void AppendFamilies(int64_t top_k, std::vector<metrics::MetricFamily>* out) const;
  };
  int32_t placement_groups_ = 1;  // N_G, for t_maxload
  mutable absl::Mutex stats_mu_;
  Counters counters_ ABSL_GUARDED_BY(stats_mu_);
  Counters reset_ ABSL_GUARDED_BY(stats_mu_);  // what Stats(reset) zeroed, summed: the metrics only go up
  std::unique_ptr<MainMetrics> metrics_;       // set by Create; its collector reads the counters above
};

}  // namespace odmoe
