#include "src/main_node/main_node.h"

#include <algorithm>
#include <utility>

#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/fingerprint.h"
#include "src/model/model_layout.h"
#include "src/model/synthetic.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<MainNode>> MainNode::Create(const rpc::DaemonArgs& args, MainNodeOptions options) {
  std::unique_ptr<MainNode> node(new MainNode());
  node->cluster_ = args.cluster;
  node->self_ = args.self;
  node->model_dir_ = args.model_dir;
  // Weights: the checkpoint, or synthetic ones generated here ([model] synthetic, when no --model is given): main
  // makes only the non-expert tensors, and has no tokenizer then (prompt ids only).
  const bool synthetic = args.model_dir.empty() && args.cluster.model.is_synthetic();
  uint64_t expert_bytes = 0;
  if (synthetic) {
    const SyntheticSpec spec{args.cluster.model.synthetic, args.cluster.model.layers, args.cluster.model.seed};
    ODMOE_ASSIGN_OR_RETURN(node->config_, SyntheticModelConfig(spec));
    ODMOE_ASSIGN_OR_RETURN(node->fingerprint_, SyntheticFingerprint(spec));
    ODMOE_ASSIGN_OR_RETURN(node->device_, CreateDevice(args.self.device));
    SyntheticSource source(node->config_, spec.seed);
    ODMOE_ASSIGN_OR_RETURN(node->weights_, ModelWeights::Load(node->config_, source, *node->device_,
                                                              WeightSelection::NonExpertOnly()));
    expert_bytes = 3 * static_cast<uint64_t>(node->config_.expert_intermediate_size * node->config_.hidden_size) *
                   DTypeSize(SyntheticDType(node->config_));
  } else {
    ODMOE_ASSIGN_OR_RETURN(node->config_, LoadModelConfig(args.model_dir));
    ODMOE_ASSIGN_OR_RETURN(node->checkpoint_, Checkpoint::Open(args.model_dir));
    ODMOE_ASSIGN_OR_RETURN(node->fingerprint_, ModelFingerprint(args.model_dir, *node->checkpoint_));
    auto tokenizer = Tokenizer::Load(args.model_dir);
    if (tokenizer.ok()) {
      node->tokenizer_ = std::move(tokenizer).value();
    } else if (!absl::IsNotFound(tokenizer.status())) {
      return tokenizer.status();
    }
    ODMOE_ASSIGN_OR_RETURN(node->device_, CreateDevice(args.self.device));
    ODMOE_ASSIGN_OR_RETURN(node->weights_, ModelWeights::Load(node->config_, *node->checkpoint_, *node->device_,
                                                              WeightSelection::NonExpertOnly()));
    // An expert's bytes as stored (metadata only: nothing is read).
    const std::vector<int64_t> sparse = node->config_.SparseLayers();
    if (!sparse.empty()) {
      for (const TensorSpec& spec : ExpertTensors(node->config_, sparse[0], 0)) {
        if (const TensorInfo* info = node->checkpoint_->Find(spec.name)) expert_bytes += info->nbytes;
      }
    }
  }

  std::vector<WorkerEndpoint> workers;
  for (const NodeConfig* w : args.cluster.workers()) workers.push_back({w->name, w->address});
  const int32_t group_size =
      args.cluster.group_size > 0 ? args.cluster.group_size : static_cast<int32_t>(node->config_.top_k);
  RemoteExpertOptions ro;
  ro.sender = args.self.name;
  ro.epoch = args.cluster.epoch;
  ro.fingerprint = node->fingerprint_;
  ro.rpc_timeout_ms = args.cluster.rpc_timeout_ms;
  ro.prefill_minibatch_rows = args.cluster.prefill_minibatch_rows;
  ro.max_tokens = options.engine.max_tokens_per_forward;
  ro.max_tensor_bytes_per_call = options.max_tensor_bytes_per_call;
  ro.max_rows_per_call = options.max_rows_per_call;
  auto experts = RemoteExpertExecutor::Create(*node->device_, node->config_, expert_bytes, std::move(workers),
                                              group_size, ro);
  if (!experts.ok()) {
    return absl::Status(experts.status().code(),
                        StrCat(args.cluster.file, ": ", experts.status().message(), " (group size ", group_size,
                               args.cluster.group_size > 0 ? "" : ", the model's top-k", ")"));
  }
  absl::MutexLock lock(&node->request_mu_);
  node->experts_ = std::move(experts).value();
  node->placement_groups_ = node->experts_->placement().num_groups();
  const ShadowSettings& ss = args.cluster.shadow_settings;
  if (ss.mode == PredictionMode::kShadow && args.cluster.shadow() != nullptr) {
    node->shadow_link_ = std::make_unique<ShadowLink>(
        args.cluster.shadow()->address, node->config_,
        ShadowLinkOptions{args.cluster.epoch, node->fingerprint_, args.self.name});
  } else if (ss.mode == PredictionMode::kRandom) {
    std::vector<std::string> addresses;
    for (const NodeConfig* w : args.cluster.workers()) addresses.push_back(w->address);
    rpc::PrefetchSenderOptions po{args.cluster.epoch, node->fingerprint_, args.self.name, args.cluster.rpc_timeout_ms};
    node->random_sender_ = std::make_unique<rpc::PrefetchSender>(addresses, node->experts_->placement(), po);
  }
  ODMOE_ASSIGN_OR_RETURN(node->engine_,
                         Engine::Create(*node->weights_, *node->device_, node->experts_.get(), options.engine));
  return node;
}

MainNode::~MainNode() {
  absl::MutexLock lock(&request_mu_);
  shadow_link_.reset();
  random_sender_.reset();
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
  if (tokenizer_ == nullptr) {
    return absl::FailedPreconditionError(
        StrCat("the model at main (", model_dir_,
               ") has no tokenizer.model (the Qwen and OLMoE families ship "
               "tokenizer.json only): send token ids in prompt_ids (odmoe generate --prompt-ids)"));
  }
  return tokenizer_->EncodeForModel(request.prompt());
}

absl::Status MainNode::RunRequest(const v1::GenerateRequest& request,
                                  const std::function<bool(const v1::GenerateResponse&)>& emit,
                                  const std::function<bool()>& cancelled) {
  // Validate before waiting for the engine: a bad request is answered at once.
  ODMOE_ASSIGN_OR_RETURN(const std::vector<int32_t> prompt, PromptOf(request));
  ODMOE_RETURN_IF_ERROR(ValidateRequest(config_, prompt, request.max_new_tokens()));
  GenerateOptions options;
  options.max_new_tokens = request.max_new_tokens();
  options.sampling.temperature = request.sampling().temperature();
  options.sampling.top_k = request.sampling().top_k();
  options.sampling.top_p = request.sampling().top_p() == 0 ? 1.0 : request.sampling().top_p();
  options.sampling.seed = request.sampling().seed();
  ODMOE_RETURN_IF_ERROR(options.sampling.Validate());
  options.ignore_eos = request.ignore_eos();
  options.keep_last_logits = request.dump_logits();
  options.record_routing = request.dump_routing();

  absl::MutexLock lock(&request_mu_);
  bool client_gone = false;
  const uint64_t request_id = next_request_id_.fetch_add(1);
  experts_->BeginRequest(request_id, [&]() { return client_gone || (cancelled != nullptr && cancelled()); });

  // Expert prediction for the decode steps (positions prompt .. prompt + max_new - 2).
  const ShadowSettings& ss = cluster_.shadow_settings;
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  const std::vector<int64_t> sparse_layers = config_.SparseLayers();
  board_.Reset(static_cast<int64_t>(sparse_layers.size()), config_.top_k);
  if (shadow_link_ != nullptr) {
    experts_->SetPrediction(&board_, prompt_len);
    shadow_link_->Start(request_id, prompt, request.max_new_tokens(), ss, &board_);
  } else if (random_sender_ != nullptr) {
    experts_->SetPrediction(&board_, prompt_len, [&](int64_t position) {
      for (size_t s = 0; s < sparse_layers.size(); ++s) {
        std::vector<int32_t> predicted = RandomExperts(ss.seed, request_id, position, static_cast<int64_t>(s),
                                                       config_.num_experts, config_.top_k);
        random_sender_->Send(request_id, position, sparse_layers[s], static_cast<int64_t>(s), predicted);
        board_.Put(position, static_cast<int64_t>(s), std::move(predicted));
      }
    });
  } else {
    experts_->SetPrediction(&board_, prompt_len);  // no predictions: recall 0, misses recorded
  }
  std::vector<float> kv_k, kv_v;
  int64_t generated = 0;
  std::unique_ptr<IncrementalDecoder> decoder;
  if (tokenizer_ != nullptr) decoder = std::make_unique<IncrementalDecoder>(*tokenizer_, prompt);
  auto on_token = [&](int32_t id) {
    if (client_gone) return;
    v1::GenerateResponse chunk;
    chunk.add_tokens(id);
    chunk.set_has_text(decoder != nullptr);
    if (decoder != nullptr) chunk.set_text(decoder->Push(id));
    if (!emit(chunk)) client_gone = true;
    // Main now decodes the position of this token (unless it was the last one or ends the request): the shadow
    // learns where main is, with the alignment due at this step.
    const int64_t i = generated++;
    const bool is_eos =
        std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(), id) != config_.eos_token_ids.end();
    if (shadow_link_ == nullptr || i + 1 >= request.max_new_tokens() || (is_eos && !request.ignore_eos())) return;
    const bool send_token = ss.align_token > 0 && i % ss.align_token == 0;
    const bool send_kv = ss.align_kv > 0 && i % ss.align_kv == 0;
    if (i == 0 && ss.align_kv > 0 && prompt_len > 1) {
      // KV alignment starts from main's state: the prompt's K/V (but its last position, which the first step
      // carries) goes once, before the first step.
      const size_t row = static_cast<size_t>(config_.num_layers * config_.kv_size());
      std::vector<float> pk(row * static_cast<size_t>(prompt_len - 1)), pv(pk.size());
      if (!engine_->ReadKvRange(0, prompt_len - 1, pk.data(), pv.data()).ok()) return;
      shadow_link_->SendKv(0, prompt_len - 1, pk.data(), pv.data());
    }
    if (send_kv) {
      kv_k.resize(static_cast<size_t>(config_.num_layers * config_.kv_size()));
      kv_v.resize(kv_k.size());
      if (!engine_->ReadKv(prompt_len + i - 1, kv_k.data(), kv_v.data()).ok()) return;
    }
    shadow_link_->Step(prompt_len + i, send_token ? std::optional<int32_t>(id) : std::nullopt,
                       send_kv ? kv_k.data() : nullptr, send_kv ? kv_v.data() : nullptr);
  };
  absl::StatusOr<GenerateResult> result = odmoe::Generate(*engine_, prompt, options, on_token);
  experts_->EndRequest();
  AlignmentCounts alignment;
  if (shadow_link_ != nullptr) {
    // The shadow's predictions for the last positions may still be on their way: they count for recall.
    shadow_link_->Finish(/*wait_ms=*/2000);
    alignment = shadow_link_->counts();
  }
  if (random_sender_ != nullptr) random_sender_->Drain();
  if (!result.ok()) {
    if (client_gone) return absl::CancelledError("the client went away");
    return result.status();
  }
  if (client_gone) return absl::CancelledError("the client went away");

  v1::GenerateResponse last;
  last.set_done(true);
  last.set_has_text(decoder != nullptr);
  if (decoder != nullptr) {
    last.set_text(decoder->Finish());
    last.set_full_text(tokenizer_->Decode(result->tokens));
  }
  last.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
  last.mutable_all_tokens()->Add(result->tokens.begin(), result->tokens.end());
  last.set_stop_reason(result->stop_reason);
  if (options.keep_last_logits) last.mutable_last_logits()->Add(result->last_logits.begin(), result->last_logits.end());
  for (const PositionRouting& position : result->routing) {
    v1::PositionRouting* p = last.add_routing();
    for (const std::vector<int32_t>& layer : position)
      p->add_layers()->mutable_experts()->Add(layer.begin(), layer.end());
  }
  v1::RequestStats* stats = last.mutable_stats();
  stats->set_ttft_ms(result->ttft_ms);
  stats->set_decode_tokens_per_s(result->decode_tokens_per_s);
  stats->set_total_ms(result->total_ms);
  const std::vector<WorkerCallStats>& per_worker = experts_->stats();
  for (size_t i = 0; i < per_worker.size(); ++i) {
    const WorkerCallStats& w = per_worker[i];
    v1::WorkerRequestStats* ws = stats->add_workers();
    ws->set_node(experts_->workers()[i].name);
    ws->set_experts_computed(w.experts_computed);
    ws->set_rows_computed(w.rows_computed);
    ws->set_calls(w.calls);
    ws->set_bytes_loaded(w.bytes_loaded);
    ws->set_loads_on_demand(w.loads_on_demand);
    ws->set_on_demand_load_ms(w.on_demand_load_ms);
    ws->set_compute_ms(w.compute_ms);
    ws->set_busy_retries(w.busy_retries);
    ws->set_peak_calls_in_flight(w.peak_calls_in_flight);
    ws->set_gpu_peak_bytes(w.gpu_peak_bytes);
    stats->set_bytes_loaded(stats->bytes_loaded() + w.bytes_loaded);
    stats->set_loads_on_demand(stats->loads_on_demand() + w.loads_on_demand);
    stats->set_on_demand_load_ms(stats->on_demand_load_ms() + w.on_demand_load_ms);
  }
  stats->set_expert_tensors_opened(static_cast<uint64_t>(expert_tensors_opened()));
  const RecallSummary recall = board_.Summarize();
  stats->set_prediction(std::string(PredictionModeName(ss.mode)));
  stats->set_recall(recall.recall);
  stats->set_timely_recall(recall.timely_recall);
  stats->mutable_recall_per_token()->Add(recall.recall_per_token.begin(), recall.recall_per_token.end());
  stats->set_predictions_received(recall.predictions_received);
  stats->set_predictions_missing(recall.predictions_missing);
  stats->set_shadow_lead_layers(recall.lead_layers_mean);
  stats->set_tokens_aligned(alignment.tokens);
  stats->set_kv_aligned(alignment.kv);
  stats->set_alignment_bytes(alignment.bytes);
  const DecodeTiming& timing = experts_->timing();
  const int32_t groups = experts_->placement().num_groups();
  stats->set_t_m_ms(timing.t_m_ms());
  stats->set_t_w_ms(timing.t_w_ms());
  stats->set_expert_load_ms(timing.load_ms_per_expert());
  stats->set_t_maxload_ms(timing.t_maxload_ms(groups));
  stats->set_io_bound(timing.loads > 0 && timing.load_ms_per_expert() > timing.t_maxload_ms(groups));
  stats->set_groups(groups);
  stats->set_stall_ms(recall.stall_ms);
  stats->set_decode_loads_on_demand(recall.loads_on_demand);
  stats->mutable_stall_ms_per_layer()->Add(recall.stall_ms_per_layer.begin(), recall.stall_ms_per_layer.end());
  {
    absl::MutexLock stats_lock(&stats_mu_);
    ++counters_.requests;
    counters_.decode_layers += recall.decode_layers;
    counters_.correct += recall.correct;
    counters_.timely += recall.timely;
    counters_.predictions_missing += recall.predictions_missing;
    counters_.loads_on_demand += recall.loads_on_demand;
    counters_.stall_ms += recall.stall_ms;
    counters_.tokens_aligned += alignment.tokens;
    counters_.kv_aligned += alignment.kv;
    counters_.alignment_bytes += alignment.bytes;
    DecodeTiming& t = counters_.timing;
    t.main_ms += timing.main_ms;
    t.worker_ms += timing.worker_ms;
    t.load_ms += timing.load_ms;
    t.main_layers += timing.main_layers;
    t.worker_layers += timing.worker_layers;
    t.loads += timing.loads;
  }
  const size_t fed = result->tokens.empty() ? 0 : result->tokens.size() - 1;  // the last token is never fed back
  stats->set_positions(prompt.size() + fed);
  if (!emit(last)) return absl::CancelledError("the client went away");
  return absl::OkStatus();
}

grpc::Status MainNode::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const absl::Status status = RunRequest(
      *request, [writer](const v1::GenerateResponse& r) { return writer->Write(r); },
      [context]() { return context->IsCancelled(); });
  if (!status.ok()) {
    spdlog::warn("request from {} failed: {}", context->peer(), std::string(status.ToString()));
  }
  return rpc::ToGrpc(status);
}

v1::MainStats MainNode::Stats(bool reset) {
  v1::MainStats s;
  s.set_node(self_.name);
  s.set_prediction(std::string(PredictionModeName(cluster_.shadow_settings.mode)));
  rpc::FillDeviceMemory(*device_, device_->memory_info().capacity, s.mutable_memory());
  absl::MutexLock lock(&stats_mu_);
  const Counters& c = counters_;
  s.set_requests(c.requests);
  s.set_decode_layers(c.decode_layers);
  s.set_correct(c.correct);
  s.set_timely(c.timely);
  const double denominator = static_cast<double>(c.decode_layers) * static_cast<double>(std::max<int64_t>(1, config_.top_k));
  s.set_recall(c.decode_layers > 0 ? static_cast<double>(c.correct) / denominator : 0.0);
  s.set_timely_recall(c.decode_layers > 0 ? static_cast<double>(c.timely) / denominator : 0.0);
  s.set_predictions_missing(c.predictions_missing);
  s.set_loads_on_demand(c.loads_on_demand);
  s.set_stall_ms(c.stall_ms);
  s.set_tokens_aligned(c.tokens_aligned);
  s.set_kv_aligned(c.kv_aligned);
  s.set_alignment_bytes(c.alignment_bytes);
  const int32_t groups = placement_groups_;
  s.set_t_m_ms(c.timing.t_m_ms());
  s.set_t_w_ms(c.timing.t_w_ms());
  s.set_expert_load_ms(c.timing.load_ms_per_expert());
  s.set_t_maxload_ms(c.timing.t_maxload_ms(groups));
  s.set_io_bound(c.timing.loads > 0 && c.timing.load_ms_per_expert() > c.timing.t_maxload_ms(groups));
  if (reset) counters_ = Counters{};
  return s;
}

grpc::Status MainNode::GetStats(grpc::ServerContext*, const v1::StatsRequest* request, v1::MainStats* response) {
  *response = Stats(request->reset());
  return grpc::Status::OK;
}

grpc::Status MainNode::GetMembership(grpc::ServerContext*, const v1::MembershipRequest*, v1::Membership* response) {
  rpc::FillMembership(cluster_, self_.name, fingerprint_, response);
  return grpc::Status::OK;
}

}  // namespace odmoe
