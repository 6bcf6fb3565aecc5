#include "src/main_node/main_metrics.h"

#include <utility>

#include "src/common/status.h"
#include "src/engine/output_grammar.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {
namespace {

double SecondsSince(MainMetrics::Clock::time_point t, MainMetrics::Clock::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

// Inter-token latencies: 1 ms .. 80 s (vLLM's range, with finer steps below 10 ms for small models).
std::vector<double> InterTokenBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
          0.4,   0.5,    0.75,  1,    2.5,   5,    7.5,   10,  20,   40,  80};
}

}  // namespace

std::string_view RequestOutcome(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return "ok";
    case absl::StatusCode::kCancelled:
      return "cancelled";
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return "invalid";
    case absl::StatusCode::kResourceExhausted:
      return IsServerBusy(status) ? "busy" : "error";
    default:
      return "error";
  }
}

MainMetrics::MainMetrics(metrics::Labels labels, std::vector<Peer> peers)
    : registry_(std::move(labels)),
      requests_(registry_.AddCounter("odmoe_requests_total",
                                     "Requests answered, by outcome: ok, cancelled (the client went away), invalid "
                                     "(refused: bad prompt or limits), busy (refused: the queue was full), error "
                                     "(failed while serving).",
                                     {"outcome"})),
      prompt_tokens_(
          registry_.AddCounter("odmoe_prompt_tokens_total", "Prompt tokens of the requests served.").With({})),
      generation_tokens_(registry_.AddCounter("odmoe_generation_tokens_total", "Tokens generated.").With({})),
      waiting_(registry_.AddGauge("odmoe_num_requests_waiting", "Requests waiting to join the batch now.").With({})),
      running_(registry_.AddGauge("odmoe_num_requests_running", "Requests in the batch now.").With({})),
      queue_time_(
          registry_
              .AddHistogram("odmoe_request_queue_time_seconds",
                            "Time a request waited to join the batch: for a place, then for room for its KV cache.",
                            metrics::LatencyBuckets())
              .With({})),
      ttft_(registry_
                .AddHistogram("odmoe_time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.", metrics::LatencyBuckets())
                .With({})),
      itl_(registry_
               .AddHistogram("odmoe_inter_token_latency_seconds", "Time between two consecutive generated tokens.",
                             InterTokenBuckets())
               .With({})),
      e2e_(registry_
               .AddHistogram("odmoe_e2e_request_latency_seconds",
                             "Time from a request's arrival to its answer (requests served ok).",
                             metrics::LatencyBuckets())
               .With({})),
      recall_(registry_
                  .AddGauge("odmoe_prediction_recall_last",
                            "Recall of the last request with decode steps (OD-MoE eq. 3; 0..1).")
                  .With({})),
      timely_recall_(registry_
                         .AddGauge("odmoe_prediction_timely_recall_last",
                                   "Timely recall of the last request with decode steps (predicted and resident "
                                   "or loading when main asked; 0..1).")
                         .With({})),
      ready_(registry_
                 .AddGauge("odmoe_ready",
                           "1 while main is ready (grpc.health.v1 odmoe.ready): every sparse layer has a reachable "
                           "owner.")
                 .With({})),
      peer_changes_(registry_.AddCounter("odmoe_peer_state_changes_total",
                                         "Changes of main's verdict on a peer (to = up or down; the first verdict "
                                         "after start counts).",
                                         {"peer", "to"})),
      peers_(std::move(peers)) {
  for (const char* outcome : {"ok", "cancelled", "invalid", "error"}) requests_.With({outcome});
  for (const Peer& p : peers_) channels_.push_back(rpc::MakeChannel(p.address));
  registry_.AddCollector([this](std::vector<metrics::MetricFamily>* out) { AppendReachability(out); });
  registry_.AddCollector(AppendGrammarCache);
  rpc::AddBuildInfo(registry_);
}

void MainMetrics::Request::Queued() {
  waiting_ = true;
  m_->waiting_.Add(1);
}

void MainMetrics::Request::Started(int64_t prompt_tokens) {
  const Clock::time_point now = Clock::now();
  if (waiting_) m_->waiting_.Add(-1);
  waiting_ = false;
  running_ = true;
  m_->running_.Add(1);
  m_->queue_time_.Observe(SecondsSince(arrival_, now));
  m_->prompt_tokens_.Add(static_cast<double>(prompt_tokens));
}

void MainMetrics::Request::Token() {
  const Clock::time_point now = Clock::now();
  (tokens_ == 0 ? m_->ttft_ : m_->itl_).Observe(SecondsSince(tokens_ == 0 ? arrival_ : last_token_, now));
  last_token_ = now;
  ++tokens_;
  m_->generation_tokens_.Add();
}

void MainMetrics::Request::Finished(const absl::Status& status) {
  if (waiting_) m_->waiting_.Add(-1);
  if (running_) m_->running_.Add(-1);
  waiting_ = running_ = false;
  m_->requests_.With({std::string(RequestOutcome(status))}).Add();
  if (status.ok()) m_->e2e_.Observe(SecondsSince(arrival_, Clock::now()));
}

void MainMetrics::Prediction(double recall, double timely_recall) {
  recall_.Set(recall);
  timely_recall_.Set(timely_recall);
}

void MainMetrics::PeerChanged(const std::string& name, bool up) {
  peer_changes_.With({name, up ? "up" : "down"}).Add();
  absl::MutexLock lock(&verdict_mu_);
  verdicts_[name] = up;
}

void MainMetrics::AppendGrammarCache(std::vector<metrics::MetricFamily>* out) {
  const GrammarCache::Counts c = GrammarCache::Shared().counts();
  auto family = [&](const char* name, const char* help, metrics::MetricType type, double value) {
    out->push_back(
        metrics::MetricFamily{.name = name, .help = help, .type = type, .samples = {metrics::Sample{.value = value}}});
  };
  family("odmoe_grammar_cache_hits_total",
         "Structured-output grammars (a JSON Schema's, a regex's) found compiled: the request's validation and "
         "sampling after the API compiled it, and schemas sent before.",
         metrics::MetricType::kCounter, static_cast<double>(c.hits));
  family("odmoe_grammar_cache_misses_total", "Structured-output grammars compiled (or refused): not found compiled.",
         metrics::MetricType::kCounter, static_cast<double>(c.misses));
  family("odmoe_grammar_cache_entries", "Compiled structured-output grammars kept now.", metrics::MetricType::kGauge,
         static_cast<double>(c.entries));
  family("odmoe_grammar_cache_bytes", "About the bytes the kept grammars hold.", metrics::MetricType::kGauge,
         static_cast<double>(c.bytes));
}

void MainMetrics::AppendReachability(std::vector<metrics::MetricFamily>* out) const {
  // Ask every idle channel to connect, then give those still settling up to 250 ms in all.
  std::vector<grpc_connectivity_state> states;
  for (const auto& channel : channels_) states.push_back(channel->GetState(/*try_to_connect=*/true));
  const auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(250);
  for (size_t i = 0; i < channels_.size(); ++i) {
    while (states[i] == GRPC_CHANNEL_IDLE || states[i] == GRPC_CHANNEL_CONNECTING) {
      if (!channels_[i]->WaitForStateChange(states[i], deadline)) break;
      states[i] = channels_[i]->GetState(/*try_to_connect=*/true);
    }
  }
  metrics::MetricFamily workers{"odmoe_worker_reachable",
                                "1 when main holds a connection to the worker (its gRPC channel is ready), else 0.",
                                metrics::MetricType::kGauge,
                                {}};
  metrics::MetricFamily shadow{"odmoe_shadow_reachable",
                               "1 when main holds a connection to the shadow (its gRPC channel is ready), else 0.",
                               metrics::MetricType::kGauge,
                               {}};
  std::map<std::string, bool> verdicts;
  {
    absl::MutexLock lock(&verdict_mu_);
    verdicts = verdicts_;
  }
  for (size_t i = 0; i < peers_.size(); ++i) {
    metrics::Sample s;
    s.value = states[i] == GRPC_CHANNEL_READY ? 1 : 0;
    if (auto v = verdicts.find(peers_[i].name); v != verdicts.end()) s.value = v->second ? 1 : 0;
    if (peers_[i].role == "worker") {
      s.labels = {{"worker", peers_[i].name}};
      workers.samples.push_back(std::move(s));
    } else {
      shadow.samples.push_back(std::move(s));
    }
  }
  out->push_back(std::move(workers));
  if (!shadow.samples.empty()) out->push_back(std::move(shadow));
}

}  // namespace odmoe
