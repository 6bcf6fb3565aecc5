// Admission control as bookkeeping: up to max_running requests run at once, max_queued wait in arrival order,
// the next is refused at once marked busy (exit code 10 for the CLI); a waiting request leaves on cancellation or
// at its deadline and its place goes to the next.
#include "src/main_node/admission.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "src/common/status.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

const absl::Time kNever = absl::InfiniteFuture();

// For a thread that should get its turn soon.
bool Eventually(const std::function<bool()>& done) {
  return odmoe::testing::Eventually(done, std::chrono::seconds(10));
}

// Arrives and takes a running place at once (a place must be free).
Admission::Ticket RunNow(Admission& a) {
  absl::StatusOr<Admission::Ticket> t = a.Arrive();
  EXPECT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());
  return std::move(t).value();
}

TEST(AdmissionTest, OneRunsMaxQueuedWaitAndTheNextIsRefusedBusy) {
  Admission a(2);
  auto first = a.Arrive();
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->WaitTurn(nullptr, kNever).ok());
  EXPECT_EQ(a.running(), 1);
  auto second = a.Arrive();
  auto third = a.Arrive();
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(a.waiting(), 2);
  auto fourth = a.Arrive();
  ASSERT_FALSE(fourth.ok());
  EXPECT_TRUE(IsServerBusy(fourth.status())) << fourth.status();
  EXPECT_EQ(ExitCodeFor(fourth.status()), kExitBusy);
  EXPECT_EQ(fourth.status().message(),
            "the server is busy: 1 request running (max_running = 1) and 2 queued (max_queued = 2); retry later");
  EXPECT_EQ(ExitCodeFor(absl::ResourceExhaustedError("budget")), kExitResources) << "a budget is not busy";
}

TEST(AdmissionTest, NoQueueAdmitsOnlyWhenIdle) {
  Admission a(0);
  {
    auto only = a.Arrive();
    ASSERT_TRUE(only.ok());
    EXPECT_TRUE(IsServerBusy(a.Arrive().status()));
    ASSERT_TRUE(only->WaitTurn(nullptr, kNever).ok());
    EXPECT_TRUE(IsServerBusy(a.Arrive().status()));
  }  // the ticket leaves
  EXPECT_EQ(a.running(), 0);
  EXPECT_TRUE(a.Arrive().ok());
}

TEST(AdmissionTest, TurnsComeInArrivalOrder) {
  Admission a(8);
  auto running = a.Arrive();
  ASSERT_TRUE(running.ok());
  ASSERT_TRUE(running->WaitTurn(nullptr, kNever).ok());
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<Admission::Ticket>> tickets;
  for (int i = 0; i < 5; ++i) tickets.push_back(a.Arrive());  // arrival order 0..4
  for (int i = 4; i >= 0; --i) {                              // threads started in reverse
    threads.emplace_back([&, i] {
      ASSERT_TRUE(tickets[static_cast<size_t>(i)]->WaitTurn(nullptr, kNever).ok());
      {
        absl::MutexLock lock(&mu);
        order.push_back(i);
      }
      absl::SleepFor(absl::Milliseconds(5));
      // Leave: the destructor of the ticket runs when `tickets` goes; leave now by moving it out.
      Admission::Ticket done = std::move(*tickets[static_cast<size_t>(i)]);
    });
  }
  absl::SleepFor(absl::Milliseconds(50));
  { Admission::Ticket done = std::move(*running); }  // the first one finishes
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(AdmissionTest, AWaiterLeavesOnCancellationOrDeadlineAndTheNextGetsItsPlace) {
  Admission a(2);
  auto running = a.Arrive();
  ASSERT_TRUE(running.ok());
  ASSERT_TRUE(running->WaitTurn(nullptr, kNever).ok());
  auto gone = a.Arrive();
  auto late = a.Arrive();
  ASSERT_TRUE(gone.ok());
  ASSERT_TRUE(late.ok());
  std::atomic<bool> client_gone{false};
  std::thread t([&] {
    const absl::Status s = gone->WaitTurn(
        [&] { return client_gone.load() ? absl::CancelledError("the client went away") : absl::OkStatus(); }, kNever);
    EXPECT_TRUE(absl::IsCancelled(s)) << s;
    EXPECT_EQ(s.message(), "the client went away while the request was queued");
  });
  client_gone = true;
  t.join();
  EXPECT_TRUE(absl::IsDeadlineExceeded(late->WaitTurn(nullptr, absl::Now() + absl::Milliseconds(30))));
  EXPECT_EQ(a.waiting(), 0);
  auto next = a.Arrive();
  ASSERT_TRUE(next.ok());
  { Admission::Ticket done = std::move(*running); }
  EXPECT_TRUE(next->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());
}

TEST(AdmissionTest, MaxRunningRunAtOnceMaxQueuedWaitAndTheNextIsRefusedBusy) {
  Admission a(/*max_queued=*/2, /*max_running=*/3);
  EXPECT_EQ(a.max_running(), 3);
  EXPECT_EQ(a.max_queued(), 2);
  std::vector<Admission::Ticket> running;
  for (int i = 0; i < 3; ++i) {
    running.push_back(RunNow(a));
    EXPECT_EQ(a.running(), i + 1);
  }
  auto fourth = a.Arrive();
  auto fifth = a.Arrive();
  ASSERT_TRUE(fourth.ok());
  ASSERT_TRUE(fifth.ok());
  EXPECT_EQ(a.running(), 3);
  EXPECT_EQ(a.waiting(), 2);
  auto sixth = a.Arrive();  // max_running + max_queued = 5 already
  ASSERT_FALSE(sixth.ok());
  EXPECT_TRUE(IsServerBusy(sixth.status())) << sixth.status();
  EXPECT_EQ(ExitCodeFor(sixth.status()), kExitBusy);
  EXPECT_EQ(sixth.status().message(),
            "the server is busy: 3 requests running (max_running = 3) and 2 queued (max_queued = 2); retry later");
  // A running request that finishes frees its place: the first waiter takes it, and one more may queue.
  running.front().Leave();
  EXPECT_EQ(a.running(), 2);
  ASSERT_TRUE(fourth->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(a.running(), 3);
  EXPECT_EQ(a.waiting(), 1);
  auto seventh = a.Arrive();
  ASSERT_TRUE(seventh.ok()) << seventh.status();
  EXPECT_TRUE(IsServerBusy(a.Arrive().status()));
}

TEST(AdmissionTest, NoQueueAdmitsMaxRunningAndRefusesTheNextAtOnce) {
  Admission a(/*max_queued=*/0, /*max_running=*/8);
  std::vector<Admission::Ticket> running;
  for (int i = 0; i < 8; ++i) running.push_back(RunNow(a));
  EXPECT_EQ(a.running(), 8);
  EXPECT_EQ(a.waiting(), 0);
  auto ninth = a.Arrive();
  ASSERT_FALSE(ninth.ok());
  EXPECT_TRUE(IsServerBusy(ninth.status())) << ninth.status();
  EXPECT_EQ(ninth.status().message(),
            "the server is busy: 8 requests running (max_running = 8) and 0 queued (max_queued = 0); retry later");
  running.pop_back();  // one finishes: the next runs at once
  EXPECT_EQ(a.running(), 7);
  running.push_back(RunNow(a));
  EXPECT_EQ(a.running(), 8);
  EXPECT_TRUE(IsServerBusy(a.Arrive().status()));
}

TEST(AdmissionTest, ArrivalsNotYetWaitingCountAgainstTheRunningPlaces) {
  // Eight arrived and will take the eight places as they wait their turn; the ninth has no place and no queue.
  Admission a(/*max_queued=*/0, /*max_running=*/8);
  std::vector<absl::StatusOr<Admission::Ticket>> arrived;
  for (int i = 0; i < 8; ++i) {
    arrived.push_back(a.Arrive());
    ASSERT_TRUE(arrived.back().ok()) << i;
  }
  EXPECT_EQ(a.running(), 0);
  EXPECT_EQ(a.waiting(), 8);
  auto ninth = a.Arrive();
  ASSERT_FALSE(ninth.ok());
  EXPECT_EQ(ninth.status().message(),
            "the server is busy: 0 requests running (max_running = 8) and 8 queued (max_queued = 0); retry later");
  for (auto& t : arrived) EXPECT_TRUE(t->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(a.running(), 8);
  EXPECT_EQ(a.waiting(), 0);
}

TEST(AdmissionTest, FreedPlacesGoToTheWaitersInArrivalOrder) {
  Admission a(/*max_queued=*/8, /*max_running=*/2);
  std::vector<Admission::Ticket> running;
  running.push_back(RunNow(a));
  running.push_back(RunNow(a));
  std::vector<absl::StatusOr<Admission::Ticket>> waiters;
  for (int i = 0; i < 3; ++i) {  // arrival order 0, 1, 2
    waiters.push_back(a.Arrive());
    ASSERT_TRUE(waiters.back().ok());
  }
  std::atomic<bool> turn[3] = {false, false, false};
  std::vector<std::thread> threads;
  for (int i = 2; i >= 1; --i) {  // the later arrivals wait first
    threads.emplace_back([&, i] {
      EXPECT_TRUE(waiters[static_cast<size_t>(i)]->WaitTurn(nullptr, kNever).ok());
      turn[i] = true;
    });
  }
  // A place frees while the first waiter has not asked for it yet: nobody behind it takes it.
  running.pop_back();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(a.running(), 1);
  EXPECT_FALSE(turn[1] || turn[2]);
  EXPECT_TRUE(waiters[0]->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());  // the place is its own
  EXPECT_EQ(a.running(), 2);
  // The next freed place goes to waiter 1, not 2; the one after to 2.
  running.pop_back();
  EXPECT_TRUE(Eventually([&] { return turn[1].load(); }));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(turn[2]);
  EXPECT_EQ(a.running(), 2);
  EXPECT_EQ(a.waiting(), 1);
  waiters[0]->Leave();
  EXPECT_TRUE(Eventually([&] { return turn[2].load(); }));
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(a.running(), 2);
  EXPECT_EQ(a.waiting(), 0);
}

TEST(AdmissionTest, CancelledLateAndLeavingWaitersGiveTheirPlaceToTheNext) {
  Admission a(/*max_queued=*/3, /*max_running=*/2);
  std::vector<Admission::Ticket> running;
  running.push_back(RunNow(a));
  running.push_back(RunNow(a));
  auto gone = a.Arrive();
  auto late = a.Arrive();
  auto next = a.Arrive();
  ASSERT_TRUE(gone.ok());
  ASSERT_TRUE(late.ok());
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(IsServerBusy(a.Arrive().status()));
  std::atomic<bool> next_runs{false};
  std::thread n([&] {
    EXPECT_TRUE(next->WaitTurn(nullptr, kNever).ok());
    next_runs = true;
  });
  std::atomic<bool> client_gone{false};
  std::thread c([&] {  // StopCheck's reason, whatever it is, is the wait's
    EXPECT_TRUE(absl::IsAborted(
        gone->WaitTurn([&] { return client_gone.load() ? absl::AbortedError("stopped") : absl::OkStatus(); }, kNever)));
  });
  // Every place is taken: the late one's deadline passes in the queue, the other's client goes away.
  EXPECT_TRUE(absl::IsDeadlineExceeded(late->WaitTurn(nullptr, absl::Now() + absl::Milliseconds(30))));
  EXPECT_EQ(a.waiting(), 2);
  client_gone = true;
  c.join();
  EXPECT_EQ(a.waiting(), 1);
  EXPECT_FALSE(next_runs);
  auto front = a.Arrive();  // arrived after `next`: queued behind it
  ASSERT_TRUE(front.ok());
  running.pop_back();  // a place frees: `next` is at the front now and takes it
  EXPECT_TRUE(Eventually([&] { return next_runs.load(); }));
  n.join();
  EXPECT_EQ(a.running(), 2);
  EXPECT_EQ(a.waiting(), 1);
  // A front waiter that has not asked for its turn holds up those behind it until it leaves.
  auto behind = a.Arrive();
  ASSERT_TRUE(behind.ok());
  std::atomic<bool> behind_runs{false};
  std::thread w([&] {
    EXPECT_TRUE(behind->WaitTurn(nullptr, kNever).ok());
    behind_runs = true;
  });
  running.pop_back();
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_FALSE(behind_runs);
  EXPECT_EQ(a.running(), 1);
  { Admission::Ticket leaves = std::move(*front); }
  EXPECT_TRUE(Eventually([&] { return behind_runs.load(); }));
  w.join();
  EXPECT_EQ(a.running(), 2);
  EXPECT_EQ(a.waiting(), 0);
}

// A ticket that ran and yields (the next choice of the same API request will run on it): its running place goes to
// the front waiter, its count stays (no newcomer takes it), and its next turn comes behind those already waiting.
TEST(AdmissionTest, AYieldedTicketKeepsItsCountAndQueuesAgainAtTheBack) {
  Admission a(/*max_queued=*/1, /*max_running=*/1);
  Admission::Ticket mine = RunNow(a);
  auto other = a.Arrive();
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(IsServerBusy(a.Arrive().status()));
  other->Yield();  // a waiting ticket does not yield: it keeps its place in the queue
  EXPECT_EQ(a.waiting(), 1);
  EXPECT_EQ(a.yielded(), 0);

  mine.Yield();
  EXPECT_EQ(a.running(), 0);
  EXPECT_EQ(a.waiting(), 1);
  EXPECT_EQ(a.yielded(), 1);
  EXPECT_TRUE(IsServerBusy(a.Arrive().status())) << "a yielded ticket keeps its count";
  ASSERT_TRUE(other->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());  // the place went to the waiter

  std::atomic<bool> mine_runs{false};
  std::thread t([&] {
    EXPECT_TRUE(mine.WaitTurn(nullptr, kNever).ok());
    mine_runs = true;
  });
  EXPECT_TRUE(Eventually([&] { return a.waiting() == 1 && a.yielded() == 0; }));  // queued again
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_FALSE(mine_runs);
  other->Leave();
  EXPECT_TRUE(Eventually([&] { return mine_runs.load(); }));
  t.join();
  EXPECT_EQ(a.running(), 1);

  // Leaving a yielded ticket frees its count.
  mine.Yield();
  EXPECT_EQ(a.yielded(), 1);
  mine.Leave();
  EXPECT_FALSE(mine.held());
  EXPECT_EQ(a.tickets(), 0);
  EXPECT_TRUE(a.Arrive().ok());
}

}  // namespace
}  // namespace odmoe
