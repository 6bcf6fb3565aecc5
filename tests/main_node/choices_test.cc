// The choices of one OpenAI API request run side by side: every job runs once, at most the window at a time, each
// on its thread's place taken beforehand (queued again behind later arrivals, never refused); the first failure
// stops the hand-out and is the one returned. A streamed request's event queue is bounded, hands every event over
// in order and lets producers go once its reader has closed.
#include "src/main_node/choices.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

std::vector<Admission::Ticket> Tickets(Admission& admission, int count) {
  std::vector<Admission::Ticket> tickets;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<Admission::Ticket> t = admission.Arrive();
    EXPECT_TRUE(t.ok()) << t.status();
    tickets.push_back(std::move(t).value());
  }
  return tickets;
}

TEST(ParallelChoicesTest, RunsEveryJobOnceAtMostTheWindowAtATime) {
  Admission admission(/*max_queued=*/8, /*max_running=*/3);
  absl::Mutex mu;
  std::vector<int> runs(10, 0);
  std::set<Admission::Ticket*> tickets_seen;
  int running = 0, most_running = 0, finished_calls = 0;
  std::atomic<bool> all_ended_when_finished{false};
  {
    ParallelChoices choices(10, Tickets(admission, 3));
    choices.Start(
        [&](int64_t index, Admission::Ticket* ticket) {
          absl::MutexLock lock(&mu);
          ++runs[index];
          most_running = std::max(most_running, ++running);
          // Every job runs on a place taken beforehand, its thread's.
          EXPECT_NE(ticket, nullptr) << index;
          tickets_seen.insert(ticket);
          // The first three run together: each waits for the other two.
          auto three = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return most_running == 3; };
          if (index < 3) {
            EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&three), absl::Seconds(10))) << index;
          }
          --running;
          return absl::OkStatus();
        },
        [&] {
          absl::MutexLock lock(&mu);
          ++finished_calls;
          all_ended_when_finished.store(running == 0);
        });
    EXPECT_TRUE(choices.Wait().ok());
  }
  EXPECT_EQ(runs, std::vector<int>(10, 1));
  EXPECT_EQ(most_running, 3);
  EXPECT_EQ(tickets_seen.size(), 3u);
  EXPECT_EQ(finished_calls, 1);
  EXPECT_TRUE(all_ended_when_finished.load());
  // Every place was left: the queue is empty again.
  EXPECT_EQ(admission.running(), 0);
  EXPECT_EQ(admission.waiting(), 0);
}

// Jobs that use their place as RunRequest does (wait for the turn, run, yield): with the queue full, every job
// runs, none is refused, and a request that arrived while the first ones ran gets its turn before any job that
// queued again on a place that had run.
TEST(ParallelChoicesTest, LaterJobsRunOnTheirThreadsPlaceBehindThoseThatArrivedMeanwhile) {
  Admission admission(/*max_queued=*/1, /*max_running=*/2);
  absl::Mutex mu;
  std::map<Admission::Ticket*, int> jobs_on;  // per place, the jobs that had their turn on it
  bool other_arrived = false;                 // the first job's to set
  std::atomic<int> over_bound{0}, ran{0};
  std::atomic<bool> other_runs{false};
  std::optional<Admission::Ticket> other;
  std::thread other_thread;
  {
    ParallelChoices choices(6, Tickets(admission, 2));
    choices.Start([&](int64_t index, Admission::Ticket* ticket) -> absl::Status {
      if (ticket == nullptr) return absl::InternalError(StrCat("job ", index, " has no place"));
      ODMOE_RETURN_IF_ERROR(ticket->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)));
      ++ran;
      if (admission.tickets() > 3) ++over_bound;
      bool first_on_place = false, arrives_other = false;
      {
        absl::MutexLock lock(&mu);
        first_on_place = jobs_on[ticket]++ == 0;
        arrives_other = !other_arrived;
        other_arrived = true;
      }
      if (arrives_other) {  // another client's request arrives while the first jobs run, and fills the queue
        absl::StatusOr<Admission::Ticket> arrived = admission.Arrive();
        EXPECT_TRUE(arrived.ok()) << arrived.status();
        EXPECT_TRUE(IsServerBusy(admission.Arrive().status()));
        if (arrived.ok()) {
          other.emplace(std::move(arrived).value());
          other_thread = std::thread([&] {
            EXPECT_TRUE(other->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());
            other_runs = true;
            other->Leave();
          });
        }
      } else if (first_on_place) {  // the other first job holds its place until the other request has had one
        EXPECT_TRUE(odmoe::testing::Eventually([&] { return other_runs.load(); }, std::chrono::seconds(10)));
      } else {  // queued again on its place: behind the other request
        EXPECT_TRUE(other_runs.load()) << "job " << index << " overtook a request that was waiting";
      }
      ticket->Yield();
      return absl::OkStatus();
    });
    EXPECT_TRUE(choices.Wait().ok());
  }
  if (other_thread.joinable()) other_thread.join();
  EXPECT_EQ(ran.load(), 6);
  EXPECT_EQ(jobs_on.size(), 2u);
  EXPECT_EQ(over_bound.load(), 0);
  EXPECT_EQ(admission.tickets(), 0);  // every place was left
}

TEST(ParallelChoicesTest, TheFirstFailureStopsTheHandOutAndIsReturned) {
  Admission admission(8, 8);
  std::atomic<int> started{0};
  int finished_calls = 0;
  ParallelChoices choices(6, Tickets(admission, 1));
  choices.Start(
      [&](int64_t index, Admission::Ticket*) -> absl::Status {
        started.fetch_add(1);
        if (index == 2) return absl::UnavailableError("worker w0 lost");
        if (index == 3) return absl::InternalError("never started");
        return absl::OkStatus();
      },
      [&] { ++finished_calls; });
  const absl::Status status = choices.Wait();
  EXPECT_EQ(status, absl::UnavailableError("worker w0 lost"));
  EXPECT_EQ(started.load(), 3);  // one thread: 0, 1, 2, then no more
  EXPECT_EQ(finished_calls, 1);
}

// WaitFor lets the caller do something else (watch its client) while the jobs run, and says when they have ended.
TEST(ParallelChoicesTest, WaitForSaysWhetherEveryJobHasEnded) {
  Admission admission(8, 8);
  std::atomic<bool> release{false};
  ParallelChoices choices(3, Tickets(admission, 2));
  choices.Start([&](int64_t index, Admission::Ticket*) -> absl::Status {
    while (index == 2 && !release.load()) std::this_thread::yield();
    return absl::OkStatus();
  });
  EXPECT_FALSE(choices.WaitFor(absl::Milliseconds(20))) << "job 2 is still running";
  release.store(true);
  EXPECT_TRUE(choices.WaitFor(absl::Seconds(30)));
  EXPECT_TRUE(choices.WaitFor(absl::ZeroDuration())) << "and stays ended";
  EXPECT_TRUE(choices.Wait().ok());
}

// The jobs running beside the one that failed stop on failed(), with errors of their own, which are never taken
// for the request's: failed() turns true only once the first error is recorded.
TEST(ParallelChoicesTest, JobsStoppedByFailedNeverReplaceTheFirstError) {
  for (int round = 0; round < 20; ++round) {
    Admission admission(8, 8);
    std::atomic<int> waiting{0};
    ParallelChoices choices(3, Tickets(admission, 3));
    EXPECT_FALSE(choices.failed());
    choices.Start([&](int64_t index, Admission::Ticket*) -> absl::Status {
      if (index == 0) {
        while (waiting.load() < 2) std::this_thread::yield();
        return absl::UnavailableError("worker w0 lost");
      }
      waiting.fetch_add(1);
      while (!choices.failed()) std::this_thread::yield();
      return absl::AbortedError("another choice of the same request failed");
    });
    EXPECT_EQ(choices.Wait(), absl::UnavailableError("worker w0 lost"));
    EXPECT_TRUE(choices.failed());
  }
}

TEST(EventQueueTest, HandsEventsOverInOrderAndFinishesOnlyWhenDrained) {
  EventQueue queue(4);
  std::thread producer([&] {
    for (int i = 0; i < 100; ++i) EXPECT_TRUE(queue.Push(std::to_string(i)));
    queue.FinishWriting();
  });
  std::vector<std::string> got;
  for (;;) {
    EventQueue::Next next = queue.Pop(absl::Milliseconds(20));
    if (next.finished) break;
    if (next.event) got.push_back(*next.event);
  }
  producer.join();
  ASSERT_EQ(got.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(got[i], std::to_string(i));
}

TEST(EventQueueTest, IsBoundedAndLetsProducersGoWhenTheReaderCloses) {
  EventQueue queue(2);
  EXPECT_TRUE(queue.Push("a"));
  EXPECT_TRUE(queue.Push("b"));
  std::atomic<int> pushed{0};
  std::atomic<bool> third_result{true};
  std::thread producer([&] {
    third_result.store(queue.Push("c"));  // waits: two events wait already
    pushed.fetch_add(1);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(pushed.load(), 0);
  // Nothing ready is not the end while writing goes on.
  EventQueue::Next next = queue.Pop(absl::Milliseconds(1));
  EXPECT_EQ(next.event, "a");
  EXPECT_TRUE(odmoe::testing::Eventually([&] { return pushed.load() == 1; }, std::chrono::seconds(10)));
  EXPECT_TRUE(third_result.load());
  // A full queue again; the reader closes: the waiting producer and every later one get false at once.
  std::thread blocked([&] { EXPECT_FALSE(queue.Push("d")); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  queue.CloseReader();
  blocked.join();
  producer.join();
  EXPECT_FALSE(queue.Push("e"));
  next = queue.Pop(absl::Milliseconds(1));
  EXPECT_FALSE(next.event.has_value());
  EXPECT_FALSE(next.finished);  // the producers have not said they are done
  queue.FinishWriting();
  EXPECT_TRUE(queue.Pop(absl::Milliseconds(1)).finished);
}

}  // namespace
}  // namespace odmoe
