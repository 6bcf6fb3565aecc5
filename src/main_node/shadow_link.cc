#include "src/main_node/shadow_link.h"

#include <algorithm>
#include <vector>

#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/common/logging.h"
#include "src/engine/generator.h"
#include "src/rpc/request_id.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {

ShadowLink::ShadowLink(std::shared_ptr<grpc::Channel> channel, const ModelConfig& config, ShadowLinkOptions options)
    : channel_(std::move(channel)),
      stub_(v1::Shadow::NewStub(channel_)),
      config_(config),
      options_(std::move(options)) {
  if (options_.health != nullptr) {
    health_subscription_ = options_.health->Subscribe([this](const PeerEvent& e) {
      if (e.peer != options_.health_peer || e.to != PeerState::kDown) return;
      absl::MutexLock lock(&context_mu_);
      if (context_ != nullptr) context_->TryCancel();  // unblocks a write stuck on a hung shadow
    });
  }
}

ShadowLink::~ShadowLink() {
  if (health_subscription_ != 0) options_.health->Unsubscribe(health_subscription_);
  Finish(0);
}

bool ShadowLink::Start(uint64_t request_id, const std::string& trace_id, std::span<const int32_t> prompt,
                       int64_t max_new_tokens, const ShadowSettings& settings, PredictionBoard* board) {
  Finish(0);  // a stream left open by a failed request
  broken_ = false;
  counts_ = AlignmentCounts{};
  if (options_.health != nullptr && options_.health->state(options_.health_peer) == PeerState::kDown) {
    if (!options_.warned->exchange(true)) {
      spdlog::warn("the shadow is down: decoding without predictions (experts load on demand)");
    }
    return false;  // no stream: Step, SendKv and Finish do nothing
  }
  grpc::ClientContext* context = nullptr;
  {
    absl::MutexLock lock(&context_mu_);
    context_ = std::make_unique<grpc::ClientContext>();
    context = context_.get();
  }
  rpc::AttachRequestId(*context, trace_id);
  stream_ = stub_->Follow(context);
  v1::FollowMessage start_msg;
  v1::FollowStart* start = start_msg.mutable_start();
  if (options_.membership != nullptr) {
    const MembershipView view = options_.membership->Current().view;
    rpc::FillHeader(start->mutable_header(), options_.epoch, options_.fingerprint, options_.sender, request_id, &view);
  } else {
    rpc::FillHeader(start->mutable_header(), options_.epoch, options_.fingerprint, options_.sender, request_id);
  }
  start->mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
  start->set_max_new_tokens(max_new_tokens);
  start->set_align_token(settings.align_token);
  start->set_align_kv(settings.align_kv);
  start->set_max_lead_tokens(settings.max_lead_tokens);
  if (!stream_->Write(start_msg)) {
    if (!options_.warned->exchange(true)) {
      spdlog::warn("the shadow is unreachable: decoding without predictions (experts load on demand)");
    }
    broken_ = true;
  } else if (options_.warned->exchange(false)) {
    spdlog::info("the shadow is following requests again");
  }
  reader_done_ = std::make_unique<absl::Notification>();
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  const int64_t last = LastDecodePosition(prompt_len, max_new_tokens);
  reader_ = std::thread([this, board, prompt_len, last, trace_id]() {
    logging::ScopedRequestId scope(trace_id);  // its warnings are about this request
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
        spdlog::warn("dropping a malformed prediction from the shadow (position {}, layer {}, {} experts)",
                     p.position(), p.layer(), p.experts_size());
        continue;
      }
      board->Put(p.position(), sparse_index, std::move(experts), std::move(hedges));
    }
    reader_done_->Notify();
  });
  return !broken_;
}

void ShadowLink::Step(int64_t position, int64_t batch_step, std::optional<int32_t> token, const float* k,
                      const float* v) {
  if (stream_ == nullptr || broken_) return;
  v1::FollowMessage msg;
  v1::FollowStep* step = msg.mutable_step();
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
  }
  if (!stream_->Write(msg)) {
    if (!options_.warned->exchange(true)) spdlog::warn("the shadow's stream broke: decoding on without predictions");
    broken_ = true;
    return;
  }
  counts_.tokens += token.has_value() ? 1 : 0;
  if (k != nullptr && v != nullptr) {
    counts_.kv += 1;
    counts_.bytes += static_cast<uint64_t>(step->k().data().size() + step->v().data().size());
  }
}

void ShadowLink::SendKv(int64_t first, int64_t count, const float* k, const float* v) {
  if (stream_ == nullptr || broken_ || count <= 0) return;
  const int64_t row = config_.num_layers * config_.kv_size();
  // At most 4 MiB of K/V per message, counted at the padded size under emulation.
  const double padded_row_bytes = 2.0 * static_cast<double>(row) * 4.0 * std::max(1.0, options_.kv_payload_scale);
  const int64_t per_message = std::max<int64_t>(1, static_cast<int64_t>((4 << 20) / padded_row_bytes));
  for (int64_t at = 0; at < count; at += per_message) {
    const int64_t n = std::min(per_message, count - at);
    v1::FollowMessage msg;
    v1::FollowKv* kv = msg.mutable_kv();
    kv->set_first_position(first + at);
    const int64_t shape[] = {n, config_.num_layers, config_.kv_size()};
    rpc::EncodeF32(std::span<const float>(k + at * row, static_cast<size_t>(n * row)), shape, kv->mutable_k());
    rpc::EncodeF32(std::span<const float>(v + at * row, static_cast<size_t>(n * row)), shape, kv->mutable_v());
    const size_t bytes = kv->k().data().size() + kv->v().data().size();
    kv->mutable_padding()->resize(PayloadScale::Padding(bytes, options_.kv_payload_scale, rpc::RoomAfter(bytes)));
    if (!stream_->Write(msg)) {
      if (!options_.warned->exchange(true)) {
        spdlog::warn("the shadow's stream broke: decoding on without predictions");
      }
      broken_ = true;
      return;
    }
    counts_.bytes += static_cast<uint64_t>(kv->k().data().size() + kv->v().data().size());
    counts_.prompt_positions += static_cast<uint64_t>(n);
  }
}

void ShadowLink::Finish(int64_t wait_ms) {
  if (stream_ == nullptr) return;
  if (!broken_) stream_->WritesDone();
  if (!reader_done_->WaitForNotificationWithTimeout(absl::Milliseconds(std::max<int64_t>(0, wait_ms)))) {
    absl::MutexLock lock(&context_mu_);
    context_->TryCancel();  // the shadow is late or stuck: its remaining predictions count as missing
  }
  reader_done_->WaitForNotification();
  reader_.join();
  const grpc::Status status = stream_->Finish();
  if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
    spdlog::warn("the shadow ended the request's stream with {}: {}", static_cast<int>(status.error_code()),
                 status.error_message());
  }
  stream_.reset();
  {
    absl::MutexLock lock(&context_mu_);
    context_.reset();
  }
  reader_done_.reset();
}

}  // namespace odmoe
