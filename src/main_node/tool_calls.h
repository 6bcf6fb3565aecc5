// Tool calling in the chat API (OpenAI's `tools` and `tool_choice`): the functions a client offers, the calls the
// model makes, and how those calls are read out of the model's text.
//
// The model sees the tools through its chat template (RenderChat in src/main_node/openai_api.h: ChatML models such
// as Qwen2.5 and Qwen3, whose templates list them in the system turn). What the model writes becomes calls by the
// request's tool_choice:
//   - "none": text, as without tools;
//   - "auto": the Hermes format Qwen's templates teach, a call being <tool_call>{"name": ..., "arguments": {...}}
//     </tool_call> anywhere in the text (vLLM's `hermes` tool parser); the rest stays the message's content;
//   - "required": the answer is held (ToolCallConstraint) to a non-empty JSON list of {"name", "parameters"}
//     objects, each one of the tools' with its parameters' schema, as vLLM does;
//   - a named function: the answer is held to that function's parameters' schema and is the call's arguments.
// A streamed answer and a whole one give the same content and calls, whatever the split of the text into pieces.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "src/common/json.h"
#include "src/engine/output_grammar.h"

namespace odmoe::openai {

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

// How a request's answer makes calls: its tool_choice, the function that names (kNamed), and whether one answer
// may make several calls (OpenAI's parallel_tool_calls, true unless the request says false).
struct ToolCalling {
  ToolChoice choice = ToolChoice::kNone;
  std::string function;
  bool parallel = true;
};

// One function the client offers (`tools[i]`, of type "function").
struct ToolDefinition {
  std::string name;
  // Its `parameters`' JSON Schema, keys in the client's order; when it gave none, an object with no properties
  // (additionalProperties false: the function takes no arguments).
  OrderedJson parameters;
  // The whole tool object as the client sent it, keys in its order: what the chat template shows the model.
  OrderedJson tool;
};

// One call the model made, as the API answers it (and as a client sends it back in an assistant message).
struct ToolCall {
  std::string id;  // a new one is "call_" and 24 random letters and digits
  std::string name;
  std::string arguments;  // the arguments' JSON text (an object)
};

// A streamed piece of a choice's calls: call `index`'s id and name on its first piece only (empty after), and the
// next part of its arguments' text. The pieces of one call concatenated are the call.
struct ToolCallDelta {
  int64_t index = 0;
  std::string id, name;
  std::string arguments;
};

// A fresh call id: "call_" and 24 random letters and digits.
std::string NewToolCallId();

// JSON as the chat templates' `tojson` writes it (Python's json.dumps with ensure_ascii=False): ", " and ": " as
// separators, keys in their order, non-ASCII characters as they are.
std::string TemplateJson(const OrderedJson& value);

// The output constraint of a tool_choice that demands a call: kRequired, a JSON list of at least one (and, unless
// parallel, at most one) {"name": <one of tools' names>, "parameters": <that tool's parameters>}; kNamed, the
// parameters of the function it names (the answer is the call's arguments). REQUIRES: kRequired with tools not
// empty, or kNamed naming one of tools.
OutputConstraint ToolCallConstraint(const ToolCalling& calling, const std::vector<ToolDefinition>& tools);

// Reads one choice's calls out of its text as it arrives (see the file comment for each tool_choice; "auto" without
// parallel calls reads the first call only, what follows it is content). Push returns the content released so far
// and the calls' pieces; Finish what is left at the end (once: later calls of either give nothing). Not
// thread-safe.
class ToolCallReader {
 public:
  explicit ToolCallReader(ToolCalling calling);

  struct Out {
    std::string content;
    std::vector<ToolCallDelta> calls;
  };
  Out Push(std::string_view text);
  Out Finish();

  // The calls read so far, whole.
  const std::vector<ToolCall>& calls() const { return calls_; }
  // Whether the choice's finish_reason is "tool_calls": calls were read and the model chose to make them ("auto"
  // and "required"; a named function's call answers its tool_choice and keeps the model's reason, as OpenAI's).
  bool finished_by_calls() const { return !calls_.empty() && calling_.choice != ToolChoice::kNamed; }

 private:
  // kAuto: a whole <tool_call> block's text (without the markers) as a call when it is one; false when not.
  bool AddHermesCall(std::string_view block, Out* out);
  // kAuto: text outside the blocks, to the content (after the first call, held while it is only whitespace).
  void Content(std::string_view text, Out* out);

  const ToolCalling calling_;
  std::vector<ToolCall> calls_;
  std::string pending_;    // kAuto: text that may open a block; in a block, its text; kRequired: the answer
  bool in_block_ = false;  // kAuto: inside <tool_call>
  bool finished_ = false;
  std::string between_;  // kAuto: whitespace after a call, shown only when more content follows
};

}  // namespace odmoe::openai
