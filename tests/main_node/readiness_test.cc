// Main's readiness as bookkeeping: which workers each sparse layer needs under the placement, the verdict of
// one probe round, and the prober turning NOT_SERVING and back by itself as probes change.
#include "src/main_node/readiness.h"

#include <atomic>
#include <chrono>
#include <thread>

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

// Waits until `cond` holds, up to 5 s.
template <typename F>
bool Eventually(F cond) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

TEST(ReadinessProberTest, FollowsTheProbesAndReportsOnlyChanges) {
  std::atomic<bool> w1_up{true};
  std::atomic<int> rounds{0};
  std::atomic<int> reports{0};
  std::atomic<bool> last{false};
  ReadinessProber prober(
      {{0}, {1}}, {"w0", "w1"},
      [&] {
        ++rounds;
        return std::vector<absl::Status>{absl::OkStatus(),
                                         w1_up ? absl::OkStatus() : absl::UnavailableError("refused")};
      },
      [&](const ReadinessVerdict& v) {
        ++reports;
        last = v.ready;
      },
      ReadinessOptions{absl::Milliseconds(5), 100});
  EXPECT_FALSE(prober.ready());  // nothing probed yet
  prober.Start();
  ASSERT_TRUE(Eventually([&] { return reports.load() == 1; }));
  EXPECT_TRUE(last);
  EXPECT_TRUE(prober.ready());
  // Further rounds with the same verdict report nothing.
  const int seen = rounds.load();
  ASSERT_TRUE(Eventually([&] { return rounds.load() >= seen + 3; }));
  EXPECT_EQ(reports.load(), 1);

  w1_up = false;
  ASSERT_TRUE(Eventually([&] { return reports.load() == 2; }));
  EXPECT_FALSE(last);
  EXPECT_FALSE(prober.ready());
  EXPECT_NE(prober.reason().find("w1 (refused)"), std::string::npos) << prober.reason();

  w1_up = true;
  ASSERT_TRUE(Eventually([&] { return reports.load() == 3; }));
  EXPECT_TRUE(last);

  prober.Stop();
  const int after_stop = rounds.load();
  w1_up = false;
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(rounds.load(), after_stop);
  EXPECT_EQ(reports.load(), 3);
  prober.Stop();  // idempotent
}

TEST(ReadinessProberTest, StopsWithoutWaitingForThePeriod) {
  ReadinessProber prober(
      {{0}}, {"w0"}, [] { return std::vector<absl::Status>{absl::OkStatus()}; }, nullptr,
      ReadinessOptions{absl::Hours(1), 100});
  prober.Start();
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(Eventually([&] { return prober.ready(); }));
  prober.Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace odmoe
