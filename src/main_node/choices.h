// The choices of one OpenAI API request (its prompts times `n`), run side by side so that main's batch loop decodes
// them together (continuous batching), and the queue that carries a streamed request's events from the threads
// running its choices to the one thread that writes to the client.
//
// ParallelChoices runs jobs 0..count-1 on `window` threads of its own, each taking the next job as it finishes one
// (so at most `window` run at once, in index order of their start). Each thread runs its jobs on one place in
// main's queue, taken beforehand for the whole window, all or none (the HTTP API answers 429 before any work when
// the queue has no room for them): a job that ends yields its running place (Admission::Ticket::Yield, done by
// RunRequest) and the thread's next job queues again on the same ticket, behind whatever arrived meanwhile, so a
// later choice is never refused for a full queue once the request is accepted. A thread leaves its place when it
// has no job left. The first job to fail stops the hand-out: no job starts after it, and failed() turns true once
// its error is recorded, so the jobs still running (the caller's to stop, through their RunRequest's `stop`) may
// stop on it without their own error ever being taken for the request's.
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
  // Runs choice `index`. `admitted`: the thread's place in main's queue, or nullptr when it was left (the job
  // then arrives in the queue when it runs).
  using Job = std::function<absl::Status(int64_t index, Admission::Ticket* admitted)>;

  // Jobs 0..count-1 on tickets.size() (the window) threads, thread t on tickets[t]; Start runs them.
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
  // Waits at most `timeout` for every job to end (or never start): true when they have, so that Wait returns at
  // once. REQUIRES: Start was called.
  bool WaitFor(absl::Duration timeout);
  // Blocks until every thread has ended: OK, or the error of the first job that failed.
  absl::Status Wait();

 private:
  void Work(Admission::Ticket* ticket);

  const int64_t count_;
  Job job_;                            // set by Start, before any thread
  std::function<void()> on_finished_;  // set by Start, before any thread
  std::atomic<bool> failed_{false};
  std::vector<Admission::Ticket> tickets_;  // thread t's jobs run on tickets_[t]; the pointers are stable
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
