#include "src/engine/decode_graphs.h"

namespace odmoe {

const Graph* DecodeGraphs::Find(const DecodeStepKey& key) {
  for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
    if (it->first == key) {
      graphs_.splice(graphs_.begin(), graphs_, it);
      return graphs_.front().second.get();
    }
  }
  return nullptr;
}

bool DecodeGraphs::ShouldCapture(const DecodeStepKey& key) {
  const bool again = previous_.has_value() && *previous_ == key;
  previous_ = key;
  return again;
}

const Graph* DecodeGraphs::Insert(DecodeStepKey key, std::unique_ptr<Graph> graph) {
  ++captures_;
  graphs_.emplace_front(std::move(key), std::move(graph));
  while (graphs_.size() > kCapacity) graphs_.pop_back();
  return graphs_.front().second.get();
}

void DecodeGraphs::Clear() {
  graphs_.clear();
  previous_.reset();
}

}  // namespace odmoe
