// MainMetrics: what the main node exposes at /metrics (src/common/metrics.h, src/rpc/metrics_server.h), named
// after vLLM's where one exists (vllm:time_to_first_token_seconds -> odmoe_time_to_first_token_seconds, ...).
//
// Per request, as it happens (a Request timeline, one call per event): the outcome, queue time, time to first
// token, inter-token latency, end-to-end latency, prompt and generated tokens, the number of requests waiting
// and running. At scrape time: whether main can reach each worker and the shadow (the state of a gRPC channel
// to each), the structured-output grammar cache's counts (GrammarCache::Shared), plus the node's own counters, which
// MainNode adds as a collector (recall, on-demand loads, stalls, alignment: counted once, where GetStats counts them).
//
// Thread safety: every method may be called from any thread; a Request belongs to one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "src/common/metrics.h"

namespace odmoe {

// "ok", "cancelled" (the client went away), "invalid" (a request the model or the node refuses:
// InvalidArgument, OutOfRange, FailedPrecondition), "busy" (refused by admission control: ServerBusyError) or
// "error" (a failure while serving it).
std::string_view RequestOutcome(const absl::Status& status);

class MainMetrics {
 public:
  using Clock = std::chrono::steady_clock;
  struct Peer {
    std::string name;
    std::string role;  // "worker" or "shadow"
    std::string address;
  };
  // `labels`: rpc::DaemonMetricLabels (model, node); `peers`: the nodes whose reachability is reported.
  MainMetrics(metrics::Labels labels, std::vector<Peer> peers);

  // One request from arrival to answer: Arrived, then Queued (it waits for admission, then for its KV cache to
  // fit), Started (it joins the batch),
  // Token per generated token, and Finished once, whatever happened before.
  class Request {
   public:
    void Queued();
    void Started(int64_t prompt_tokens);
    void Token();
    void Finished(const absl::Status& status);

   private:
    friend class MainMetrics;
    explicit Request(MainMetrics* m) : m_(m), arrival_(Clock::now()) {}
    MainMetrics* m_;
    Clock::time_point arrival_, last_token_;
    bool waiting_ = false, running_ = false;
    int64_t tokens_ = 0;
  };
  Request Arrived() { return Request(this); }

  // The last request's recall and timely recall (fractions; OD-MoE eq. 3), for a dashboard; rates over time
  // come from the odmoe_prediction_experts_* counters.
  void Prediction(double recall, double timely_recall);

  // odmoe_ready: main's readiness as its prober last judged it (src/main_node/readiness.h), the metric twin of
  // grpc.health.v1 "odmoe.ready". 0 until the first judgement.
  void Ready(bool ready) { ready_.Set(ready ? 1 : 0); }

  // Main's verdict on peer `name` changed (src/main_node/peer_health.h): from now on its odmoe_*_reachable is
  // that verdict (before the first one, the channel's state), and odmoe_peer_state_changes_total{peer,to} counts
  // the change.
  void PeerChanged(const std::string& name, bool up);

  metrics::Registry& registry() { return registry_; }

 private:
  // odmoe_worker_reachable / odmoe_shadow_reachable: 1 when the channel to the peer is connected. A channel
  // that is idle or connecting is given a short while to settle (all peers at once).
  void AppendReachability(std::vector<metrics::MetricFamily>* out) const;
  // odmoe_grammar_cache_*: GrammarCache::Shared()'s counts.
  static void AppendGrammarCache(std::vector<metrics::MetricFamily>* out);

  metrics::Registry registry_;
  metrics::Family<metrics::Counter>& requests_;  // {outcome}
  metrics::Counter& prompt_tokens_;
  metrics::Counter& generation_tokens_;
  metrics::Gauge& waiting_;
  metrics::Gauge& running_;
  metrics::Histogram& queue_time_;
  metrics::Histogram& ttft_;
  metrics::Histogram& itl_;
  metrics::Histogram& e2e_;
  metrics::Gauge& recall_;
  metrics::Gauge& timely_recall_;
  metrics::Gauge& ready_;
  metrics::Family<metrics::Counter>& peer_changes_;  // {peer, to}
  const std::vector<Peer> peers_;
  mutable absl::Mutex verdict_mu_;
  std::map<std::string, bool> verdicts_ ABSL_GUARDED_BY(verdict_mu_);  // by peer name
  std::vector<std::shared_ptr<grpc::Channel>> channels_;               // one per peer
};

}  // namespace odmoe
