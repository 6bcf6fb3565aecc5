#include "src/main_node/shadow_link.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/common/logging.h"
#include "src/engine/generator.h"
#include "src/rpc/request_id.h"
#include "src/rpc/rpc_util.h"
#include "src/rpc/sampling_proto.h"

namespace odmoe {

ShadowLink::ShadowLink(std::shared_ptr<grpc::Channel> channel, const ModelConfig& config, ShadowLinkOptions options)
    : channel_(std::move(channel)),
      stub_(v1::Shadow::NewStub(channel_)),
      config_(config),
      options_(std::move(options)) {
  if (options_.health != nullptr) {
    health_subscription_ = options_.health->Subscribe([this](const PeerEvent& e) {
      if (e.peer != options_.health_peer || e.to != PeerState::kDown) return;
      absl::MutexLock lock(&mu_);
      if (context_ != nullptr) context_->TryCancel();  // unblocks a write stuck on a hung shadow
    });
  }
}

ShadowLink::~ShadowLink() {
  if (health_subscription_ != 0) options_.health->Unsubscribe(health_subscription_);
  Finish(0);
}

bool ShadowLink::Start(uint64_t request_id, const std::string& trace_id, std::span<const int32_t> prompt,
                       const GenerateOptions& options, const ShadowSettings& settings, PredictionBoard* board) {
  const int64_t max_new_tokens = options.max_new_tokens;
  Finish(0);  // a stream left open by a failed request
  if (options_.health != nullptr && options_.health->state(options_.health_peer) == PeerState::kDown) {
    if (!options_.warned->exchange(true)) {
      spdlog::warn("the shadow is down: decoding without predictions (experts load on demand)");
    }
    return false;  // no stream: Step, SendKv and Finish do nothing
  }
  Outgoing start_item;
  v1::FollowStart* start = start_item.message.mutable_start();
  if (options_.membership != nullptr) {
    const MembershipView view = options_.membership->Current().view;
    rpc::FillHeader(start->mutable_header(), options_.epoch, options_.fingerprint, options_.sender, request_id, &view);
  } else {
    rpc::FillHeader(start->mutable_header(), options_.epoch, options_.fingerprint, options_.sender, request_id);
  }
  start->mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
  start->set_max_new_tokens(max_new_tokens);
  rpc::PickRuleToProto(options, start->mutable_pick());
  start->set_align_token(settings.align_token);
  start->set_align_kv(settings.align_kv);
  start->set_max_lead_tokens(settings.max_lead_tokens);
  {
    absl::MutexLock lock(&mu_);
    context_ = std::make_unique<grpc::ClientContext>();
    rpc::AttachRequestId(*context_, trace_id);
    started_ = true;
    closing_ = false;
    kv_dropped_ = false;
    broken_ = false;
    skip_logged_ = false;
    counts_ = AlignmentCounts{};
    queue_.push_back(std::move(start_item));
  }
  trace_id_ = trace_id;
  reader_done_ = std::make_unique<absl::Notification>();
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  settings_ = settings;
  prompt_len_ = prompt_len;
  shadow_position_.store(prompt_len - 1, std::memory_order_relaxed);
  writer_ =
      std::thread(&ShadowLink::WriteLoop, this, board, prompt_len, LastDecodePosition(prompt_len, max_new_tokens));
  return true;
}

void ShadowLink::WriteLoop(PredictionBoard* board, int64_t prompt_len, int64_t last) {
  logging::ScopedRequestId scope(trace_id_);  // its warnings are about this request
  grpc::ClientContext* context = nullptr;
  {
    absl::MutexLock lock(&mu_);
    context = context_.get();  // stays until Finish, which joins this thread first
  }
  stream_ = stub_->Follow(context);
  reader_ = std::thread([this, board, prompt_len, last]() {
    logging::ScopedRequestId reader_scope(trace_id_);
    ReadLoop(board, prompt_len, last);
  });
  bool first = true;
  for (;;) {
    Outgoing item;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || closing_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) break;  // closing, with everything sent
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!Write(item)) {
      bool closing = false;
      {
        absl::MutexLock lock(&mu_);
        broken_ = true;  // nothing more goes out
        queue_.clear();
        pending_kv_bytes_ = 0;
        closing = closing_;
      }
      // While closing, Finish cancelled a late link (or the shadow ended the stream, which Finish logs).
      if (!closing && !options_.warned->exchange(true)) {
        spdlog::warn(first ? "the shadow is unreachable: decoding without predictions (experts load on demand)"
                           : "the shadow's stream broke: decoding on without predictions");
      }
      return;
    }
    if (first && options_.warned->exchange(false)) spdlog::info("the shadow is following requests again");
    first = false;
    absl::MutexLock lock(&mu_);
    if (!kv_dropped_) pending_kv_bytes_ -= item.kv_bytes;  // (else Finish zeroed it)
  }
  stream_->WritesDone();
}

void ShadowLink::ReadLoop(PredictionBoard* board, int64_t prompt_len, int64_t last) {
  v1::Prediction p;
  const int64_t k = config_.top_k;
  while (stream_->Read(&p)) {
    if (p.summary()) {  // the stream's last message: the workers' hedged loads for this request
      board->SetHedgeLoads(p.hedge_loads());
      continue;
    }
    // A malformed prediction is dropped (counted as missing), never trusted for placement.
    const int64_t sparse_index = config_.SparseIndex(p.layer());
    bool ok = p.layer() >= 0 && p.layer() < config_.num_layers && sparse_index >= 0 && p.position() >= prompt_len &&
              p.position() <= last && p.experts_size() == k;
    std::vector<int32_t> experts(p.experts().begin(), p.experts().end());
    for (int32_t e : experts) ok = ok && e >= 0 && e < config_.num_experts;
    std::vector<int32_t> hedges(p.hedges().begin(), p.hedges().end());
    for (int32_t e : hedges) ok = ok && e >= 0 && e < config_.num_experts;
    std::vector<int32_t> sorted = experts;
    sorted.insert(sorted.end(), hedges.begin(), hedges.end());  // hedges are disjoint from the top-k
    std::sort(sorted.begin(), sorted.end());
    ok = ok && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
    if (!ok) {
      spdlog::warn("dropping a malformed prediction from the shadow (position {}, layer {}, {} experts)", p.position(),
                   p.layer(), p.experts_size());
      continue;
    }
    board->Put(p.position(), sparse_index, std::move(experts), std::move(hedges));
    if (p.position() > shadow_position_.load(std::memory_order_relaxed)) {
      shadow_position_.store(p.position(), std::memory_order_relaxed);  // the one writer
    }
  }
  reader_done_->Notify();
}

StepAlignment ShadowLink::AlignmentDue(int64_t position) const {
  const int64_t i = position - prompt_len_;
  // The shadow runs the position after the last it predicted for next (ShadowNode: far behind when
  // main's position - its next >= catch_up_lag).
  if (settings_.catch_up_lag > 0 && position - (shadow_position() + 1) >= settings_.catch_up_lag) return {true, true};
  return {settings_.align_token > 0 && i % settings_.align_token == 0,
          settings_.align_kv > 0 && i % settings_.align_kv == 0};
}

bool ShadowLink::Write(const Outgoing& item) {
  if (item.count == 0) {
    if (!stream_->Write(item.message)) return false;
    if (item.message.has_step()) {
      const v1::FollowStep& step = item.message.step();
      absl::MutexLock lock(&mu_);
      counts_.tokens += step.has_token() ? 1 : 0;
      if (step.has_k()) {
        counts_.kv += 1;
        counts_.bytes += static_cast<uint64_t>(step.k().data().size() + step.v().data().size());
      }
    }
    return true;
  }
  const int64_t row = config_.num_layers * config_.kv_size();
  // At most 4 MiB of K/V per message, counted at the padded size under emulation.
  const double padded_row_bytes = 2.0 * static_cast<double>(row) * 4.0 * std::max(1.0, options_.kv_payload_scale);
  const int64_t per_message = std::max<int64_t>(1, static_cast<int64_t>((4 << 20) / padded_row_bytes));
  for (int64_t at = 0; at < item.count; at += per_message) {
    const int64_t n = std::min(per_message, item.count - at);
    v1::FollowMessage msg;
    v1::FollowKv* kv = msg.mutable_kv();
    kv->set_first_position(item.first + at);
    const int64_t shape[] = {n, config_.num_layers, config_.kv_size()};
    const size_t offset = static_cast<size_t>(at * row), size = static_cast<size_t>(n * row);
    rpc::EncodeF32(std::span<const float>(item.k).subspan(offset, size), shape, kv->mutable_k());
    rpc::EncodeF32(std::span<const float>(item.v).subspan(offset, size), shape, kv->mutable_v());
    const size_t bytes = kv->k().data().size() + kv->v().data().size();
    kv->mutable_padding()->resize(PayloadScale::Padding(bytes, options_.kv_payload_scale, rpc::RoomAfter(bytes)));
    if (!stream_->Write(msg)) return false;
    absl::MutexLock lock(&mu_);
    counts_.bytes += static_cast<uint64_t>(bytes);
    counts_.prompt_positions += static_cast<uint64_t>(n);
    if (kv_dropped_) break;  // the rest goes with the K/V Finish dropped
  }
  return true;
}

void ShadowLink::Queue(Outgoing item) {
  absl::MutexLock lock(&mu_);
  if (!started_ || broken_ || closing_) return;
  pending_kv_bytes_ += item.kv_bytes;
  queue_.push_back(std::move(item));
}

void ShadowLink::Step(int64_t position, int64_t batch_step, std::optional<int32_t> token, const float* k,
                      const float* v) {
  Outgoing item;  // (Queue drops it when the link is not active)
  v1::FollowStep* step = item.message.mutable_step();
  step->set_position(position);
  step->set_batch_id(options_.batch_id);
  step->set_batch_step(batch_step);
  if (options_.membership != nullptr) rpc::ToProto(options_.membership->Current().view, step->mutable_membership());
  if (token.has_value()) {
    step->set_has_token(true);
    step->set_token(*token);
  }
  if (k != nullptr && v != nullptr) {
    const int64_t n = config_.num_layers * config_.kv_size();
    const int64_t shape[] = {config_.num_layers, config_.kv_size()};
    rpc::EncodeF32(std::span<const float>(k, static_cast<size_t>(n)), shape, step->mutable_k());
    rpc::EncodeF32(std::span<const float>(v, static_cast<size_t>(n)), shape, step->mutable_v());
    const size_t bytes = step->k().data().size() + step->v().data().size();
    step->mutable_padding()->resize(PayloadScale::Padding(bytes, options_.kv_payload_scale, rpc::RoomAfter(bytes)));
    item.kv_bytes = static_cast<int64_t>(bytes + step->padding().size());
  }
  Queue(std::move(item));
}

void ShadowLink::SendKv(int64_t first, int64_t count, std::vector<float> k, std::vector<float> v) {
  if (count <= 0) return;
  Outgoing item;
  item.first = first;
  item.count = count;
  item.kv_bytes = static_cast<int64_t>((k.size() + v.size()) * sizeof(float));
  item.k = std::move(k);
  item.v = std::move(v);
  Queue(std::move(item));
}

bool ShadowLink::RoomForKv() {
  absl::MutexLock lock(&mu_);
  if (!started_ || broken_) return false;
  if (pending_kv_bytes_ < options_.max_pending_kv_bytes) return true;
  ++counts_.kv_skipped;
  if (!skip_logged_) {
    skip_logged_ = true;
    spdlog::warn(
        "request {}: the link to the shadow is behind by {} MiB of K/V: K/V alignment pauses until it "
        "catches up",
        trace_id_, pending_kv_bytes_ >> 20);
  }
  return false;
}

bool ShadowLink::active() const {
  absl::MutexLock lock(&mu_);
  return started_ && !broken_;
}

AlignmentCounts ShadowLink::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

int64_t ShadowLink::pending_kv_bytes() const {
  absl::MutexLock lock(&mu_);
  return pending_kv_bytes_;
}

void ShadowLink::Finish(int64_t wait_ms) {
  if (!writer_.joinable()) return;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    // Main has decoded every position: on a link that is behind, the K/V still queued can no longer help the
    // shadow's predictions and would hold up the request's answer. The steps go (the shadow predicts the last
    // positions from them).
    if (pending_kv_bytes_ >= options_.max_pending_kv_bytes) {
      kv_dropped_ = true;
      std::erase_if(queue_, [](const Outgoing& item) { return item.count > 0; });
      for (Outgoing& item : queue_) {
        if (!item.message.has_step()) continue;
        v1::FollowStep* step = item.message.mutable_step();
        step->clear_k();
        step->clear_v();
        step->clear_padding();
      }
      pending_kv_bytes_ = 0;
    }
  }
  // The writer sends what is queued and closes main's side; the shadow then sends its last predictions and ends
  // the stream, which ends the reader.
  if (!reader_done_->WaitForNotificationWithTimeout(absl::Milliseconds(std::max<int64_t>(0, wait_ms)))) {
    absl::MutexLock lock(&mu_);
    context_->TryCancel();  // the link or the shadow is late or stuck: what remains counts as missing
  }
  writer_.join();
  reader_.join();
  const grpc::Status status = stream_->Finish();
  if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
    spdlog::warn("the shadow ended the request's stream with {}: {}", static_cast<int>(status.error_code()),
                 status.error_message());
  }
  stream_.reset();
  reader_done_.reset();
  absl::MutexLock lock(&mu_);
  context_.reset();
  queue_.clear();
  pending_kv_bytes_ = 0;
  started_ = false;
}

}  // namespace odmoe
