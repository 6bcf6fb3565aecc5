// Residency: the worker's bookkeeping of resident experts, with no device, no model and no gRPC. Payloads are
// counted objects, so each test sees exactly when an entry's payload is freed.
#include "src/worker_node/residency.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace odmoe {
namespace {

// A payload that counts how many of its kind are alive.
class Counted final : public ResidentPayload {
 public:
  explicit Counted(std::atomic<int>* alive) : alive_(alive) { alive_->fetch_add(1); }
  ~Counted() override { alive_->fetch_sub(1); }

 private:
  std::atomic<int>* alive_;
};

class ResidencyTest : public ::testing::Test {
 protected:
  std::unique_ptr<ResidentPayload> Payload() { return std::make_unique<Counted>(&alive_); }
  static bool Always(size_t) { return true; }

  Residency residency_;
  std::atomic<int> alive_{0};
};

constexpr uint64_t kRequest = 5;
constexpr uint64_t kBytes = 1000;

TEST_F(ResidencyTest, PrefetchReservesFillsAndTheComputationTakesAndFrees) {
  const Residency::Reservation r = residency_.Reserve(kRequest, /*position=*/3, /*layer=*/1, {2, 5}, Always);
  ASSERT_EQ(r.outcome, Residency::ReserveOutcome::kReserved);
  ASSERT_EQ(r.keys.size(), 2u);
  EXPECT_EQ(r.keys[0], ResidentKey(1, 2, 3));
  EXPECT_EQ(residency_.size(), 2);
  residency_.Fill(r.keys[0], Payload(), kBytes);
  residency_.Fill(r.keys[1], Payload(), kBytes);
  EXPECT_EQ(alive_, 2);

  // A second prediction of the same experts for the same position reserves nothing.
  EXPECT_TRUE(residency_.Reserve(kRequest, 3, 1, {2, 5}, Always).keys.empty());

  const Residency::Taken taken = residency_.Take({1, 2}, 3);
  ASSERT_NE(taken.payload, nullptr);
  EXPECT_EQ(taken.origin, ResidentOrigin::kPrefetch);
  residency_.Release(taken.key, /*expert_calls=*/1);
  EXPECT_EQ(alive_, 1);  // no expert cache: freed after its one use
  EXPECT_EQ(residency_.size(), 1);
  const ResidencyCounts c = residency_.counts(/*reset=*/true);
  EXPECT_EQ(c.evictions, 1u);
  EXPECT_EQ(c.prefetches_unused, 0u);
  EXPECT_EQ(residency_.counts(false).evictions, 0u);
}

TEST_F(ResidencyTest, ReserveIsAllOrNothingWhenTheExpertsDoNotFit) {
  size_t asked = 0;
  const Residency::Reservation r = residency_.Reserve(kRequest, 0, 1, {0, 1, 2}, [&](size_t count) {
    asked = count;
    return false;
  });
  EXPECT_EQ(r.outcome, Residency::ReserveOutcome::kNoRoom);
  EXPECT_EQ(asked, 3u);
  EXPECT_EQ(r.keys.size(), 3u);  // what did not fit
  EXPECT_EQ(residency_.size(), 0);
}

TEST_F(ResidencyTest, APredictionMainHasReachedIsLateAndStaleEntriesAreFreed) {
  const auto r = residency_.Reserve(kRequest, /*position=*/4, /*layer=*/3, {1}, Always);
  residency_.Fill(r.keys[0], Payload(), kBytes);
  // Main computes (position 4, layer 1): the prediction for layer 3 is ahead, so it stays.
  EXPECT_EQ(residency_.Advance(kRequest, 4, 1), 0);
  EXPECT_FALSE(residency_.Passed(kRequest, 4, 3));
  EXPECT_TRUE(residency_.Passed(kRequest, 4, 1));
  EXPECT_EQ(alive_, 1);
  // Main reaches layer 5 without using it: freed, counted as unused; a prediction for layer 3 is now late.
  EXPECT_EQ(residency_.Advance(kRequest, 4, 5), 1);
  EXPECT_EQ(alive_, 0);
  const auto late = residency_.Reserve(kRequest, 4, 3, {1}, Always);
  EXPECT_EQ(late.outcome, Residency::ReserveOutcome::kLate);
  const ResidencyCounts c = residency_.counts(false);
  EXPECT_EQ(c.prefetches_unused, 1u);
  EXPECT_EQ(c.prefetches_late, 1u);
  // Another request makes every entry of this one stale; untracked entries (request 0) never are.
  residency_.Fill(residency_.Reserve(0, 9, 3, {2}, Always).keys[0], Payload(), kBytes);
  residency_.Fill(residency_.Reserve(kRequest, 9, 3, {3}, Always).keys[0], Payload(), kBytes);
  EXPECT_EQ(residency_.Advance(kRequest + 1, 0, 0), 1);
  EXPECT_EQ(residency_.size(), 1);
  EXPECT_FALSE(residency_.Passed(0, 0, 0));
}

TEST_F(ResidencyTest, TakePrefersItsPositionElseTheNewestEarlierOne) {
  for (int64_t position : {2, 5, 9}) {
    residency_.Fill(residency_.Reserve(kRequest, position, 1, {7}, Always).keys[0], Payload(), kBytes);
  }
  const Residency::Taken five = residency_.Take({1, 7}, 5);
  EXPECT_EQ(five.key, ResidentKey(1, 7, 5));
  residency_.Release(five.key, 1);
  EXPECT_EQ(residency_.Take({1, 7}, 7).key, ResidentKey(1, 7, 2));  // the newest earlier one; never a later one
  EXPECT_EQ(residency_.Take({1, 7}, 1).payload, nullptr);
  EXPECT_EQ(residency_.Take({1, 6}, 5).payload, nullptr);
  EXPECT_TRUE(residency_.Has({1, 7}, 100));
  EXPECT_FALSE(residency_.Has({1, 7}, 1));
}

TEST_F(ResidencyTest, TakeWaitsForALoadInFlightAndFindsNothingWhenItIsAbandoned) {
  const auto a = residency_.Reserve(kRequest, 0, 1, {0}, Always);
  const auto b = residency_.Reserve(kRequest, 0, 1, {1}, Always);
  std::atomic<bool> filled{false};
  std::thread loader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    filled = true;
    residency_.Fill(a.keys[0], Payload(), kBytes);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    residency_.Abandon(b.keys);
  });
  const Residency::Taken got = residency_.Take({1, 0}, 0);
  EXPECT_TRUE(filled);
  EXPECT_NE(got.payload, nullptr);
  EXPECT_EQ(residency_.Take({1, 1}, 0).payload, nullptr);  // woken by Abandon: load it on demand
  loader.join();
  residency_.Release(got.key, 1);
  EXPECT_EQ(residency_.size(), 0);
}

TEST_F(ResidencyTest, AKeptExpertServesItsOtherCallsThenGoes) {
  const ResidentKey key{1, 4, 0};
  // Loaded on demand by the first of three calls: kept.
  residency_.KeepOrFree(key, kRequest, /*expert_calls=*/3, Payload(), kBytes);
  EXPECT_EQ(alive_, 1);
  for (int call = 2; call <= 3; ++call) {
    const Residency::Taken t = residency_.Take({1, 4}, 0);
    ASSERT_NE(t.payload, nullptr) << "call " << call;
    EXPECT_EQ(t.origin, ResidentOrigin::kKept);
    residency_.Release(t.key, 3);
  }
  EXPECT_EQ(alive_, 0);
  EXPECT_EQ(residency_.counts(false).experts_kept, 1u);
  // A single-call expert, or one that a staged load already holds, is freed at once.
  residency_.KeepOrFree({1, 5, 0}, kRequest, 1, Payload(), kBytes);
  EXPECT_EQ(alive_, 0);
  EXPECT_TRUE(residency_.Insert({1, 6, 0}, kRequest, Payload(), kBytes));
  EXPECT_FALSE(residency_.Insert({1, 6, 0}, kRequest, Payload(), kBytes));
  residency_.KeepOrFree({1, 6, 0}, kRequest, 2, Payload(), kBytes);
  EXPECT_EQ(alive_, 1);  // the staged copy only
  // Freed: the kept one once used up, the single-call one, and the duplicate of the staged one.
  EXPECT_EQ(residency_.counts(false).evictions, 3u);
}

TEST_F(ResidencyTest, EvictionFreesIdleEntriesOldestFirstSparingWhatTheCallerNeeds) {
  for (int32_t e : {0, 1, 2}) {
    residency_.Fill(residency_.Reserve(kRequest, 0, 1, {e}, Always).keys[0], Payload(), kBytes);
  }
  const Residency::Taken in_use = residency_.Take({1, 1}, 0);
  // Room for 1.5 entries: expert 0 is needed later, expert 1 is in use: expert 2 goes, then expert 0.
  EXPECT_EQ(residency_.EvictIdle(kBytes / 2, {{1, 0}}), 1);
  EXPECT_TRUE(residency_.Has({1, 0}, 0));
  EXPECT_FALSE(residency_.Has({1, 2}, 0));
  EXPECT_EQ(residency_.EvictIdle(kBytes + 1, {{1, 0}}), 1);
  EXPECT_FALSE(residency_.Has({1, 0}, 0));
  EXPECT_EQ(residency_.EvictIdle(kBytes, {}), 0);  // only the entry in use is left
  EXPECT_EQ(residency_.counts(false).prefetches_unused, 2u);
  residency_.Release(in_use.key, 1);
  EXPECT_EQ(alive_, 0);
}

TEST_F(ResidencyTest, DropFreesOnlyReadyEntries) {
  ASSERT_TRUE(residency_.Insert({1, 0, 0}, kRequest, Payload(), kBytes));
  ASSERT_TRUE(residency_.Insert({1, 1, 0}, kRequest, Payload(), kBytes));
  const auto loading = residency_.Reserve(kRequest, 0, 1, {2}, Always);
  const Residency::Taken taken = residency_.Take({1, 1}, 0);
  residency_.Drop({{1, 0, 0}, {1, 1, 0}, {1, 2, 0}});
  EXPECT_EQ(residency_.size(), 2);  // the one in use and the one loading stay
  residency_.Release(taken.key, 1);
  residency_.Abandon(loading.keys);
  EXPECT_EQ(residency_.size(), 0);
  EXPECT_EQ(alive_, 0);
}

}  // namespace
}  // namespace odmoe
