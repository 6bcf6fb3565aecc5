#include "src/main_node/main_node.h"

#include <algorithm>
#include <utility>

#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/fingerprint.h"

namespace odmoe {

void FillMembership(const ClusterConfig& cluster, const std::string& self, const std::string& fingerprint,
                    v1::Membership* out) {
  out->set_epoch(cluster.epoch);
  out->set_model_fingerprint(fingerprint);
  out->set_self(self);
  for (const NodeConfig& n : cluster.nodes) {
    v1::NodeInfo* info = out->add_nodes();
    info->set_name(n.name);
    info->set_role(std::string(NodeRoleName(n.role)));
    info->set_address(n.address);
    info->set_device(n.device);
    info->set_gpu_budget_bytes(n.gpu_budget_bytes);
  }
}

absl::StatusOr<std::unique_ptr<MainNode>> MainNode::Create(const rpc::DaemonArgs& args, MainNodeOptions options) {
  std::unique_ptr<MainNode> node(new MainNode());
  node->cluster_ = args.cluster;
  node->self_ = args.self;
  node->model_dir_ = args.model_dir;
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

  std::vector<WorkerEndpoint> workers;
  for (const NodeConfig* w : args.cluster.workers()) workers.push_back({w->name, w->address});
  const int32_t group_size =
      args.cluster.group_size > 0 ? args.cluster.group_size : static_cast<int32_t>(node->config_.top_k);
  RemoteExpertOptions ro;
  ro.sender = args.self.name;
  ro.epoch = args.cluster.epoch;
  ro.fingerprint = node->fingerprint_;
  ro.rpc_timeout_ms = args.cluster.rpc_timeout_ms;
  ro.max_tokens = options.engine.max_tokens_per_forward;
  ro.max_tensor_bytes_per_call = options.max_tensor_bytes_per_call;
  ro.max_rows_per_call = options.max_rows_per_call;
  auto experts = RemoteExpertExecutor::Create(*node->device_, node->config_, *node->checkpoint_, std::move(workers),
                                              group_size, ro);
  if (!experts.ok()) {
    return absl::Status(experts.status().code(),
                        StrCat(args.cluster.file, ": ", experts.status().message(), " (group size ", group_size,
                               args.cluster.group_size > 0 ? "" : ", the model's top-k", ")"));
  }
  absl::MutexLock lock(&node->request_mu_);
  node->experts_ = std::move(experts).value();
  ODMOE_ASSIGN_OR_RETURN(node->engine_,
                         Engine::Create(*node->weights_, *node->device_, node->experts_.get(), options.engine));
  return node;
}

MainNode::~MainNode() {
  absl::MutexLock lock(&request_mu_);
  engine_.reset();
  experts_.reset();
}

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
  experts_->BeginRequest(next_request_id_.fetch_add(1),
                         [&]() { return client_gone || (cancelled != nullptr && cancelled()); });
  std::unique_ptr<IncrementalDecoder> decoder;
  if (tokenizer_ != nullptr) decoder = std::make_unique<IncrementalDecoder>(*tokenizer_, prompt);
  auto on_token = [&](int32_t id) {
    if (client_gone) return;
    v1::GenerateResponse chunk;
    chunk.add_tokens(id);
    chunk.set_has_text(decoder != nullptr);
    if (decoder != nullptr) chunk.set_text(decoder->Push(id));
    if (!emit(chunk)) client_gone = true;
  };
  absl::StatusOr<GenerateResult> result = odmoe::Generate(*engine_, prompt, options, on_token);
  experts_->EndRequest();
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
    stats->set_bytes_loaded(stats->bytes_loaded() + w.bytes_loaded);
    stats->set_loads_on_demand(stats->loads_on_demand() + w.loads_on_demand);
    stats->set_on_demand_load_ms(stats->on_demand_load_ms() + w.on_demand_load_ms);
  }
  stats->set_expert_tensors_opened(static_cast<uint64_t>(checkpoint_->ExpertTensorsRead()));
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

grpc::Status MainNode::GetMembership(grpc::ServerContext*, const v1::MembershipRequest*, v1::Membership* response) {
  FillMembership(cluster_, self_.name, fingerprint_, response);
  return grpc::Status::OK;
}

}  // namespace odmoe
