// The shadow node (odmoe-shadow): Scaled Emulative Prediction (OD-MoE section 3, ../shared/DESIGN.md). It holds
// a full replica of the model whose decoder-layer linear weights are quantized at load time (FP16, INT8 per
// output row, NF4 in blocks of 64; embeddings, lm_head, norms and biases kept, and the routers and attention
// projections too with [shadow] keep_router / keep_attention), runs each request main serves ahead of main, and
// as soon as its router of a sparse layer has chosen at a decode position it tells that layer's workers to load
// those experts (Prefetch, fire and forget) and tells main (the Follow stream). With [shadow] hedge_margin it
// also sends its (k+1)-th expert when the router nearly chose it (hedge.h): to the workers as a Prefetch flagged
// hedge, to main in the prediction's `hedges`.
//
// One Follow stream per client request; main runs several requests at once (continuous batching) and the
// shadow follows each of them. Main sends FollowStart (the prompt), then a FollowStep as it starts each decode
// position, saying in which of its decode steps it decodes it (batch_id, batch_step: every running request
// advances one position per step), carrying the aligned token every T_tok steps and the K/V of the position it
// decoded last every T_kv steps. The shadow, for each request:
//  - prefills the prompt on its replica and guesses each next token itself, picked from its own logits by main's
//    rule for the request (FollowStart.pick: greedy, or main's seeded sampling and penalties, and a structured
//    output's grammar where the shadow has the model's tokenizer; pick_replay.h);
//  - at a position where a token alignment is due, waits for main's token (late departure; with [shadow]
//    early_departure it runs the position at once with its guess, and rolls back if main's token differs);
//    elsewhere it runs on with its own guess, at most max_lead_tokens positions ahead of the position main is
//    decoding (and its first position waits for main's first step, which anchors the request's positions to
//    main's steps);
//  - when an aligned token differs from the one it used at that position, it rolls back there (drops its KV
//    from that position on) and runs again, so predictions of the same (position, layer) are re-sent;
//  - writes main's K/V into its own cache as it arrives (for positions it has computed; later ones wait);
//  - with [shadow] catch_up_lag, when it has fallen that many positions behind main, takes main's token and K/V
//    for the positions main has left behind instead of running them (where both have come, with the next
//    position's token), so that a slower shadow catches up instead of predicting positions main no longer needs.
// One loop thread runs every request on the replica: each pass takes the requests that can run their next
// position and runs, in one decode forward, those whose position main decodes in the earliest step (normally
// all of them, in step with main; a request that rolled back catches up alone). At each sparse layer of it the
// shadow sends each request's own prediction to main (its Prediction stream: its recall) and the union over
// the requests of that step to the layer's workers (Prefetch for (batch_id, step, layer), placed by
// Placement::Assign as main places a step's union), again whenever a later forward of the same step adds
// experts. A request from a main that gives no batch step is prefetched under its own id and positions.
// A request's stream ends when the shadow has run the last position main decoded and main has closed its
// side, with a summary message: once every Prefetch sent so far has completed, the hedged loads the workers
// accepted while the request ran (shared with the requests followed beside it).
// A miss never affects main's tokens: predictions only decide where experts are loaded.
//
// Thread safety: the gRPC handlers may be called concurrently. The engine, the executor, the sessions' loop
// state and the union table are used only by the loop thread. Each request's session is shared by its handler
// (which waits for the loop to finish it), its reader thread (main's messages, under the session's mutex) and
// the loop. The registered sessions are under loop_mu_ (lock order: loop_mu_ is never held while a session's
// mutex is taken, and stats_mu_ is a leaf).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "odmoe/v1/shadow.grpc.pb.h"
#include "src/backend/device.h"
#include "src/common/cluster_config.h"
#include "src/common/metrics.h"
#include "src/engine/engine.h"
#include "src/engine/model_weights.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/open_model.h"
#include "src/rpc/daemon.h"
#include "src/rpc/prefetch_sender.h"

namespace odmoe {

class PredictingExecutor;

WeightQuant WeightQuantOf(ShadowQuant quant);

// One row's prediction at a sparse layer of a decode forward: its top-k, best first, and its hedges.
struct RowPrediction {
  std::span<const int32_t> experts;
  std::vector<int32_t> hedges;
};

class ShadowNode final : public v1::Shadow::Service {
 public:
  // Opens the checkpoint and the device named by the node's `device` spec; in prediction mode "shadow" it also
  // loads the quantized replica (every tensor: the shadow holds the whole model).
  static absl::StatusOr<std::unique_ptr<ShadowNode>> Create(const rpc::DaemonArgs& args);
  ~ShadowNode() override;

  grpc::Status Follow(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                        v1::ShadowStats* response) override;
  grpc::Status GetMembership(grpc::ServerContext* context, const v1::MembershipRequest* request,
                             v1::Membership* response) override;

  const std::string& fingerprint() const { return fingerprint_; }
  const ShadowSettings& settings() const { return cluster_.shadow_settings; }
  bool has_replica() const { return weights_ != nullptr; }
  uint64_t replica_bytes() const { return weights_ != nullptr ? weights_->device_bytes() : 0; }
  v1::ShadowStats Stats(bool reset);
  // The shadow's metrics (served by rpc::MetricsServer, which must stop before the node is destroyed).
  const metrics::Registry& metrics() const { return *metrics_; }
  metrics::Registry& mutable_metrics() { return *metrics_; }  // the metrics server adds its connections
  // Checks a Follow stream's messages as the handler does, without a stream or a run: `first` must be a valid
  // FollowStart, then each of `rest` is applied to the session in order (the fuzz target's entry point).
  absl::Status CheckFollowMessages(const v1::FollowMessage& first, const std::vector<v1::FollowMessage>& rest);

 private:
  struct Session;
  struct Counters {
    uint64_t requests = 0;
    uint64_t predictions = 0;
    uint64_t positions_decoded = 0;
    uint64_t positions_adopted = 0;  // positions main had left behind, taken on main's K/V (catch-up)
    uint64_t rollbacks = 0;
    uint64_t tokens_aligned = 0;
    uint64_t kv_aligned = 0;
    uint64_t alignment_bytes = 0;
    double lead_sum = 0;
    uint64_t hedges = 0;                          // hedged experts sent
    uint64_t batch_forwards = 0, batch_rows = 0;  // decode forwards of the replica and their rows
    // The one conversion to the node's stats (the counter fields and the mean lead).
    void ToProto(v1::ShadowStats* s) const;
    void Add(const Counters& o);
    // The metrics' families of these counters (odmoe_shadow_*_total).
    void AppendFamilies(std::vector<metrics::MetricFamily>* out) const;
  };
  ShadowNode() = default;
  // Makes the registry (with the daemon's constant labels), its lead histogram and its collector.
  void InitMetrics(metrics::Labels labels);
  // Checks the stream's first message (a FollowStart: header, prompt, periods) and fills `session`.
  absl::Status BeginSession(const v1::FollowMessage& first, Session& session);
  // Checks one later message (a FollowStep or FollowKv) and files it into `session`.
  absl::Status ApplyMessage(const v1::FollowMessage& msg, Session& session);
  // Where main decodes a request's position: a step of main's batch stream (or, from a main that gives no
  // batch step, the request's own id and the position).
  struct StepKey {
    uint64_t batch_id = 0;
    int64_t step = 0;
    bool operator==(const StepKey&) const = default;
  };
  // REQUIRES: s.mu held (Session is incomplete here, so the annotation cannot say it).
  static StepKey StepOf(const Session& s, int64_t position);
  // A request's next decode: the token it runs (main's aligned one, else the replica's guess) and its step.
  struct Next {
    int32_t token = 0;
    StepKey step;
    bool runnable = false;  // false: it waits for main (its token, or main's progress)
  };

  // The loop thread's body: passes over the registered sessions until the node stops, waiting for news (a new
  // request, a message from main) when a pass had nothing to do.
  void Loop();
  void Wake();  // news for the loop
  // One pass; false when nothing could run.
  bool Pass(const std::vector<Session*>& sessions);
  // Prefills a new request's prompt on its own sequence and takes the replica's guess of the first token.
  absl::Status Prefill(Session& session);
  // Applies what main sent (roll back, K/V) and decides: true when the request is over for the replica (`end`:
  // OK, or why it failed); otherwise `next` is its next position's (runnable now or not).
  bool NextOf(Session& s, std::optional<Next>* next, absl::Status* end);
  // Unregisters the session and hands it back to its handler with `status` (the loop does not touch it after).
  // `status` goes to the session's handler, on another thread: the caller keeps no copy of it, so that the last
  // reference to its payload dies on the handler's thread, under or after the session's mutex.
  void Finish(Session& session, absl::Status status);
  // The executor's hook at each sparse layer of a decode forward of Pass (rows in batch_'s order).
  void OnPredicted(int64_t layer, std::span<const RowPrediction> rows);
  // Drops the union entries of steps main has reached for every request of their stream.
  void PruneUnions();
  ClusterConfig cluster_;
  NodeConfig self_;
  std::string model_dir_;
  std::string fingerprint_;
  ModelConfig config_;
  // The model's tokens as bytes, for requests with structured output (nullptr without a tokenizer or a replica);
  // constant after construction.
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  OpenedModel model_;  // keeps the checkpoint mapped (nullptr with synthetic weights)
  std::unique_ptr<Device> device_;
  std::unique_ptr<ModelWeights> weights_;  // nullptr unless prediction mode is "shadow"
  std::unique_ptr<rpc::PrefetchSender> sender_;

  // The loop thread's (see the file comment).
  std::unique_ptr<PredictingExecutor> executor_;
  std::unique_ptr<Engine> engine_;
  struct BatchRow {
    Session* session = nullptr;
    int64_t position = 0;
    StepKey step;
  };
  std::vector<BatchRow> batch_;  // the rows of the decode forward running now
  // Per (batch id, step, model layer): each request's predicted experts and hedges, and the union last sent.
  struct UnionEntry {
    std::map<uint64_t, std::pair<std::vector<int32_t>, std::vector<int32_t>>> by_request;
    std::vector<int32_t> sent_experts, sent_hedges;
  };
  std::map<std::tuple<uint64_t, int64_t, int64_t>, UnionEntry> unions_;
  // The step whose late requests the loop waits for, and until when.
  static constexpr absl::Duration kGatherWait = absl::Milliseconds(5);
  std::optional<std::pair<StepKey, absl::Time>> gathering_;
  std::thread loop_;

  absl::Mutex loop_mu_;
  std::vector<Session*> sessions_ ABSL_GUARDED_BY(loop_mu_);  // registered by their handlers, in arrival order
  uint64_t wake_ ABSL_GUARDED_BY(loop_mu_) = 0;               // bumped on news
  bool stopping_ ABSL_GUARDED_BY(loop_mu_) = false;

  mutable absl::Mutex stats_mu_;
  Counters counters_ ABSL_GUARDED_BY(stats_mu_);
  Counters reset_ ABSL_GUARDED_BY(stats_mu_);  // what Stats(reset) zeroed, summed: the metrics only go up

  // /metrics: the counters above at scrape time, and each prediction's lead (a histogram).
  std::unique_ptr<metrics::Registry> metrics_;
  metrics::Histogram* lead_layers_ = nullptr;
};

}  // namespace odmoe
