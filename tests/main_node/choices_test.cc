// The choices of one OpenAI API request run side by side: every job runs once, at most the window at a time, the
// first ones on the places taken beforehand; the first failure stops the hand-out and is the one returned. A
// streamed request's event queue is bounded, hands every event over in order and lets producers go once its
// reader has closed.
#include "src/main_node/choices.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
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
          // The first window's jobs run on the places taken beforehand, each on its own; later ones on none.
          EXPECT_EQ(ticket != nullptr, index < 3) << index;
          if (ticket != nullptr) {
            EXPECT_TRUE(tickets_seen.insert(ticket).second) << index;
          }
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
  EXPECT_EQ(finished_calls, 1);
  EXPECT_TRUE(all_ended_when_finished.load());
  // Every place was left: the queue is empty again.
  EXPECT_EQ(admission.running(), 0);
  EXPECT_EQ(admission.waiting(), 0);
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
