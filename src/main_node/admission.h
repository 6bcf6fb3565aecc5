// Admission control on main (Client API 2/2): a bounded, first-come-first-served queue in front of the engine.
//
// Main serves one request at a time (continuous batching is not there yet); up to `max_queued` more wait their
// turn in arrival order, and a request arriving when that many wait already is refused at once with
// ResourceExhausted marked busy (ServerBusyError in src/common/status.h; gRPC RESOURCE_EXHAUSTED, HTTP 429 with Retry-After, `odmoe
// generate` exit 10). So the queue is never unbounded and the gRPC server never runs out of threads: main's
// thread quota covers the running request, the queue and its other RPCs (see MainNode).
//
// A waiting request leaves the queue when its client goes away or its deadline passes (its place is given to
// the next one), and a Ticket leaves whatever it holds when it is destroyed.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace odmoe {

class Admission {
 public:
  class Ticket;

  // REQUIRES: max_queued >= 0.
  explicit Admission(int32_t max_queued);
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // A place in the queue, or ServerBusyError naming the running and queued counts and the limit.
  absl::StatusOr<Ticket> Arrive();

  int32_t running() const;  // 0 or 1
  int32_t waiting() const;
  int32_t max_queued() const { return max_queued_; }

 private:
  void Leave(uint64_t id);

  const int32_t max_queued_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<uint64_t> waiting_ ABSL_GUARDED_BY(mu_);  // in arrival order
  uint64_t running_ ABSL_GUARDED_BY(mu_) = 0;          // the ticket that holds the engine (0: none)
};

class Admission::Ticket {
 public:
  Ticket(Ticket&& other) noexcept : admission_(other.admission_), id_(other.id_) { other.admission_ = nullptr; }
  Ticket& operator=(Ticket&&) = delete;
  Ticket(const Ticket&) = delete;
  ~Ticket();

  // Waits until every request that arrived earlier has left, then holds the engine until the ticket is
  // destroyed. Cancelled when `cancelled` (optional, polled every 20 ms) returns true, DeadlineExceeded at
  // `deadline`; the ticket has left the queue then.
  absl::Status WaitTurn(const std::function<bool()>& cancelled, absl::Time deadline);
  // Leaves the queue, or gives the engine to the next request, now (the destructor does it otherwise).
  void Leave();

 private:
  friend class Admission;
  Ticket(Admission* admission, uint64_t id) : admission_(admission), id_(id) {}
  Admission* admission_;  // nullptr once moved from or left
  uint64_t id_;
};

}  // namespace odmoe
