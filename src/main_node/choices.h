// The choices of one OpenAI API request (its prompts times `n`), run side by side so that main's batch loop decodes
// them together (continuous batching), and the queue that carries a streamed request's events from the threads
// running its choices to the one thread that writes to the client.
//
// ParallelChoices runs jobs 0..count-1 on `window` threads of its own, each taking the next job as it finishes one
// (so at most `window` run at once, in index order of their start). The first `window` jobs run on places in main's
// queue taken beforehand, all or none (the HTTP API answers 429 before any work when the queue has no room for
// them); a later job arrives in the queue when it starts, behind whatever arrived meanwhile, as a request of its
// own would. The first job to fail stops the hand-out: no job starts after it, and failed() turns true once its
// error is recorded, so the jobs still running (the caller's to stop, through their RunRequest's `stop`) may stop
// on it without their own error ever being taken for the request's.
//
// EventQueue is bounded: a producer waits while `capacity` events wait to be written, so a client that reads slowly
// slows its own choices and nothing else, and memory stays bounded; once the reader closes it (the client went away)
// every Push fails at once, which cancels the choices.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/main_node/admission.h"

namespace odmoe {

class ParallelChoices {
 public:
  // Runs choice `index`. `admitted`: its place in main's queue taken beforehand (the first window's), or nullptr
  // (it arrives when it runs).
  using Job = std::function<absl::Status(int64_t index, Admission::Ticket* admitted)>;

  // Jobs 0..count-1, job i < tickets.size() (the window) on tickets[i]; Start runs them.
  // REQUIRES: 1 <= tickets.size() <= count.
  ParallelChoices(int64_t count, std::vector<Admission::Ticket> tickets);
  ParallelChoices(const ParallelChoices&) = delete;
  ParallelChoices& operator=(const ParallelChoices&) = delete;
  ~ParallelChoices();  // Wait()s

  // Starts the window's threads over the jobs (so a job may call failed() on this object). `on_finished`
  // (optional) is called once, on the last thread to end, when every job has ended or will never start.
  // REQUIRES: called once.
  void Start(Job job, std::function<void()> on_finished = nullptr);
  // True once a job has failed and its error is recorded (the one Wait returns).
  bool failed() const { return failed_.load(); }
  // Blocks until every thread has ended: OK, or the error of the first job that failed.
  absl::Status Wait();

 private:
  void Work();

  const int64_t count_;
  Job job_;                            // set by Start, before any thread
  std::function<void()> on_finished_;  // set by Start, before any thread
  std::atomic<bool> failed_{false};
  std::vector<Admission::Ticket> tickets_;  // job i < tickets_.size() runs on tickets_[i]; its pointer is stable
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;     // the next job to hand out
  int64_t working_ ABSL_GUARDED_BY(mu_) = 0;  // threads not yet ended
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

class EventQueue {
 public:
  // REQUIRES: capacity >= 1.
  explicit EventQueue(size_t capacity) : capacity_(capacity) {}

  // Appends `event`, waiting while `capacity` events wait. False (and `event` dropped) once the reader has closed.
  bool Push(std::string event);
  // No more events will come (every producer has ended).
  void FinishWriting();
  // The reader stops reading: waiting and later pushes return false.
  void CloseReader();

  struct Next {
    std::optional<std::string> event;  // the next event, or none
    bool finished = false;             // none, and none will come: the producers have finished and all was read
  };
  // The next event, waiting at most `timeout` for one (then neither an event nor finished: the reader may check
  // its client and wait again).
  Next Pop(absl::Duration timeout);

 private:
  const size_t capacity_;
  absl::Mutex mu_;
  std::deque<std::string> events_ ABSL_GUARDED_BY(mu_);
  bool writing_done_ ABSL_GUARDED_BY(mu_) = false;
  bool reader_closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace odmoe
