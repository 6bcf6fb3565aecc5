// Main's side of the shadow's Follow stream (shadow.proto) for one request: it sends the prompt, then a step
// per decode position (with the batch step that decodes it) and the alignment due at that step (the token every T_tok
// steps, the K/V of the last decoded position every T_kv steps), and a reader thread files the shadow's predictions
// into the request's PredictionBoard.
//
// The shadow is an optimisation, never a dependency: if the stream cannot be opened or breaks, main logs it
// once and goes on without predictions (workers then load after routing); tokens never depend on it. Each
// request opens a new stream, so a restarted shadow is followed again from the next request on (logged).
//
// Thread safety: Start, Step and Finish are called by one thread at a time (main's batch loop, then the
// request's thread once the loop is done with it); the reader thread
// only touches the board (thread-safe) and its own state; the PeerHealth listener only cancels the stream's
// context (under context_mu_).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "odmoe/v1/shadow.grpc.pb.h"
#include "src/common/cluster_config.h"
#include "src/main_node/membership.h"
#include "src/main_node/peer_health.h"
#include "src/main_node/prediction.h"
#include "src/model/model_config.h"

namespace odmoe {

struct ShadowLinkOptions {
  uint64_t epoch = 1;
  std::string fingerprint;
  std::string sender = "main";
  // Main's membership of the workers (nullable): its view goes with FollowStart and every FollowStep, so the
  // shadow places its prefetches where main will look for the experts. Must outlive the link.
  const Membership* membership = nullptr;
  // Main's verdict on its peers and the shadow's index among them (nullable): a request starts without the
  // shadow while it is down, and the stream of the request in flight is cancelled when it goes down (a hung
  // shadow would otherwise stall main's writes once the stream's flow-control window is full). Must outlive
  // the link.
  PeerHealth* health = nullptr;
  int32_t health_peer = -1;
  // Main's batch stream: the request id its expert calls carry (FollowStep.batch_id).
  uint64_t batch_id = 0;
  // Emulation: K/V padded to this many times its bytes (PayloadScale::kv, src/backend/device_factory.h; 1: none).
  double kv_payload_scale = 1.0;
  // Shared by the links of one main: whether the shadow's loss has been logged (once, and its return once).
  std::shared_ptr<std::atomic<bool>> warned = std::make_shared<std::atomic<bool>>(false);
};

struct AlignmentCounts {
  uint64_t tokens = 0;            // token alignments sent
  uint64_t kv = 0;                // KV alignments sent
  uint64_t bytes = 0;             // K/V bytes sent
  uint64_t prompt_positions = 0;  // prompt positions whose K/V was sent (once, before the first step)
};

class ShadowLink {
 public:
  // `channel`: to the shadow (shared by the links of the requests running at once).
  ShadowLink(std::shared_ptr<grpc::Channel> channel, const ModelConfig& config, ShadowLinkOptions options);
  ~ShadowLink();
  ShadowLink(const ShadowLink&) = delete;
  ShadowLink& operator=(const ShadowLink&) = delete;

  // Opens the stream for request `request_id` (with `trace_id`, the client's request id, as x-request-id
  // metadata) and sends FollowStart. Predictions go to `board` (which must outlive Finish). Returns false (and
  // logs why) when the shadow cannot be reached: the request goes on without.
  bool Start(uint64_t request_id, const std::string& trace_id, std::span<const int32_t> prompt, int64_t max_new_tokens,
             const ShadowSettings& settings, PredictionBoard* board);
  // Main starts decoding `position`, in its decode step `batch_step` (FollowStep): sends the step with `token`
  // (token alignment) and `k`/`v` ([num_layers, kv_size] of position - 1; both null for none). No-op when the
  // stream is not open.
  void Step(int64_t position, int64_t batch_step, std::optional<int32_t> token, const float* k, const float* v);
  // KV alignment of positions [first, first + count): rows of [count, num_layers, kv_size] each, sent in
  // messages of at most ~4 MiB. No-op when the stream is not open.
  void SendKv(int64_t first, int64_t count, const float* k, const float* v);
  // Closes main's side and waits up to `wait_ms` for the shadow's remaining predictions, then ends the stream.
  void Finish(int64_t wait_ms);

  bool active() const { return stream_ != nullptr && !broken_; }
  const AlignmentCounts& counts() const { return counts_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Shadow::Stub> stub_;
  const ModelConfig& config_;
  const ShadowLinkOptions options_;

  int64_t health_subscription_ = 0;
  absl::Mutex context_mu_;  // context_ as the PeerHealth listener sees it
  std::unique_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(context_mu_);
  std::unique_ptr<grpc::ClientReaderWriter<v1::FollowMessage, v1::Prediction>> stream_;
  std::unique_ptr<absl::Notification> reader_done_;
  std::thread reader_;
  bool broken_ = false;
  AlignmentCounts counts_;
};

}  // namespace odmoe
