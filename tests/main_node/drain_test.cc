// RequestDrain: passes counted while open, none after Close, and WaitIdle waiting for the passes out (or its
// deadline).
#include "src/main_node/drain.h"

#include <optional>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace odmoe {
namespace {

TEST(RequestDrainTest, CountsPassesWhileOpen) {
  RequestDrain drain;
  std::optional<RequestDrain::Pass> a = drain.Enter();
  ASSERT_TRUE(a.has_value());
  {
    std::optional<RequestDrain::Pass> b = drain.Enter();
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(drain.in_flight(), 2);
    RequestDrain::Pass moved = std::move(*b);  // a moved pass counts once
    b.reset();
    EXPECT_EQ(drain.in_flight(), 2);
  }
  EXPECT_EQ(drain.in_flight(), 1);
  a.reset();
  EXPECT_EQ(drain.in_flight(), 0);
  EXPECT_EQ(drain.WaitIdle(absl::Now()), 0);  // idle: at once
}

TEST(RequestDrainTest, CloseRefusesLaterRequestsAndWaitIdleWaitsForThoseInFlight) {
  RequestDrain drain;
  std::optional<RequestDrain::Pass> running = drain.Enter();
  ASSERT_TRUE(running.has_value());
  drain.Close();
  EXPECT_FALSE(drain.Enter().has_value());
  EXPECT_EQ(drain.in_flight(), 1);
  // Still out at the deadline: WaitIdle says how many.
  const absl::Time start = absl::Now();
  EXPECT_EQ(drain.WaitIdle(start + absl::Milliseconds(30)), 1);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(30));
  // Back before the deadline: WaitIdle returns when it comes back, long before the deadline.
  std::thread finisher([&] {
    absl::SleepFor(absl::Milliseconds(20));
    running.reset();
  });
  EXPECT_EQ(drain.WaitIdle(absl::Now() + absl::Seconds(30)), 0);
  finisher.join();
  EXPECT_FALSE(drain.Enter().has_value());  // closed for good
}

}  // namespace
}  // namespace odmoe
