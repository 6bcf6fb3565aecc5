#include "src/main_node/peer_health.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "spdlog/spdlog.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/peer_version.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {

std::string_view PeerStateName(PeerState state) {
  switch (state) {
    case PeerState::kUp:
      return "up";
    case PeerState::kDown:
      return "down";
    case PeerState::kUnknown:
      break;
  }
  return "unknown";
}

namespace {

// The PeerHealth whose events this thread is delivering now, if any (a listener's own reports are delivered by
// that loop, after the listener returns).
thread_local const PeerHealth* tl_delivering = nullptr;

std::string Seconds(absl::Duration d) { return absl::StrFormat("%.2f s", absl::ToDoubleSeconds(d)); }

// Main's verdict on one finished health check of `peer`, given the cluster main serves (empty: not compared).
void ReportCheck(PeerHealth& health, int32_t peer, const grpc::Status& st, const grpc::ClientContext& ctx,
                 const grpc::health::v1::HealthCheckResponse& response, const std::string& cluster) {
  if (!st.ok()) {
    health.ReportFailure(peer, StrCat("health check failed: ", st.error_message(), " (gRPC code ",
                                      static_cast<int>(st.error_code()), ")"));
    return;
  }
  const std::string theirs = rpc::ReceivedMetadata(ctx.GetServerInitialMetadata(), rpc::kClusterMetadataKey);
  if (!cluster.empty() && !theirs.empty() && theirs != cluster) {
    health.ReportForeign(peer, StrCat("serves another cluster (", theirs, "; this cluster: ", cluster,
                                      "): check its cluster file and model"));
  } else if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    health.ReportFailure(peer, "answers but is not ready");
  } else {
    health.ReportAlive(peer, "answers its health check and is ready");
  }
}

}  // namespace

PeerHealth::PeerHealth(std::vector<Peer> peers, PeerHealthOptions options, Clock clock)
    : peers_(std::move(peers)), options_(options), clock_(std::move(clock)) {
  absl::MutexLock lock(&mu_);
  records_.resize(peers_.size());
}

void PeerHealth::ChangeLocked(int32_t peer, PeerState to, std::string_view reason, absl::Time now, bool new_reason) {
  PeerRecord& r = records_[static_cast<size_t>(peer)];
  if (r.snapshot.state == to && (!new_reason || r.snapshot.reason == reason)) return;
  PeerEvent e;
  e.peer = peer;
  e.name = peers_[static_cast<size_t>(peer)].name;
  e.address = peers_[static_cast<size_t>(peer)].address;
  e.from = r.snapshot.state;
  e.to = to;
  e.reason = std::string(reason);
  e.at = now;
  e.silent = r.last_alive == absl::InfinitePast() ? absl::ZeroDuration() : now - r.last_alive;
  r.snapshot = Snapshot{to, e.reason, now};
  pending_.push_back(std::move(e));
}

void PeerHealth::ReportAlive(int32_t peer, std::string_view what) {
  ODMOE_CHECK(peer >= 0 && static_cast<size_t>(peer) < peers_.size());
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_();
    PeerRecord& r = records_[static_cast<size_t>(peer)];
    r.last_alive = now;
    r.foreign = false;
    ChangeLocked(peer, PeerState::kUp, what, now);
  }
  Deliver();
}

void PeerHealth::ReportFailure(int32_t peer, std::string_view why) {
  ODMOE_CHECK(peer >= 0 && static_cast<size_t>(peer) < peers_.size());
  {
    absl::MutexLock lock(&mu_);
    PeerRecord& r = records_[static_cast<size_t>(peer)];
    ChangeLocked(peer, PeerState::kDown, why, clock_(), /*new_reason=*/r.foreign);
    r.foreign = false;
  }
  Deliver();
}

void PeerHealth::ReportForeign(int32_t peer, std::string_view why) {
  ODMOE_CHECK(peer >= 0 && static_cast<size_t>(peer) < peers_.size());
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_();
    PeerRecord& r = records_[static_cast<size_t>(peer)];
    r.last_alive = now;  // it answers, for another cluster
    r.foreign = true;
    ChangeLocked(peer, PeerState::kDown, why, now, /*new_reason=*/true);
  }
  Deliver();
}

void PeerHealth::CheckSilence() {
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_();
    for (size_t i = 0; i < records_.size(); ++i) {
      const PeerRecord& r = records_[i];
      if (r.snapshot.state != PeerState::kUp || now - r.last_alive <= options_.down_after) continue;
      ChangeLocked(static_cast<int32_t>(i), PeerState::kDown,
                   StrCat("no answer for ", Seconds(now - r.last_alive), " (hung or partitioned?)"), now);
    }
  }
  Deliver();
}

PeerState PeerHealth::state(int32_t peer) const {
  absl::MutexLock lock(&mu_);
  return records_[static_cast<size_t>(peer)].snapshot.state;
}

PeerHealth::Snapshot PeerHealth::Get(int32_t peer) const {
  absl::MutexLock lock(&mu_);
  return records_[static_cast<size_t>(peer)].snapshot;
}

std::vector<PeerHealth::Snapshot> PeerHealth::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<Snapshot> out;
  for (const PeerRecord& r : records_) out.push_back(r.snapshot);
  return out;
}

absl::Status PeerHealth::CheckReachable(int32_t peer, std::string_view role) const {
  const Snapshot s = Get(peer);
  if (s.state != PeerState::kDown) return absl::OkStatus();
  const Peer& p = peers_[static_cast<size_t>(peer)];
  return absl::UnavailableError(StrCat(role, " ", p.name, " at ", p.address, " is unreachable (down for ",
                                       Seconds(clock_() - s.since), ": ", s.reason, ")"));
}

int64_t PeerHealth::Subscribe(Listener listener) {
  absl::MutexLock lock(&mu_);
  const int64_t id = next_listener_++;
  listeners_.emplace_back(id, std::make_shared<Listener>(std::move(listener)));
  return id;
}

void PeerHealth::Unsubscribe(int64_t id) {
  {
    absl::MutexLock lock(&mu_);
    std::erase_if(listeners_, [id](const auto& l) { return l.first == id; });
  }
  // A delivery in progress may still hold the listener: wait for it (deliveries take deliver_mu_).
  absl::MutexLock wait(&deliver_mu_);
}

void PeerHealth::Deliver() {
  if (tl_delivering == this) return;  // the loop below, further up this thread's stack, delivers it
  absl::MutexLock deliver(&deliver_mu_);
  tl_delivering = this;
  for (;;) {
    PeerEvent e;
    std::vector<std::shared_ptr<Listener>> listeners;
    {
      absl::MutexLock lock(&mu_);
      if (pending_.empty()) break;
      e = std::move(pending_.front());
      pending_.pop_front();
      for (const auto& l : listeners_) listeners.push_back(l.second);
    }
    if (e.to == PeerState::kDown) {
      spdlog::warn("peer {} at {} is down: {}{}", e.name, e.address, e.reason,
                   e.silent > absl::ZeroDuration() ? StrCat(" (last answer ", Seconds(e.silent), " ago)") : "");
    } else {
      spdlog::info("peer {} at {} is up: {}", e.name, e.address, e.reason);
    }
    for (const auto& l : listeners) (*l)(e);
  }
  tl_delivering = nullptr;
}

// The health checks, one slot per peer. The callbacks borrow it: Stop returns only once every callback has
// returned, so the prober frees it (and with it the channels and ClientContexts) on the thread that stops it,
// never on a gRPC callback thread (rpc::MakeChannel says why that matters).
struct PeerProber::Checks {
  explicit Checks(size_t n) : slots(n) {}
  struct Slot {
    std::unique_ptr<grpc::health::v1::Health::Stub> stub;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<grpc::ClientContext> ctx;  // of the check in flight
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
  };
  std::vector<Slot> slots;  // stubs and channels fixed at construction
  absl::Mutex mu;
  std::vector<bool> in_flight ABSL_GUARDED_BY(mu);
  int active ABSL_GUARDED_BY(mu) = 0;  // checks started whose callback has not returned
  bool stopped ABSL_GUARDED_BY(mu) = false;
};

PeerProber::PeerProber(PeerHealth& health, PeerProberOptions options)
    : health_(health), options_(options), checks_(std::make_unique<Checks>(health.size())) {
  for (size_t i = 0; i < health.size(); ++i) {
    Checks::Slot& s = checks_->slots[i];
    s.channel = rpc::MakeChannel(health.peer(static_cast<int32_t>(i)).address);
    s.stub = grpc::health::v1::Health::NewStub(s.channel);
    s.request.set_service(rpc::kReadinessService);
  }
  absl::MutexLock lock(&checks_->mu);
  checks_->in_flight.assign(health.size(), false);
}

PeerProber::~PeerProber() { Stop(); }

void PeerProber::Start() {
  ODMOE_CHECK(!thread_.joinable());  // started twice
  thread_ = std::thread([this] { Loop(); });
}

void PeerProber::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  // No check starts any more; cancel those in flight and wait for their callbacks.
  std::vector<grpc::ClientContext*> contexts;
  {
    absl::MutexLock lock(&checks_->mu);
    checks_->stopped = true;
    for (size_t i = 0; i < checks_->slots.size(); ++i) {
      if (checks_->in_flight[i]) contexts.push_back(checks_->slots[i].ctx.get());
    }
  }
  for (grpc::ClientContext* ctx : contexts) ctx->TryCancel();
  absl::MutexLock lock(&checks_->mu);
  checks_->mu.Await(absl::Condition(
      +[](int* active) { return *active == 0; }, &checks_->active));
}

void PeerProber::Loop() {
  Checks* const checks = checks_.get();
  PeerHealth* health = &health_;
  const std::string* cluster = &options_.cluster;  // outlives the callbacks, as `checks` does
  while (true) {
    const absl::Time next = absl::Now() + options_.period;
    for (size_t i = 0; i < checks->slots.size(); ++i) {
      Checks::Slot& s = checks->slots[i];
      const int32_t peer = static_cast<int32_t>(i);
      // A channel that failed to connect (refused, reset, or closed by a keepalive timeout and not back) is down
      // without waiting for its health check.
      if (s.channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
        health->ReportFailure(peer, "cannot connect (channel in TRANSIENT_FAILURE)");
      }
      {
        absl::MutexLock lock(&checks->mu);
        if (checks->stopped || checks->in_flight[i]) continue;
        checks->in_flight[i] = true;
        ++checks->active;
        s.ctx = std::make_unique<grpc::ClientContext>();
      }
      rpc::SetDeadline(*s.ctx, absl::ToInt64Milliseconds(options_.timeout));
      s.response.Clear();
      auto done = [checks, health, cluster, peer, &s](grpc::Status st) {
        bool stopped = false;
        {
          absl::MutexLock lock(&checks->mu);
          stopped = checks->stopped;
        }
        if (!stopped) ReportCheck(*health, peer, st, *s.ctx, s.response, *cluster);
        absl::MutexLock lock(&checks->mu);
        checks->in_flight[static_cast<size_t>(peer)] = false;
        --checks->active;  // `checks` may be freed from here on
      };
      s.stub->async()->Check(s.ctx.get(), &s.request, &s.response, std::move(done));
    }
    health->CheckSilence();
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&stop_), next);
    if (stop_) return;
  }
}

}  // namespace odmoe
