#include "src/main_node/prediction.h"

#include <algorithm>

namespace odmoe {

void PredictionBoard::Reset(int64_t num_sparse, int64_t top_k) {
  absl::MutexLock lock(&mu_);
  num_sparse_ = num_sparse;
  top_k_ = top_k;
  predictions_.clear();
  outcomes_.clear();
  progress_ = {-1, -1};
  received_ = 0;
  lead_sum_ = 0;
  hedge_loads_ = 0;
}

void PredictionBoard::SetHedgeLoads(uint64_t loads) {
  absl::MutexLock lock(&mu_);
  hedge_loads_ = loads;
}

void PredictionBoard::Put(int64_t position, int64_t sparse_index, std::vector<int32_t> experts,
                          std::vector<int32_t> hedges) {
  absl::MutexLock lock(&mu_);
  ++received_;
  // Lead: sparse layers between main's current (position, layer) and the predicted one.
  if (progress_.first >= 0) {
    lead_sum_ += static_cast<double>((position - progress_.first) * num_sparse_ + (sparse_index - progress_.second));
  } else {
    lead_sum_ += static_cast<double>(sparse_index + 1);  // main has not started decoding yet
  }
  predictions_[{position, sparse_index}] = Predicted{std::move(experts), std::move(hedges)};
}

std::optional<std::vector<int32_t>> PredictionBoard::Get(int64_t position, int64_t sparse_index) const {
  absl::MutexLock lock(&mu_);
  auto it = predictions_.find({position, sparse_index});
  if (it == predictions_.end()) return std::nullopt;
  std::vector<int32_t> loaded = it->second.experts;
  loaded.insert(loaded.end(), it->second.hedges.begin(), it->second.hedges.end());
  return loaded;
}

void PredictionBoard::SetProgress(int64_t position, int64_t sparse_index) {
  absl::MutexLock lock(&mu_);
  progress_ = {position, sparse_index};
}

void PredictionBoard::Record(int64_t position, int64_t sparse_index, std::vector<int32_t> actual,
                             std::vector<bool> resident, double stall_ms) {
  absl::MutexLock lock(&mu_);
  outcomes_[{position, sparse_index}] = Outcome{std::move(actual), std::move(resident), stall_ms};
}

void RecallSummary::ToProto(v1::RequestStats* p) const {
  p->set_recall(recall);
  p->set_timely_recall(timely_recall);
  p->mutable_recall_per_token()->Add(recall_per_token.begin(), recall_per_token.end());
  p->set_predictions_received(predictions_received);
  p->set_predictions_missing(predictions_missing);
  p->set_shadow_lead_layers(lead_layers_mean);
  p->set_stall_ms(stall_ms);
  p->set_decode_loads_on_demand(loads_on_demand);
  p->mutable_stall_ms_per_layer()->Add(stall_ms_per_layer.begin(), stall_ms_per_layer.end());
  p->set_hedge_loads(hedge_loads);
  p->set_hedges_used(hedges_used);
}

RecallSummary PredictionBoard::Summarize() const {
  absl::MutexLock lock(&mu_);
  RecallSummary s;
  s.predictions_received = received_;
  s.hedge_loads = hedge_loads_;
  s.lead_layers_mean = received_ > 0 ? lead_sum_ / static_cast<double>(received_) : 0;
  s.stall_ms_per_layer.assign(static_cast<size_t>(std::max<int64_t>(0, num_sparse_)), 0.0);
  int64_t current = -1;
  uint64_t token_correct = 0, token_total = 0;
  auto close_token = [&]() {
    if (token_total > 0) {
      s.recall_per_token.push_back(static_cast<double>(token_correct) / static_cast<double>(token_total));
    }
    token_correct = token_total = 0;
  };
  for (const auto& [key, outcome] : outcomes_) {
    if (key.first != current) {
      close_token();
      current = key.first;
    }
    ++s.decode_layers;
    s.stall_ms += outcome.stall_ms;
    if (key.second >= 0 && key.second < num_sparse_) s.stall_ms_per_layer[static_cast<size_t>(key.second)] += outcome.stall_ms;
    for (bool r : outcome.resident) s.loads_on_demand += r ? 0 : 1;
    const uint64_t k = static_cast<uint64_t>(std::max<int64_t>(1, top_k_));
    token_total += k;
    auto it = predictions_.find(key);
    if (it == predictions_.end()) {
      ++s.predictions_missing;
      continue;
    }
    const std::vector<int32_t>& top = it->second.experts;
    const std::vector<int32_t>& hedges = it->second.hedges;
    for (size_t i = 0; i < outcome.actual.size(); ++i) {
      const int32_t e = outcome.actual[i];
      const bool in_top = std::find(top.begin(), top.end(), e) != top.end();
      const bool in_hedges = !in_top && std::find(hedges.begin(), hedges.end(), e) != hedges.end();
      if (!in_top && !in_hedges) continue;
      if (in_hedges) ++s.hedges_used;
      ++s.correct;
      ++token_correct;
      if (i < outcome.resident.size() && outcome.resident[i]) ++s.timely;
    }
  }
  close_token();
  const double denominator = static_cast<double>(s.decode_layers) * static_cast<double>(std::max<int64_t>(1, top_k_));
  if (s.decode_layers > 0) {
    s.recall = static_cast<double>(s.correct) / denominator;
    s.timely_recall = static_cast<double>(s.timely) / denominator;
  }
  return s;
}

}  // namespace odmoe
