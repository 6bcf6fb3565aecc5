// Main's readiness as bookkeeping: the verdict of one probe round (a layer is served while one of its owners
// answers), and the watch turning NOT_SERVING and back by itself as main's verdict on the workers changes.
#include "src/main_node/readiness.h"

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace odmoe {
namespace {

TEST(JudgeReadinessTest, ALayerIsServedWhileOneOfItsOwnersAnswers) {
  // Layers 0..3 may go to any of the three workers (failover), layer 4 only to w2.
  const std::vector<std::vector<int32_t>> owners = {{0, 1, 2}, {0, 1, 2}, {0, 1, 2}, {0, 1, 2}, {2}};
  const std::vector<std::string> names = {"w0", "w1", "w2"};
  ReadinessVerdict v = JudgeReadiness(owners, names, {absl::OkStatus(), absl::OkStatus(), absl::OkStatus()});
  EXPECT_TRUE(v.ready);
  EXPECT_TRUE(v.unreachable.empty());
  EXPECT_EQ(v.reason, "every sparse layer has a reachable owner (3 workers)");

  v = JudgeReadiness(owners, names, {absl::OkStatus(), absl::UnavailableError("connection refused"), absl::OkStatus()});
  EXPECT_TRUE(v.ready) << "degraded, still serving";
  EXPECT_EQ(v.unreachable, (std::vector<int32_t>{1}));
  EXPECT_EQ(v.reason, "every sparse layer has a reachable owner (3 workers, 1 unreachable: w1 (connection refused))");

  v = JudgeReadiness(owners, names,
                     {absl::UnavailableError("down"), absl::OkStatus(), absl::DeadlineExceededError("slow")});
  EXPECT_FALSE(v.ready);
  EXPECT_EQ(v.reason, "sparse layer 4 has no reachable owner: w0 (down); w2 (slow)");

  v = JudgeReadiness(owners, names,
                     {absl::UnavailableError("a"), absl::UnavailableError("b"), absl::UnavailableError("c")});
  EXPECT_EQ(v.reason, "sparse layers 0-4 have no reachable owner: w0 (a); w1 (b); w2 (c)");
}

TEST(ReadinessWatchTest, FollowsPeerHealthAndReportsOnlyChanges) {
  // Two workers and the shadow (peer 2, which no layer needs).
  PeerHealth health(std::vector<PeerHealth::Peer>{{"w0", "a:1"}, {"w1", "a:2"}, {"shadow", "a:3"}});
  int reports = 0;
  bool last = false;
  ReadinessWatch watch({{0, 1}, {0, 1}}, {"w0", "w1"}, health, [&](const ReadinessVerdict& v) {
    ++reports;
    last = v.ready;
  });
  EXPECT_FALSE(watch.ready());
  health.ReportAlive(0, "answered");
  EXPECT_EQ(reports, 0) << "the first verdict waits for every worker's state";
  health.ReportAlive(1, "answered");
  EXPECT_EQ(reports, 1);
  EXPECT_TRUE(last);
  EXPECT_TRUE(watch.ready());
  // The same verdict again, or a change of a peer no layer needs, reports nothing.
  health.ReportAlive(1, "answered again");
  health.ReportFailure(2, "refused");
  EXPECT_EQ(reports, 1);

  // One worker lost: still ready (degraded), reported because the unreachable set changed.
  health.ReportFailure(1, "refused");
  EXPECT_EQ(reports, 2);
  EXPECT_TRUE(last);
  EXPECT_NE(watch.reason().find("1 unreachable: w1 (refused)"), std::string::npos) << watch.reason();
  // Both lost: not ready.
  health.ReportFailure(0, "reset");
  EXPECT_EQ(reports, 3);
  EXPECT_FALSE(last);
  EXPECT_FALSE(watch.ready());
  EXPECT_NE(watch.reason().find("no reachable owner: w0 (reset); w1 (refused)"), std::string::npos) << watch.reason();

  health.ReportAlive(1, "back");
  EXPECT_EQ(reports, 4);
  EXPECT_TRUE(last);
}

// Start-up: main waits for the whole cluster (so `cluster up` returns a complete one), and serves degraded only
// once the grace is over or after every worker has answered once.
TEST(ReadinessWatchTest, AtStartUpWaitsForEveryWorkerUntilTheGraceEnds) {
  PeerHealth health(std::vector<PeerHealth::Peer>{{"w0", "a:1"}, {"w1", "a:2"}});
  absl::Mutex mu;
  std::vector<bool> reports;
  ReadinessWatch watch(
      {{0, 1}}, {"w0", "w1"}, health,
      [&](const ReadinessVerdict& v) {
        absl::MutexLock lock(&mu);
        reports.push_back(v.ready);
      },
      absl::Milliseconds(300));
  health.ReportAlive(0, "answered");
  health.ReportFailure(1, "refused");
  EXPECT_FALSE(watch.ready());
  EXPECT_NE(watch.reason().find("starting: waiting for every peer to answer (1 of 2 up"), std::string::npos)
      << watch.reason();
  absl::SleepFor(absl::Milliseconds(600));  // the grace ends: degraded service
  EXPECT_TRUE(watch.ready()) << watch.reason();

  PeerHealth whole(std::vector<PeerHealth::Peer>{{"w0", "a:1"}, {"w1", "a:2"}});
  ReadinessWatch quick({{0, 1}}, {"w0", "w1"}, whole, nullptr, absl::Seconds(60));
  whole.ReportAlive(0, "answered");
  whole.ReportAlive(1, "answered");
  EXPECT_TRUE(quick.ready()) << "every worker answered: start-up is over";
  whole.ReportFailure(1, "gone");
  EXPECT_TRUE(quick.ready()) << "after start-up a lost worker leaves main degraded, not down";
}

TEST(ReadinessWatchTest, JudgesAtOnceWhenEveryWorkerAlreadyHasAState) {
  PeerHealth health(std::vector<PeerHealth::Peer>{{"w0", "a:1"}});
  health.ReportFailure(0, "refused");
  int reports = 0;
  ReadinessWatch watch({{0}}, {"w0"}, health, [&](const ReadinessVerdict&) { ++reports; });
  EXPECT_EQ(reports, 1);
  EXPECT_FALSE(watch.ready());
}

}  // namespace
}  // namespace odmoe
