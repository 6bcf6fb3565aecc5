#include "src/common/placement.h"

#include <algorithm>
#include <map>
#include <set>

#include "gtest/gtest.h"

namespace odmoe {
namespace {

TEST(PlacementTest, RejectsBadTopologies) {
  EXPECT_FALSE(Placement::Create(0, 1).ok());
  EXPECT_FALSE(Placement::Create(8, 0).ok());
  EXPECT_FALSE(Placement::Create(8, 3).ok());   // does not divide
  EXPECT_FALSE(Placement::Create(2, 4).ok());   // larger than the worker count
  auto p = Placement::Create(8, 3);
  EXPECT_NE(p.status().message().find("does not divide"), absl::string_view::npos);
  EXPECT_TRUE(Placement::Create(8, 2).ok());
  EXPECT_TRUE(Placement::Create(1, 1).ok());
}

TEST(PlacementTest, SparseLayersGoRoundRobinOverGroups) {
  auto p = Placement::Create(8, 2).value();
  EXPECT_EQ(p.num_groups(), 4);
  for (int64_t s = 0; s < 32; ++s) EXPECT_EQ(p.GroupOf(s), s % 4);
  // Worker 5 is in group 2: sparse layers 2, 6, 10, ...
  EXPECT_EQ(p.DecodeLayersOf(5, 12), (std::vector<int64_t>{2, 6, 10}));
  EXPECT_TRUE(p.ServesInDecode(4, 6));
  EXPECT_FALSE(p.ServesInDecode(4, 7));
}

TEST(PlacementTest, AssignIsOneToOneInsideTheGroupAndDeterministic) {
  auto p = Placement::Create(8, 2).value();
  for (int64_t s = 0; s < 8; ++s) {
    const std::vector<int32_t> experts = {6, 1};
    auto a = p.Assign(s, experts);
    ASSERT_EQ(a.size(), 2u);
    EXPECT_EQ(a[0].expert, 1);  // ascending expert order
    EXPECT_EQ(a[1].expert, 6);
    EXPECT_NE(a[0].worker, a[1].worker);  // one-to-one
    for (const auto& x : a) {
      EXPECT_TRUE(p.ServesInDecode(x.worker, s));
      EXPECT_TRUE(x.predicted);
    }
    // The order the set is given in does not matter.
    const std::vector<int32_t> reversed = {1, 6};
    auto b = p.Assign(s, reversed);
    EXPECT_EQ(a[0].worker, b[0].worker);
    EXPECT_EQ(a[1].worker, b[1].worker);
  }
}

TEST(PlacementTest, MoreExpertsThanGroupSlotsWrapAround) {
  auto p = Placement::Create(4, 2).value();
  const std::vector<int32_t> experts = {0, 3, 5, 9};
  auto a = p.Assign(1, experts);  // group 1: workers 2, 3
  ASSERT_EQ(a.size(), 4u);
  std::map<int32_t, int> load;
  for (const auto& x : a) ++load[x.worker];
  EXPECT_EQ(load[2], 2);
  EXPECT_EQ(load[3], 2);
}

TEST(PlacementTest, HitsStayWhereTheyWereLoadedMissesTakeUnusedWorkers) {
  auto p = Placement::Create(8, 2).value();
  const int64_t s = 3;  // group 3: workers 6, 7
  const std::vector<int32_t> predicted = {2, 5};
  auto planned = p.Assign(s, predicted);  // 2 -> worker 6, 5 -> worker 7
  ASSERT_EQ(planned[0].worker, 6);
  ASSERT_EQ(planned[1].worker, 7);

  // All hits.
  auto r = p.Resolve(s, predicted, predicted);
  EXPECT_EQ(r[0].worker, 6);
  EXPECT_EQ(r[1].worker, 7);
  EXPECT_TRUE(r[0].predicted && r[1].predicted);

  // Expert 5 predicted, 2 not used; actual {0, 5}: 5 stays on worker 7, the miss 0 goes to worker 6 (whose
  // predicted expert 2 turned out unused).
  const std::vector<int32_t> actual = {5, 0};
  r = p.Resolve(s, predicted, actual);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].expert, 0);
  EXPECT_EQ(r[0].worker, 6);
  EXPECT_FALSE(r[0].predicted);
  EXPECT_EQ(r[1].expert, 5);
  EXPECT_EQ(r[1].worker, 7);
  EXPECT_TRUE(r[1].predicted);

  // Both missed: each miss takes one unused worker, one-to-one.
  const std::vector<int32_t> other = {1, 4};
  r = p.Resolve(s, predicted, other);
  EXPECT_EQ(r[0].worker, 6);
  EXPECT_EQ(r[1].worker, 7);
  EXPECT_FALSE(r[0].predicted || r[1].predicted);

  // No prediction at all (a shadow that did not answer): the placement of the actual set.
  r = p.Resolve(s, {}, other);
  auto direct = p.Assign(s, other);
  ASSERT_EQ(r.size(), direct.size());
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(r[i].worker, direct[i].worker);
    EXPECT_FALSE(r[i].predicted);
  }
}

TEST(PlacementTest, PrefillSpreadsExpertsOverAllWorkers) {
  auto p = Placement::Create(8, 2).value();
  std::set<int32_t> used;
  for (int32_t e = 0; e < 16; ++e) {
    EXPECT_EQ(p.PrefillWorkerOf(e), e % 8);
    used.insert(p.PrefillWorkerOf(e));
  }
  EXPECT_EQ(used.size(), 8u);
}

}  // namespace
}  // namespace odmoe

namespace odmoe {
namespace {

// The rule for more than G experts in a group (hedged prefetch; the union of several requests' experts).
TEST(PlacementTest, MoreThanGroupSizeSpreadsEvenlyAndDeterministically) {
  auto p = Placement::Create(6, 3).value();  // group 1: workers 3, 4, 5
  const std::vector<int32_t> experts = {7, 2, 11, 0, 5};
  const auto a = p.Assign(1, experts);
  ASSERT_EQ(a.size(), 5u);
  // Ascending order, round-robin over the slots: 0->3, 2->4, 5->5, 7->3, 11->4.
  const std::vector<std::pair<int32_t, int32_t>> want = {{0, 3}, {2, 4}, {5, 5}, {7, 3}, {11, 4}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(a[i].expert, want[i].first);
    EXPECT_EQ(a[i].worker, want[i].second);
    EXPECT_TRUE(a[i].predicted);
  }
  // Any order of the same set, and duplicates, place the same.
  const std::vector<int32_t> shuffled = {11, 5, 0, 2, 7, 5};
  const auto b = p.Assign(1, shuffled);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(b[i].worker, a[i].worker);
  // No worker gets more than ceil(n / G).
  for (int n = 1; n <= 8; ++n) {
    std::vector<int32_t> set;
    for (int e = 0; e < n; ++e) set.push_back(3 * e + 1);
    std::map<int32_t, int> load;
    for (const Assignment& x : p.Assign(0, set)) ++load[x.worker];
    for (const auto& [w, count] : load) {
      EXPECT_LE(count, (n + 2) / 3) << "n=" << n;
      EXPECT_LT(w, 3);  // group 0
    }
  }
}

TEST(PlacementTest, GroupSizeCaseIsUnchangedByTheGeneralRule) {
  // G experts or fewer go one-to-one, expert i of the sorted set to slot i, with or without (ample) capacities.
  auto p = Placement::Create(8, 4).value();
  const std::vector<int32_t> experts = {6, 1, 3};
  const std::vector<int32_t> roomy = {1, 1, 1, 1};
  for (int64_t s = 0; s < 4; ++s) {
    const auto a = p.Assign(s, experts);
    const auto b = p.Assign(s, experts, roomy);
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), 3u);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].worker, p.WorkerOf(p.GroupOf(s), static_cast<int32_t>(i)));
      EXPECT_EQ(b[i].worker, a[i].worker);
    }
  }
}

TEST(PlacementTest, MoreThanGroupSizeStaysWithinEachWorkersRoom) {
  auto p = Placement::Create(4, 2).value();  // group 0: workers 0, 1
  const std::vector<int32_t> experts = {1, 2, 3, 4, 5};
  // Worker 0 has room for 1 expert, worker 1 for 3: the full slot is skipped; the fifth expert has no room.
  const std::vector<int32_t> capacity = {1, 3};
  const auto a = p.Assign(0, experts, capacity);
  ASSERT_EQ(a.size(), 4u);
  std::map<int32_t, int> load;
  for (const Assignment& x : a) ++load[x.worker];
  EXPECT_EQ(load[0], 1);
  EXPECT_EQ(load[1], 3);
  EXPECT_EQ(a[0].expert, 1);
  EXPECT_EQ(a[0].worker, 0);
  EXPECT_EQ(a[3].expert, 4);  // ascending: the ones left out are the highest ids
  // No room at all: nothing placed.
  const std::vector<int32_t> none = {0, 0};
  EXPECT_TRUE(p.Assign(0, experts, none).empty());
}

TEST(PlacementTest, HedgedExpertsThatTurnOutUsedRunWhereTheyWereLoaded) {
  auto p = Placement::Create(4, 2).value();  // sparse layer 1: group 1, workers 2, 3
  // Top-k {2, 5} with the hedge 4: loaded on 2->2, 4->3, 5->2.
  const std::vector<int32_t> loaded = {2, 5, 4};
  const auto planned = p.Assign(1, loaded);
  const std::vector<int32_t> actual = {4, 5};  // the hedge was right, 2 was wrong
  const auto r = p.Resolve(1, loaded, actual);
  ASSERT_EQ(r.size(), 2u);
  for (const Assignment& x : r) {
    EXPECT_TRUE(x.predicted);
    auto at = std::find_if(planned.begin(), planned.end(), [&](const Assignment& a) { return a.expert == x.expert; });
    ASSERT_NE(at, planned.end());
    EXPECT_EQ(x.worker, at->worker);
  }
}

// Operations 4/4: for every set of surviving workers of the 8-worker layout (and each group size that divides
// it), every (sparse layer, expert) has exactly one owner, a survivor, in decode and in prefill; with every
// worker alive the rule is the plain one; and the mapping depends only on the set (what every node computes).
TEST(PlacementFailoverTest, EverySurvivorSetGivesEveryExpertExactlyOneLiveOwner) {
  constexpr int32_t kWorkers = 8, kExperts = 8;
  constexpr int64_t kSparse = 9;  // more layers than groups: every home group several times
  for (int32_t g : {1, 2, 4, 8}) {
    const Placement base = Placement::Create(kWorkers, g).value();
    for (uint32_t alive = 1; alive < (1u << kWorkers); ++alive) {
      std::vector<int32_t> absent, absent_reversed;
      for (int32_t w = 0; w < kWorkers; ++w) {
        if ((alive & (1u << w)) == 0) absent.push_back(w);
      }
      absent_reversed.assign(absent.rbegin(), absent.rend());
      absent_reversed.insert(absent_reversed.end(), absent.begin(), absent.end());  // duplicates count once
      const Placement p = base.Without(absent).value();
      const Placement other = Placement::Create(kWorkers, g).value().Without(absent_reversed).value();
      SCOPED_TRACE(::testing::Message() << "G=" << g << " alive=" << alive);
      ASSERT_TRUE(p.servable());
      ASSERT_EQ(p.absent(), absent);
      for (int64_t s = 0; s < kSparse; ++s) {
        const int32_t group = p.GroupOf(s);
        ASSERT_EQ(group, other.GroupOf(s));
        // Every expert of the layer at once (the largest set), then one request's top-2.
        std::vector<int32_t> all(kExperts);
        for (int32_t e = 0; e < kExperts; ++e) all[static_cast<size_t>(e)] = e;
        for (const std::vector<int32_t>& set : {all, std::vector<int32_t>{1, 6}, std::vector<int32_t>{7}}) {
          const std::vector<Assignment> a = p.Assign(s, set);
          ASSERT_EQ(a.size(), set.size());
          std::set<int32_t> owned;
          for (size_t i = 0; i < a.size(); ++i) {
            EXPECT_TRUE(owned.insert(a[i].expert).second) << "expert " << a[i].expert << " has two owners";
            EXPECT_TRUE(p.member(a[i].worker)) << "expert " << a[i].expert << " on absent worker " << a[i].worker;
            EXPECT_TRUE(p.ServesInDecode(a[i].worker, s));
            const std::vector<Assignment> b = other.Assign(s, set);
            EXPECT_EQ(a[i].worker, b[i].worker);
          }
          // Resolve with a wrong prediction puts the misses on live workers too.
          const std::vector<int32_t> predicted = {0, 2};
          for (const Assignment& r : p.Resolve(s, predicted, set)) EXPECT_TRUE(p.member(r.worker));
        }
      }
      for (int32_t e = 0; e < kExperts; ++e) {
        const int32_t w = p.PrefillWorkerOf(e);
        EXPECT_TRUE(p.member(w)) << "prefill expert " << e << " on absent worker " << w;
        EXPECT_EQ(w, other.PrefillWorkerOf(e));
        if (p.member(e % kWorkers)) {
          EXPECT_EQ(w, e % kWorkers);  // a survivor keeps what it had
        }
      }
    }
    // Everyone alive: the plain rule.
    const Placement full = base.Without({}).value();
    for (int64_t s = 0; s < kSparse; ++s) {
      EXPECT_EQ(full.GroupOf(s), static_cast<int32_t>(s % (kWorkers / g)));
      const std::vector<Assignment> a = full.Assign(s, std::vector<int32_t>{3, 5});
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].worker, full.WorkerOf(full.GroupOf(s), static_cast<int32_t>(i % static_cast<size_t>(g))));
      }
    }
  }
}

TEST(PlacementFailoverTest, AWholeGroupDownMovesItsLayersToTheNextGroupAndNobodyLeftIsNotServable) {
  const Placement base = Placement::Create(8, 2).value();  // groups {0,1} {2,3} {4,5} {6,7}
  const Placement p = base.Without(std::vector<int32_t>{2, 3}).value();
  EXPECT_EQ(p.HomeGroupOf(1), 1);
  EXPECT_EQ(p.GroupOf(1), 2);  // group 1 is gone: its layers go to group 2
  EXPECT_EQ(p.GroupOf(5), 2);
  EXPECT_EQ(p.GroupOf(0), 0);
  EXPECT_FALSE(p.member(3));
  EXPECT_EQ(p.num_members(), 6);
  // One member left in a group: it takes the group's whole set.
  const Placement q = base.Without(std::vector<int32_t>{1}).value();
  for (const Assignment& a : q.Assign(0, std::vector<int32_t>{2, 4})) EXPECT_EQ(a.worker, 0);
  EXPECT_FALSE(base.Without(std::vector<int32_t>{8}).ok());
  EXPECT_FALSE(base.Without(std::vector<int32_t>{-1}).ok());
  const Placement none = base.Without(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}).value();
  EXPECT_FALSE(none.servable());
}

}  // namespace
}  // namespace odmoe
