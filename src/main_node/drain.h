// Graceful shutdown of main's HTTP API: the requests it serves are counted so that a stop (SIGTERM) can wait for
// them to finish, as the gRPC server does for its calls.
//
// A request holds a Pass for its whole life (a streamed one until its last byte is written). Close() refuses every
// later Enter, so a drain ends: once closed, the count only goes down. WaitIdle waits for the passes out to come
// back, up to a deadline.
//
// Thread safety: every method may be called from any thread; a Pass may be destroyed on any thread.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace odmoe {

class RequestDrain {
 public:
  class Pass {
   public:
    Pass(Pass&& other) noexcept : drain_(other.drain_) { other.drain_ = nullptr; }
    Pass& operator=(Pass&&) = delete;
    Pass(const Pass&) = delete;
    ~Pass();

   private:
    friend class RequestDrain;
    explicit Pass(RequestDrain* drain) : drain_(drain) {}
    RequestDrain* drain_;  // nullptr once moved from
  };

  RequestDrain() = default;
  RequestDrain(const RequestDrain&) = delete;
  RequestDrain& operator=(const RequestDrain&) = delete;
  // REQUIRES: no Pass is out (they point to the drain).
  ~RequestDrain() = default;

  // A pass for a request arriving now, or none once Close() was called (the caller refuses the request).
  std::optional<Pass> Enter();
  // From now on Enter gives no pass.
  void Close();
  // Closes, then waits until every pass has come back or `deadline` passes: the passes still out (0 when idle).
  int64_t WaitIdle(absl::Time deadline);
  int64_t in_flight() const;

 private:
  mutable absl::Mutex mu_;
  int64_t out_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace odmoe
