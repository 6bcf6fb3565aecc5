#include "src/main_node/main_node.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <limits>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/common/logging.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"
#include "src/rpc/logprobs_proto.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/peer_version.h"
#include "src/rpc/request_id.h"
#include "src/rpc/sampling_proto.h"
#include "src/rpc/security.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<MainNode>> MainNode::Create(const rpc::DaemonArgs& args, MainNodeOptions options) {
  std::unique_ptr<MainNode> node(new MainNode());
  node->cluster_ = args.cluster;
  node->self_ = args.self;
  node->model_dir_ = args.model_dir;
  // Weights: the checkpoint, or synthetic ones ([model] synthetic, when no --model is given): main loads only
  // the non-expert tensors, and has no tokenizer with synthetic weights (prompt ids only).
  ODMOE_ASSIGN_OR_RETURN(OpenedModel model, OpenModel(args.cluster.model, args.model_dir));
  node->config_ = model.config;
  node->fingerprint_ = model.fingerprint;
  const uint64_t expert_bytes = model.ExpertBytes();
  ODMOE_ASSIGN_OR_RETURN(node->tokenizer_, OpenTokenizer(model, args.model_dir));
  if (node->tokenizer_ != nullptr) {
    node->vocabulary_ = TokenVocabulary::FromTokenizer(*node->tokenizer_, node->config_.vocab_size);
  }
  ODMOE_ASSIGN_OR_RETURN(node->device_, CreateNodeDevice(args.cluster, args.self, args.model_dir));
  ODMOE_ASSIGN_OR_RETURN(node->weights_, ModelWeights::Load(node->config_, *model.source, *node->device_,
                                                            WeightSelection::NonExpertOnly()));
  node->model_ = std::move(model);

  std::vector<WorkerEndpoint> workers;
  std::vector<PeerHealth::Peer> peers;
  for (const NodeConfig* w : args.cluster.workers()) {
    workers.push_back({w->name, w->address});
    peers.push_back({w->name, w->address});
  }
  if (args.cluster.shadow_settings.mode == PredictionMode::kShadow && args.cluster.shadow() != nullptr) {
    peers.push_back({args.cluster.shadow()->name, args.cluster.shadow()->address});
  }
  node->health_ = std::make_unique<PeerHealth>(std::move(peers));
  ODMOE_ASSIGN_OR_RETURN(const Placement placement,
                         Placement::ForCluster(args.cluster.file, static_cast<int32_t>(workers.size()),
                                               args.cluster.group_size, node->config_.top_k));
  node->admission_ = std::make_unique<Admission>(args.cluster.max_queued, args.cluster.max_running);
  std::vector<std::string> worker_names;
  for (const WorkerEndpoint& w : workers) worker_names.push_back(w.name);
  node->membership_ =
      std::make_unique<Membership>(placement, std::move(worker_names), node->health_.get(), Membership::FirstEpoch());
  RemoteExpertOptions ro;
  ro.sender = args.self.name;
  ro.epoch = args.cluster.epoch;
  ro.fingerprint = node->fingerprint_;
  ro.rpc_timeout_ms = args.cluster.rpc_timeout_ms;
  ro.prefill_minibatch_rows = args.cluster.prefill_minibatch_rows;
  ODMOE_ASSIGN_OR_RETURN(const PayloadScale payload, PayloadScaleOf(args.cluster, node->config_));
  ro.payload_scale = payload.hidden;
  ro.max_tokens = options.engine.max_tokens_per_forward;
  ro.max_tensor_bytes_per_call = options.max_tensor_bytes_per_call;
  ro.max_rows_per_call = options.max_rows_per_call;
  ro.health = node->health_.get();
  ro.membership = node->membership_.get();
  auto experts = RemoteExpertExecutor::Create(*node->device_, node->config_, expert_bytes, std::move(workers),
                                              placement.group_size(), ro);
  if (!experts.ok()) {
    return absl::Status(experts.status().code(), StrCat(args.cluster.file, ": ", experts.status().message()));
  }
  node->experts_ = std::move(experts).value();
  node->experts_unguarded_ = node->experts_.get();
  node->placement_groups_ = node->experts_->placement().num_groups();
  const ShadowSettings& ss = args.cluster.shadow_settings;
  // The workers' residency follows main's steps through one stream id; a restarted main is another stream.
  absl::BitGen bitgen;
  node->batch_id_ = absl::Uniform<uint64_t>(absl::IntervalClosed, bitgen, 1, std::numeric_limits<uint64_t>::max());
  if (ss.mode == PredictionMode::kShadow && args.cluster.shadow() != nullptr) {
    node->shadow_channel_ = rpc::MakeChannel(args.cluster.shadow()->address);
    node->shadow_options_ = ShadowLinkOptions{.epoch = args.cluster.epoch,
                                              .fingerprint = node->fingerprint_,
                                              .sender = args.self.name,
                                              .membership = node->membership_.get(),
                                              .health = node->health_.get(),
                                              .health_peer = static_cast<int32_t>(args.cluster.workers().size()),
                                              .batch_id = node->batch_id_,
                                              .kv_payload_scale = payload.kv};
  } else if (ss.mode == PredictionMode::kRandom) {
    std::vector<std::string> addresses;
    for (const NodeConfig* w : args.cluster.workers()) addresses.push_back(w->address);
    rpc::PrefetchSenderOptions po{args.cluster.epoch, node->fingerprint_, args.self.name, args.cluster.rpc_timeout_ms};
    node->random_sender_ = std::make_unique<rpc::PrefetchSender>(addresses, node->experts_->placement(), po);
  }
  // One decode step carries a token of every running request (of at most max_tokens_per_forward of them).
  EngineOptions engine_options = options.engine;
  engine_options.max_sequences_per_forward =
      std::clamp<int64_t>(args.cluster.max_running, 1, engine_options.max_tokens_per_forward);
  ODMOE_ASSIGN_OR_RETURN(node->engine_,
                         Engine::Create(*node->weights_, *node->device_, node->experts_.get(), engine_options));
  node->runner_ = std::make_unique<BatchRunner>(*node->engine_, BatchOptions{});
  node->InitMetrics(args);
  node->prober_ = std::make_unique<PeerProber>(
      *node->health_, PeerProberOptions{.cluster = rpc::ClusterIdentity(args.cluster.epoch, node->fingerprint_)});
  node->prober_->Start();
  node->batch_thread_ = std::thread([n = node.get()] { n->BatchLoop(); });
  return node;
}

namespace {

// odmoe_membership_epoch, odmoe_workers_in_placement, odmoe_membership_changes_total{worker,change} and
// odmoe_expert_calls_reissued_total{reason}.
void AppendFailoverFamilies(const Membership& membership, const RemoteExpertExecutor& experts,
                            std::vector<metrics::MetricFamily>* out) {
  using metrics::MetricType;
  const Membership::Snapshot now = membership.Current();
  out->push_back(metrics::SingleSample(
      "odmoe_membership_epoch", "Main's membership epoch of the workers (it changes as workers leave and rejoin).",
      MetricType::kGauge, static_cast<double>(now.view.epoch)));
  out->push_back(metrics::SingleSample("odmoe_workers_in_placement", "Workers that take work now.", MetricType::kGauge,
                                       static_cast<double>(now.placement.num_members())));
  metrics::MetricFamily changes{"odmoe_membership_changes_total",
                                "Workers leaving (change=left) and rejoining (change=joined) the placement.",
                                MetricType::kCounter,
                                {}};
  const std::vector<Membership::Changes> counts = membership.changes();
  for (size_t w = 0; w < counts.size(); ++w) {
    for (const bool joined : {false, true}) {
      metrics::Sample sample;
      sample.labels = {{"worker", membership.names()[w]}, {"change", joined ? "joined" : "left"}};
      sample.value = static_cast<double>(joined ? counts[w].joined : counts[w].left);
      changes.samples.push_back(std::move(sample));
    }
  }
  out->push_back(std::move(changes));
  metrics::MetricFamily reissued{"odmoe_expert_calls_reissued_total",
                                 "Expert calls sent again to another worker: reason=worker_down (their worker left "
                                 "the placement) or slow (10x its p99).",
                                 MetricType::kCounter,
                                 {}};
  metrics::Sample down, slow;
  down.labels = {{"reason", "worker_down"}};
  down.value = static_cast<double>(experts.reissued_worker_down_total());
  slow.labels = {{"reason", "slow"}};
  slow.value = static_cast<double>(experts.reissued_slow_total());
  reissued.samples = {down, slow};
  out->push_back(std::move(reissued));
}

}  // namespace

void MainNode::InitMetrics(const rpc::DaemonArgs& args) {
  std::vector<MainMetrics::Peer> peers;
  for (const NodeConfig* w : args.cluster.workers()) peers.push_back({w->name, "worker", w->address});
  const NodeConfig* shadow = args.cluster.shadow();
  if (args.cluster.shadow_settings.mode == PredictionMode::kShadow && shadow != nullptr) {
    peers.push_back({shadow->name, "shadow", shadow->address});
  }
  metrics_ = std::make_unique<MainMetrics>(rpc::DaemonMetricLabels(args.cluster, args.self, args.model_dir), peers);
  // Reachability as main judges it (PeerHealth), and its changes.
  health_->Subscribe([m = metrics_.get()](const PeerEvent& e) {
    if (e.from != e.to) m->PeerChanged(e.name, e.to == PeerState::kUp);  // not a down peer's new reason
  });
  metrics_->registry().AddCollector([this](std::vector<metrics::MetricFamily>* out) {
    {
      absl::MutexLock lock(&stats_mu_);
      Counters totals = reset_;
      totals.Add(counters_);
      totals.AppendFamilies(config_.top_k, out);
    }
    const MemoryInfo m = device_->memory_info();
    rpc::AppendDeviceMemoryFamilies(m, m.capacity, out);
  });
  // Failover (src/main_node/membership.h): the membership and what the executor sent again.
  metrics_->registry().AddCollector(
      [membership = membership_.get(), experts = experts_unguarded_](std::vector<metrics::MetricFamily>* out) {
        AppendFailoverFamilies(*membership, *experts, out);
      });
}

MainNode::~MainNode() {
  if (batch_thread_.joinable()) {
    {
      absl::MutexLock lock(&inbox_mu_);
      stopping_ = true;
    }
    batch_thread_.join();  // ends the requests it holds (Unavailable)
  }
  if (prober_ != nullptr) prober_->Stop();  // no event reaches the executor or the metrics from here on
  random_sender_.reset();
  runner_.reset();
  engine_.reset();
  experts_.reset();
}

namespace {

// k distinct experts of `num_experts`, a pure function of its arguments (splitmix64 stream).
std::vector<int32_t> RandomExperts(uint64_t seed, uint64_t request_id, int64_t position, int64_t sparse_index,
                                   int64_t num_experts, int64_t k) {
  uint64_t state = seed ^ (request_id * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(position) << 20) ^
                   static_cast<uint64_t>(sparse_index);
  auto next = [&state]() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  std::vector<int32_t> all(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) all[static_cast<size_t>(e)] = static_cast<int32_t>(e);
  for (int64_t i = 0; i < k && i < num_experts; ++i) {  // partial Fisher-Yates
    const uint64_t j = static_cast<uint64_t>(i) + next() % static_cast<uint64_t>(num_experts - i);
    std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(j)]);
  }
  all.resize(static_cast<size_t>(std::min(k, num_experts)));
  return all;
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> MainNode::PromptOf(const v1::GenerateRequest& request) const {
  const bool has_text = !request.prompt().empty();
  const bool has_ids = request.prompt_ids_size() > 0;
  if (has_text && has_ids) return absl::InvalidArgumentError("give either prompt (text) or prompt_ids, not both");
  if (!has_text && !has_ids) {
    return absl::InvalidArgumentError("the prompt is empty: give a text prompt or at least one prompt id");
  }
  if (has_ids) return std::vector<int32_t>(request.prompt_ids().begin(), request.prompt_ids().end());
  ODMOE_RETURN_IF_ERROR(CheckUtf8(request.prompt(), "prompt"));
  if (tokenizer_ == nullptr) {
    return absl::FailedPreconditionError(
        StrCat("the model at main (", model_dir_,
               ") has no tokenizer (neither tokenizer.model nor tokenizer.json): send token ids in prompt_ids "
               "(odmoe generate --prompt-ids)"));
  }
  return tokenizer_->EncodeForModel(request.prompt());
}

// One request's state while it runs. Its thread (RunRequest) fills the first part and hands it to the batch
// loop, which owns the loop part until it posts the end; the mailbox passes tokens and the end between them.
struct MainNode::RequestRun {
  // Set by the request's thread before the hand-over.
  uint64_t id = 0;
  std::string trace_id;  // the client's request id: x-request-id metadata on every RPC of the request
  std::vector<int32_t> prompt;
  GenerateOptions options;
  absl::Time deadline = absl::InfiniteFuture();  // the client's
  MainMetrics::Request* timeline = nullptr;      // the request's metrics
  absl::Time arrived;                            // when main got it
  int64_t prompt_len() const { return static_cast<int64_t>(prompt.size()); }

  // The batch loop's, from the hand-over until it posts the end.
  std::unique_ptr<BatchRequest> batch;
  bool waited_for_memory = false;  // its KV cache did not fit at first (MainNode::JoinWaiting)
  double queue_ms = 0;             // from arrival until it joined the batch: admission's queue, then waiting_
  // It leaves waiting_ at `now` (joining or not): its queue_ms.
  void EndWait(absl::Time now) { queue_ms = absl::ToDoubleMilliseconds(now - arrived); }
  std::vector<float> kv_k, kv_v;  // [num_layers, kv_size]: a position's K/V for the shadow
  // Its predictions and outcomes, and its stream to the shadow (nullptr without one); the request's thread
  // finishes both once the loop is done with it.
  PredictionBoard board;
  std::unique_ptr<ShadowLink> link;
  // What its steps cost (each step's figures added to every request in it) and its prediction figures.
  std::vector<WorkerCallStats> worker_stats;
  uint64_t calls_reissued = 0;
  uint64_t membership_epoch = 0;
  DecodeTiming timing;
  RecallSummary recall;
  AlignmentCounts alignment;

  // Set by the request's thread when its client has gone or its StopCheck stopped it: the loop takes it out at
  // the next step (with Cancelled, which the request's thread replaces with the reason).
  std::atomic<bool> stop{false};

  // The mailbox, filled by the loop.
  absl::Mutex mu;
  // A generated token with what its message carries besides the id, when the request asked.
  struct PostedToken {
    int32_t id = 0;
    bool shows_text = true;  // false for a last token whose text the answer leaves out (ShowsTokenText)
    std::optional<PositionLogprobs> logprobs;
    std::vector<PositionLogprobs> prompt_logprobs;  // the first token's: the prompt's
  };
  std::deque<PostedToken> tokens ABSL_GUARDED_BY(mu);  // generated, not yet streamed
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
};

absl::StatusOr<GenerateOptions> MainNode::OptionsOf(const v1::GenerateRequest& request,
                                                    std::span<const int32_t> prompt) const {
  ODMOE_RETURN_IF_ERROR(ValidateRequest(config_, prompt, request.max_new_tokens()));
  GenerateOptions options;
  options.max_new_tokens = request.max_new_tokens();
  options.sampling = rpc::SamplingFromProto(request.sampling());
  if (!request.logprobs() && request.top_logprobs() != 0) {
    return absl::InvalidArgumentError(StrCat("top_logprobs (", request.top_logprobs(), ") needs logprobs set"));
  }
  options.logprobs = request.logprobs() ? request.top_logprobs() : -1;
  options.prompt_logprobs = request.prompt_logprobs();
  options.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  options.min_tokens = request.min_tokens();
  options.include_stop_str_in_output = request.include_stop_str_in_output();
  options.constraint = rpc::ConstraintFromProto(request.constraint());
  options.vocabulary = vocabulary_;
  options.ignore_eos = request.ignore_eos();
  ODMOE_RETURN_IF_ERROR(options.Validate(config_.vocab_size));
  options.keep_last_logits = request.dump_logits();
  options.record_routing = request.dump_routing();
  return options;
}

absl::Status MainNode::RunRequest(const v1::GenerateRequest& request,
                                  const std::function<bool(const v1::GenerateResponse&)>& emit, const StopCheck& stop,
                                  RequestRecord* record) {
  RequestRecord own;
  if (record == nullptr) record = &own;
  MainMetrics::Request timeline = metrics_->Arrived();
  const absl::Status status = ServeRequest(request, emit, stop, record, timeline);
  timeline.Finished(status);
  LogFinished(status, *record);
  return status;
}

absl::Status MainNode::ServeRequest(const v1::GenerateRequest& request,
                                    const std::function<bool(const v1::GenerateResponse&)>& emit, const StopCheck& stop,
                                    RequestRecord* record, MainMetrics::Request& timeline) {
  // Validate before waiting for the engine: a bad request is answered at once.
  RequestRun run;
  run.arrived = absl::Now();
  struct TimeOnExit {  // a request that ends before its figures are taken (refused, failed in the queue) too
    RequestRecord& record;
    absl::Time arrived;
    ~TimeOnExit() {
      if (record.total_ms == 0) record.total_ms = absl::ToDoubleMilliseconds(absl::Now() - arrived);
    }
  } time_on_exit{*record, run.arrived};
  // The place in the queue goes to the next request as this one ends, however it ends (a place taken beforehand
  // too: left in the queue, it would hold back every later arrival). The caller's ticket keeps its count once it
  // ran (RequestRecord::admitted).
  std::optional<Admission::Ticket> arrived;
  Admission::Ticket* ticket = record->admitted;
  struct LeaveWhenDone {
    Admission::Ticket*& ticket;
    bool yield = false;  // the caller's ticket had its turn
    ~LeaveWhenDone() {
      if (ticket == nullptr) return;
      if (yield) {
        ticket->Yield();
      } else {
        ticket->Leave();
      }
    }
  } leave{ticket};
  run.trace_id = record->request_id;
  ODMOE_ASSIGN_OR_RETURN(run.prompt, PromptOf(request));
  record->prompt_tokens = run.prompt_len();
  ODMOE_ASSIGN_OR_RETURN(run.options, OptionsOf(request, run.prompt));
  run.timeline = &timeline;

  // Admission: a place in the bounded queue or a busy refusal at once; then wait (first come, first served).
  if (ticket == nullptr) {
    ODMOE_ASSIGN_OR_RETURN(Admission::Ticket place, admission_->Arrive());
    ticket = &arrived.emplace(std::move(place));
  }
  timeline.Queued();
  ODMOE_RETURN_IF_ERROR(ticket->WaitTurn(stop, record->deadline));
  leave.yield = record->admitted != nullptr;
  run.deadline = record->deadline;
  run.id = next_request_id_.fetch_add(1);
  run.batch = std::make_unique<BatchRequest>(run.id, config_, run.prompt, run.options,
                                             [this, r = &run](int32_t id, bool last) { OnToken(*r, id, last); });
  std::unique_ptr<IncrementalDecoder> decoder;
  if (tokenizer_ != nullptr) decoder = tokenizer_->NewDecoder(run.prompt);
  Submit(&run);

  // Stream what the loop posts until it posts the end; it takes the request out when the client goes or `stop`
  // says so.
  absl::Status status;
  bool client_gone = false;
  absl::Status stopped;  // `stop`'s verdict once not OK
  for (;;) {
    std::deque<RequestRun::PostedToken> tokens;
    bool done = false;
    {
      absl::MutexLock lock(&run.mu);
      auto ready = [&run]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(run.mu) { return !run.tokens.empty() || run.done; };
      run.mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(20));
      tokens.swap(run.tokens);
      done = run.done;
      status = run.status;
    }
    for (const RequestRun::PostedToken& token : tokens) {
      if (client_gone) break;
      v1::GenerateResponse chunk;
      chunk.add_tokens(token.id);
      if (token.logprobs) rpc::LogprobsToProto(*token.logprobs, chunk.add_logprobs());
      for (const PositionLogprobs& p : token.prompt_logprobs) rpc::LogprobsToProto(p, chunk.add_prompt_logprobs());
      chunk.set_has_text(decoder != nullptr);
      if (decoder != nullptr && token.shows_text) chunk.set_text(decoder->Push(token.id));
      if (!emit(chunk)) client_gone = true;
    }
    if (done) break;
    if (stopped.ok() && stop) stopped = stop();
    if (client_gone || !stopped.ok()) run.stop.store(true);
  }
  // The loop is done with `run`: its running place goes to the next request in the queue now, not after the wait
  // for the shadow's last predictions (the ticket keeps its count until this request returns, so the queue's
  // bound still holds this thread). Those predictions count for its recall.
  ticket->Yield();
  FinishPrediction(run, status.ok() && !client_gone);
  // The figures as far as the request got, whatever its outcome. Times count from arrival: the queue is part of
  // what the client waited.
  GenerateResult result = run.batch->result();
  if (!result.tokens.empty()) result.ttft_ms += run.queue_ms;
  result.total_ms += run.queue_ms;
  record->generated_tokens = static_cast<int64_t>(result.tokens.size());
  record->ttft_ms = result.ttft_ms;
  record->decode_tokens_per_s = result.decode_tokens_per_s;
  record->total_ms = result.total_ms;
  if (client_gone && record->emit_false_is_stop) return absl::OkStatus();
  if (client_gone) return absl::CancelledError("the client went away");
  if (absl::IsCancelled(status) && !stopped.ok()) return stopped;  // the loop took it out: why
  ODMOE_RETURN_IF_ERROR(status);

  v1::GenerateResponse last = FinalResponse(run, result, decoder.get());
  FillRequestStats(run, result, last.mutable_stats());
  if (!emit(last) && !record->emit_false_is_stop) return absl::CancelledError("the client went away");
  return absl::OkStatus();
}

void MainNode::Submit(RequestRun* run) {
  absl::MutexLock lock(&inbox_mu_);
  if (stopping_) {
    absl::MutexLock run_lock(&run->mu);
    run->done = true;
    run->status = absl::UnavailableError("main is shutting down");
    return;
  }
  inbox_.push_back(run);
}

void MainNode::BatchLoop() {
  bool fresh = true;  // the loop waited for work before the next step
  for (;;) {
    std::vector<RequestRun*> arrived;
    bool stopping = false;
    {
      absl::MutexLock lock(&inbox_mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(inbox_mu_) {
        return stopping_ || !inbox_.empty() || !running_.empty() || !waiting_.empty();
      };
      if (running_.empty() && waiting_.empty() && inbox_.empty()) fresh = true;
      inbox_mu_.Await(absl::Condition(&work));
      arrived.swap(inbox_);
      stopping = stopping_;
    }
    waiting_.insert(waiting_.end(), arrived.begin(), arrived.end());
    if (stopping) {
      while (!running_.empty()) Leave(running_.front(), absl::UnavailableError("main is shutting down"));
      for (RequestRun* run : waiting_) Finish(run, absl::UnavailableError("main is shutting down"));
      waiting_.clear();
      return;
    }
    // Requests whose client went away, or whose deadline passed, leave between steps, running or waiting.
    const absl::Time now = absl::Now();
    auto why_out = [now](const RequestRun* run) -> absl::Status {
      if (run->stop.load()) return absl::CancelledError("stopped by the request's thread");
      if (now >= run->deadline) return absl::DeadlineExceededError("the request's deadline passed");
      return absl::OkStatus();
    };
    for (size_t i = 0; i < running_.size();) {
      if (absl::Status out = why_out(running_[i]); !out.ok()) {
        Leave(running_[i], std::move(out));
      } else {
        ++i;
      }
    }
    std::erase_if(waiting_, [&](RequestRun* run) {
      absl::Status out = why_out(run);
      if (out.ok()) return false;
      run->EndWait(now);
      Finish(run, std::move(out));
      memory_freed_ = true;  // the new head of waiting_ may need less
      return true;
    });
    JoinWaiting();
    if (running_.empty()) continue;
    RunStep(fresh);
    fresh = false;
  }
}

void MainNode::JoinWaiting() {
  while (!waiting_.empty() && memory_freed_) {
    RequestRun* run = waiting_.front();
    absl::Status added = runner_->Add(run->batch.get());  // its KV cache allocated
    if (absl::IsResourceExhausted(added) && !running_.empty() && FitsWithoutOthers(*run)) {
      // It will fit once running requests have left; those behind it wait their turn.
      memory_freed_ = false;
      if (!run->waited_for_memory) {
        run->waited_for_memory = true;
        spdlog::info("request {} waits for device memory beside {} running request(s): {}", run->trace_id,
                     running_.size(), std::string(added.message()));
      }
      return;
    }
    waiting_.pop_front();
    run->EndWait(absl::Now());
    if (!added.ok()) {
      Finish(run, std::move(added));  // a prompt that could never fit, or a failure of another kind
      continue;
    }
    if (run->waited_for_memory) spdlog::info("request {} joins after {:.0f} ms", run->trace_id, run->queue_ms);
    run->timeline->Started(run->prompt_len());
    run->worker_stats.assign(experts_->workers().size(), WorkerCallStats());
    running_.push_back(run);
    StartPrediction(*run);
  }
}

bool MainNode::FitsWithoutOthers(const RequestRun& run) const {
  const MemoryInfo m = device_->memory_info();
  if (m.capacity == 0) return true;  // no capacity known: only waiting tells
  uint64_t caches = 0;
  for (const RequestRun* r : running_) caches += engine_->KvCacheBytes(r->batch->sequence()->capacity());
  const uint64_t rest = m.in_use - std::min(m.in_use, caches);  // the weights, workspaces and buffers
  return engine_->KvCacheBytes(run.batch->cache_positions()) <= m.capacity - std::min(m.capacity, rest);
}

void MainNode::Leave(RequestRun* run, absl::Status status) {
  runner_->Remove(run->batch.get(), status);
  running_.erase(std::remove(running_.begin(), running_.end(), run), running_.end());
  memory_freed_ = true;
  Finish(run, std::move(status));
}

void MainNode::Finish(RequestRun* run, absl::Status status) {
  absl::MutexLock lock(&run->mu);
  run->done = true;
  run->status = std::move(status);
}

MainNode::RequestRun* MainNode::RunOf(const BatchRequest* request) const {
  auto it = std::find_if(running_.begin(), running_.end(),
                         [request](const RequestRun* run) { return run->batch.get() == request; });
  ODMOE_CHECK(it != running_.end());
  return *it;
}

void MainNode::RunStep(bool fresh) {
  const BatchRunner::Plan plan = runner_->Schedule();
  if (plan.empty()) return;
  const bool decode = plan.kind == ForwardKind::kDecode;
  RemoteExpertExecutor::StepContext step;
  step.fresh = fresh;
  step.deadline = absl::InfinitePast();
  // A decode step is the stream's next position; a prefill chunk goes at the last decode step's, so that
  // predictions of the next decode step stay ahead of the workers' view of main.
  step.request_id = batch_id_;
  step.position = decode ? decode_steps_ + 1 : decode_steps_;
  std::vector<RequestRun*> runs;
  for (const BatchRequest* r : plan.requests) {
    runs.push_back(RunOf(r));
    step.deadline = std::max(step.deadline, runs.back()->deadline);
    if (decode) step.boards[r->tag()] = &runs.back()->board;
  }
  step.trace_id = runs.front()->trace_id;
  if (decode && random_sender_ != nullptr) PredictAtRandom(runs, step.position);
  // The step stops early only when every request in it is gone.
  step.cancelled = [runs]() {
    return std::all_of(runs.begin(), runs.end(), [](RequestRun* run) { return run->stop.load(); });
  };
  experts_->BeginStep(std::move(step));
  // (The step's status dies here, before any request is handed back: the loop keeps no reference to a status
  // its requests' threads read.)
  if (const absl::Status ran = runner_->Run(plan); !ran.ok()) {
    spdlog::warn("a batch step of {} request(s) failed: {}", runs.size(), std::string(ran.message()));
  }
  experts_->EndStep();
  if (decode) ++decode_steps_;  // before Postprocess: OnToken tells the shadow the next step's number
  // The step's cost goes to each of its requests (a load shared by several counts for each).
  for (RequestRun* run : runs) {
    for (size_t w = 0; w < run->worker_stats.size(); ++w) run->worker_stats[w].Add(experts_->stats()[w]);
    run->calls_reissued += experts_->calls_reissued();
    run->membership_epoch = experts_->membership_epoch();
    run->timing.Add(experts_->timing());
  }
  {
    absl::MutexLock stats_lock(&stats_mu_);
    counters_.timing.Add(experts_->timing());
    if (decode) {
      ++counters_.decode_steps;
      counters_.decode_rows += runs.size();
    }
  }
  for (BatchRequest* done : runner_->Postprocess(plan)) Leave(RunOf(done), done->status());
}

void MainNode::StartPrediction(RequestRun& run) {
  // Expert prediction for the decode steps (positions prompt .. LastDecodePosition).
  run.board.Reset(static_cast<int64_t>(config_.SparseLayers().size()), config_.top_k);
  if (shadow_channel_ == nullptr) return;  // random predictions are made per step; none: recall 0, misses recorded
  run.link = std::make_unique<ShadowLink>(shadow_channel_, config_, shadow_options_);
  run.link->Start(run.id, run.trace_id, run.prompt, run.options, cluster_.shadow_settings, &run.board);
}

void MainNode::FinishPrediction(RequestRun& run, bool request_ok) {
  if (run.link != nullptr) {
    // The shadow's predictions for the last positions may still be on their way: they count for recall. A
    // failed request has no recall to complete: its error goes out at once.
    run.link->Finish(/*wait_ms=*/request_ok ? cluster_.shadow_settings.finish_wait_ms : 0);
    run.alignment = run.link->counts();
  }
  if (random_sender_ != nullptr) random_sender_->Drain();
  run.recall = run.board.Summarize();
}

void MainNode::PredictAtRandom(const std::vector<RequestRun*>& runs, int64_t step) {
  const std::vector<int64_t> sparse_layers = config_.SparseLayers();
  // Placed over main's membership as it is now (a view main made itself: always valid).
  ODMOE_CHECK_OK(random_sender_->SetMembership(membership_->Current().view));
  for (size_t s = 0; s < sparse_layers.size(); ++s) {
    std::vector<int32_t> all;
    for (RequestRun* run : runs) {
      const int64_t position = run->batch->sequence()->position();
      std::vector<int32_t> predicted = RandomExperts(cluster_.shadow_settings.seed, run->id, position,
                                                     static_cast<int64_t>(s), config_.num_experts, config_.top_k);
      all.insert(all.end(), predicted.begin(), predicted.end());
      run->board.Put(position, static_cast<int64_t>(s), std::move(predicted));
    }
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    random_sender_->Send(batch_id_, step, sparse_layers[s], static_cast<int64_t>(s), all, runs.front()->trace_id);
  }
}

void MainNode::OnToken(RequestRun& run, int32_t id, bool last) {
  run.timeline->Token();
  const GenerateResult& result = run.batch->result();                // the loop's: this thread's
  const int64_t i = static_cast<int64_t>(result.tokens.size()) - 1;  // this token's index
  {
    absl::MutexLock lock(&run.mu);
    RequestRun::PostedToken& posted = run.tokens.emplace_back();
    posted.id = id;
    posted.shows_text = !last || ShowsTokenText(config_, run.options, id);  // only the last can be a stop token
    if (run.options.logprobs >= 0) posted.logprobs = result.logprobs.back();
    if (i == 0) posted.prompt_logprobs = result.prompt_logprobs;  // the first token's message carries them
  }
  // Main now decodes the position of this token (unless it was the last one): the shadow learns where main is,
  // with the alignment due at this step.
  if (run.link == nullptr || !run.link->active() || last) return;  // (a broken link needs no K/V read)
  const ShadowSettings& ss = cluster_.shadow_settings;
  const int64_t prompt_len = run.prompt_len();
  const StepAlignment due = run.link->AlignmentDue(prompt_len + i);
  bool send_kv = due.kv;
  // K/V that cannot be read (logged), or that the link has no room for, is not sent: the step still goes, so that
  // the shadow keeps main's position.
  auto read = [&run](const absl::Status& s) {
    if (s.ok()) return true;
    spdlog::warn("request {}: main's K/V for the shadow could not be read: {}", run.trace_id, s.ToString());
    return false;
  };
  if (i == 0 && ss.align_kv > 0 && prompt_len > 1 && run.link->RoomForKv()) {
    // KV alignment starts from main's state: the prompt's K/V (but its last position, which the first step
    // carries) goes once, before the first step.
    const size_t row = static_cast<size_t>(config_.num_layers * config_.kv_size());
    std::vector<float> pk(row * static_cast<size_t>(prompt_len - 1)), pv(pk.size());
    if (read(engine_->ReadKvRange(*run.batch->sequence(), 0, prompt_len - 1, pk.data(), pv.data()))) {
      run.link->SendKv(0, prompt_len - 1, std::move(pk), std::move(pv));
    }
  }
  if (send_kv) {
    run.kv_k.resize(static_cast<size_t>(config_.num_layers * config_.kv_size()));
    run.kv_v.resize(run.kv_k.size());
    send_kv = run.link->RoomForKv() &&
              read(engine_->ReadKv(*run.batch->sequence(), prompt_len + i - 1, run.kv_k.data(), run.kv_v.data()));
  }
  // The position is decoded in the next decode step: every decoding request is in every decode step.
  run.link->Step(prompt_len + i, decode_steps_ + 1, due.token ? std::optional<int32_t>(id) : std::nullopt,
                 send_kv ? run.kv_k.data() : nullptr, send_kv ? run.kv_v.data() : nullptr);
}

v1::GenerateResponse MainNode::FinalResponse(RequestRun& run, const GenerateResult& result,
                                             IncrementalDecoder* decoder) const {
  v1::GenerateResponse last;
  last.set_done(true);
  last.set_has_text(decoder != nullptr);
  if (decoder != nullptr) {
    last.set_text(decoder->Finish());
    last.set_full_text(tokenizer_->DecodeAfter(run.prompt, ShownTokens(config_, run.options, result)));
  }
  last.mutable_prompt_ids()->Add(run.prompt.begin(), run.prompt.end());
  last.mutable_all_tokens()->Add(result.tokens.begin(), result.tokens.end());
  last.set_stop_reason(result.stop_reason);
  if (run.options.keep_last_logits) {
    last.mutable_last_logits()->Add(result.last_logits.begin(), result.last_logits.end());
  }
  if (result.tokens.empty()) {  // no token message carried them
    for (const PositionLogprobs& p : result.prompt_logprobs) rpc::LogprobsToProto(p, last.add_prompt_logprobs());
  }
  for (const PositionRouting& position : result.routing) {
    v1::PositionRouting* p = last.add_routing();
    for (const std::vector<int32_t>& layer : position) {
      p->add_layers()->mutable_experts()->Add(layer.begin(), layer.end());
    }
  }
  return last;
}

void MainNode::FillRequestStats(const RequestRun& run, const GenerateResult& result, v1::RequestStats* stats) {
  stats->set_ttft_ms(result.ttft_ms);
  stats->set_decode_tokens_per_s(result.decode_tokens_per_s);
  stats->set_total_ms(result.total_ms);
  const std::vector<WorkerCallStats>& per_worker = run.worker_stats;
  WorkerCallStats total;
  for (size_t i = 0; i < per_worker.size(); ++i) {
    per_worker[i].ToProto(experts_->workers()[i].name, stats->add_workers());
    total.Add(per_worker[i]);
  }
  stats->set_bytes_loaded(total.bytes_loaded);
  stats->set_loads_on_demand(total.loads_on_demand);
  stats->set_on_demand_load_ms(total.on_demand_load_ms);
  stats->set_expert_tensors_opened(static_cast<uint64_t>(expert_tensors_opened()));
  const RecallSummary& recall = run.recall;
  const AlignmentCounts& alignment = run.alignment;
  if (recall.decode_layers > 0) metrics_->Prediction(recall.recall, recall.timely_recall);
  stats->set_prediction(std::string(PredictionModeName(cluster_.shadow_settings.mode)));
  recall.ToProto(stats);
  stats->set_tokens_aligned(alignment.tokens);
  stats->set_kv_aligned(alignment.kv);
  stats->set_alignment_bytes(alignment.bytes);
  stats->set_kv_alignments_skipped(alignment.kv_skipped);
  stats->set_queue_ms(run.queue_ms);
  stats->set_calls_reissued(run.calls_reissued);
  stats->set_membership_epoch(run.membership_epoch);
  const DecodeTiming& timing = run.timing;
  const int32_t groups = experts_->placement().num_groups();
  timing.ToProto(groups, stats);
  stats->set_groups(groups);
  stats->set_modeled_layers(timing.modeled_layers);
  stats->set_measured_layers_ms(timing.measured_layers_ms());
  stats->set_modeled_main_ms(timing.modeled_main_ms);
  stats->set_modeled_worker_ms(timing.modeled_worker_ms);
  stats->mutable_measured_ms_per_layer()->Add(timing.layer_ms.begin(), timing.layer_ms.end());
  {
    absl::MutexLock stats_lock(&stats_mu_);
    counters_.Add(Counters::OfRequest(recall, alignment));  // the timing is counted per step (RunStep)
  }
  const size_t fed = result.tokens.empty() ? 0 : result.tokens.size() - 1;  // the last token is never fed back
  stats->set_positions(run.prompt.size() + fed);
}

MainNode::Counters MainNode::Counters::OfRequest(const RecallSummary& r, const AlignmentCounts& a) {
  return Counters{.requests = 1,
                  .decode_layers = r.decode_layers,
                  .correct = r.correct,
                  .timely = r.timely,
                  .predictions_missing = r.predictions_missing,
                  .loads_on_demand = r.loads_on_demand,
                  .stall_ms = r.stall_ms,
                  .tokens_aligned = a.tokens,
                  .kv_aligned = a.kv,
                  .alignment_bytes = a.bytes,
                  .kv_alignments_skipped = a.kv_skipped,
                  .predictions_received = r.predictions_received,
                  .lead_layers_sum = r.lead_layers_mean * static_cast<double>(r.predictions_received),
                  .hedge_loads = r.hedge_loads,
                  .hedges_used = r.hedges_used};
}

void MainNode::Counters::Add(const Counters& o) {
  requests += o.requests;
  decode_layers += o.decode_layers;
  correct += o.correct;
  timely += o.timely;
  predictions_missing += o.predictions_missing;
  loads_on_demand += o.loads_on_demand;
  stall_ms += o.stall_ms;
  tokens_aligned += o.tokens_aligned;
  kv_aligned += o.kv_aligned;
  alignment_bytes += o.alignment_bytes;
  kv_alignments_skipped += o.kv_alignments_skipped;
  predictions_received += o.predictions_received;
  lead_layers_sum += o.lead_layers_sum;
  timing.Add(o.timing);
  hedge_loads += o.hedge_loads;
  hedges_used += o.hedges_used;
  decode_steps += o.decode_steps;
  decode_rows += o.decode_rows;
}

void MainNode::Counters::AppendFamilies(int64_t top_k, std::vector<metrics::MetricFamily>* out) const {
  using metrics::MetricType;
  auto counter = [out](const char* name, const char* help, double value) {
    out->push_back(metrics::SingleSample(name, help, MetricType::kCounter, value));
  };
  const double needed = static_cast<double>(decode_layers) * static_cast<double>(std::max<int64_t>(1, top_k));
  counter("odmoe_prediction_experts_needed_total",
          "Experts decode needed (k per sparse layer and decode step): recall = hit / needed.", needed);
  counter("odmoe_prediction_experts_hit_total", "Needed experts that had been predicted.",
          static_cast<double>(correct));
  counter("odmoe_prediction_experts_hit_timely_total",
          "Needed experts predicted in time: resident or loading when main asked (timely recall = this / needed).",
          static_cast<double>(timely));
  counter("odmoe_prediction_layers_unpredicted_total", "Decoded (position, sparse layer) pairs with no prediction.",
          static_cast<double>(predictions_missing));
  counter("odmoe_prediction_hedge_loads_total",
          "Hedged experts the workers loaded ([shadow] hedge_margin), as the shadow counted them.",
          static_cast<double>(hedge_loads));
  counter("odmoe_prediction_hedges_used_total", "Needed experts only a hedge had predicted (counted in hit).",
          static_cast<double>(hedges_used));
  counter("odmoe_batch_decode_steps_total",
          "Decode steps run (continuous batching: each carries every decoding request).",
          static_cast<double>(decode_steps));
  counter("odmoe_batch_decode_rows_total",
          "Request rows the decode steps carried (mean batch size = this / odmoe_batch_decode_steps_total).",
          static_cast<double>(decode_rows));
  counter("odmoe_on_demand_loads_total", "Decode experts no worker had when main asked (loaded after routing).",
          static_cast<double>(loads_on_demand));
  counter("odmoe_on_demand_stall_seconds_total", "Time main waited for on-demand loads in decode, in seconds.",
          stall_ms / 1e3);
  counter("odmoe_alignment_tokens_sent_total", "Token alignments sent to the shadow.",
          static_cast<double>(tokens_aligned));
  counter("odmoe_alignment_kv_sent_total", "K/V alignments sent to the shadow.", static_cast<double>(kv_aligned));
  counter("odmoe_alignment_bytes_sent_total", "K/V alignment bytes sent to the shadow.",
          static_cast<double>(alignment_bytes));
  counter("odmoe_alignment_kv_skipped_total",
          "K/V alignments due but not sent: the link to the shadow already had its bound of K/V queued (16 MiB).",
          static_cast<double>(kv_alignments_skipped));
  counter("odmoe_decode_main_seconds_total",
          "Main's own decode time per sparse layer, summed (t_M of OD-MoE eq. 1 = this / layers).",
          timing.main_ms / 1e3);
  counter("odmoe_decode_main_layers_total", "Sparse layers main timed for t_M.",
          static_cast<double>(timing.main_layers));
  counter("odmoe_decode_worker_round_trip_seconds_total",
          "Decode expert round trips to the workers, summed (t_W of OD-MoE eq. 1 = this / round trips).",
          timing.worker_ms / 1e3);
  counter("odmoe_decode_worker_round_trips_total", "Decode expert round trips timed for t_W.",
          static_cast<double>(timing.worker_layers));
  metrics::MetricFamily lead{"odmoe_shadow_lead_layers",
                             "How many sparse layers ahead of main the shadow's predictions arrived (sum and count "
                             "over the predictions received; mean = sum / count).",
                             MetricType::kSummary,
                             {}};
  metrics::Sample s;
  s.sum = lead_layers_sum;
  s.count = predictions_received;
  lead.samples.push_back(s);
  out->push_back(std::move(lead));
}

void MainNode::Counters::ToProto(int64_t top_k, int32_t groups, v1::MainStats* s) const {
  s->set_requests(requests);
  s->set_decode_layers(decode_layers);
  s->set_correct(correct);
  s->set_timely(timely);
  const double denominator = static_cast<double>(decode_layers) * static_cast<double>(std::max<int64_t>(1, top_k));
  s->set_recall(decode_layers > 0 ? static_cast<double>(correct) / denominator : 0.0);
  s->set_timely_recall(decode_layers > 0 ? static_cast<double>(timely) / denominator : 0.0);
  s->set_predictions_missing(predictions_missing);
  s->set_loads_on_demand(loads_on_demand);
  s->set_stall_ms(stall_ms);
  s->set_tokens_aligned(tokens_aligned);
  s->set_kv_aligned(kv_aligned);
  s->set_alignment_bytes(alignment_bytes);
  s->set_kv_alignments_skipped(kv_alignments_skipped);
  timing.ToProto(groups, s);
  s->set_hedge_loads(hedge_loads);
  s->set_hedges_used(hedges_used);
  s->set_decode_steps(decode_steps);
  s->set_decode_rows(decode_rows);
}

grpc::Status MainNode::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                grpc::ServerWriter<v1::GenerateResponse>* writer) {
  if (grpc::Status admitted = rpc::AdmitClient(context); !admitted.ok()) return admitted;
  if (refusing_calls_.load()) return rpc::ToGrpc(absl::UnavailableError("main is shutting down"));
  absl::StatusOr<std::string> request_id = rpc::TakeOrMakeRequestId(*context);
  if (!request_id.ok()) {
    spdlog::warn("request from {} refused: {}", context->peer(), request_id.status().ToString());
    return rpc::ToGrpc(request_id.status());
  }
  // The client learns the id with the first message (or the status, when there is none).
  context->AddInitialMetadata(rpc::kRequestIdKey, *request_id);
  logging::ScopedRequestId scope(*request_id);
  spdlog::info("request from {}: prompt of {}, max_new_tokens {}", context->peer(),
               request->prompt_ids_size() > 0 ? StrCat(request->prompt_ids_size(), " token ids")
                                              : StrCat(request->prompt().size(), " bytes of text"),
               request->max_new_tokens());
  RequestRecord record;
  record.request_id = *request_id;
  record.deadline = rpc::RequestDeadline(*context);
  const absl::Status status = RunRequest(
      *request, [writer](const v1::GenerateResponse& r) { return writer->Write(r); },
      [context]() { return context->IsCancelled() ? absl::CancelledError("the client went away") : absl::OkStatus(); },
      &record);
  return rpc::ToGrpc(status);
}

void MainNode::LogFinished(const absl::Status& status, const RequestRecord& record) {
  // outcome: "ok", or the status code in lower case ("unavailable", "invalid_argument", ...).
  std::string outcome = status.ok() ? "ok" : absl::StatusCodeToString(status.code());
  for (char& c : outcome) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string line =
      StrCat("finished: outcome=", outcome, " prompt_tokens=", record.prompt_tokens,
             " generated_tokens=", record.generated_tokens, " ttft_ms=", absl::StrFormat("%.1f", record.ttft_ms),
             " tokens_per_s=", absl::StrFormat("%.2f", record.decode_tokens_per_s),
             " total_ms=", absl::StrFormat("%.1f", record.total_ms));
  if (status.ok()) {
    spdlog::info("{}", line);
  } else {
    spdlog::warn("{} error: {}", line, std::string(status.message()));
  }
}

v1::MainStats MainNode::Stats(bool reset) {
  v1::MainStats s;
  s.set_node(self_.name);
  s.set_prediction(std::string(PredictionModeName(cluster_.shadow_settings.mode)));
  rpc::FillDeviceMemory(*device_, device_->memory_info().capacity, s.mutable_memory());
  absl::MutexLock lock(&stats_mu_);
  counters_.ToProto(config_.top_k, placement_groups_, &s);
  if (reset) {
    reset_.Add(counters_);
    counters_ = Counters{};
  }
  return s;
}

grpc::Status MainNode::GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                                v1::MainStats* response) {
  if (grpc::Status admitted = rpc::AdmitClient(context); !admitted.ok()) return admitted;
  *response = Stats(request->reset());
  return grpc::Status::OK;
}

grpc::Status MainNode::GetMembership(grpc::ServerContext* context, const v1::MembershipRequest*,
                                     v1::Membership* response) {
  if (grpc::Status admitted = rpc::AdmitMember(context); !admitted.ok()) return admitted;
  rpc::FillMembership(cluster_, self_.name, fingerprint_, response);
  return grpc::Status::OK;
}

}  // namespace odmoe
