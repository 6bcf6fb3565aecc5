// DecodeGraphs: when a decode step is recorded, which graph a step replays, and how many are kept.
#include "src/engine/decode_graphs.h"

#include <memory>

#include "gtest/gtest.h"

namespace odmoe {
namespace {

class FakeGraph : public Graph {};

DecodeStepKey Key(std::vector<uint64_t> caches, bool routing = false) {
  DecodeStepKey key;
  key.tokens.assign(caches.size(), true);
  key.caches = std::move(caches);
  key.routing = routing;
  return key;
}

TEST(DecodeGraphsTest, AKeyIsCapturedTheSecondTimeInARow) {
  DecodeGraphs graphs;
  EXPECT_FALSE(graphs.ShouldCapture(Key({1})));
  EXPECT_FALSE(graphs.ShouldCapture(Key({1, 2}))) << "the batch changed";
  EXPECT_FALSE(graphs.ShouldCapture(Key({1}))) << "not in a row";
  EXPECT_TRUE(graphs.ShouldCapture(Key({1})));
  EXPECT_FALSE(graphs.ShouldCapture(Key({1}, /*routing=*/true))) << "other outputs are another step";
  DecodeStepKey other = Key({1});
  other.tokens = {false};
  EXPECT_FALSE(graphs.ShouldCapture(other));
}

TEST(DecodeGraphsTest, FindsWhatWasInsertedAndDropsTheLeastRecentlyUsed) {
  DecodeGraphs graphs;
  std::vector<const Graph*> made;
  for (uint64_t id = 1; id <= DecodeGraphs::kCapacity; ++id) {
    made.push_back(graphs.Insert(Key({id}), std::make_unique<FakeGraph>()));
  }
  EXPECT_EQ(graphs.size(), DecodeGraphs::kCapacity);
  EXPECT_EQ(graphs.Find(Key({1})), made[0]);  // now the most recently used
  EXPECT_EQ(graphs.Find(Key({1, 2})), nullptr);
  graphs.Insert(Key({99}), std::make_unique<FakeGraph>());
  EXPECT_EQ(graphs.size(), DecodeGraphs::kCapacity);
  EXPECT_EQ(graphs.Find(Key({2})), nullptr) << "the least recently used went";
  EXPECT_NE(graphs.Find(Key({1})), nullptr);
  EXPECT_NE(graphs.Find(Key({99})), nullptr);
  EXPECT_EQ(graphs.captures(), DecodeGraphs::kCapacity + 1);
  graphs.Clear();
  EXPECT_EQ(graphs.size(), 0u);
  EXPECT_EQ(graphs.Find(Key({1})), nullptr);
  EXPECT_FALSE(graphs.ShouldCapture(Key({99}))) << "Clear forgets the previous step too";
}

}  // namespace
}  // namespace odmoe
