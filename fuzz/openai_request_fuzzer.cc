// Fuzzes the OpenAI-compatible HTTP API's request handling (src/main_node/openai_api.h), everything the server does
// with a body before a model is involved: the first byte picks the endpoint (even: /v1/completions, odd:
// /v1/chat/completions), the rest is the body. Checked: a refused body is a 400 whose error object is valid JSON
// naming it; an accepted one respects the documented ranges; chat messages render (or are refused) without crashing,
// with the request's tools where the template knows them; stop strings, and the tool calls read out of the text by
// the request's tool_choice and its reasoning by each parser, are the same whatever the split of the text into
// pieces; the responses and stream chunks built from the request's text (and its calls) are valid JSON. The same
// body as a /tokenize and a /detokenize request: refused as a 400, or accepted with a prompt or messages (not both),
// ids >= 0 and a valid answer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "src/main_node/openai_api.h"
#include "src/main_node/reasoning.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

// Stop matching over `text` split at `cut` equals matching it whole (the same text, the same stop string).
void CheckStopSplit(const std::vector<std::string>& stops, bool include_stop, const std::string& text, size_t cut) {
  odmoe::openai::StopMatcher whole(stops, include_stop), split(stops, include_stop);
  const std::string a = whole.Push(text) + whole.Finish();
  cut = std::min(cut, text.size());
  const std::string b = split.Push(text.substr(0, cut)) + split.Push(text.substr(cut)) + split.Finish();
  Check(a == b);
  Check(whole.matched() == split.matched());
  Check(text.rfind(a, 0) == 0);  // always a prefix of the text
  if (include_stop && whole.stopped()) Check(a.ends_with(whole.matched()));
}

// The body as vLLM's /tokenize and /detokenize requests.
void CheckTokenizeRequests(std::string_view body) {
  using namespace odmoe::openai;
  ApiError error;
  absl::StatusOr<TokenizeRequest> t = ParseTokenizeRequest(body, &error);
  if (t.ok()) {
    Check(t->prompt.has_value() != !t->messages.empty());
  } else {
    Check(error.http_status == 400 && !error.message.empty());
  }
  ApiError derror;
  absl::StatusOr<DetokenizeRequest> d = ParseDetokenizeRequest(body, &derror);
  if (!d.ok()) {
    Check(derror.http_status == 400 && !derror.message.empty());
    return;
  }
  for (int32_t id : d->tokens) Check(id >= 0);
  Check(odmoe::ParseJson(TokenizeBody(d->tokens, 2048), "tokenize").ok());
  Check(odmoe::ParseJson(DetokenizeBody(std::string(body)), "detokenize").ok());
}

// The tool calls read out of `text` split at `cut` equal those read from it whole (content, names, arguments), and
// each call's deltas join into it.
std::vector<odmoe::openai::ToolCall> CheckToolCallSplit(const odmoe::openai::ToolCalling& calling,
                                                        const std::string& text, size_t cut) {
  using odmoe::openai::ToolCallReader;
  ToolCallReader whole(calling), split(calling);
  ToolCallReader::Out a = whole.Push(text);
  ToolCallReader::Out a_end = whole.Finish();
  cut = std::min(cut, text.size());
  std::vector<ToolCallReader::Out> pieces = {split.Push(text.substr(0, cut)), split.Push(text.substr(cut)),
                                             split.Finish()};
  std::string content;
  std::vector<std::string> arguments;
  for (const ToolCallReader::Out& piece : pieces) {
    content += piece.content;
    for (const odmoe::openai::ToolCallDelta& d : piece.calls) {
      Check(d.index >= 0 && static_cast<size_t>(d.index) <= arguments.size());
      if (static_cast<size_t>(d.index) == arguments.size()) arguments.emplace_back();
      arguments[d.index] += d.arguments;
    }
  }
  Check(a.content + a_end.content == content);
  Check(whole.calls().size() == split.calls().size() && split.calls().size() == arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    Check(whole.calls()[i].name == split.calls()[i].name);
    Check(whole.calls()[i].arguments == split.calls()[i].arguments && arguments[i] == split.calls()[i].arguments);
  }
  Check(whole.finished_by_calls() == split.finished_by_calls());
  return whole.calls();
}

// The reasoning told from `text` split at `cut` is the reasoning told from it whole, for each parser, and the
// two parts hold the text's bytes but the tags.
void CheckReasoningSplit(const std::string& text, size_t cut) {
  using odmoe::openai::ReasoningReader;
  for (const odmoe::ReasoningParser parser : {odmoe::ReasoningParser::kQwen3, odmoe::ReasoningParser::kDeepSeekR1}) {
    ReasoningReader whole(parser), split(parser);
    const ReasoningReader::Out a = whole.Push(text), a_end = whole.Finish();
    cut = std::min(cut, text.size());
    const ReasoningReader::Out b = split.Push(text.substr(0, cut)), c = split.Push(text.substr(cut)),
                               b_end = split.Finish();
    Check(a.reasoning + a_end.reasoning == b.reasoning + c.reasoning + b_end.reasoning);
    Check(a.content + a_end.content == b.content + c.content + b_end.content);
    Check((a.reasoning + a_end.reasoning + a.content + a_end.content).size() <= text.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace odmoe::openai;
  if (size == 0) return 0;
  const Endpoint endpoint = data[0] % 2 == 0 ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  CheckTokenizeRequests(body);
  ApiError error;
  absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(body, endpoint, &error);
  if (!r.ok()) {
    Check(error.http_status == 400 && !error.message.empty());
    Check(odmoe::ParseJson(ErrorBody(error), "error").ok());
    return 0;
  }
  Check(r->temperature >= 0 && r->temperature <= 2 && r->top_p > 0 && r->top_p <= 1 && r->top_k >= 0);
  Check(!r->max_tokens || *r->max_tokens >= 1);
  Check(r->stop.size() <= kMaxStopStrings);
  std::string text;
  if (endpoint == Endpoint::kCompletions) {
    Check(!r->prompts.empty());
    for (const Prompt& p : r->prompts) {
      Check(p.is_text || !p.ids.empty());
      for (int32_t id : p.ids) Check(id >= 0);
      text += p.text;
    }
  } else {
    Check(!r->messages.empty());
    for (const ChatFormat format : {ChatFormat::kMistralInst, ChatFormat::kLlama2}) {
      absl::StatusOr<std::vector<PromptPiece>> pieces = RenderChat({format}, r->messages);
      if (pieces.ok()) Check(!pieces->empty() && (*pieces)[0].kind == PromptPiece::kBos);
    }
    const ChatTemplate chat_ml{ChatFormat::kChatMl, "You are a helpful assistant.", /*drop_reasoning=*/true,
                               /*tools=*/true};
    absl::StatusOr<std::vector<PromptPiece>> chat = RenderChat(chat_ml, r->messages, r->tools);
    if (chat.ok()) {
      Check(chat->size() == 1 && (*chat)[0].kind == PromptPiece::kText);
      const std::string& prompt = (*chat)[0].text;
      Check(prompt.rfind("<|im_start|>system\n", 0) == 0);
      Check(prompt.size() >= 22 && prompt.compare(prompt.size() - 22, 22, "<|im_start|>assistant\n") == 0);
    }
    for (const ChatMessage& m : r->messages) text += m.content;
  }
  CheckStopSplit(r->stop, r->include_stop_str_in_output, text, text.size() / 2);
  CheckStopSplit(r->stop, r->include_stop_str_in_output, text, size % (text.size() + 1));
  std::vector<Choice> choices = {{0, text, {1, 2}, {"stop"}}};
  CheckReasoningSplit(text, size % (text.size() + 1));
  choices[0].tool_calls = CheckToolCallSplit(r->tool_calling, text, size % (text.size() + 1));
  Check(r->logprobs >= -1 && r->logprobs <= odmoe::kMaxTopLogprobs);
  if (r->logprobs >= 0) {  // the text's bytes as tokens (any bytes: cut characters, invalid UTF-8)
    choices[0].has_logprobs = true;
    for (size_t at = 0; at < text.size(); at += 3) {
      TokenLogprobs t{{text.substr(at, 3), -0.5f}, {}};
      for (int32_t k = 0; k < r->logprobs; ++k) t.top.push_back({text.substr(at + k % 3, 2), -1.0f - k});
      choices[0].logprobs.push_back(std::move(t));
    }
  }
  const std::string model = r->model.value_or("served");  // main answers with the served model's name
  const std::string answer = CompletionBody(endpoint, "id", 1, model, choices, {3, 2});
  absl::StatusOr<odmoe::Json> parsed = odmoe::ParseJson(answer, "body");
  Check(parsed.ok());
  if (r->logprobs >= 0) {
    const odmoe::Json& lp = (*parsed)["choices"][0]["logprobs"];
    Check((endpoint == Endpoint::kCompletions ? lp["tokens"] : lp["content"]).size() == choices[0].logprobs.size());
  }
  const odmoe::openai::Usage so_far{3, 2};
  const std::string event = SseEvent(StreamChunk(endpoint, "id", 1, model, 0, text, {}, {}, true, r->include_usage,
                                                 nullptr, r->continuous_usage ? &so_far : nullptr));
  Check(event.rfind("data: ", 0) == 0 && event.size() >= 8 && event.substr(event.size() - 2) == "\n\n");
  Check(odmoe::ParseJson(std::string_view(event).substr(6), "chunk").ok());
  return 0;
}
