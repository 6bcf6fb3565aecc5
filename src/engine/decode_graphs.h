// The decode steps an Engine replays as graphs (Device::CaptureGraph): a step's device work is recorded once and
// then launched in one call at every later token, instead of its launches one by one (about 80 for
// tiny-mixtral-kjv's 8 layers).
//
// A recorded step is only right for steps whose work is the same: the same sequences' caches in the same rows, the
// same outputs. DecodeStepKey says what that is; the values that change from token to token (the ids, the
// positions, the sampling choices) reach the graph through host memory its copies read at each launch, and the
// position through device memory the ops read when they run (Device::AttentionAt, RopeWriteKv, WriteKvRows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "src/backend/device.h"

namespace odmoe {

// What makes two decode steps' device work the same.
struct DecodeStepKey {
  std::vector<uint64_t> caches;  // the KV caches of the rows' sequences, in row order (Sequence's cache id)
  std::vector<bool> tokens;      // per row: whether it picks a token
  bool routing = false;          // whether the router's ids come back to the host
  bool operator==(const DecodeStepKey&) const = default;
};

// The graphs of one engine, at most kCapacity (the least recently used dropped first), and when to record one: a
// key is captured the second time in a row it comes, so a batch whose rows change at every step never pays a
// capture it would not replay, and state an op makes at its first use (e.g. RoPE's table, uploaded with a wait)
// exists before the capture, which forbids waits. Not thread-safe (the engine's caller is one at a time).
class DecodeGraphs {
 public:
  static constexpr size_t kCapacity = 4;

  // The graph recorded for `key`, or null; a hit becomes the most recently used.
  const Graph* Find(const DecodeStepKey& key);
  // Whether a step of `key` without a graph should be captured now rather than run op by op: the previous
  // step had the same key. Then remembers `key` as the previous step's.
  bool ShouldCapture(const DecodeStepKey& key);
  // Keeps `graph` as the one of `key`, dropping the least recently used beyond kCapacity.
  const Graph* Insert(DecodeStepKey key, std::unique_ptr<Graph> graph);
  // Drops every graph (the memory they use is about to go, or the device refused one).
  void Clear();

  size_t size() const { return graphs_.size(); }
  uint64_t captures() const { return captures_; }  // Insert calls so far

 private:
  std::list<std::pair<DecodeStepKey, std::unique_ptr<Graph>>> graphs_;  // most recently used first
  std::optional<DecodeStepKey> previous_;
  uint64_t captures_ = 0;
};

}  // namespace odmoe
