#include "src/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "src/backend/cpu_kernels.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {

absl::Status SamplingOptions::Validate(int64_t vocab_size) const {
  auto invalid = [](std::string_view field, const auto&... rest) {
    return RequestFieldError(absl::StatusCode::kInvalidArgument, field, rest...);
  };
  if (!(temperature >= 0) || !std::isfinite(temperature)) {
    return invalid("sampling.temperature", " must be a number >= 0, got ", temperature);
  }
  if (top_k < 0) return invalid("sampling.top_k", " must be >= 0, got ", top_k);
  if (!(top_p > 0 && top_p <= 1)) return invalid("sampling.top_p", " must be in (0, 1], got ", top_p);
  if (!(min_p >= 0 && min_p <= 1)) return invalid("sampling.min_p", " must be in [0, 1], got ", min_p);
  for (const auto& [field, value] : {std::pair{"sampling.presence_penalty", presence_penalty},
                                     std::pair{"sampling.frequency_penalty", frequency_penalty}}) {
    if (!(value >= -2 && value <= 2)) return invalid(field, " must be in [-2, 2], got ", value);
  }
  if (!(repetition_penalty > 0 && repetition_penalty <= kMaxRepetitionPenalty)) {
    return invalid("sampling.repetition_penalty", " must be in (0, ", kMaxRepetitionPenalty, "], got ",
                   repetition_penalty);
  }
  constexpr std::string_view kBias = "sampling.logit_bias";
  if (logit_bias.size() > kMaxLogitBias) {
    return invalid(kBias, " has ", logit_bias.size(), " entries, at most ", kMaxLogitBias);
  }
  std::vector<int32_t> ids;
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || id >= vocab_size) {
      return RequestFieldError(absl::StatusCode::kOutOfRange, kBias, " token id ", id,
                               " is outside the vocabulary [0, ", vocab_size, ")");
    }
    if (!(bias >= -100 && bias <= 100)) return invalid(kBias, " of token ", id, " must be in [-100, 100], got ", bias);
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  if (auto dup = std::adjacent_find(ids.begin(), ids.end()); dup != ids.end()) {
    return invalid(kBias, " gives token ", *dup, " twice");
  }
  return absl::OkStatus();
}

TokenChoice ToTokenChoice(const SamplingOptions& options, float uniform) {
  TokenChoice c;
  c.temperature = static_cast<float>(options.temperature);
  c.top_k = options.top_k > std::numeric_limits<int32_t>::max() ? 0 : static_cast<int32_t>(options.top_k);
  c.top_p = static_cast<float>(options.top_p);
  c.uniform = uniform;
  c.min_p = static_cast<float>(options.min_p);
  return c;
}

int32_t ArgMax(std::span<const float> logits) {
  return cpu::ArgMax(logits.data(), static_cast<int64_t>(logits.size()));
}

Sampler::Sampler(const SamplingOptions& options, TokenBan ban, std::span<const int32_t> prompt,
                 std::optional<TokenConstraint> constraint)
    : options_(options),
      rng_(options.seed),
      ban_picks_left_(ban.ids.empty() ? 0 : ban.picks),
      constraint_(std::move(constraint)) {
  // Every id with a change, sorted once (a long prompt would make inserting them one by one quadratic).
  std::vector<int32_t> ids;
  for (const auto& [id, b] : options.logit_bias) ids.push_back(id);
  if (ban_picks_left_ > 0) ids.insert(ids.end(), ban.ids.begin(), ban.ids.end());
  if (options.repetition_penalty != 1) ids.insert(ids.end(), prompt.begin(), prompt.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (const int32_t id : ids) deltas_.push_back(LogitDelta{.id = id});
  bias_.assign(ids.size(), 0.0);
  counts_.assign(ids.size(), 0);
  banned_.assign(ids.size(), false);
  in_prompt_.assign(ids.size(), false);
  for (const auto& [id, b] : options.logit_bias) bias_[EntryOf(id)] = b;
  if (ban_picks_left_ > 0) {
    for (const int32_t id : ban.ids) banned_[EntryOf(id)] = true;
  }
  if (options.repetition_penalty != 1) {
    for (const int32_t id : prompt) in_prompt_[EntryOf(id)] = true;
  }
  for (size_t i = 0; i < deltas_.size(); ++i) Refresh(i);
}

size_t Sampler::EntryOf(int32_t id) {
  auto it =
      std::lower_bound(deltas_.begin(), deltas_.end(), id, [](const LogitDelta& d, int32_t v) { return d.id < v; });
  const size_t at = static_cast<size_t>(it - deltas_.begin());
  if (it == deltas_.end() || it->id != id) {
    const auto offset = static_cast<std::ptrdiff_t>(at);
    deltas_.insert(it, LogitDelta{.id = id});
    bias_.insert(bias_.begin() + offset, 0.0);
    counts_.insert(counts_.begin() + offset, 0);
    banned_.insert(banned_.begin() + offset, false);
    in_prompt_.insert(in_prompt_.begin() + offset, false);
  }
  return at;
}

void Sampler::Refresh(size_t at) {
  const int64_t count = counts_[at];
  const bool seen = count > 0 || in_prompt_[at];
  deltas_[at].penalty = seen ? static_cast<float>(options_.repetition_penalty) : 1.0f;
  if (banned_[at]) {
    deltas_[at].delta = -std::numeric_limits<float>::infinity();
    return;
  }
  const double penalty =
      count > 0 ? static_cast<double>(count) * options_.frequency_penalty + options_.presence_penalty : 0.0;
  deltas_[at].delta = static_cast<float>(bias_[at] - penalty);
}

void Sampler::LiftBan() {
  size_t kept = 0;
  for (size_t i = 0; i < deltas_.size(); ++i) {
    // Nothing but the ban changed it.
    if (banned_[i] && bias_[i] == 0 && counts_[i] == 0 && !in_prompt_[i]) continue;
    deltas_[kept] = deltas_[i];
    bias_[kept] = bias_[i];
    counts_[kept] = counts_[i];
    banned_[kept] = false;
    in_prompt_[kept] = in_prompt_[i];
    Refresh(kept);
    ++kept;
  }
  deltas_.resize(kept);
  bias_.resize(kept);
  counts_.resize(kept);
  banned_.resize(kept);
  in_prompt_.resize(kept);
}

void Sampler::Record(int32_t id) {
  // Without penalties on generated tokens, the bias alone never changes.
  if (options_.presence_penalty != 0 || options_.frequency_penalty != 0 || options_.repetition_penalty != 1) {
    const size_t at = EntryOf(id);
    ++counts_[at];
    Refresh(at);
  }
  if (ban_picks_left_ > 0 && --ban_picks_left_ == 0) LiftBan();
  if (constraint_) constraint_->Record(id);
  constrained_stale_ = true;
}

std::span<const LogitDelta> Sampler::Deltas() const {
  if (!constraint_) return deltas_;
  if (constrained_stale_) Constrain();
  return constrained_;
}

void Sampler::Constrain() const {
  constrained_stale_ = false;
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  const std::span<const int32_t> banned = constraint_->banned();
  constrained_.clear();
  size_t b = 0;
  for (const LogitDelta& d : deltas_) {
    for (; b < banned.size() && banned[b] < d.id; ++b) constrained_.push_back({.id = banned[b], .delta = kBanned});
    const bool ban = b < banned.size() && banned[b] == d.id;
    if (ban) ++b;
    constrained_.push_back(ban ? LogitDelta{.id = d.id, .penalty = d.penalty, .delta = kBanned} : d);
  }
  for (; b < banned.size(); ++b) constrained_.push_back({.id = banned[b], .delta = kBanned});
}

float Sampler::Uniform() { return static_cast<float>(rng_() >> 40) * 0x1.0p-24f; }

TokenChoice Sampler::NextChoice() {
  TokenChoice c = ToTokenChoice(options_, 0.0f);
  if (!kernels::IsGreedy(c)) c.uniform = Uniform();
  return c;
}

int32_t Sampler::Next(std::span<const float> logits) {
  const TokenChoice c = NextChoice();
  std::vector<float> changed;
  if (!Deltas().empty()) {
    changed.assign(logits.begin(), logits.end());
    for (const LogitDelta& d : Deltas()) {
      float& l = changed[static_cast<size_t>(d.id)];
      l = kernels::ChangedLogit(l, d.penalty, d.delta);
    }
    logits = changed;
  }
  int32_t id = 0;
  cpu::SelectTokens(logits.data(), 1, static_cast<int64_t>(logits.size()), &c, &id);
  Record(id);
  return id;
}

}  // namespace odmoe
