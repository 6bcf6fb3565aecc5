#include "src/main_node/membership.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "spdlog/spdlog.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {

uint64_t Membership::FirstEpoch() { return static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())); }

Membership::Membership(Placement base, std::vector<std::string> names, PeerHealth* health, uint64_t first_epoch)
    : base_(base),
      names_(std::move(names)),
      health_(health),
      epoch_(first_epoch),
      placement_(base),
      why_absent_(names_.size()),
      changes_(names_.size()) {
  ODMOE_CHECK(static_cast<int32_t>(names_.size()) == base_.num_workers());
  if (health_ != nullptr) {
    ODMOE_CHECK(health_->size() >= names_.size());  // peer i is worker i
    subscription_ = health_->Subscribe([this](const PeerEvent& e) { OnPeerEvent(e); });
  }
}

Membership::~Membership() {
  if (subscription_ != 0) health_->Unsubscribe(subscription_);
}

Membership::Snapshot Membership::Current() const {
  absl::MutexLock lock(&mu_);
  return {{epoch_, placement_.absent()}, placement_};
}

Membership::Snapshot Membership::AwaitNewer(uint64_t epoch, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto newer = [this, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return epoch_ > epoch; };
  mu_.AwaitWithDeadline(absl::Condition(&newer), deadline);
  return {{epoch_, placement_.absent()}, placement_};
}

std::vector<Membership::Changes> Membership::changes() const {
  absl::MutexLock lock(&mu_);
  return changes_;
}

absl::Status Membership::CheckServable(std::string_view what) const {
  absl::MutexLock lock(&mu_);
  if (placement_.servable()) return absl::OkStatus();
  std::string who;
  for (size_t w = 0; w < names_.size(); ++w) {
    who += StrCat(w == 0 ? "" : "; ", names_[w], " (", why_absent_[w], ")");
  }
  return absl::UnavailableError(
      StrCat(what, " cannot be served: every worker is out of the placement (membership epoch ", epoch_, "): ", who));
}

void Membership::OnPeerEvent(const PeerEvent& event) {
  const size_t w = static_cast<size_t>(event.peer);
  if (w >= names_.size()) return;  // the shadow
  const bool up = event.to == PeerState::kUp;
  if (!up && event.to != PeerState::kDown) return;
  std::string line;
  {
    absl::MutexLock lock(&mu_);
    if (placement_.member(event.peer) == up) {  // no change: a first "up", or down while out already
      if (!up) why_absent_[w] = event.reason;   // a new reason for the same absence (PeerHealth::ReportForeign)
      return;
    }
    std::vector<int32_t> absent = placement_.absent();
    if (up) {
      absent.erase(std::find(absent.begin(), absent.end(), event.peer));
      why_absent_[w].clear();
      ++changes_[w].joined;
    } else {
      absent.push_back(event.peer);
      why_absent_[w] = event.reason;
      ++changes_[w].left;
    }
    placement_ = base_.Without(absent).value();  // indices come from the base: always valid
    ++epoch_;
    line = StrCat("membership epoch ", epoch_, ": worker ", names_[w], up ? " rejoined (" : " left (", event.reason,
                  "); ", placement_.num_members(), " of ", names_.size(), " workers take work",
                  placement_.servable() ? "" : ": requests fail until one returns");
  }
  if (up) {
    spdlog::info("{}", line);
  } else {
    spdlog::warn("{}", line);
  }
}

}  // namespace odmoe
