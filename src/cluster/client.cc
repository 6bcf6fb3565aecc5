#include "src/cluster/client.h"

#include <optional>

#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/logprobs_proto.h"
#include "src/rpc/request_id.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {

absl::StatusOr<RemoteResult> GenerateRemote(const std::string& endpoint, const v1::GenerateRequest& request,
                                            int64_t timeout_ms,
                                            std::function<void(const v1::GenerateResponse&)> on_chunk,
                                            const std::string& request_id) {
  if (timeout_ms < 1) return absl::InvalidArgumentError(StrCat("timeout must be positive, got ", timeout_ms, " ms"));
  if (!request_id.empty()) ODMOE_RETURN_IF_ERROR(rpc::ValidateRequestId(request_id));
  std::unique_ptr<v1::Inference::Stub> stub = v1::Inference::NewStub(rpc::MakeChannel(endpoint));
  grpc::ClientContext ctx;
  rpc::SetDeadline(ctx, timeout_ms);
  rpc::AttachRequestId(ctx, request_id);
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(&ctx, request);
  v1::GenerateResponse message;
  std::optional<v1::GenerateResponse> last;
  std::vector<PositionLogprobs> logprobs, prompt_logprobs;
  while (reader->Read(&message)) {
    if (on_chunk) on_chunk(message);
    for (const v1::PositionLogprobs& p : message.logprobs()) logprobs.push_back(rpc::LogprobsFromProto(p));
    for (const v1::PositionLogprobs& p : message.prompt_logprobs()) {
      prompt_logprobs.push_back(rpc::LogprobsFromProto(p));
    }
    if (message.done()) last = message;
  }
  const grpc::Status status = reader->Finish();
  // Main answers with the id it logged the request under (initial metadata, sent even with an error status).
  std::string answered_id;
  const auto& metadata = ctx.GetServerInitialMetadata();
  if (auto it = metadata.find(rpc::kRequestIdKey); it != metadata.end()) {
    answered_id.assign(it->second.data(), it->second.size());
  }
  const std::string where = answered_id.empty() ? StrCat("main at ", endpoint)
                                                : StrCat("main at ", endpoint, " (request_id ", answered_id, ")");
  if (!status.ok()) return rpc::FromGrpc(status, where);
  if (!last.has_value()) {
    return absl::DataLossError(StrCat(where, ": the response stream ended without its final message"));
  }
  RemoteResult r;
  r.request_id = answered_id;
  r.prompt_ids.assign(last->prompt_ids().begin(), last->prompt_ids().end());
  r.tokens.assign(last->all_tokens().begin(), last->all_tokens().end());
  r.has_text = last->has_text();
  r.text = last->full_text();
  r.stop_reason = last->stop_reason();
  r.last_logits.assign(last->last_logits().begin(), last->last_logits().end());
  for (const v1::PositionRouting& p : last->routing()) {
    std::vector<std::vector<int32_t>>& position = r.routing.emplace_back();
    for (const v1::LayerRouting& l : p.layers()) position.emplace_back(l.experts().begin(), l.experts().end());
  }
  r.stats = last->stats();
  r.logprobs = std::move(logprobs);
  r.prompt_logprobs = std::move(prompt_logprobs);
  return r;
}

}  // namespace odmoe
