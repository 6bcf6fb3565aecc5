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

void PickReplay::Restart() {
  sampler_ = RequestSampler(config_, options_, prompt_);
  choice_ = sampler_.NextChoice();
}

void PickReplay::Push(int32_t id) {
  tokens_.push_back(id);
  sampler_.Record(id);
  choice_ = sampler_.NextChoice();
}

void PickReplay::Truncate(size_t n) {
  if (n >= tokens_.size()) return;
  std::vector<int32_t> kept(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(n));
  tokens_.clear();
  Restart();
  for (const int32_t id : kept) Push(id);
}

}  // namespace odmoe
