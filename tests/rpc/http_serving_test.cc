// The HTTP servers' task queue: a thread per connection, one kept spare, up to the limit, idle ones ending; at the
// limit enqueue waits for a connection to end (counted for ops); shutdown runs what is queued and joins.
#include "src/rpc/http_serving.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace odmoe::rpc {
namespace {

constexpr absl::Duration kPatience = absl::Seconds(30);  // a bound for what must happen, not a timing

// A connection that holds its thread until released, as an idle keep-alive connection does.
struct HeldJobs {
  absl::Notification release;
  std::atomic<int> started{0};
  std::atomic<int> finished{0};
  std::function<void()> Job() {
    return [this] {
      started.fetch_add(1);
      release.WaitForNotificationWithTimeout(kPatience);
      finished.fetch_add(1);
    };
  }
};

bool Eventually(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + kPatience;
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST(HttpConnectionPoolTest, HeldConnectionsDoNotKeepTheNextWaiting) {
  HttpConnectionPool pool(64, "test");
  HeldJobs held;
  for (int i = 0; i < 40; ++i) pool.enqueue(held.Job());
  // Each held connection got a thread of its own, and the next one runs while they are all still held.
  absl::Notification next;
  pool.enqueue([&next] { next.Notify(); });
  EXPECT_TRUE(next.WaitForNotificationWithTimeout(kPatience));
  EXPECT_TRUE(Eventually([&] { return held.started.load() == 40; }));
  EXPECT_EQ(held.finished.load(), 0);
  EXPECT_EQ(pool.threads(), 42u);  // one spare
  held.release.Notify();
  EXPECT_TRUE(Eventually([&] { return held.finished.load() == 40; }));
  // Free threads are taken again: no new one for the next connections.
  for (int i = 0; i < 10; ++i) {
    absl::Notification ran;
    pool.enqueue([&ran] { ran.Notify(); });
    EXPECT_TRUE(ran.WaitForNotificationWithTimeout(kPatience));
  }
  EXPECT_EQ(pool.threads(), 42u);
  pool.shutdown();
}

TEST(HttpConnectionPoolTest, ABurstsThreadsEndWhenIdleButTheSpare) {
  HttpConnectionPool pool(64, "test", {}, absl::Milliseconds(20));
  HeldJobs held;
  for (int i = 0; i < 10; ++i) pool.enqueue(held.Job());
  ASSERT_TRUE(Eventually([&] { return held.started.load() == 10; }));
  EXPECT_EQ(pool.threads(), 11u);
  held.release.Notify();
  // Idle, all but one end; that one takes the next connection at once, and threads come back for a burst.
  EXPECT_TRUE(Eventually([&] { return pool.threads() == 1; }));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(pool.threads(), 1u);
  absl::Notification ran;
  pool.enqueue([&ran] { ran.Notify(); });
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(kPatience));
  HeldJobs again;
  for (int i = 0; i < 5; ++i) pool.enqueue(again.Job());
  EXPECT_TRUE(Eventually([&] { return again.started.load() == 5; }));
  again.release.Notify();
  pool.shutdown();
  EXPECT_EQ(again.finished.load(), 5);
  EXPECT_EQ(pool.threads(), 0u);
}

TEST(HttpConnectionPoolTest, AtTheLimitEnqueueWaitsForAThreadToFree) {
  odmoe::testing::CapturedLog log;
  metrics::Registry registry;
  const HttpConnectionMetrics counted = HttpConnectionMetrics::In(registry, "api", 2);
  HttpConnectionPool pool(2, "test", counted);
  HeldJobs held;
  pool.enqueue(held.Job());
  pool.enqueue(held.Job());
  std::atomic<bool> enqueued{false};
  absl::Notification third_ran;
  std::thread accept([&] {
    pool.enqueue([&third_ran] { third_ran.Notify(); });
    enqueued.store(true);
  });
  ASSERT_TRUE(Eventually([&] { return held.started.load() == 2; }));
  // Both threads are held: the third connection is not taken (the accept loop waits) and no thread is added.
  EXPECT_FALSE(third_ran.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  EXPECT_FALSE(enqueued.load());
  EXPECT_EQ(pool.threads(), 2u);
  // Ops see it: both connections open, the cap, and the one that waited.
  EXPECT_EQ(counted.open->value(), 2);
  EXPECT_EQ(counted.waits->value(), 1);
  EXPECT_NE(registry.Render().find("odmoe_http_max_connections{server=\"api\"} 2\n"), std::string::npos);
  held.release.Notify();
  EXPECT_TRUE(third_ran.WaitForNotificationWithTimeout(kPatience));
  accept.join();
  EXPECT_TRUE(enqueued.load());
  EXPECT_EQ(pool.threads(), 2u);
  pool.shutdown();
  EXPECT_EQ(held.finished.load(), 2);
  EXPECT_EQ(counted.open->value(), 0);
  EXPECT_EQ(counted.waits->value(), 1);
  // Ops are told (at most once a minute).
  EXPECT_EQ(log.Count("HTTP server at test: all 2 connections are taken"), 1) << log.text();
}

TEST(HttpConnectionPoolTest, ShutdownRunsWhatIsQueuedAndJoins) {
  std::atomic<int> ran{0};
  {
    HttpConnectionPool pool(1, "test");
    HeldJobs held;
    pool.enqueue(held.Job());
    ASSERT_TRUE(Eventually([&] { return held.started.load() == 1; }));
    std::thread accept([&] { pool.enqueue([&ran] { ran.fetch_add(1); }); });  // waits for the one thread
    std::thread release([&] {
      absl::SleepFor(absl::Milliseconds(50));
      held.release.Notify();
    });
    accept.join();
    release.join();
    pool.shutdown();
    EXPECT_EQ(ran.load(), 1);
    pool.shutdown();  // again: nothing left to do
    EXPECT_EQ(pool.threads(), 0u);
  }
  // A pool that httplib never shut down joins its threads when it goes.
  {
    HttpConnectionPool pool(4, "test");
    pool.enqueue([&ran] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 2);
}

}  // namespace
}  // namespace odmoe::rpc
