// Main's membership of the workers (Operations 4/4): which workers take work, at which epoch. Main is the
// authority; every other node learns the membership from main's messages (the view in every request header and
// in every FollowStep to the shadow) and places experts over it with the same rule (Placement::Without).
//
// The rule, driven by main's verdict on each worker (PeerHealth):
//   - at start every worker is a member, at epoch FirstEpoch() (main's start time in microseconds since the
//     Unix epoch, so that a restarted main's epochs are newer than any of its predecessor's);
//   - a member that PeerHealth marks down (a crash, a hang, a partition) leaves: epoch + 1;
//   - a worker out of the placement that PeerHealth marks up again (it answers health checks: restarted, or the
//     partition healed) rejoins: epoch + 1.
// Each change is one log line ("membership epoch E: worker W left (REASON); M of N workers take work") and is
// counted per worker and direction (changes()); waiters (AwaitNewer) are woken.
//
// A worker that takes no part may still be reached: nothing else changes for it, and the next epoch that makes
// it a member again sends it work.
//
// Thread safety: every method may be called from any thread. The PeerHealth listener runs on the thread that
// reported the change.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/common/placement.h"
#include "src/main_node/peer_health.h"

namespace odmoe {

class Membership {
 public:
  struct Snapshot {
    MembershipView view;  // the epoch and the workers out of the placement
    Placement placement;  // the layout over the members
  };
  // What happened to one worker since start.
  struct Changes {
    uint64_t left = 0;
    uint64_t joined = 0;
  };

  // The epoch a main starting now begins with (microseconds since the Unix epoch).
  static uint64_t FirstEpoch();

  // `base`: the cluster's layout, every worker a member; `names`: the workers' names (index = worker index,
  // peer i of `health`). Subscribes to `health` (nullable: a fixed membership), which must outlive this.
  Membership(Placement base, std::vector<std::string> names, PeerHealth* health, uint64_t first_epoch);
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  Snapshot Current() const;
  // Waits until the epoch is newer than `epoch`, or until `deadline`; returns the membership then.
  Snapshot AwaitNewer(uint64_t epoch, absl::Time deadline) const;
  // Per worker (index = worker index).
  std::vector<Changes> changes() const;
  const std::vector<std::string>& names() const { return names_; }
  // When no worker is a member: Unavailable "WHAT cannot be served: every worker is out of the placement:
  // w0 (REASON); w1 (...)"; else OK.
  absl::Status CheckServable(std::string_view what) const;

 private:
  void OnPeerEvent(const PeerEvent& event);

  const Placement base_;
  const std::vector<std::string> names_;
  PeerHealth* const health_;
  int64_t subscription_ = 0;

  mutable absl::Mutex mu_;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_);
  Placement placement_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> why_absent_ ABSL_GUARDED_BY(mu_);  // per worker: the reason it left ("" for members)
  std::vector<Changes> changes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace odmoe
