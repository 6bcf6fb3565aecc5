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
