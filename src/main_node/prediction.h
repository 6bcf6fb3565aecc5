// What main knows about expert prediction during one request: the predictions it has received (from the
// shadow's Follow stream, or made up at random for ablation case 5), where it is itself (so that the shadow's
// lead can be measured), and what actually happened at every decode (position, sparse layer): the actual top-k
// and which of its experts the workers found already resident or loading.
//
// Recall (OD-MoE eq. 3) = correct predictions / (k x sparse layers x decode steps), from the LAST prediction
// received for each (position, layer) by the end of the request (a shadow that rolled back to an aligned
// token re-sends a corrected one). Timely recall counts only the correct ones whose expert the worker had
// before main's request came (the prediction was in time to load it).
//
// Hedged prefetch ([shadow] hedge_margin): a prediction may carry hedges, experts the shadow also had loaded
// though not in its top-k. Recall with hedges = |actual ∩ (top-k ∪ hedges)| / k per (position, layer), averaged
// as eq. 3 (it stays <= 1: the actual set has k experts); timely recall likewise. hedges_used counts the actual
// experts only a hedge predicted; hedge_loads is what the shadow reported the workers loaded for hedges.
//
// Thread safety: Put/SetProgress come from the stream's reader thread while the request thread calls Get and
// Record; everything is under one mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "odmoe/v1/main.pb.h"

namespace odmoe {

struct RecallSummary {
  double recall = 0;          // fraction, 0..1
  double timely_recall = 0;
  std::vector<double> recall_per_token;  // one per decode position, in order
  uint64_t decode_layers = 0;            // (position, sparse layer) pairs decoded
  uint64_t predictions_received = 0;
  uint64_t predictions_missing = 0;      // decoded pairs never predicted
  uint64_t correct = 0;
  uint64_t timely = 0;
  double lead_layers_mean = 0;           // how many sparse layers ahead of main predictions arrived, on average
  uint64_t loads_on_demand = 0;          // decode experts no worker had when main asked (loaded after routing)
  double stall_ms = 0;                   // the workers' load time of those (main waited for it)
  uint64_t hedges_used = 0;              // actual experts predicted by a hedge only (counted in `correct`)
  uint64_t hedge_loads = 0;              // the workers' loads of hedged experts (the shadow's summary)
  std::vector<double> stall_ms_per_layer;  // the same per sparse layer
  // The one conversion to a request's stats (its recall, prediction and stall fields).
  void ToProto(v1::RequestStats* p) const;
};

class PredictionBoard {
 public:
  // Starts a request: forgets everything. `num_sparse`: sparse layers of the model; `top_k`: k.
  void Reset(int64_t num_sparse, int64_t top_k);

  // A prediction for (position, sparse layer `sparse_index`): its top-k `experts` and its `hedges` (disjoint
  // from them); replaces an earlier one of the same pair.
  void Put(int64_t position, int64_t sparse_index, std::vector<int32_t> experts, std::vector<int32_t> hedges = {});
  // The experts the prediction of (position, sparse_index) had loaded: its top-k, then its hedges (what main
  // resolves the actual experts against, Placement::Resolve). nullopt when there is none.
  std::optional<std::vector<int32_t>> Get(int64_t position, int64_t sparse_index) const;
  // The shadow's count of the workers' hedged loads for this request.
  void SetHedgeLoads(uint64_t loads);
  // Main is about to run (position, sparse_index).
  void SetProgress(int64_t position, int64_t sparse_index);

  // What happened at a decoded (position, sparse layer): the actual experts and, for each, whether its worker
  // had it before the request (not loaded on demand), and the load time main waited for (`stall_ms`).
  void Record(int64_t position, int64_t sparse_index, std::vector<int32_t> actual, std::vector<bool> resident,
              double stall_ms);

  RecallSummary Summarize() const;

 private:
  using Key = std::pair<int64_t, int64_t>;  // (position, sparse index)
  struct Outcome {
    std::vector<int32_t> actual;
    std::vector<bool> resident;
    double stall_ms = 0;
  };
  mutable absl::Mutex mu_;
  int64_t num_sparse_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t top_k_ ABSL_GUARDED_BY(mu_) = 0;
  struct Predicted {
    std::vector<int32_t> experts;  // top-k
    std::vector<int32_t> hedges;
  };
  std::map<Key, Predicted> predictions_ ABSL_GUARDED_BY(mu_);
  uint64_t hedge_loads_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Key, Outcome> outcomes_ ABSL_GUARDED_BY(mu_);
  Key progress_ ABSL_GUARDED_BY(mu_) = {-1, -1};
  uint64_t received_ ABSL_GUARDED_BY(mu_) = 0;
  double lead_sum_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace odmoe
