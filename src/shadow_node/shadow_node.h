// The shadow node (odmoe-shadow): Scaled Emulative Prediction (OD-MoE section 3, ../shared/DESIGN.md). It holds
// a full replica of the model whose decoder-layer linear weights are quantized at load time (FP16, INT8 per
// output row, NF4 in blocks of 64; embeddings, lm_head, norms and biases kept, and the routers and attention
// projections too with [shadow] keep_router / keep_attention), runs each request main serves ahead of main, and
// as soon as its router of a sparse layer has chosen at a decode position it tells that layer's workers to load
// those experts (Prefetch, fire and forget) and tells main (the Follow stream). With [shadow] hedge_margin it
// also sends its (k+1)-th expert when the router nearly chose it (hedge.h): to the workers as a Prefetch flagged
// hedge, to main in the prediction's `hedges`.
//
// One Follow stream per client request. Main sends FollowStart (the prompt), then a FollowStep as it starts
// each decode position, carrying the aligned token every T_tok steps and the K/V of the position it decoded
// last every T_kv steps. The shadow:
//  - prefills the prompt on its replica and guesses each next token itself (greedy on its own logits);
//  - at a position where a token alignment is due, waits for main's token (late departure); elsewhere it runs
//    on with its own guess, at most max_lead_tokens positions ahead of the position main is decoding;
//  - when an aligned token differs from the one it used at that position, it rolls back there (drops its KV
//    from that position on) and runs again, so predictions of the same (position, layer) are re-sent;
//  - writes main's K/V into its own cache as it arrives (for positions it has computed; later ones wait).
// The stream ends when the shadow has run the last position main decoded and main has closed its side, with a
// summary message: once every Prefetch it sent has completed, the hedged loads the workers accepted for the
// request (what their hedge_loads counters added).
// A miss never affects main's tokens: predictions only decide where experts are loaded.
//
// Requests run one at a time on the replica (a second Follow waits for the first to end). Thread safety: the
// gRPC handlers may be called concurrently; the engine is used only under run_mu_; each Follow has its own
// session state, shared by its reader thread and its handler under the session's mutex.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  // Checks a Follow stream's messages as the handler does, without a stream or a run: `first` must be a valid
  // FollowStart, then each of `rest` is applied to the session in order (the fuzz target's entry point).
  absl::Status CheckFollowMessages(const v1::FollowMessage& first, const std::vector<v1::FollowMessage>& rest);

 private:
  struct Session;
  struct Counters {
    uint64_t requests = 0;
    uint64_t predictions = 0;
    uint64_t positions_decoded = 0;
    uint64_t rollbacks = 0;
    uint64_t tokens_aligned = 0;
    uint64_t kv_aligned = 0;
    uint64_t alignment_bytes = 0;
    double lead_sum = 0;
    uint64_t hedges = 0;  // hedged experts sent
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
  // The body of Follow once the start message is read and checked.
  absl::Status RunSession(Session& session, grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);

  ClusterConfig cluster_;
  NodeConfig self_;
  std::string model_dir_;
  std::string fingerprint_;
  ModelConfig config_;
  OpenedModel model_;  // keeps the checkpoint mapped (nullptr with synthetic weights)
  std::unique_ptr<Device> device_;
  std::unique_ptr<ModelWeights> weights_;  // nullptr unless prediction mode is "shadow"
  std::unique_ptr<rpc::PrefetchSender> sender_;

  absl::Mutex run_mu_;
  std::unique_ptr<PredictingExecutor> executor_ ABSL_GUARDED_BY(run_mu_);
  std::unique_ptr<Engine> engine_ ABSL_GUARDED_BY(run_mu_);

  mutable absl::Mutex stats_mu_;
  Counters counters_ ABSL_GUARDED_BY(stats_mu_);
  Counters reset_ ABSL_GUARDED_BY(stats_mu_);  // what Stats(reset) zeroed, summed: the metrics only go up

  // /metrics: the counters above at scrape time, and each prediction's lead (a histogram).
  std::unique_ptr<metrics::Registry> metrics_;
  metrics::Histogram* lead_layers_ = nullptr;
};

}  // namespace odmoe
