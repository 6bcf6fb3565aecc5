// Main's verdict on each peer it depends on (the workers, and the shadow): up or down, and why.
//
// PeerHealth is bookkeeping with no I/O: it takes evidence and turns it into one state per peer, and tells
// subscribers of every change. Evidence comes from three places: the health checks of PeerProber (below), the
// outcome of each expert call (RemoteExpertExecutor), and the state of the gRPC channel to the peer (whose
// connection carries keepalive pings, rpc::ChannelArgs). The rule:
//   - a peer is kUnknown until the first evidence about it arrives;
//   - ReportAlive (an answer: a SERVING health check, a completed call) makes it kUp;
//   - ReportFailure (no answer: connection refused or reset, a health check past its deadline, not ready, a call
//     that failed in transport) makes it kDown at once;
//   - ReportForeign (an answer from a node of another cluster) makes it kDown at once too, and a peer already
//     down for another reason (a worker stopped, then restarted from another cluster file) gets the new reason;
//     a ReportFailure after it (that node stopped in turn) gives its own reason back;
//   - CheckSilence makes a kUp peer kDown once nothing has shown it alive for `down_after` (a hung or
//     partitioned peer answers nothing and refuses nothing).
// With PeerProber's defaults (a health check every 250 ms, each with a 1.5 s deadline) a crash is seen within one
// period and a hang (SIGSTOP) or a partition within about 1.75 s (sanitizer builds: deadlines x kBuildSlowdown).
//
// Every change (kUnknown -> kUp/kDown, kUp -> kDown, kDown -> kUp, and the kDown -> kDown of a reason that changes
// between another cluster and no answer) is logged
// once ("peer NAME at ADDRESS is down: REASON" / "... is up ...") and delivered to every subscriber as a
// PeerEvent. The next step (failover,
// membership epochs) subscribes here.
//
// Thread safety: every method may be called from any thread. Listeners are called without PeerHealth's lock
// held, one event at a time and in the order of the changes, on the thread whose report caused the change (a
// listener that reports evidence itself has its events delivered after it returns, by the same loop).
// Listeners may read states (state, Get, All) but must not call Subscribe or Unsubscribe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "src/common/limits.h"

namespace odmoe {

enum class PeerState { kUnknown, kUp, kDown };
// "unknown", "up", "down".
std::string_view PeerStateName(PeerState state);

struct PeerEvent {
  int32_t peer = 0;  // index into the peer list
  std::string name;
  std::string address;
  PeerState from = PeerState::kUnknown;
  PeerState to = PeerState::kUnknown;  // equal to `from` (kDown) only when a down peer's reason changed
  std::string reason;     // what showed it: the failure, or what answered
  absl::Time at;          // when the change was made (PeerHealth's clock)
  absl::Duration silent;  // for a change to kDown: time since the last sign of life (zero if none was ever seen)
};

struct PeerHealthOptions {
  // A kUp peer with no sign of life for this long is kDown (CheckSilence).
  absl::Duration down_after = absl::Milliseconds(1500) * kBuildSlowdown;
};

class PeerHealth {
 public:
  struct Peer {
    std::string name;
    std::string address;
  };
  using Clock = std::function<absl::Time()>;
  using Listener = std::function<void(const PeerEvent&)>;

  // `clock` is read for every report (tests pass a fake one).
  explicit PeerHealth(
      std::vector<Peer> peers, PeerHealthOptions options = {}, Clock clock = [] { return absl::Now(); });
  PeerHealth(const PeerHealth&) = delete;
  PeerHealth& operator=(const PeerHealth&) = delete;

  // Evidence about peer `peer` (REQUIRES: 0 <= peer < size()). `what` / `why` become the event's reason.
  void ReportAlive(int32_t peer, std::string_view what);
  void ReportFailure(int32_t peer, std::string_view why);
  // An answer from a node of another cluster: as ReportFailure, and a peer already down with another reason gets
  // an event (kDown -> kDown) with `why`. The same `why` again changes nothing. The event's `silent` is 0: the
  // node answers. ReportFailure of a peer down as foreign gives it the failure's reason (one kDown -> kDown).
  void ReportForeign(int32_t peer, std::string_view why);
  // Marks kDown every kUp peer silent for more than down_after.
  void CheckSilence();

  struct Snapshot {
    PeerState state = PeerState::kUnknown;
    std::string reason;  // of the last change ("" while kUnknown)
    absl::Time since;    // of the last change
  };
  PeerState state(int32_t peer) const;
  Snapshot Get(int32_t peer) const;
  std::vector<Snapshot> All() const;
  // When the peer is kDown: Unavailable "ROLE NAME at ADDRESS is unreachable (down for 1.20 s: REASON)" (`role`
  // e.g. "worker"); else OK.
  absl::Status CheckReachable(int32_t peer, std::string_view role = "peer") const;

  // `listener` gets every change made after Subscribe returns. The id is for Unsubscribe.
  int64_t Subscribe(Listener listener);
  // After Unsubscribe returns, the listener is not running and will not be called again.
  void Unsubscribe(int64_t id);

  size_t size() const { return peers_.size(); }
  const Peer& peer(int32_t i) const { return peers_[static_cast<size_t>(i)]; }
  const PeerHealthOptions& options() const { return options_; }

 private:
  struct PeerRecord {
    Snapshot snapshot;
    absl::Time last_alive = absl::InfinitePast();  // the last answer, a foreign one included
    bool foreign = false;                          // down by ReportForeign, not since given another reason
  };
  // Changes peer `peer` to `to` and queues the event; a no-op when it is already there, unless `new_reason` and
  // its reason differs.
  void ChangeLocked(int32_t peer, PeerState to, std::string_view reason, absl::Time now, bool new_reason = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Logs and delivers the queued events (see the thread-safety note).
  void Deliver() ABSL_LOCKS_EXCLUDED(mu_);

  const std::vector<Peer> peers_;
  const PeerHealthOptions options_;
  const Clock clock_;

  // Lock order: deliver_mu_ before mu_.
  absl::Mutex deliver_mu_;  // held while listeners run
  mutable absl::Mutex mu_;
  std::vector<PeerRecord> records_ ABSL_GUARDED_BY(mu_);
  std::deque<PeerEvent> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int64_t, std::shared_ptr<Listener>>> listeners_ ABSL_GUARDED_BY(mu_);
  int64_t next_listener_ ABSL_GUARDED_BY(mu_) = 1;
};

struct PeerProberOptions {
  absl::Duration period = absl::Milliseconds(250);    // between the starts of two health checks of a peer
  absl::Duration timeout = absl::Milliseconds(1500) * kBuildSlowdown;  // each health check's deadline
  // The cluster main serves (rpc::ClusterIdentity). A peer whose answer names another (started from another
  // cluster file, or with another model: it would refuse every call) is down; one whose answer names none (a
  // build before identities) is judged by its answer alone. Empty: not compared.
  std::string cluster;
};

// Asks each peer's grpc.health.v1 "odmoe.ready" every period (at most one check in flight per peer, gRPC
// callback calls) and watches its channel's state, reporting to a PeerHealth; then CheckSilence. An answer is
// alive when it is SERVING and names no other cluster than options.cluster; a peer of another cluster stays down
// ("serves another cluster (epoch E, model F; this cluster: ...)") for as long as it answers so. The channels
// are rpc::MakeChannel's, so they share the connection (and its keepalive) with main's other calls to the peer.
//
// Thread safety: the prober owns one thread (Start .. Stop); the health checks' callbacks run on gRPC's threads
// and report from there. Stop cancels the checks in flight and waits until their callbacks have returned.
class PeerProber {
 public:
  // `health` must outlive the prober; its peers' addresses are dialed.
  PeerProber(PeerHealth& health, PeerProberOptions options = {});
  ~PeerProber();
  PeerProber(const PeerProber&) = delete;
  PeerProber& operator=(const PeerProber&) = delete;

  // REQUIRES: not started before.
  void Start();
  // Cancels the checks in flight and joins; no report is made after Stop returns. Idempotent.
  void Stop();

 private:
  struct Checks;  // the channels and the checks in flight, borrowed by their callbacks (peer_health.cc)
  void Loop();

  PeerHealth& health_;
  const PeerProberOptions options_;
  std::unique_ptr<Checks> checks_;
  std::thread thread_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace odmoe
