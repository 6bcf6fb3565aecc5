// A chat answer's reasoning told from its content ([model] reasoning_parser, vLLM's --reasoning-parser), as the
// text arrives: reasoning models write a <think> ... </think> block before their answer, which the API returns
// as the message's `reasoning_content` (delta.reasoning_content when streamed), the rest as its `content`.
//   - kQwen3: a block the answer opens with ("<think>" first, after any white space); an answer that does not
//     open one is all content (Qwen3 with enable_thinking false, whose template wrote an empty block).
//   - kDeepSeekR1: everything up to the first "</think>" (its template opens the block in the prompt; a "<think>"
//     the answer opens with anyway is dropped).
// An answer cut short inside its block (max_tokens, a stop string) is all reasoning. The tags are in neither part;
// the content is what follows "</think>", as it is. A streamed answer and a whole one are split alike, whatever
// the pieces.
#pragma once

#include <string>
#include <string_view>

#include "src/common/cluster_config.h"

namespace odmoe::openai {

class ReasoningReader {
 public:
  explicit ReasoningReader(ReasoningParser parser);

  struct Out {
    std::string reasoning, content;
  };
  // The parts of `text` (the answer's next piece) that are known now; a possible tag's start is held back.
  Out Push(std::string_view text);
  // What is held back, at the end of the answer. Once: later calls of either give nothing.
  Out Finish();

 private:
  enum class State { kStart, kReasoning, kContent };
  const ReasoningParser parser_;
  State state_;
  std::string pending_;  // kStart: the answer so far; kReasoning: a possible "</think>"'s start
  bool finished_ = false;
};

}  // namespace odmoe::openai
