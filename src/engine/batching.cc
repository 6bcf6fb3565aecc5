#include "src/engine/batching.h"

#include <algorithm>
#include <string>

#include "absl/strings/cord.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

// A copy of `s` that shares nothing with it (its message and payloads copied): each request of a failed step
// gets its own, since their owners' threads drop them independently.
absl::Status Unshared(const absl::Status& s) {
  absl::Status copy(s.code(), std::string(s.message()));
  s.ForEachPayload([&copy](absl::string_view url, const absl::Cord& payload) {
    copy.SetPayload(url, absl::Cord(std::string(payload)));
  });
  return copy;
}

}  // namespace

BatchRequest::BatchRequest(uint64_t tag, const ModelConfig& config, std::vector<int32_t> prompt,
                           GenerateOptions options, TokenCallback on_token)
    : tag_(tag),
      prompt_(std::move(prompt)),
      options_(std::move(options)),
      on_token_(std::move(on_token)),
      sampler_(RequestSampler(config, options_, prompt_)) {
  result_.stop_reason = "length";
}

void BatchRequest::TakeToken(int32_t next, const ModelConfig& config) {
  // Generate's loop, one step of it.
  if (result_.tokens.empty()) first_token_ = Clock::now();
  sampler_.Record(next);
  if (options_.logprobs >= 0) result_.logprobs.push_back(LogprobsOf(logits_, next, options_.logprobs));
  result_.tokens.push_back(next);
  const std::string_view stop = StopReasonOf(config, options_, next);
  const bool last = !stop.empty() || static_cast<int64_t>(result_.tokens.size()) == options_.max_new_tokens;
  if (on_token_) on_token_(next, last);
  if (!stop.empty()) result_.stop_reason = stop;
  if (last) Finish(absl::OkStatus());
}

void BatchRequest::Finish(absl::Status status) {
  finished_ = true;
  status_ = std::move(status);
  SetRequestTimes(start_, first_token_, Clock::now(), &result_);
}

BatchRunner::BatchRunner(Engine& engine, BatchOptions options) : engine_(engine), options_(options) {
  ODMOE_CHECK(options_.prefill_chunk_tokens >= 1);
}

int64_t BatchRequest::cache_positions() const {
  const int64_t prompt_len = static_cast<int64_t>(prompt_.size());
  return std::max(prompt_len, LastDecodePosition(prompt_len, options_.max_new_tokens) + 1);
}

absl::Status BatchRunner::Add(BatchRequest* request) {
  ODMOE_ASSIGN_OR_RETURN(request->sequence_, engine_.NewSequence(request->cache_positions(), request->tag_));
  request->start_ = BatchRequest::Clock::now();
  requests_.push_back(request);
  return absl::OkStatus();
}

void BatchRunner::Remove(BatchRequest* request, absl::Status why) {
  requests_.erase(std::remove(requests_.begin(), requests_.end(), request), requests_.end());
  request->sequence_.reset();
  if (!request->finished_) request->Finish(std::move(why));
}

BatchRunner::Plan BatchRunner::Schedule() {
  Plan plan;
  BatchRequest* prefill = nullptr;
  bool any_decoding = false;
  for (BatchRequest* r : requests_) {
    if (r->finished_) continue;
    if (r->decoding()) {
      any_decoding = true;
    } else if (prefill == nullptr) {
      prefill = r;  // the oldest with prompt left
    }
  }
  if (prefill != nullptr && !(any_decoding && last_was_prefill_)) {
    const int64_t left = static_cast<int64_t>(prefill->prompt_.size()) - prefill->prefilled_;
    // Alone, a prompt goes in chunks as large as the engine takes (each chunk loads its experts again).
    const int64_t most = any_decoding ? options_.prefill_chunk_tokens : engine_.max_tokens_per_forward();
    const int64_t chunk = std::min({left, most, engine_.max_tokens_per_forward()});
    plan.kind = ForwardKind::kPrefill;
    plan.requests.push_back(prefill);
    plan.ids.push_back(std::span<const int32_t>(prefill->prompt_)
                           .subspan(static_cast<size_t>(prefill->prefilled_), static_cast<size_t>(chunk)));
    last_was_prefill_ = true;
    return plan;
  }
  last_was_prefill_ = false;
  plan.kind = ForwardKind::kDecode;
  fed_.clear();
  for (BatchRequest* r : requests_) {
    if (!r->decoding()) continue;
    if (static_cast<int64_t>(plan.requests.size()) == engine_.max_sequences_per_forward()) break;
    plan.requests.push_back(r);
    fed_.push_back(r->result_.tokens.back());
  }
  for (size_t i = 0; i < plan.requests.size(); ++i) plan.ids.push_back(std::span<const int32_t>(&fed_[i], 1));
  return plan;
}

absl::Status BatchRunner::Run(const Plan& plan) {
  std::vector<BatchInput> inputs;
  std::vector<RowLogitsFn> prompt_rows;  // the prompt logprobs of each request that asks (stable: reserved)
  prompt_rows.reserve(plan.requests.size());
  for (size_t i = 0; i < plan.requests.size(); ++i) {
    BatchRequest* r = plan.requests[i];
    const bool prompt_done =
        plan.kind == ForwardKind::kDecode ||
        r->prefilled_ + static_cast<int64_t>(plan.ids[i].size()) == static_cast<int64_t>(r->prompt_.size());
    std::vector<PositionRouting>* routing = r->options_.record_routing ? &r->result_.routing : nullptr;
    // The row that ends the prompt, or decodes, picks the next token (a request of no new tokens picks none).
    const bool picks = prompt_done && r->options_.max_new_tokens > 0;
    // Its logits come back for the prompt's when kept, and for each pick when logprobs are asked for.
    const bool keeps_logits = (plan.kind == ForwardKind::kPrefill && prompt_done && r->options_.keep_last_logits) ||
                              (picks && r->options_.logprobs >= 0);
    if (picks) r->choice_ = r->sampler_.NextChoice();
    inputs.push_back({r->sequence_.get(), plan.ids[i], routing, keeps_logits ? &r->logits_ : nullptr,
                      picks ? &r->choice_ : nullptr, picks ? &r->token_ : nullptr,
                      picks ? r->sampler_.Deltas() : std::span<const LogitDelta>()});
    if (plan.kind == ForwardKind::kPrefill && r->options_.prompt_logprobs) {
      const int64_t first = r->prefilled_;  // the chunk's first prompt row
      prompt_rows.push_back([r, first](int64_t row, std::span<const float> logits) {
        AppendPromptLogprobs(r->prompt_, r->options_, first + row, logits, &r->result_);
      });
      inputs.back().row_logits = &prompt_rows.back();
    }
  }
  const absl::Status status = engine_.ForwardBatch(inputs, plan.kind);
  if (!status.ok()) {
    for (BatchRequest* r : plan.requests) r->Finish(Unshared(status));
    return status;
  }
  if (plan.kind == ForwardKind::kPrefill) plan.requests[0]->prefilled_ += static_cast<int64_t>(plan.ids[0].size());
  return absl::OkStatus();
}

std::vector<BatchRequest*> BatchRunner::Postprocess(const Plan& plan) {
  std::vector<BatchRequest*> finished;
  const ModelConfig& c = engine_.config();
  for (BatchRequest* r : plan.requests) {
    if (r->finished_) {  // failed in Run
      finished.push_back(r);
      continue;
    }
    if (plan.kind == ForwardKind::kPrefill) {
      if (!r->decoding()) continue;  // prompt left
      if (r->options_.keep_last_logits) {
        // TakeToken reads them too for the first token's logprobs.
        r->result_.last_logits = r->options_.logprobs >= 0 ? r->logits_ : std::move(r->logits_);
      }
      if (r->options_.max_new_tokens == 0) {
        r->Finish(absl::OkStatus());
        finished.push_back(r);
        continue;
      }
    }
    r->TakeToken(r->token_, c);
    if (r->finished_) finished.push_back(r);
  }
  return finished;
}

std::vector<BatchRequest*> BatchRunner::Step() {
  const Plan plan = Schedule();
  if (plan.empty()) return {};
  (void)Run(plan);  // a failure finishes the plan's requests, which Postprocess returns
  return Postprocess(plan);
}

}  // namespace odmoe
