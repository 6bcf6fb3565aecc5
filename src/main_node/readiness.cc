#include "src/main_node/readiness.h"

#include <algorithm>
#include <set>
#include <utility>

#include "spdlog/spdlog.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {

std::vector<std::vector<int32_t>> SparseLayerOwners(const Placement& placement, int64_t num_sparse,
                                                    int64_t num_experts) {
  std::vector<std::vector<int32_t>> owners(static_cast<size_t>(std::max<int64_t>(num_sparse, 0)));
  for (int64_t s = 0; s < num_sparse; ++s) {
    std::set<int32_t> workers;
    const int32_t group = placement.GroupOf(s);
    for (int32_t slot = 0; slot < placement.group_size(); ++slot) workers.insert(placement.WorkerOf(group, slot));
    for (int64_t e = 0; e < num_experts; ++e) workers.insert(placement.PrefillWorkerOf(static_cast<int32_t>(e)));
    owners[static_cast<size_t>(s)].assign(workers.begin(), workers.end());
  }
  return owners;
}

namespace {

// "0-3,5,7-8"
std::string Ranges(const std::vector<int64_t>& sorted) {
  std::string out;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    out += StrCat(out.empty() ? "" : ",", sorted[i]);
    if (j > i) out += StrCat("-", sorted[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

ReadinessVerdict JudgeReadiness(const std::vector<std::vector<int32_t>>& owners, const std::vector<std::string>& names,
                                const std::vector<absl::Status>& probes) {
  ReadinessVerdict v;
  for (size_t w = 0; w < probes.size(); ++w) {
    if (!probes[w].ok()) v.unreachable.push_back(static_cast<int32_t>(w));
  }
  std::vector<int64_t> unserved;
  for (size_t s = 0; s < owners.size(); ++s) {
    for (int32_t w : owners[s]) {
      if (!probes[static_cast<size_t>(w)].ok()) {
        unserved.push_back(static_cast<int64_t>(s));
        break;
      }
    }
  }
  v.ready = unserved.empty();
  if (v.ready) {
    v.reason = StrCat("every sparse layer has a reachable owner (", probes.size(), " workers)");
    return v;
  }
  v.reason = StrCat(unserved.size() == 1 ? "sparse layer " : "sparse layers ", Ranges(unserved),
                    unserved.size() == 1 ? " has" : " have", " an unreachable owner:");
  for (size_t i = 0; i < v.unreachable.size(); ++i) {
    const size_t w = static_cast<size_t>(v.unreachable[i]);
    v.reason += StrCat(i == 0 ? " " : "; ", names[w], " (", probes[w].message(), ")");
  }
  return v;
}

absl::StatusOr<std::unique_ptr<ReadinessWatch>> ReadinessWatch::ForCluster(const ClusterConfig& cluster,
                                                                           const ModelConfig& model, PeerHealth& health,
                                                                           Report report) {
  const std::vector<const NodeConfig*> workers = cluster.workers();
  ODMOE_ASSIGN_OR_RETURN(
      const Placement placement,
      Placement::ForCluster(cluster.file, static_cast<int32_t>(workers.size()), cluster.group_size, model.top_k));
  std::vector<std::string> names;
  for (const NodeConfig* w : workers) names.push_back(w->name);
  return std::make_unique<ReadinessWatch>(
      SparseLayerOwners(placement, static_cast<int64_t>(model.SparseLayers().size()), model.num_experts),
      std::move(names), health, std::move(report));
}

ReadinessWatch::ReadinessWatch(std::vector<std::vector<int32_t>> owners, std::vector<std::string> names,
                               PeerHealth& health, Report report)
    : owners_(std::move(owners)), names_(std::move(names)), health_(health), report_(std::move(report)) {
  ODMOE_CHECK(names_.size() <= health_.size());
  subscription_ = health_.Subscribe([this](const PeerEvent& e) {
    if (static_cast<size_t>(e.peer) < names_.size()) Judge();
  });
  Judge();  // the workers may all have a verdict already
}

ReadinessWatch::~ReadinessWatch() { health_.Unsubscribe(subscription_); }

bool ReadinessWatch::ready() const {
  absl::MutexLock lock(&mu_);
  return verdict_.ready;
}

std::string ReadinessWatch::reason() const {
  absl::MutexLock lock(&mu_);
  return verdict_.reason;
}

void ReadinessWatch::Judge() {
  absl::MutexLock judging(&judge_mu_);
  const std::vector<PeerHealth::Snapshot> states = health_.All();
  std::vector<absl::Status> probes;
  for (size_t w = 0; w < names_.size(); ++w) {
    const PeerHealth::Snapshot& s = states[w];
    if (s.state == PeerState::kUnknown) return;  // the first verdict waits for every worker's
    probes.push_back(s.state == PeerState::kUp ? absl::OkStatus() : absl::UnavailableError(s.reason));
  }
  ReadinessVerdict v = JudgeReadiness(owners_, names_, probes);
  {
    absl::MutexLock lock(&mu_);
    const bool changed = !reported_ || v.ready != verdict_.ready || v.unreachable != verdict_.unreachable;
    reported_ = true;
    verdict_ = v;
    if (!changed) return;
  }
  if (v.ready) {
    spdlog::info("ready: {}", v.reason);
  } else {
    spdlog::warn("not ready: {}", v.reason);
  }
  if (report_) report_(v);
}

}  // namespace odmoe
