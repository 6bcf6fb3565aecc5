// Main's readiness as bookkeeping: which workers each sparse layer needs under the placement, the verdict of
// one probe round, and the watch turning NOT_SERVING and back by itself as main's verdict on the workers changes.
#include "src/main_node/readiness.h"

#include "gtest/gtest.h"

namespace odmoe {
namespace {

TEST(SparseLayerOwnersTest, DecodeGroupAndPrefillWorkers) {
  // 4 workers in groups of 2: decode layer s goes to group s % 2; prefill expert e to worker e % 4.
  auto p = Placement::Create(4, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  // 2 experts: prefill uses workers 0 and 1 only.
  auto owners = SparseLayerOwners(*p, 3, 2);
  ASSERT_EQ(owners.size(), 3u);
  EXPECT_EQ(owners[0], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(owners[1], (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(owners[2], (std::vector<int32_t>{0, 1}));
  // 8 experts: every worker takes prefill experts of every layer.
  owners = SparseLayerOwners(*p, 2, 8);
  EXPECT_EQ(owners[0], (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(JudgeReadinessTest, NamesTheLayersAndWorkers) {
  const std::vector<std::vector<int32_t>> owners = {{0}, {1}, {0}, {1}, {2}};
  const std::vector<std::string> names = {"w0", "w1", "w2"};
  ReadinessVerdict v = JudgeReadiness(owners, names, {absl::OkStatus(), absl::OkStatus(), absl::OkStatus()});
  EXPECT_TRUE(v.ready);
  EXPECT_TRUE(v.unreachable.empty());
  EXPECT_NE(v.reason.find("3 workers"), std::string::npos) << v.reason;

  v = JudgeReadiness(owners, names, {absl::OkStatus(), absl::UnavailableError("connection refused"), absl::OkStatus()});
  EXPECT_FALSE(v.ready);
  EXPECT_EQ(v.unreachable, (std::vector<int32_t>{1}));
  EXPECT_EQ(v.reason, "sparse layers 1,3 have an unreachable owner: w1 (connection refused)");

  v = JudgeReadiness(owners, names,
                     {absl::UnavailableError("down"), absl::OkStatus(), absl::DeadlineExceededError("slow")});
  EXPECT_EQ(v.reason, "sparse layers 0,2,4 have an unreachable owner: w0 (down); w2 (slow)");

  v = JudgeReadiness({{0}, {0}, {0}, {1}}, {"a", "b"}, {absl::UnavailableError("x"), absl::OkStatus()});
  EXPECT_EQ(v.reason, "sparse layers 0-2 have an unreachable owner: a (x)");
}

TEST(JudgeReadinessTest, AWorkerNoLayerNeedsDoesNotMatter) {
  const ReadinessVerdict v = JudgeReadiness({{0}}, {"w0", "spare"}, {absl::OkStatus(), absl::UnavailableError("x")});
  EXPECT_TRUE(v.ready);
  EXPECT_EQ(v.unreachable, (std::vector<int32_t>{1}));
}

TEST(ReadinessWatchTest, FollowsPeerHealthAndReportsOnlyChanges) {
  // Two workers and the shadow (peer 2, which no layer needs).
  PeerHealth health(std::vector<PeerHealth::Peer>{{"w0", "a:1"}, {"w1", "a:2"}, {"shadow", "a:3"}});
  int reports = 0;
  bool last = false;
  ReadinessWatch watch({{0}, {1}}, {"w0", "w1"}, health, [&](const ReadinessVerdict& v) {
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

  health.ReportFailure(1, "refused");
  EXPECT_EQ(reports, 2);
  EXPECT_FALSE(last);
  EXPECT_FALSE(watch.ready());
  EXPECT_NE(watch.reason().find("unreachable owner: w1 (refused)"), std::string::npos) << watch.reason();

  health.ReportAlive(1, "back");
  EXPECT_EQ(reports, 3);
  EXPECT_TRUE(last);
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
