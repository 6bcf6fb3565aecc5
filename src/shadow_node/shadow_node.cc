#include "src/shadow_node/shadow_node.h"

#include <algorithm>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/common/logging.h"
#include "src/common/placement.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/request_id.h"
#include "src/rpc/rpc_util.h"
#include "src/rpc/security.h"
#include "src/shadow_node/hedge.h"

namespace odmoe {

WeightQuant WeightQuantOf(ShadowQuant quant) {
  switch (quant) {
    case ShadowQuant::kFp16: return WeightQuant::kFp16;
    case ShadowQuant::kInt8: return WeightQuant::kInt8;
    case ShadowQuant::kNf4: return WeightQuant::kNf4;
    case ShadowQuant::kNone: return WeightQuant::kNone;
  }
  return WeightQuant::kNone;
}

// The replica's experts are all local; this wrapper reports each decode position's routing before computing,
// with the experts to hedge (hedge.h): for those it runs the layer's router once more on the same input to
// see the probabilities of every expert (the engine hands over only the top-k).
class PredictingExecutor : public ExpertExecutor {
 public:
  using Callback = std::function<void(int64_t position, int64_t layer, std::span<const int32_t> experts,
                                      std::span<const int32_t> hedges)>;
  // `margin` > 0: hedging on ([shadow] hedge_margin).
  static absl::StatusOr<std::unique_ptr<PredictingExecutor>> Create(std::unique_ptr<LocalExpertExecutor> local,
                                                                    Device& device, const ModelWeights& weights,
                                                                    double margin) {
    std::unique_ptr<PredictingExecutor> e(new PredictingExecutor(std::move(local), device, weights, margin));
    if (margin > 0) {
      const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, weights.config().num_experts)) * sizeof(float);
      ODMOE_ASSIGN_OR_RETURN(e->logits_, device.Allocate(bytes, "hedge router logits"));
      e->host_logits_.resize(static_cast<size_t>(weights.config().num_experts));
    }
    return e;
  }

  void BeginForward(std::span<const ForwardSegment> segments, ForwardKind kind) override {
    position_ = segments.front().first_position;  // the shadow's engine runs one sequence
    decode_ = kind == ForwardKind::kDecode;
  }
  absl::Status Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                   std::span<const float> weights, float* out, Stream* stream) override {
    if (on_predict_ && decode_) {
      const std::span<const int32_t> chosen = ids.subspan(0, static_cast<size_t>(top_k_));
      std::vector<int32_t> hedges;
      if (margin_ > 0) {
        const ModelConfig& c = weights_.config();
        device_.MatMul(h, weights_.layer(layer).router, {}, 1, c.hidden_size, c.num_experts, logits_->as<float>(),
                       stream);
        device_.CopyToHost(host_logits_.data(), logits_->data(), host_logits_.size() * sizeof(float), stream);
        hedges = HedgeExperts(host_logits_, chosen, margin_);
      }
      on_predict_(position_, layer, chosen, hedges);
    }
    return local_->Run(layer, h, n, ids, weights, out, stream);
  }
  // Decode steps are predicted through `on_predict` (nullptr: none).
  void Set(Callback on_predict) { on_predict_ = std::move(on_predict); }

 private:
  PredictingExecutor(std::unique_ptr<LocalExpertExecutor> local, Device& device, const ModelWeights& weights,
                     double margin)
      : local_(std::move(local)), device_(device), weights_(weights), top_k_(weights.config().top_k),
        margin_(margin) {}
  std::unique_ptr<LocalExpertExecutor> local_;
  Device& device_;
  const ModelWeights& weights_;
  int64_t top_k_;
  double margin_;
  std::unique_ptr<Buffer> logits_;  // [num_experts] on the device (hedging only)
  std::vector<float> host_logits_;
  Callback on_predict_;
  int64_t position_ = 0;
  bool decode_ = false;  // the current forward is a decode step
};

// What main has told the shadow about one request so far (filled by the stream's reader thread).
struct ShadowNode::Session {
  // Fixed at the start.
  uint64_t request_id = 0;
  std::string trace_id;  // the client's request id (x-request-id from main), passed on with the predictions
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 0;
  int64_t align_token = 0;
  int64_t max_lead = 1;

  absl::Mutex mu;
  int64_t main_position ABSL_GUARDED_BY(mu) = -1;  // the position main is decoding (prompt - 1 during prefill)
  bool main_done ABSL_GUARDED_BY(mu) = false;      // main closed its side (or the stream broke)
  absl::Status error ABSL_GUARDED_BY(mu);          // a malformed message from main
  std::map<int64_t, int32_t> tokens ABSL_GUARDED_BY(mu);  // aligned tokens by position
  std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>> kv ABSL_GUARDED_BY(mu);  // pending K/V
};

absl::StatusOr<std::unique_ptr<ShadowNode>> ShadowNode::Create(const rpc::DaemonArgs& args) {
  std::unique_ptr<ShadowNode> node(new ShadowNode());
  node->cluster_ = args.cluster;
  node->self_ = args.self;
  node->model_dir_ = args.model_dir;
  node->InitMetrics(rpc::DaemonMetricLabels(args.cluster, args.self, args.model_dir));
  // Weights: the checkpoint, or synthetic ones ([model] synthetic, when no --model is given).
  ODMOE_ASSIGN_OR_RETURN(OpenedModel model, OpenModel(args.cluster.model, args.model_dir));
  node->config_ = model.config;
  node->fingerprint_ = model.fingerprint;
  ODMOE_ASSIGN_OR_RETURN(node->device_, CreateDevice(args.self.device));
  if (args.cluster.shadow_settings.mode != PredictionMode::kShadow) {
    node->model_ = std::move(model);
    return node;
  }
  WeightSelection selection = WeightSelection::Quantized(WeightQuantOf(args.cluster.shadow_settings.quant));
  selection.keep_router = args.cluster.shadow_settings.keep_router;
  selection.keep_attention = args.cluster.shadow_settings.keep_attention;
  ODMOE_ASSIGN_OR_RETURN(node->weights_, ModelWeights::Load(node->config_, *model.source, *node->device_, selection));
  node->model_ = std::move(model);
  EngineOptions engine_options;
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<LocalExpertExecutor> local,
                         LocalExpertExecutor::Create(*node->device_, *node->weights_,
                                                     engine_options.max_tokens_per_forward));

  std::vector<std::string> workers;
  for (const NodeConfig* w : args.cluster.workers()) workers.push_back(w->address);
  ODMOE_ASSIGN_OR_RETURN(const Placement placement,
                         Placement::ForCluster(args.cluster.file, static_cast<int32_t>(workers.size()),
                                               args.cluster.group_size, node->config_.top_k));
  rpc::PrefetchSenderOptions po;
  po.epoch = args.cluster.epoch;
  po.fingerprint = node->fingerprint_;
  po.sender = args.self.name;
  po.rpc_timeout_ms = args.cluster.rpc_timeout_ms;
  node->sender_ = std::make_unique<rpc::PrefetchSender>(workers, placement, po);

  absl::MutexLock lock(&node->run_mu_);
  ODMOE_ASSIGN_OR_RETURN(node->executor_,
                         PredictingExecutor::Create(std::move(local), *node->device_, *node->weights_,
                                                    args.cluster.shadow_settings.hedge_margin));
  ODMOE_ASSIGN_OR_RETURN(node->engine_,
                         Engine::Create(*node->weights_, *node->device_, node->executor_.get(), engine_options));
  return node;
}

ShadowNode::~ShadowNode() {
  if (sender_ != nullptr) sender_->Drain();
  absl::MutexLock lock(&run_mu_);
  engine_.reset();
  executor_.reset();
}

namespace {

int32_t Argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

}  // namespace

absl::Status ShadowNode::BeginSession(const v1::FollowMessage& first, Session& session) {
  absl::Status bad;
  if (!first.has_start()) {
    bad = absl::InvalidArgumentError("the first message of a Follow stream must be a FollowStart");
  } else {
    const v1::FollowStart& start = first.start();
    bad = rpc::CheckHeader(start.header(), cluster_.epoch, fingerprint_);
    session.request_id = start.header().request_id();
    session.prompt.assign(start.prompt_ids().begin(), start.prompt_ids().end());
    session.max_new_tokens = start.max_new_tokens();
    session.align_token = start.align_token();
    session.max_lead = start.max_lead_tokens();
    if (bad.ok()) bad = ValidateRequest(config_, session.prompt, session.max_new_tokens);
    if (bad.ok() && (session.align_token < 0 || start.align_kv() < 0)) {
      bad = absl::InvalidArgumentError(StrCat("align_token and align_kv must be >= 0, got ", session.align_token,
                                              " and ", start.align_kv()));
    }
    if (bad.ok() && session.max_lead < 1) {
      bad = absl::InvalidArgumentError(StrCat("max_lead_tokens must be >= 1, got ", session.max_lead));
    }
    if (bad.ok() && weights_ == nullptr) {
      bad = absl::FailedPreconditionError(StrCat("shadow '", self_.name, "' runs in prediction mode '",
                                                 PredictionModeName(cluster_.shadow_settings.mode),
                                                 "' and holds no replica"));
    }
  }
  return bad;
}

absl::Status ShadowNode::ApplyMessage(const v1::FollowMessage& msg, Session& session) {
  const int64_t prompt_len = static_cast<int64_t>(session.prompt.size());
  const int64_t kv_values = config_.num_layers * config_.kv_size();
  absl::Status status;
  if (msg.has_kv()) {
    // Several positions' K/V (the prompt's): rows of [n, num_layers, kv_size].
    const v1::FollowKv& kv = msg.kv();
    const int64_t shape[] = {-1, config_.num_layers, config_.kv_size()};
    std::vector<int64_t> dims;
    absl::StatusOr<std::vector<float>> dk = rpc::DecodeF32(kv.k(), shape, "kv.k", &dims);
    absl::StatusOr<std::vector<float>> dv = rpc::DecodeF32(kv.v(), shape, "kv.v");
    if (!dk.ok()) {
      status = dk.status();
    } else if (!dv.ok()) {
      status = dv.status();
    } else if (dv->size() != dk->size()) {
      status = absl::InvalidArgumentError("kv.k and kv.v have different shapes");
    } else if (kv.first_position() < 0 || kv.first_position() + dims[0] > prompt_len + session.max_new_tokens) {
      status = absl::InvalidArgumentError(StrCat("kv positions ", kv.first_position(), "..",
                                                 kv.first_position() + dims[0] - 1, " are outside the request"));
    } else {
      const size_t row = static_cast<size_t>(kv_values);
      absl::MutexLock lock(&session.mu);
      for (int64_t i = 0; i < dims[0]; ++i) {
        const size_t at = static_cast<size_t>(i) * row;
        session.kv[kv.first_position() + i] = {std::vector<float>(dk->begin() + at, dk->begin() + at + row),
                                               std::vector<float>(dv->begin() + at, dv->begin() + at + row)};
      }
      absl::MutexLock stats_lock(&stats_mu_);
      counters_.alignment_bytes += kv.k().data().size() + kv.v().data().size();
    }
  } else if (!msg.has_step()) {
    status = absl::InvalidArgumentError("a Follow stream carries one FollowStart, then FollowSteps and FollowKvs");
  } else {
    const v1::FollowStep& step = msg.step();
    const int64_t p = step.position();
    std::vector<float> k, v;
    if (p < prompt_len || p > prompt_len + session.max_new_tokens) {
      status = absl::InvalidArgumentError(StrCat("step position ", p, " is outside the request's decode positions [",
                                                 prompt_len, ", ", prompt_len + session.max_new_tokens, ")"));
    } else if (step.has_token() && (step.token() < 0 || step.token() >= config_.vocab_size)) {
      status = absl::OutOfRangeError(StrCat("aligned token ", step.token(), " at position ", p,
                                            " is outside the vocabulary [0, ", config_.vocab_size, ")"));
    } else if (step.has_k() || step.has_v()) {
      const int64_t shape[] = {config_.num_layers, config_.kv_size()};
      absl::StatusOr<std::vector<float>> dk = rpc::DecodeF32(step.k(), shape, "step.k");
      absl::StatusOr<std::vector<float>> dv = rpc::DecodeF32(step.v(), shape, "step.v");
      if (!dk.ok()) status = dk.status();
      else if (!dv.ok()) status = dv.status();
      else {
        k = std::move(dk).value();
        v = std::move(dv).value();
      }
    }
    if (status.ok()) {
      absl::MutexLock lock(&session.mu);
      session.main_position = std::max(session.main_position, p);
      if (step.has_token()) session.tokens[p] = step.token();
      if (!k.empty()) session.kv[p - 1] = {std::move(k), std::move(v)};
      absl::MutexLock stats_lock(&stats_mu_);
      counters_.tokens_aligned += step.has_token() ? 1 : 0;
      counters_.kv_aligned += step.has_k() ? 1 : 0;
      counters_.alignment_bytes += step.k().data().size() + step.v().data().size();
    }
  }
  return status;
}

absl::Status ShadowNode::CheckFollowMessages(const v1::FollowMessage& first,
                                             const std::vector<v1::FollowMessage>& rest) {
  Session session;
  ODMOE_RETURN_IF_ERROR(BeginSession(first, session));
  for (const v1::FollowMessage& msg : rest) ODMOE_RETURN_IF_ERROR(ApplyMessage(msg, session));
  return absl::OkStatus();
}

grpc::Status ShadowNode::Follow(grpc::ServerContext* context,
                                grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream) {
  if (grpc::Status admitted = rpc::AdmitMember(context, {NodeRole::kMain}); !admitted.ok()) return admitted;
  const std::string trace_id = rpc::RequestIdOf(*context);
  logging::ScopedRequestId scope(trace_id);
  v1::FollowMessage first;
  if (!stream->Read(&first)) return grpc::Status(grpc::StatusCode::CANCELLED, "main closed the stream at once");
  Session session;
  session.trace_id = trace_id;
  absl::Status bad = BeginSession(first, session);
  // Main's membership: the prefetches go where main will look for the experts.
  if (bad.ok() && first.start().header().has_membership()) {
    bad = sender_->SetMembership(rpc::FromProto(first.start().header().membership()));
  }
  if (!bad.ok()) {
    spdlog::warn("{}: Follow refused: {}", self_.name, bad.ToString());
    return rpc::ToGrpc(bad);
  }

  {
    absl::MutexLock lock(&session.mu);
    session.main_position = static_cast<int64_t>(session.prompt.size()) - 1;
  }
  spdlog::info("{}: following the request (#{} of {}): prompt of {} tokens, up to {} new tokens", self_.name,
               session.request_id, first.start().header().sender(), session.prompt.size(), session.max_new_tokens);
  // The reader: main's steps into the session, until main closes its side or the stream breaks.
  std::thread reader([&]() {
    logging::ScopedRequestId reader_scope(trace_id);
    v1::FollowMessage msg;
    while (stream->Read(&msg)) {
      absl::Status status = ApplyMessage(msg, session);
      if (status.ok() && msg.has_step() && msg.step().has_membership()) {
        status = sender_->SetMembership(rpc::FromProto(msg.step().membership()));
      }
      if (!status.ok()) {
        absl::MutexLock lock(&session.mu);
        session.error = status;
        break;
      }
    }
    absl::MutexLock lock(&session.mu);
    session.main_done = true;
  });

  absl::Status status;
  {
    absl::MutexLock lock(&run_mu_);
    status = RunSession(session, stream);
  }
  if (!status.ok()) context->TryCancel();  // unblocks the reader
  reader.join();
  {
    absl::MutexLock lock(&session.mu);
    if (status.ok() && !session.error.ok()) status = session.error;
  }
  if (!status.ok()) {
    spdlog::warn("{}: Follow of request {} failed: {}", self_.name, session.request_id, status.ToString());
  } else {
    spdlog::info("{}: request #{} followed to its end", self_.name, session.request_id);
  }
  return rpc::ToGrpc(status);
}

absl::Status ShadowNode::RunSession(Session& session,
                                    grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream) {
  const int64_t prompt_len = static_cast<int64_t>(session.prompt.size());
  const int64_t last = LastDecodePosition(prompt_len, session.max_new_tokens);
  {
    absl::MutexLock lock(&stats_mu_);
    ++counters_.requests;
  }
  if (last < prompt_len) return absl::OkStatus();  // nothing is decoded: no prediction to make

  const int64_t num_sparse = static_cast<int64_t>(config_.SparseLayers().size());
  int64_t main_position_seen = prompt_len - 1;  // for the lead statistics (updated each position)
  bool stream_ok = true;
  // This request's hedged loads: what the sender counts while it runs (requests run one at a time).
  const uint64_t hedge_loads_before = sender_->stats().hedge_loads;
  executor_->Set([&](int64_t position, int64_t layer, std::span<const int32_t> experts,
                     std::span<const int32_t> hedges) {
    const int64_t sparse_index = config_.SparseIndex(layer);
    // The workers first: their loads are what the prediction is for.
    sender_->Send(session.request_id, position, layer, sparse_index, experts, session.trace_id, hedges);
    v1::Prediction p;
    p.set_position(position);
    p.set_layer(static_cast<int32_t>(layer));
    p.mutable_experts()->Add(experts.begin(), experts.end());
    p.mutable_hedges()->Add(hedges.begin(), hedges.end());
    if (stream_ok && !stream->Write(p)) stream_ok = false;
    absl::MutexLock lock(&stats_mu_);
    ++counters_.predictions;
    counters_.hedges += hedges.size();
    const int64_t lead = (position - main_position_seen) * num_sparse + sparse_index;
    counters_.lead_sum += static_cast<double>(lead);
    lead_layers_->Observe(static_cast<double>(lead));
  });
  struct Unset {
    PredictingExecutor* e;
    ~Unset() { e->Set(nullptr); }
  } unset{executor_.get()};

  ODMOE_RETURN_IF_ERROR(engine_->StartSequence(last + 1));
  ODMOE_ASSIGN_OR_RETURN(std::vector<float> logits, engine_->Forward(session.prompt, nullptr));
  int32_t guess = Argmax(logits);
  std::vector<int32_t> used;  // the token the replica ran at each decode position (index position - prompt)
  int64_t pos = prompt_len;
  for (;;) {
    int32_t token = guess;
    std::vector<std::pair<int64_t, std::pair<std::vector<float>, std::vector<float>>>> kv_writes;
    {
      absl::MutexLock lock(&session.mu);
      // Roll back to the first aligned token that differs from what the replica ran.
      for (auto it = session.tokens.begin(); it != session.tokens.end() && it->first < pos; ++it) {
        const size_t i = static_cast<size_t>(it->first - prompt_len);
        if (i < used.size() && used[i] != it->second) {
          pos = it->first;
          used.resize(i);
          ODMOE_RETURN_IF_ERROR(engine_->Truncate(pos));
          absl::MutexLock stats_lock(&stats_mu_);
          ++counters_.rollbacks;
          break;
        }
      }
      const bool token_due = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
        return session.align_token > 0 && (pos - prompt_len) % session.align_token == 0;
      }();
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
        if (session.main_done || !session.error.ok() || !stream_ok) return true;
        if (pos > session.main_position + session.max_lead) return false;
        return !token_due || session.tokens.contains(pos);
      };
      session.mu.Await(absl::Condition(&ready));
      if (!session.error.ok() || !stream_ok) break;
      // Main has finished: run on only up to the last position it decoded.
      if (session.main_done && pos > std::min(last, session.main_position)) break;
      if (pos > last) break;
      main_position_seen = session.main_position;
      if (auto it = session.tokens.find(pos); it != session.tokens.end()) token = it->second;
      // Main's K/V for positions the replica has computed replace its own.
      for (auto it = session.kv.begin(); it != session.kv.end() && it->first < engine_->position();) {
        kv_writes.emplace_back(it->first, std::move(it->second));
        it = session.kv.erase(it);
      }
    }
    for (auto& [p, kv] : kv_writes) ODMOE_RETURN_IF_ERROR(engine_->WriteKv(p, kv.first.data(), kv.second.data()));
    ODMOE_ASSIGN_OR_RETURN(logits,
                           engine_->Forward(std::span<const int32_t>(&token, 1), nullptr, ForwardKind::kDecode));
    guess = Argmax(logits);
    used.push_back(token);
    ++pos;
    absl::MutexLock lock(&stats_mu_);
    ++counters_.positions_decoded;
  }
  if (!stream_ok) return absl::UnavailableError("main went away (writing a prediction failed)");
  // The summary: once every prefetch has completed, the hedged loads the workers accepted for this request.
  sender_->Drain();
  const uint64_t hedge_loads = sender_->stats().hedge_loads - hedge_loads_before;
  v1::Prediction summary;
  summary.set_summary(true);
  summary.set_hedge_loads(hedge_loads);
  // Main may have stopped waiting for it (its wait after the last token is bounded): the request is over.
  if (!stream->Write(summary)) spdlog::debug("{}: main did not wait for the request's summary", self_.name);
  return absl::OkStatus();
}

void ShadowNode::Counters::ToProto(v1::ShadowStats* s) const {
  s->set_requests(requests);
  s->set_predictions(predictions);
  s->set_positions_decoded(positions_decoded);
  s->set_rollbacks(rollbacks);
  s->set_tokens_aligned(tokens_aligned);
  s->set_kv_aligned(kv_aligned);
  s->set_alignment_bytes(alignment_bytes);
  s->set_lead_layers_mean(predictions > 0 ? lead_sum / static_cast<double>(predictions) : 0.0);
  s->set_hedges(hedges);
}

v1::ShadowStats ShadowNode::Stats(bool reset) {
  v1::ShadowStats s;
  s.set_node(self_.name);
  rpc::FillDeviceMemory(*device_, device_->memory_info().capacity, s.mutable_memory());
  s.set_quant(std::string(ShadowQuantName(cluster_.shadow_settings.quant)));
  if (sender_ != nullptr) {
    const rpc::PrefetchSenderStats ps = sender_->stats();
    s.set_prefetch_calls(ps.calls);
    s.set_prefetch_failures(ps.failures);
    s.set_hedge_loads(ps.hedge_loads);
  }
  absl::MutexLock lock(&stats_mu_);
  counters_.ToProto(&s);
  if (reset) {
    reset_.Add(counters_);
    counters_ = Counters{};
  }
  return s;
}

void ShadowNode::Counters::Add(const Counters& o) {
  requests += o.requests;
  predictions += o.predictions;
  positions_decoded += o.positions_decoded;
  rollbacks += o.rollbacks;
  tokens_aligned += o.tokens_aligned;
  kv_aligned += o.kv_aligned;
  alignment_bytes += o.alignment_bytes;
  lead_sum += o.lead_sum;
  hedges += o.hedges;
}

void ShadowNode::Counters::AppendFamilies(std::vector<metrics::MetricFamily>* out) const {
  auto counter = [out](const char* name, const char* help, uint64_t value) {
    out->push_back(metrics::SingleSample(name, help, metrics::MetricType::kCounter, static_cast<double>(value)));
  };
  counter("odmoe_shadow_requests_total", "Requests main streamed to the shadow (Follow streams).", requests);
  counter("odmoe_shadow_predictions_sent_total",
          "Predictions sent (one per decode position and sparse layer, re-sent after a rollback).", predictions);
  counter("odmoe_shadow_positions_decoded_total", "Decode positions the shadow ran on its replica.",
          positions_decoded);
  counter("odmoe_shadow_rollbacks_total", "Times an aligned token differed from the shadow's guess (it re-ran).",
          rollbacks);
  counter("odmoe_shadow_alignment_tokens_total", "Token alignments received from main.", tokens_aligned);
  counter("odmoe_shadow_alignment_kv_total", "K/V alignments received from main.", kv_aligned);
  counter("odmoe_shadow_alignment_bytes_received_total", "K/V alignment bytes received from main.",
          alignment_bytes);
  counter("odmoe_shadow_hedges_sent_total",
          "Hedged experts sent (the router's (k+1)-th choice within [shadow] hedge_margin), re-sends included.",
          hedges);
}

void ShadowNode::InitMetrics(metrics::Labels labels) {
  metrics_ = std::make_unique<metrics::Registry>(std::move(labels));
  lead_layers_ = &metrics_
                      ->AddHistogram("odmoe_shadow_prediction_lead_layers",
                                     "How many sparse layers ahead of main each prediction was made (negative: "
                                     "behind main, too late to help).",
                                     {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128})
                      .With({});
  metrics_->AddCollector([this](std::vector<metrics::MetricFamily>* out) {
    {
      absl::MutexLock lock(&stats_mu_);
      Counters totals = reset_;
      totals.Add(counters_);
      totals.AppendFamilies(out);
    }
    if (sender_ != nullptr) {
      const rpc::PrefetchSenderStats ps = sender_->stats();
      out->push_back(metrics::SingleSample("odmoe_shadow_prefetch_calls_total",
                                           "Prefetch calls sent to the workers.", metrics::MetricType::kCounter,
                                           static_cast<double>(ps.calls)));
      out->push_back(metrics::SingleSample("odmoe_shadow_prefetch_failures_total",
                                           "Prefetch calls that failed (the worker refused or did not answer).",
                                           metrics::MetricType::kCounter, static_cast<double>(ps.failures)));
    }
    if (device_ != nullptr) {
      const MemoryInfo m = device_->memory_info();
      rpc::AppendDeviceMemoryFamilies(m, m.capacity, out);
    }
  });
}

grpc::Status ShadowNode::GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                                  v1::ShadowStats* response) {
  if (grpc::Status admitted = rpc::AdmitClient(context); !admitted.ok()) return admitted;
  *response = Stats(request->reset());
  return grpc::Status::OK;
}

grpc::Status ShadowNode::GetMembership(grpc::ServerContext* context, const v1::MembershipRequest*,
                                       v1::Membership* response) {
  if (grpc::Status admitted = rpc::AdmitMember(context); !admitted.ok()) return admitted;
  rpc::FillMembership(cluster_, self_.name, fingerprint_, response);
  return grpc::Status::OK;
}

}  // namespace odmoe
