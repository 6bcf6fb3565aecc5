#include "src/main_node/reasoning.h"

#include "src/common/markers.h"

namespace odmoe::openai {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

}  // namespace

ReasoningReader::ReasoningReader(ReasoningParser parser)
    : parser_(parser), state_(parser == ReasoningParser::kNone ? State::kContent : State::kStart) {}

ReasoningReader::Out ReasoningReader::Push(std::string_view text) {
  Out out;
  if (finished_) return out;
  if (state_ == State::kContent) {
    out.content = std::string(text);
    return out;
  }
  pending_ += text;
  if (state_ == State::kStart) {
    // Whether the answer opens a block: decided at its first character that is not white space.
    const size_t first = pending_.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) return out;
    const std::string_view rest = std::string_view(pending_).substr(first);
    if (rest.size() < kOpen.size() && kOpen.starts_with(rest)) return out;  // may still be "<think>"
    if (rest.starts_with(kOpen)) {
      pending_.erase(0, first + kOpen.size());
      state_ = State::kReasoning;
    } else if (parser_ == ReasoningParser::kDeepSeekR1) {
      state_ = State::kReasoning;
    } else {
      state_ = State::kContent;
      out.content = std::move(pending_);
      pending_.clear();
      return out;
    }
  }
  // kReasoning: up to "</think>", holding back what may be its start.
  if (const size_t close = pending_.find(kClose); close != std::string::npos) {
    out.reasoning = pending_.substr(0, close);
    out.content = pending_.substr(close + kClose.size());
    pending_.clear();
    state_ = State::kContent;
    return out;
  }
  const size_t release = pending_.size() - MarkerPrefixAtEnd(pending_, kClose);
  out.reasoning = pending_.substr(0, release);
  pending_.erase(0, release);
  return out;
}

ReasoningReader::Out ReasoningReader::Finish() {
  Out out;
  if (finished_) return out;
  finished_ = true;
  // An answer that never decided (all white space, or a "<think>" cut short) is content for Qwen3, and reasoning
  // for DeepSeek-R1, whose block was open from the start; one cut short in its block is reasoning.
  if (state_ == State::kReasoning || (state_ == State::kStart && parser_ == ReasoningParser::kDeepSeekR1)) {
    out.reasoning = std::move(pending_);
  } else {
    out.content = std::move(pending_);
  }
  pending_.clear();
  return out;
}

}  // namespace odmoe::openai
