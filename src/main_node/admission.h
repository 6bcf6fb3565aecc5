// Admission control on main (Client API 2/2): a bounded, first-come-first-served queue in front of the engine.
//
// Up to `max_running` requests run at once (the batch loop decodes them together: continuous batching) and up
// to `max_queued` more wait their turn in arrival order; a request arriving when max_running + max_queued
// already run or wait (no running place is free for it and max_queued wait) is refused at once with
// ResourceExhausted marked busy (ServerBusyError in src/common/status.h; gRPC RESOURCE_EXHAUSTED, HTTP 429 with
// Retry-After, `odmoe generate` exit 10). So at most max_running + max_queued tickets exist, the queue is never
// unbounded and the gRPC server never runs out of threads: main's thread quota covers the running requests, the
// queue and its other RPCs (see MainNode).
//
// First come, first served: a ticket's turn comes when it is at the front of the queue and fewer than
// max_running run; a later arrival never overtakes an earlier one. A waiting request leaves the queue when its
// client goes away or its deadline passes (its place is given to the next one), and a Ticket leaves whatever it
// holds (its place in the queue or its running place) when it is destroyed or Leave()s.
//
// One API request's choices run one after another on a ticket (ParallelChoices): a choice that ends Yield()s its
// running place to the next in the queue and keeps the ticket's count, so the next choice on that ticket queues
// again at the back (WaitTurn) without meeting a full queue. A yielded ticket blocks no one: it only counts
// against max_running + max_queued, as it did while it ran.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace odmoe {

// Polled while a request waits for its turn and while it runs: OK to go on, or why it stops now, which is then
// the request's outcome (Cancelled when its client went away, Unavailable when the server shuts down, Aborted
// when another choice of the same API request failed, ...). A null StopCheck never stops a request.
using StopCheck = std::function<absl::Status()>;

class Admission {
 public:
  class Ticket;

  // REQUIRES: max_queued >= 0, max_running >= 1.
  explicit Admission(int32_t max_queued, int32_t max_running = 1);
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // A place in the queue, or ServerBusyError naming the running and queued counts and both limits when
  // running() + waiting() >= max_running + max_queued (no running place is free for it and max_queued wait).
  absl::StatusOr<Ticket> Arrive();

  int32_t running() const;  // tickets holding a running place: 0..max_running
  int32_t waiting() const;  // tickets in the queue (arrived, not yet running)
  int32_t yielded() const;  // tickets that ran and Yield()ed, neither running nor queued
  int32_t tickets() const;  // all three at once: at most max_running + max_queued
  int32_t max_queued() const { return max_queued_; }
  int32_t max_running() const { return max_running_; }

 private:
  void Leave(uint64_t id);
  void Yield(uint64_t id);

  const int32_t max_queued_;   // constant after construction
  const int32_t max_running_;  // constant after construction
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<uint64_t> waiting_ ABSL_GUARDED_BY(mu_);   // in arrival order
  std::vector<uint64_t> running_ ABSL_GUARDED_BY(mu_);  // the tickets holding a running place (<= max_running_)
  std::vector<uint64_t> yielded_ ABSL_GUARDED_BY(mu_);  // counted, neither running nor waiting
};

class Admission::Ticket {
 public:
  Ticket(Ticket&& other) noexcept : admission_(other.admission_), id_(other.id_) { other.admission_ = nullptr; }
  Ticket& operator=(Ticket&&) = delete;
  Ticket(const Ticket&) = delete;
  ~Ticket();

  // Waits until every request that arrived earlier is running or has left and fewer than max_running run, then
  // holds a running place until the ticket is destroyed, leaves or yields. A yielded ticket first queues again,
  // at the back. `stop`'s status (polled every 20 ms) when it is not OK, "while the request was queued" added to
  // its message; DeadlineExceeded at `deadline`. The ticket has left the queue then.
  // REQUIRES: held(), and the ticket holds no running place (it has not had its turn, or it yielded since).
  absl::Status WaitTurn(const StopCheck& stop, absl::Time deadline);
  // Gives its running place to the next in the queue and keeps its count (see the file comment); a ticket that
  // waits or has left is unchanged.
  void Yield();
  // Leaves the queue, or frees its running place for the next request, now (the destructor does it otherwise).
  void Leave();
  // Not left and not moved from.
  bool held() const { return admission_ != nullptr; }

 private:
  friend class Admission;
  Ticket(Admission* admission, uint64_t id) : admission_(admission), id_(id) {}
  Admission* admission_;  // nullptr once moved from or left
  uint64_t id_;
};

}  // namespace odmoe
