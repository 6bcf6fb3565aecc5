// The client side of the cluster's API: one Generate request to a main node, streamed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "odmoe/v1/main.grpc.pb.h"
#include "src/engine/logprobs.h"

namespace odmoe {

// The final message of a Generate stream, unpacked.
struct RemoteResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> tokens;     // every generated id (an EOS that stopped generation included)
  bool has_text = false;           // main has a tokenizer: `text` is meaningful
  std::string text;                // the generated text, decoded as a whole
  std::string stop_reason;         // "eos", "stop_token" or "length"
  std::vector<float> last_logits;  // when the request set dump_logits
  // When the request set dump_routing: [position][sparse layer][k], best first.
  std::vector<std::vector<std::vector<int32_t>>> routing;
  // When the request set logprobs: one per generated token, gathered from the stream's messages.
  std::vector<PositionLogprobs> logprobs;
  // When the request set prompt_logprobs: one per prompt token after the first.
  std::vector<PositionLogprobs> prompt_logprobs;
  v1::RequestStats stats;
  std::string request_id;  // the id main logged the request under (its x-request-id response metadata)
};

// Sends `request` to the main node at `endpoint` (host:port) with a deadline of `timeout_ms` for the whole
// request and calls `on_chunk` (optional) with every message as it arrives, the final one (done = true)
// included. `request_id` (optional) is sent as x-request-id metadata: main logs the request under it (else main
// makes one); InvalidArgument, before anything is sent, when it is not a valid id (rpc::ValidateRequestId).
// Errors carry main's status code with the endpoint and the request id in the message (Unavailable when main
// cannot be reached or a worker is down, DeadlineExceeded past the deadline, InvalidArgument / OutOfRange /
// FailedPrecondition for a bad request); DataLoss when the stream ends without its final message.
absl::StatusOr<RemoteResult> GenerateRemote(const std::string& endpoint, const v1::GenerateRequest& request,
                                            int64_t timeout_ms,
                                            std::function<void(const v1::GenerateResponse&)> on_chunk = nullptr,
                                            const std::string& request_id = "");

}  // namespace odmoe
