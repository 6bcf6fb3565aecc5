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
#include "src/rpc/sampling_proto.h"
#include "src/rpc/security.h"
#include "src/shadow_node/hedge.h"
#include "src/shadow_node/pick_replay.h"

namespace odmoe {

WeightQuant WeightQuantOf(ShadowQuant quant) {
  switch (quant) {
    case ShadowQuant::kFp16:
      return WeightQuant::kFp16;
    case ShadowQuant::kInt8:
      return WeightQuant::kInt8;
    case ShadowQuant::kNf4:
      return WeightQuant::kNf4;
    case ShadowQuant::kNone:
      return WeightQuant::kNone;
  }
  return WeightQuant::kNone;
}

// The replica's experts are all local; this wrapper reports the routing of each row of a decode forward before
// computing, with the experts to hedge (hedge.h): for those it runs the layer's router once more on the same
// input to see the probabilities of every expert (the engine hands over only the top-k).
class PredictingExecutor : public ExpertExecutor {
 public:
  using Row = RowPrediction;
  using Callback = std::function<void(int64_t layer, std::span<const Row> rows)>;
  // `margin` > 0: hedging on ([shadow] hedge_margin). `max_rows`: the most rows of one forward.
  static absl::StatusOr<std::unique_ptr<PredictingExecutor>> Create(std::unique_ptr<LocalExpertExecutor> local,
                                                                    Device& device, const ModelWeights& weights,
                                                                    double margin, int64_t max_rows) {
    std::unique_ptr<PredictingExecutor> e(new PredictingExecutor(std::move(local), device, weights, margin));
    if (margin > 0) {
      const size_t values = static_cast<size_t>(max_rows * std::max<int64_t>(1, weights.config().num_experts));
      ODMOE_ASSIGN_OR_RETURN(e->logits_, device.Allocate(values * sizeof(float), "hedge router logits"));
      e->host_logits_.resize(values);
    }
    return e;
  }

  void BeginForward(std::span<const ForwardSegment> segments, ForwardKind kind) override {
    (void)segments;  // a decode forward has one row per sequence, in the order of its inputs
    decode_ = kind == ForwardKind::kDecode;
  }
  absl::Status Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                   std::span<const float> weights, float* out, Stream* stream) override {
    if (on_predict_ && decode_) {
      const ModelConfig& c = weights_.config();
      if (margin_ > 0) {
        device_.MatMul(h, weights_.layer(layer).router, {}, n, c.hidden_size, c.num_experts, logits_->as<float>(),
                       stream);
        device_.CopyToHost(host_logits_.data(), logits_->data(), static_cast<size_t>(n * c.num_experts) * sizeof(float),
                           stream);
      }
      std::vector<Row> rows(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        Row& row = rows[static_cast<size_t>(i)];
        row.experts = ids.subspan(static_cast<size_t>(i * top_k_), static_cast<size_t>(top_k_));
        if (margin_ > 0) {
          const std::span<const float> logits(host_logits_.data() + i * c.num_experts,
                                              static_cast<size_t>(c.num_experts));
          row.hedges = HedgeExperts(logits, row.experts, margin_);
        }
      }
      on_predict_(layer, rows);
    }
    return local_->Run(layer, h, n, ids, weights, out, stream);
  }
  // Decode forwards are predicted through `on_predict` (nullptr: none).
  void Set(Callback on_predict) { on_predict_ = std::move(on_predict); }

 private:
  PredictingExecutor(std::unique_ptr<LocalExpertExecutor> local, Device& device, const ModelWeights& weights,
                     double margin)
      : local_(std::move(local)), device_(device), weights_(weights), top_k_(weights.config().top_k), margin_(margin) {}
  std::unique_ptr<LocalExpertExecutor> local_;
  Device& device_;
  const ModelWeights& weights_;
  int64_t top_k_;
  double margin_;
  std::unique_ptr<Buffer> logits_;  // [max_rows, num_experts] on the device (hedging only)
  std::vector<float> host_logits_;
  Callback on_predict_;
  bool decode_ = false;  // the current forward is a decode step
};

// One followed request. Its handler thread fills the fixed part and waits for `finished`; its reader thread
// files main's messages under `mu`; the loop thread owns the loop part and finishes it.
struct ShadowNode::Session {
  // Fixed at the start.
  uint64_t request_id = 0;
  std::string trace_id;  // the client's request id (x-request-id from main), passed on with the predictions
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 0;
  int64_t align_token = 0;
  int64_t max_lead = 1;
  grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream = nullptr;
  uint64_t hedge_loads_before = 0;  // the sender's count when it started
  int64_t prompt_len() const { return static_cast<int64_t>(prompt.size()); }
  int64_t last() const { return LastDecodePosition(prompt_len(), max_new_tokens); }

  absl::Mutex mu;
  int64_t main_position ABSL_GUARDED_BY(mu) = -1;         // the position main is decoding (prompt - 1 during prefill)
  bool main_done ABSL_GUARDED_BY(mu) = false;             // main closed its side (or the stream broke)
  absl::Status error ABSL_GUARDED_BY(mu);                 // a malformed message from main
  std::map<int64_t, int32_t> tokens ABSL_GUARDED_BY(mu);  // aligned tokens by position
  std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>> kv ABSL_GUARDED_BY(mu);  // pending K/V
  // Where main decodes the request (FollowStep.batch_id/batch_step): `anchor_position` in step `anchor_step`
  // of stream `batch_id`, each later position in the next step. anchor_step 0: no step heard of yet.
  uint64_t batch_id ABSL_GUARDED_BY(mu) = 0;
  int64_t anchor_position ABSL_GUARDED_BY(mu) = 0;
  int64_t anchor_step ABSL_GUARDED_BY(mu) = 0;
  bool any_step ABSL_GUARDED_BY(mu) = false;  // a FollowStep has come
  bool finished ABSL_GUARDED_BY(mu) = false;  // set by the loop, last: the loop no longer touches the session
  absl::Status result ABSL_GUARDED_BY(mu);

  // The loop's.
  std::unique_ptr<Sequence> sequence;  // nullptr until prefilled
  int32_t guess = 0;                   // the replica's own next token
  // Main's pick rule over the token the replica ran at each decode position (picks->tokens(), index pos -
  // prompt): how the guess of the next one is picked. Set by BeginSession once the start is valid.
  std::optional<PickReplay> picks;
  int64_t pos = 0;                     // the next position to run
  int64_t main_position_seen = 0;      // for the lead statistics
  bool stream_ok = true;
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
  ODMOE_ASSIGN_OR_RETURN(node->device_, CreateNodeDevice(args.cluster, args.self, args.model_dir));
  if (args.cluster.shadow_settings.mode != PredictionMode::kShadow) {
    node->model_ = std::move(model);
    return node;
  }
  // Only a replica follows requests, so only it needs the tokens for their grammars.
  ODMOE_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer, OpenTokenizer(model, args.model_dir));
  if (tokenizer != nullptr) node->vocabulary_ = TokenVocabulary::FromTokenizer(*tokenizer, node->config_.vocab_size);
  WeightSelection selection = WeightSelection::Quantized(WeightQuantOf(args.cluster.shadow_settings.quant));
  selection.keep_router = args.cluster.shadow_settings.keep_router;
  selection.keep_attention = args.cluster.shadow_settings.keep_attention;
  ODMOE_ASSIGN_OR_RETURN(node->weights_, ModelWeights::Load(node->config_, *model.source, *node->device_, selection));
  node->model_ = std::move(model);
  EngineOptions engine_options;
  ODMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<LocalExpertExecutor> local,
      LocalExpertExecutor::Create(*node->device_, *node->weights_, engine_options.max_tokens_per_forward,
                                  LocalExpertExecutor::Ids::kHostOnly));

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

  // One decode forward carries a row of each request main runs at once.
  engine_options.max_sequences_per_forward =
      std::clamp<int64_t>(args.cluster.max_running, 1, engine_options.max_tokens_per_forward);
  ODMOE_ASSIGN_OR_RETURN(node->executor_, PredictingExecutor::Create(std::move(local), *node->device_, *node->weights_,
                                                                     args.cluster.shadow_settings.hedge_margin,
                                                                     engine_options.max_tokens_per_forward));
  ODMOE_ASSIGN_OR_RETURN(node->engine_,
                         Engine::Create(*node->weights_, *node->device_, node->executor_.get(), engine_options));
  node->executor_->Set(
      [n = node.get()](int64_t layer, std::span<const RowPrediction> rows) { n->OnPredicted(layer, rows); });
  node->loop_ = std::thread([n = node.get()] { n->Loop(); });
  return node;
}

ShadowNode::~ShadowNode() {
  if (loop_.joinable()) {
    {
      absl::MutexLock lock(&loop_mu_);
      stopping_ = true;
    }
    loop_.join();  // fails the sessions it holds (Unavailable)
  }
  if (sender_ != nullptr) sender_->Drain();
  engine_.reset();
  executor_.reset();
}

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
    GenerateOptions pick = rpc::PickRuleFromProto(start.pick(), session.max_new_tokens);
    // Main's grammar, where this node has the tokens to follow it; without, its guesses ignore it.
    if (vocabulary_ == nullptr) pick.constraint = {};
    pick.vocabulary = vocabulary_;
    const absl::Status checked = bad.ok() ? pick.Validate(config_.vocab_size) : absl::OkStatus();
    if (!checked.ok()) bad = absl::Status(checked.code(), StrCat("FollowStart.pick: ", checked.message()));
    if (bad.ok() && (session.align_token < 0 || start.align_kv() < 0)) {
      bad = absl::InvalidArgumentError(
          StrCat("align_token and align_kv must be >= 0, got ", session.align_token, " and ", start.align_kv()));
    }
    if (bad.ok() && session.max_lead < 1) {
      bad = absl::InvalidArgumentError(StrCat("max_lead_tokens must be >= 1, got ", session.max_lead));
    }
    if (bad.ok() && weights_ == nullptr) {
      bad = absl::FailedPreconditionError(StrCat("shadow '", self_.name, "' runs in prediction mode '",
                                                 PredictionModeName(cluster_.shadow_settings.mode),
                                                 "' and holds no replica"));
    }
    if (bad.ok()) session.picks.emplace(config_, pick, session.prompt);
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
    } else if (step.batch_step() < 0) {
      status = absl::InvalidArgumentError(StrCat("batch_step ", step.batch_step(), " at position ", p, " is negative"));
    } else if (step.has_token() && (step.token() < 0 || step.token() >= config_.vocab_size)) {
      status = absl::OutOfRangeError(StrCat("aligned token ", step.token(), " at position ", p,
                                            " is outside the vocabulary [0, ", config_.vocab_size, ")"));
    } else if (step.has_k() || step.has_v()) {
      const int64_t shape[] = {config_.num_layers, config_.kv_size()};
      absl::StatusOr<std::vector<float>> dk = rpc::DecodeF32(step.k(), shape, "step.k");
      absl::StatusOr<std::vector<float>> dv = rpc::DecodeF32(step.v(), shape, "step.v");
      if (!dk.ok())
        status = dk.status();
      else if (!dv.ok())
        status = dv.status();
      else {
        k = std::move(dk).value();
        v = std::move(dv).value();
      }
    }
    if (status.ok()) {
      absl::MutexLock lock(&session.mu);
      session.main_position = std::max(session.main_position, p);
      session.any_step = true;
      if (step.batch_step() > 0) {
        session.batch_id = step.batch_id();
        session.anchor_position = p;
        session.anchor_step = step.batch_step();
      }
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
  session.stream = stream;
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
    session.main_position = session.prompt_len() - 1;
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
      Wake();
    }
    {
      absl::MutexLock lock(&session.mu);
      session.main_done = true;
    }
    Wake();
  });

  // The loop runs the request with the others until it finishes it.
  session.hedge_loads_before = sender_->stats().hedge_loads;
  {
    absl::MutexLock lock(&stats_mu_);
    ++counters_.requests;
  }
  bool registered = false;
  {
    absl::MutexLock lock(&loop_mu_);
    if (!stopping_) {
      sessions_.push_back(&session);
      ++wake_;
      registered = true;
    }
  }
  absl::Status status = absl::UnavailableError("the shadow is shutting down");
  if (registered) {
    absl::MutexLock lock(&session.mu);
    session.mu.Await(absl::Condition(&session.finished));
    status = session.result;
  }
  if (status.ok()) {
    // The summary: once every prefetch sent so far has completed, the hedged loads the workers accepted while
    // the request ran (shared with the requests followed beside it: a union prefetch serves them all).
    sender_->Drain();
    v1::Prediction summary;
    summary.set_summary(true);
    summary.set_hedge_loads(sender_->stats().hedge_loads - session.hedge_loads_before);
    // Main may have stopped waiting for it (its wait after the last token is bounded): the request is over.
    if (!stream->Write(summary)) spdlog::debug("{}: main did not wait for the request's summary", self_.name);
  } else {
    context->TryCancel();  // unblocks the reader
  }
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

void ShadowNode::Wake() {
  absl::MutexLock lock(&loop_mu_);
  ++wake_;
}

void ShadowNode::Loop() {
  uint64_t seen = 0;
  bool worked = false;
  for (;;) {
    std::vector<Session*> sessions;
    bool stopping = false;
    {
      absl::MutexLock lock(&loop_mu_);
      auto news = [this, &seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(loop_mu_) { return stopping_ || wake_ != seen; };
      if (!worked) loop_mu_.Await(absl::Condition(&news));
      seen = wake_;
      sessions = sessions_;
      stopping = stopping_;
    }
    if (stopping) {
      for (Session* session : sessions) Finish(*session, absl::UnavailableError("the shadow is shutting down"));
      return;
    }
    worked = Pass(sessions);
  }
}

void ShadowNode::Finish(Session& session, absl::Status status) {
  session.sequence.reset();
  {
    absl::MutexLock lock(&loop_mu_);
    sessions_.erase(std::remove(sessions_.begin(), sessions_.end(), &session), sessions_.end());
  }
  // Last: the handler may destroy the session as soon as it sees `finished`.
  absl::MutexLock lock(&session.mu);
  session.result = std::move(status);
  session.finished = true;
}

absl::Status ShadowNode::Prefill(Session& session) {
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> sequence,
                         engine_->NewSequence(session.last() + 1, session.request_id));
  const std::span<const int32_t> prompt(session.prompt);
  const size_t chunk = static_cast<size_t>(engine_->max_tokens_per_forward());
  // The guess is picked by main's rule on the replica's device (only its id comes back).
  int32_t guess = 0;
  for (size_t start = 0; start < prompt.size(); start += chunk) {
    const size_t len = std::min(chunk, prompt.size() - start);
    BatchInput input{sequence.get(), prompt.subspan(start, len)};
    if (start + len == prompt.size()) {
      input.choice = &session.picks->choice();
      input.token = &guess;
      input.deltas = session.picks->deltas();
    }
    ODMOE_RETURN_IF_ERROR(engine_->ForwardBatch(std::span<const BatchInput>(&input, 1), ForwardKind::kPrefill));
  }
  session.sequence = std::move(sequence);
  session.guess = guess;
  session.pos = session.prompt_len();
  return absl::OkStatus();
}

bool ShadowNode::NextOf(Session& s, std::optional<Next>* next, absl::Status* end) {
  std::vector<std::pair<int64_t, std::pair<std::vector<float>, std::vector<float>>>> kv_writes;
  {
    absl::MutexLock lock(&s.mu);
    // Roll back to the first aligned token that differs from what the replica ran.
    for (auto it = s.tokens.begin(); it != s.tokens.end() && it->first < s.pos; ++it) {
      const size_t i = static_cast<size_t>(it->first - s.prompt_len());
      if (i < s.picks->tokens().size() && s.picks->tokens()[i] != it->second) {
        s.pos = it->first;
        s.picks->Truncate(i);
        if (absl::Status truncated = engine_->Truncate(*s.sequence, s.pos); !truncated.ok()) {
          *end = truncated;
          return true;
        }
        absl::MutexLock stats_lock(&stats_mu_);
        ++counters_.rollbacks;
        break;
      }
    }
    const int64_t last = s.last();
    if (!s.error.ok()) {
      *end = s.error;
      return true;
    }
    if (!s.stream_ok) {
      *end = absl::UnavailableError("main went away (writing a prediction failed)");
      return true;
    }
    if (s.pos > last || (s.main_done && s.pos > std::min(last, s.main_position))) {
      // Main has finished: the replica runs on only up to the last position main decoded.
      *end = absl::OkStatus();
      return true;
    }
    // A replica catch_up_lag positions behind main: main has left positions [pos, main_position) behind, and
    // predictions for them come too late to load anything. Where main's token of such a position and its K/V have come,
    // and the next position's token (which the replica runs next), the replica takes main's K/V instead of running the
    // position: a slower shadow catches up with main instead of predicting the past.
    const int64_t lag = cluster_.shadow_settings.catch_up_lag;
    const bool far_behind = lag > 0 && s.main_position - s.pos >= lag;
    while (far_behind && s.pos < s.main_position && s.tokens.contains(s.pos) && s.tokens.contains(s.pos + 1)) {
      auto kv = s.kv.find(s.pos);
      if (kv == s.kv.end()) break;
      if (absl::Status adopted = engine_->AppendKv(*s.sequence, kv->second.first.data(), kv->second.second.data());
          !adopted.ok()) {
        *end = adopted;
        return true;
      }
      s.picks->Push(s.tokens.at(s.pos));
      s.kv.erase(kv);
      ++s.pos;
      absl::MutexLock stats_lock(&stats_mu_);
      ++counters_.positions_adopted;
    }
    // Late departure: where a token alignment is due, main's token first. Early: the replica's guess at once (a
    // differing token rolls it back above).
    const bool token_due =
        s.align_token > 0 && (s.pos - s.prompt_len()) % s.align_token == 0 && !cluster_.shadow_settings.early_departure;
    // The first position waits for main's first step, which says where main decodes it.
    const bool runnable = s.main_done || (s.pos <= s.main_position + s.max_lead && s.any_step &&
                                          (!token_due || s.tokens.contains(s.pos)));
    if (runnable) s.main_position_seen = s.main_position;
    auto it = s.tokens.find(s.pos);
    *next = Next{it != s.tokens.end() ? it->second : s.guess, StepOf(s, s.pos), runnable};
    // Main's K/V for positions the replica has computed replace its own.
    for (auto kv = s.kv.begin(); kv != s.kv.end() && kv->first < s.sequence->position();) {
      kv_writes.emplace_back(kv->first, std::move(kv->second));
      kv = s.kv.erase(kv);
    }
  }
  for (auto& [p, kv] : kv_writes) {
    if (absl::Status written = engine_->WriteKv(*s.sequence, p, kv.first.data(), kv.second.data()); !written.ok()) {
      *end = written;
      return true;
    }
  }
  return false;
}

ShadowNode::StepKey ShadowNode::StepOf(const Session& s, int64_t position) {
  if (s.anchor_step <= 0) return StepKey{s.request_id, position};  // a main that does not batch: its positions
  return StepKey{s.batch_id, s.anchor_step + (position - s.anchor_position)};
}

bool ShadowNode::Pass(const std::vector<Session*>& sessions) {
  bool worked = false;
  // New requests: their prompts first (one at a time), or their end when nothing is to be decoded.
  std::vector<Session*> started;
  for (Session* session : sessions) {
    if (session->sequence == nullptr) {
      worked = true;
      absl::Status prefilled = session->last() < session->prompt_len() ? absl::OkStatus() : Prefill(*session);
      if (!prefilled.ok() || session->sequence == nullptr) {
        Finish(*session, std::move(prefilled));  // failed, or nothing is decoded: no prediction to make
        continue;
      }
    }
    started.push_back(session);
  }
  // Which requests can run their next position now, and in which of main's steps main decodes it.
  struct Candidate {
    Session* session;
    Next next;
  };
  std::vector<Candidate> ready;
  for (Session* session : started) {
    std::optional<Next> next;
    absl::Status end;
    if (NextOf(*session, &next, &end)) {
      worked = true;
      Finish(*session, std::move(end));
    } else if (next.has_value()) {
      ready.push_back({session, *next});
    }
  }
  std::vector<StepKey> waiting;  // the steps of the requests that cannot run yet
  for (const Candidate& c : ready) {
    if (!c.next.runnable) waiting.push_back(c.next.step);
  }
  std::erase_if(ready, [](const Candidate& c) { return !c.next.runnable; });
  if (ready.empty()) return worked;

  // One decode forward: the requests whose next position main decodes in the earliest step (they run in step
  // with main; one that rolled back catches up alone).
  const StepKey step = std::min_element(ready.begin(), ready.end(), [](const Candidate& a, const Candidate& b) {
                         return a.next.step.step < b.next.step.step;
                       })->next.step;
  std::erase_if(ready, [&](const Candidate& c) { return !(c.next.step == step); });
  // Main sends the steps of all its requests at once: a request of the same step whose token is still on its
  // way is waited for a moment (kGatherWait at most per step), so that the step's union goes out whole.
  if (std::find(waiting.begin(), waiting.end(), step) != waiting.end()) {
    const absl::Time now = absl::Now();
    if (!gathering_.has_value() || !(gathering_->first == step)) gathering_.emplace(step, now + kGatherWait);
    if (now < gathering_->second) {
      absl::MutexLock lock(&loop_mu_);
      const uint64_t seen = wake_;
      auto news = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(loop_mu_) { return stopping_ || wake_ != seen; };
      loop_mu_.AwaitWithDeadline(absl::Condition(&news), gathering_->second);
      return true;
    }
  }
  if (static_cast<int64_t>(ready.size()) > engine_->max_sequences_per_forward()) {
    ready.resize(static_cast<size_t>(engine_->max_sequences_per_forward()));
  }
  batch_.clear();
  std::vector<BatchInput> inputs;
  // Each row's guess is picked on the replica's device by main's rule: after the token it runs, which the row's
  // PickReplay takes first.
  std::vector<int32_t> guesses(ready.size());
  for (size_t i = 0; i < ready.size(); ++i) {
    Session& s = *ready[i].session;
    batch_.push_back({&s, s.pos, step});
    s.picks->Push(ready[i].next.token);
    inputs.push_back({.sequence = s.sequence.get(),
                      .ids = std::span<const int32_t>(&ready[i].next.token, 1),
                      .choice = &s.picks->choice(),
                      .token = &guesses[i],
                      .deltas = s.picks->deltas()});
  }
  const absl::Status ran = engine_->ForwardBatch(inputs, ForwardKind::kDecode);
  batch_.clear();
  {
    absl::MutexLock lock(&stats_mu_);
    ++counters_.batch_forwards;
    counters_.batch_rows += inputs.size();
  }
  for (size_t i = 0; i < ready.size(); ++i) {
    Session& s = *ready[i].session;
    if (!ran.ok()) {
      Finish(s, absl::Status(ran.code(), ran.message()));  // a status of its own (see Finish)
      continue;
    }
    s.guess = guesses[i];
    ++s.pos;
    absl::MutexLock lock(&stats_mu_);
    ++counters_.positions_decoded;
  }
  PruneUnions();
  return true;
}

void ShadowNode::OnPredicted(int64_t layer, std::span<const RowPrediction> rows) {
  if (rows.size() != batch_.size() || batch_.empty()) return;  // not a decode forward of Pass
  const int64_t sparse_index = config_.SparseIndex(layer);
  const int64_t num_sparse = static_cast<int64_t>(config_.SparseLayers().size());
  const StepKey step = batch_.front().step;
  // Each request's own prediction to main (its recall), then the union over the requests of this step to the
  // workers: the experts main's step will need, placed as main places them (Placement::Assign of the union).
  UnionEntry& entry = unions_[{step.batch_id, step.step, layer}];
  for (size_t i = 0; i < rows.size(); ++i) {
    Session& s = *batch_[i].session;
    const RowPrediction& row = rows[i];
    v1::Prediction p;
    p.set_position(batch_[i].position);
    p.set_layer(static_cast<int32_t>(layer));
    p.mutable_experts()->Add(row.experts.begin(), row.experts.end());
    p.mutable_hedges()->Add(row.hedges.begin(), row.hedges.end());
    if (s.stream_ok && !s.stream->Write(p)) s.stream_ok = false;
    entry.by_request[s.request_id] = {std::vector<int32_t>(row.experts.begin(), row.experts.end()), row.hedges};
    absl::MutexLock lock(&stats_mu_);
    ++counters_.predictions;
    counters_.hedges += row.hedges.size();
    const int64_t lead = (batch_[i].position - s.main_position_seen) * num_sparse + sparse_index;
    counters_.lead_sum += static_cast<double>(lead);
    lead_layers_->Observe(static_cast<double>(lead));
  }
  std::vector<int32_t> experts, hedges;
  for (const auto& [request, predicted] : entry.by_request) {
    experts.insert(experts.end(), predicted.first.begin(), predicted.first.end());
    hedges.insert(hedges.end(), predicted.second.begin(), predicted.second.end());
  }
  std::sort(experts.begin(), experts.end());
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  std::sort(hedges.begin(), hedges.end());
  hedges.erase(std::unique(hedges.begin(), hedges.end()), hedges.end());
  std::erase_if(hedges, [&](int32_t e) { return std::binary_search(experts.begin(), experts.end(), e); });
  if (experts == entry.sent_experts && hedges == entry.sent_hedges) return;  // nothing new for the workers
  entry.sent_experts = experts;
  entry.sent_hedges = hedges;
  sender_->Send(step.batch_id, step.step, layer, sparse_index, experts, batch_.front().session->trace_id, hedges);
}

void ShadowNode::PruneUnions() {
  // The steps main has reached for every request of their stream need no more prefetches.
  std::map<uint64_t, int64_t> reached;  // per stream: the earliest step main is at among its requests
  std::vector<Session*> sessions;
  {
    absl::MutexLock lock(&loop_mu_);
    sessions = sessions_;  // those still running (a finished one may be gone)
  }
  for (Session* session : sessions) {
    absl::MutexLock lock(&session->mu);
    const StepKey at = StepOf(*session, std::max(session->main_position, session->prompt_len()));
    auto [it, inserted] = reached.try_emplace(at.batch_id, at.step);
    if (!inserted) it->second = std::min(it->second, at.step);
  }
  std::erase_if(unions_, [&reached](const auto& entry) {
    const auto& [batch_id, step, layer] = entry.first;
    const auto it = reached.find(batch_id);
    return it == reached.end() || step < it->second;
  });
}

void ShadowNode::Counters::ToProto(v1::ShadowStats* s) const {
  s->set_requests(requests);
  s->set_predictions(predictions);
  s->set_positions_decoded(positions_decoded);
  s->set_positions_adopted(positions_adopted);
  s->set_rollbacks(rollbacks);
  s->set_tokens_aligned(tokens_aligned);
  s->set_kv_aligned(kv_aligned);
  s->set_alignment_bytes(alignment_bytes);
  s->set_lead_layers_mean(predictions > 0 ? lead_sum / static_cast<double>(predictions) : 0.0);
  s->set_hedges(hedges);
  s->set_batch_forwards(batch_forwards);
  s->set_batch_rows(batch_rows);
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
    s.set_prefetch_dropped(ps.dropped);
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
  positions_adopted += o.positions_adopted;
  rollbacks += o.rollbacks;
  tokens_aligned += o.tokens_aligned;
  kv_aligned += o.kv_aligned;
  alignment_bytes += o.alignment_bytes;
  lead_sum += o.lead_sum;
  hedges += o.hedges;
  batch_forwards += o.batch_forwards;
  batch_rows += o.batch_rows;
}

void ShadowNode::Counters::AppendFamilies(std::vector<metrics::MetricFamily>* out) const {
  auto counter = [out](const char* name, const char* help, uint64_t value) {
    out->push_back(metrics::SingleSample(name, help, metrics::MetricType::kCounter, static_cast<double>(value)));
  };
  counter("odmoe_shadow_requests_total", "Requests main streamed to the shadow (Follow streams).", requests);
  counter("odmoe_shadow_predictions_sent_total",
          "Predictions sent (one per decode position and sparse layer, re-sent after a rollback).", predictions);
  counter("odmoe_shadow_positions_decoded_total", "Decode positions the shadow ran on its replica.", positions_decoded);
  counter("odmoe_shadow_positions_adopted_total",
          "Decode positions main had left behind that the shadow took main's K/V for instead of running (catch-up).",
          positions_adopted);
  counter("odmoe_shadow_rollbacks_total", "Times an aligned token differed from the shadow's guess (it re-ran).",
          rollbacks);
  counter("odmoe_shadow_alignment_tokens_total", "Token alignments received from main.", tokens_aligned);
  counter("odmoe_shadow_alignment_kv_total", "K/V alignments received from main.", kv_aligned);
  counter("odmoe_shadow_alignment_bytes_received_total", "K/V alignment bytes received from main.", alignment_bytes);
  counter("odmoe_shadow_hedges_sent_total",
          "Hedged experts sent (the router's (k+1)-th choice within [shadow] hedge_margin), re-sends included.",
          hedges);
  counter("odmoe_shadow_batch_forwards_total",
          "Decode forwards the replica ran (each a row of every request it runs in step with main).", batch_forwards);
  counter("odmoe_shadow_batch_rows_total", "Rows of those forwards (rows / forwards: the mean batch).", batch_rows);
}

void ShadowNode::InitMetrics(metrics::Labels labels) {
  metrics_ = std::make_unique<metrics::Registry>(std::move(labels));
  rpc::AddBuildInfo(*metrics_);
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
      out->push_back(metrics::SingleSample("odmoe_shadow_prefetch_calls_total", "Prefetch calls sent to the workers.",
                                           metrics::MetricType::kCounter, static_cast<double>(ps.calls)));
      out->push_back(metrics::SingleSample("odmoe_shadow_prefetch_failures_total",
                                           "Prefetch calls that failed (the worker refused or did not answer).",
                                           metrics::MetricType::kCounter, static_cast<double>(ps.failures)));
      out->push_back(metrics::SingleSample(
          "odmoe_shadow_prefetch_dropped_total",
          "Prefetch calls never sent: dropped from a worker's full queue, or queued behind a call it did not answer.",
          metrics::MetricType::kCounter, static_cast<double>(ps.dropped)));
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
