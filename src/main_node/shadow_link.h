// Main's side of the shadow's Follow stream (shadow.proto) for one request: it sends the prompt, then a step
// per decode position (with the batch step that decodes it) and the alignment due at that step (the token every T_tok
// steps, the K/V of the last decoded position every T_kv steps; both at every step while the shadow is
// catch_up_lag behind: AlignmentDue), and a reader thread files the shadow's predictions into the request's
// PredictionBoard.
//
// The shadow is an optimisation, never a dependency: if the stream cannot be opened or breaks, main logs it
// once and goes on without predictions (workers then load after routing); tokens never depend on it. Each
// request opens a new stream, so a restarted shadow is followed again from the next request on (logged).
// Main's batch loop never waits on the shadow's link: a writer thread opens the stream and sends what Start,
// Step and SendKv queue, in order. The queue's K/V is bounded (max_pending_kv_bytes): while the link is behind
// by that much, K/V alignment pauses (RoomForKv; counted, logged once per request) and only the steps, a few
// bytes each and one per decode position, are queued; a request that ends then drops the K/V still queued.
//
// Thread safety: Start, Step, SendKv, RoomForKv and Finish are called by one thread at a time (main's batch
// loop, then the request's thread once the loop is done with it); the writer thread owns the stream's writes,
// the reader thread its reads and the board (thread-safe); the PeerHealth listener only cancels the stream's
// context. Shared state is under mu_.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "odmoe/v1/shadow.grpc.pb.h"
#include "src/common/cluster_config.h"
#include "src/engine/generator.h"
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
  // K/V queued for the shadow and not yet written, beyond which K/V alignment pauses (RoomForKv). One item may
  // take it past the bound (a long prompt's K/V goes whole when the queue holds none).
  int64_t max_pending_kv_bytes = int64_t{16} << 20;
  // Shared by the links of one main: whether the shadow's loss has been logged (once, and its return once).
  std::shared_ptr<std::atomic<bool>> warned = std::make_shared<std::atomic<bool>>(false);
};

// What main's step of one position (FollowStep) carries: main's token at the position, and the K/V of the one
// before it.
struct StepAlignment {
  bool token = false;
  bool kv = false;
};

struct AlignmentCounts {
  uint64_t tokens = 0;            // token alignments sent
  uint64_t kv = 0;                // KV alignments sent
  uint64_t bytes = 0;             // K/V bytes sent
  uint64_t prompt_positions = 0;  // prompt positions whose K/V was sent (once, before the first step)
  uint64_t kv_skipped = 0;        // KV alignments due but not sent: the link was behind (RoomForKv)
};

class ShadowLink {
 public:
  // `channel`: to the shadow (shared by the links of the requests running at once).
  ShadowLink(std::shared_ptr<grpc::Channel> channel, const ModelConfig& config, ShadowLinkOptions options);
  ~ShadowLink();
  ShadowLink(const ShadowLink&) = delete;
  ShadowLink& operator=(const ShadowLink&) = delete;

  // Queues FollowStart for request `request_id` (with `trace_id`, the client's request id, as x-request-id
  // metadata) and starts the writer, which opens the stream and starts the reader. The start carries the request's
  // max_new_tokens and how main picks its tokens (`options`' pick rule, which the shadow's guesses replay).
  // Predictions go to `board` (which must outlive Finish). Returns false, and the request goes on without
  // predictions, when PeerHealth has the shadow down; a shadow that cannot be reached shows later, as a link no
  // longer active (logged).
  bool Start(uint64_t request_id, const std::string& trace_id, std::span<const int32_t> prompt,
             const GenerateOptions& options, const ShadowSettings& settings, PredictionBoard* board);
  // Main starts decoding `position`, in its decode step `batch_step` (FollowStep): queues the step with `token`
  // (token alignment) and `k`/`v` ([num_layers, kv_size] of position - 1, copied; both null for none). No-op
  // when the link is not active.
  void Step(int64_t position, int64_t batch_step, std::optional<int32_t> token, const float* k, const float* v);
  // The alignment due with main's step at `position`, the (position - prompt length)-th of the request started
  // last: the token every align_token steps and the K/V every align_kv steps (0: never). With catch_up_lag > 0,
  // both at every step while the shadow is catch_up_lag or more positions behind `position` (as far as its
  // predictions show): it then takes main's token and K/V for the positions main has left behind instead of
  // running them (ShadowNode's catch-up), whatever the periods. Main reads the K/V only where it is due.
  StepAlignment AlignmentDue(int64_t position) const;
  // The latest position the shadow has sent a prediction for (prompt length - 1 before its first).
  int64_t shadow_position() const { return shadow_position_.load(std::memory_order_relaxed); }
  // KV alignment of positions [first, first + count): rows of [count, num_layers, kv_size] each, queued whole and
  // sent by the writer in messages of at most ~4 MiB. No-op when the link is not active.
  void SendKv(int64_t first, int64_t count, std::vector<float> k, std::vector<float> v);
  // Whether K/V alignment due now should be read and sent: false while the link is not active or the K/V queued
  // is at max_pending_kv_bytes or more (then counted in kv_skipped, and logged once: the shadow aligns less,
  // main never waits on it).
  bool RoomForKv();
  // Closes main's side once what is queued has gone out, and waits, up to `wait_ms` in all, for that and the
  // shadow's remaining predictions; then cancels the stream (predictions not yet received count as missing) and
  // ends it. A link at max_pending_kv_bytes drops the K/V still queued first (main has decoded every position:
  // it can no longer help), so that the request's answer does not wait for it; the steps still go.
  void Finish(int64_t wait_ms);

  // The link is started and its stream has not broken.
  bool active() const;
  // What went out (copied under the lock; final once Finish returns).
  AlignmentCounts counts() const;
  // K/V queued and not yet written.
  int64_t pending_kv_bytes() const;

 private:
  // What the writer sends: a message encoded by its sender, or (count > 0) K/V of positions [first, first +
  // count), encoded by the writer in messages of at most ~4 MiB.
  struct Outgoing {
    v1::FollowMessage message;
    int64_t first = 0, count = 0;
    std::vector<float> k, v;
    int64_t kv_bytes = 0;  // towards max_pending_kv_bytes
  };

  void Queue(Outgoing item);
  // The writer thread: opens the stream, starts the reader, sends the queue in order, then closes main's side;
  // on a failed write it marks the link broken and stops.
  void WriteLoop(PredictionBoard* board, int64_t prompt_len, int64_t last);
  // The reader thread: files the shadow's predictions for positions [prompt_len, last] into `board`.
  void ReadLoop(PredictionBoard* board, int64_t prompt_len, int64_t last);
  // Writes `item`; false when the stream broke.
  bool Write(const Outgoing& item);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Shadow::Stub> stub_;
  const ModelConfig& config_;
  const ShadowLinkOptions options_;
  int64_t health_subscription_ = 0;

  mutable absl::Mutex mu_;
  std::unique_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(mu_);  // set by Start, reset by Finish
  std::deque<Outgoing> queue_ ABSL_GUARDED_BY(mu_);
  int64_t pending_kv_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // Finish: no more items; the writer closes once the queue is sent
  bool broken_ ABSL_GUARDED_BY(mu_) = false;   // a write failed (set by the writer): nothing more goes out
  bool kv_dropped_ ABSL_GUARDED_BY(mu_) = false;  // Finish dropped the K/V queued (the link was behind)
  bool skip_logged_ ABSL_GUARDED_BY(mu_) = false;
  AlignmentCounts counts_ ABSL_GUARDED_BY(mu_);

  // Created by the writer before it starts the reader; read by the reader and, after joining the writer, Finish.
  std::unique_ptr<grpc::ClientReaderWriter<v1::FollowMessage, v1::Prediction>> stream_;
  std::unique_ptr<absl::Notification> reader_done_;  // the stream ended
  std::string trace_id_;  // the request's: set by Start before it starts the writer, read by the link's threads
  // The request's, set by Start (read by the caller's thread only).
  ShadowSettings settings_;
  int64_t prompt_len_ = 0;
  std::atomic<int64_t> shadow_position_{-1};  // written by the reader (Start before it starts)
  std::thread writer_;
  std::thread reader_;  // started by the writer
};

}  // namespace odmoe
