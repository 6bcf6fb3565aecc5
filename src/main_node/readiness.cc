#include "src/main_node/readiness.h"

#include <algorithm>
#include <utility>

#include "spdlog/spdlog.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {

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
    const bool served =
        std::any_of(owners[s].begin(), owners[s].end(), [&](int32_t w) { return probes[static_cast<size_t>(w)].ok(); });
    if (!served) unserved.push_back(static_cast<int64_t>(s));
  }
  std::string who;
  for (size_t i = 0; i < v.unreachable.size(); ++i) {
    const size_t w = static_cast<size_t>(v.unreachable[i]);
    who += StrCat(i == 0 ? " " : "; ", names[w], " (", probes[w].message(), ")");
  }
  v.ready = unserved.empty();
  if (v.ready) {
    v.reason = StrCat("every sparse layer has a reachable owner (", probes.size(), " workers");
    v.reason += v.unreachable.empty() ? ")" : StrCat(", ", v.unreachable.size(), " unreachable:", who, ")");
    return v;
  }
  v.reason = StrCat(unserved.size() == 1 ? "sparse layer " : "sparse layers ", Ranges(unserved),
                    unserved.size() == 1 ? " has" : " have", " no reachable owner:", who);
  return v;
}

absl::StatusOr<std::unique_ptr<ReadinessWatch>> ReadinessWatch::ForCluster(const ClusterConfig& cluster,
                                                                           const ModelConfig& model, PeerHealth& health,
                                                                           Report report) {
  const std::vector<const NodeConfig*> workers = cluster.workers();
  ODMOE_RETURN_IF_ERROR(
      Placement::ForCluster(cluster.file, static_cast<int32_t>(workers.size()), cluster.group_size, model.top_k)
          .status());
  std::vector<std::string> names;
  std::vector<int32_t> every;
  for (const NodeConfig* w : workers) {
    every.push_back(static_cast<int32_t>(names.size()));
    names.push_back(w->name);
  }
  // Failover: a layer goes to whichever workers are left (Placement::Without).
  std::vector<std::vector<int32_t>> owners(model.SparseLayers().size(), every);
  return std::make_unique<ReadinessWatch>(std::move(owners), std::move(names), health, std::move(report),
                                          absl::Milliseconds(cluster.startup_timeout_ms));
}

ReadinessWatch::ReadinessWatch(std::vector<std::vector<int32_t>> owners, std::vector<std::string> names,
                               PeerHealth& health, Report report, absl::Duration startup_grace)
    : owners_(std::move(owners)),
      names_(std::move(names)),
      health_(health),
      report_(std::move(report)),
      grace_ends_(absl::Now() + startup_grace) {
  ODMOE_CHECK(names_.size() <= health_.size());
  subscription_ = health_.Subscribe([this](const PeerEvent&) { Judge(); });
  Judge();  // the workers may all have a verdict already
  if (startup_grace > absl::ZeroDuration()) {
    grace_timer_ = std::thread([this] {
      if (!stop_.WaitForNotificationWithDeadline(grace_ends_)) Judge();
    });
  }
}

ReadinessWatch::~ReadinessWatch() {
  stop_.Notify();
  if (grace_timer_.joinable()) grace_timer_.join();
  health_.Unsubscribe(subscription_);
}

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
    // Start-up: the whole cluster first (every peer, the shadow too, so that the first requests are followed),
    // unless the grace is over.
    if (v.ready && std::all_of(states.begin(), states.end(),
                               [](const PeerHealth::Snapshot& p) { return p.state == PeerState::kUp; })) {
      whole_once_ = true;
    }
    if (v.ready && !whole_once_ && absl::Now() < grace_ends_) {
      v.ready = false;
      const size_t up = static_cast<size_t>(std::count_if(
          states.begin(), states.end(), [](const PeerHealth::Snapshot& p) { return p.state == PeerState::kUp; }));
      v.reason = StrCat("starting: waiting for every peer to answer (", up, " of ", states.size(),
                        " up; main serves without the others ", absl::FormatDuration(grace_ends_ - absl::Now()),
                        " from now)");
    }
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
