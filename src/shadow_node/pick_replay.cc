#include "src/shadow_node/pick_replay.h"

#include <utility>

namespace odmoe {

PickReplay::PickReplay(const ModelConfig& config, GenerateOptions options, std::span<const int32_t> prompt)
    : config_(config),
      options_(std::move(options)),
      prompt_(prompt.begin(), prompt.end()),
      sampler_(RequestSampler(config_, options_, prompt_)) {
  choice_ = sampler_.NextChoice();
}

void PickReplay::Push(int32_t id) {
  tokens_.push_back(id);
  sampler_.Record(id);
  choice_ = sampler_.NextChoice();
}

void PickReplay::Truncate(size_t n) {
  if (n >= tokens_.size()) return;
  PickReplay replayed(config_, options_, prompt_);
  for (size_t i = 0; i < n; ++i) replayed.Push(tokens_[i]);
  *this = std::move(replayed);
}

}  // namespace odmoe
