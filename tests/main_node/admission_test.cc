// Admission control as bookkeeping: one request runs, max_queued wait in arrival order, the next is refused at
// once marked busy (exit code 10 for the CLI); a waiting request leaves on cancellation or at its deadline and
// its place goes to the next.
#include "src/main_node/admission.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "src/common/status.h"

namespace odmoe {
namespace {

const absl::Time kNever = absl::InfiniteFuture();

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
  EXPECT_EQ(fourth.status().message(), "the server is busy: 1 request running and 2 queued (max_queued = 2); retry later");
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
  std::thread t([&] { EXPECT_TRUE(absl::IsCancelled(gone->WaitTurn([&] { return client_gone.load(); }, kNever))); });
  client_gone = true;
  t.join();
  EXPECT_TRUE(absl::IsDeadlineExceeded(late->WaitTurn(nullptr, absl::Now() + absl::Milliseconds(30))));
  EXPECT_EQ(a.waiting(), 0);
  auto next = a.Arrive();
  ASSERT_TRUE(next.ok());
  { Admission::Ticket done = std::move(*running); }
  EXPECT_TRUE(next->WaitTurn(nullptr, absl::Now() + absl::Seconds(10)).ok());
}

}  // namespace
}  // namespace odmoe
