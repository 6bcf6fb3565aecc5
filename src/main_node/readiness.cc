#include "src/main_node/readiness.h"

#include <algorithm>
#include <set>
#include <utility>

#include "grpc/health/v1/health.grpc.pb.h"
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

namespace {

// Asks every worker's "odmoe.ready" at once (gRPC callback calls, no threads of ours) and waits for all.
class HealthProbe {
 public:
  HealthProbe(const std::vector<const NodeConfig*>& workers, int64_t timeout_ms) : timeout_ms_(timeout_ms) {
    for (const NodeConfig* w : workers) {
      stubs_.push_back(grpc::health::v1::Health::NewStub(rpc::MakeChannel(w->address)));
    }
  }

  std::vector<absl::Status> Run() {
    // Shared with the callbacks, so that it outlives the last of them, however late it lets go.
    struct Round {
      explicit Round(size_t n) : calls(n), pending(n) {}
      struct Call {
        grpc::ClientContext ctx;
        grpc::health::v1::HealthCheckRequest request;
        grpc::health::v1::HealthCheckResponse response;
        grpc::Status status;
      };
      std::vector<Call> calls;
      absl::Mutex mu;
      size_t pending ABSL_GUARDED_BY(mu);
    };
    const size_t n = stubs_.size();
    auto round = std::make_shared<Round>(n);
    for (size_t i = 0; i < n; ++i) {
      Round::Call& c = round->calls[i];
      c.request.set_service(rpc::kReadinessService);
      rpc::SetDeadline(c.ctx, timeout_ms_);
      stubs_[i]->async()->Check(&c.ctx, &c.request, &c.response, [round, &c](grpc::Status s) {
        absl::MutexLock lock(&round->mu);
        c.status = std::move(s);
        --round->pending;
      });
    }
    std::vector<absl::Status> out;
    absl::MutexLock lock(&round->mu);
    round->mu.Await(absl::Condition(
        +[](size_t* p) { return *p == 0; }, &round->pending));
    for (const Round::Call& c : round->calls) {
      if (!c.status.ok()) {
        out.push_back(rpc::FromGrpc(c.status, "health check"));
      } else if (c.response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
        out.push_back(absl::UnavailableError("not ready"));
      } else {
        out.push_back(absl::OkStatus());
      }
    }
    return out;
  }

 private:
  const int64_t timeout_ms_;
  std::vector<std::unique_ptr<grpc::health::v1::Health::Stub>> stubs_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ReadinessProber>> ReadinessProber::ForCluster(const ClusterConfig& cluster,
                                                                             const ModelConfig& model, Report report,
                                                                             ReadinessOptions options) {
  const std::vector<const NodeConfig*> workers = cluster.workers();
  ODMOE_ASSIGN_OR_RETURN(
      const Placement placement,
      Placement::ForCluster(cluster.file, static_cast<int32_t>(workers.size()), cluster.group_size, model.top_k));
  std::vector<std::string> names;
  for (const NodeConfig* w : workers) names.push_back(w->name);
  auto probe = std::make_shared<HealthProbe>(workers, options.probe_timeout_ms);
  return std::make_unique<ReadinessProber>(
      SparseLayerOwners(placement, static_cast<int64_t>(model.SparseLayers().size()), model.num_experts),
      std::move(names), [probe] { return probe->Run(); }, std::move(report), options);
}

ReadinessProber::ReadinessProber(std::vector<std::vector<int32_t>> owners, std::vector<std::string> names, Probe probe,
                                 Report report, ReadinessOptions options)
    : owners_(std::move(owners)),
      names_(std::move(names)),
      probe_(std::move(probe)),
      report_(std::move(report)),
      options_(options) {}

ReadinessProber::~ReadinessProber() { Stop(); }

void ReadinessProber::Start() {
  ODMOE_CHECK(!thread_.joinable());  // started twice
  thread_ = std::thread([this] { Loop(); });
}

void ReadinessProber::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool ReadinessProber::ready() const {
  absl::MutexLock lock(&mu_);
  return verdict_.ready;
}

std::string ReadinessProber::reason() const {
  absl::MutexLock lock(&mu_);
  return verdict_.reason;
}

void ReadinessProber::Loop() {
  while (true) {
    const absl::Time next = absl::Now() + options_.period;
    RunRound();
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&stop_), next);
    if (stop_) return;
  }
}

void ReadinessProber::RunRound() {
  std::vector<absl::Status> probes = probe_();
  ODMOE_CHECK(probes.size() == names_.size());  // one probe status per worker
  ReadinessVerdict v = JudgeReadiness(owners_, names_, probes);
  bool changed = false;
  {
    absl::MutexLock lock(&mu_);
    changed = !reported_ || v.ready != verdict_.ready || v.unreachable != verdict_.unreachable;
    reported_ = true;
    verdict_ = v;
  }
  if (!changed) return;
  if (v.ready) {
    spdlog::info("ready: {}", v.reason);
  } else {
    spdlog::warn("not ready: {}", v.reason);
  }
  if (report_) report_(v);
}

}  // namespace odmoe
