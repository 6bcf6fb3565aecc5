// The OpenAI-compatible HTTP API of the main node, as pure functions: request bodies parsed and checked into
// CompletionRequest, responses and server-sent-event chunks built, errors in OpenAI's error object, stop strings
// matched across tokens, and chat messages rendered through a chat template. No sockets and no model here
// (src/main_node/http_server.h wires these to cpp-httplib and MainNode), so all of it is unit-tested and fuzzed
// (fuzz/openai_request_fuzzer.cc).
//
// What is accepted (POST /v1/completions and /v1/chat/completions): `model` (optional, as in vLLM: left out or null,
// the served model); `prompt` as a string, a list of strings, a list of token ids or a list of such lists, or
// `messages` for chat; `n` (choices per prompt); `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`,
// `seed`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `stop` (a string or a list of up to 16), `stream`,
// `stream_options.include_usage`, `logprobs` (completions: the alternatives per token; chat: true, with
// `top_logprobs`), `echo` (completions), and vLLM's extensions `ignore_eos`, `top_k`, `min_p`, `repetition_penalty`,
// `min_tokens`, `stop_token_ids`, `include_stop_str_in_output` and `stream_options.continuous_usage_stats`; a choice
// carries vLLM's `stop_reason` and `token_ids` beside OpenAI's fields. Structured output: `response_format` {"type":
// "json_object"} (the answer is one JSON object) or {"type": "json_schema"} (one value of the schema), vLLM's
// `guided_choice` (exactly one of a list of strings), `guided_json` (a schema), `guided_regex` (a text the
// expression matches whole) and vLLM's `structured_outputs` with `choice`, `json`, `regex` or `json_object`;
// src/engine/output_grammar.h. Tool calling (chat): `tools` (functions), `tool_choice` ("none", "auto", "required"
// or a named function) and `parallel_tool_calls`, assistant messages with `tool_calls` and `tool` messages with the
// results; src/main_node/tool_calls.h. vLLM's `chat_template_kwargs` (its `enable_thinking`: Qwen3's switch); with a
// reasoning parser, a chat answer's reasoning apart (`reasoning_content`, src/main_node/reasoning.h). Unknown fields
// are ignored; options odmoe does not implement are refused (400, `param` naming them) only when set to a value that
// needs them: `best_of` > 1, chat's `echo`, `suffix`, completions' `tools`, the legacy `functions` and a
// `function_call` that demands a call, `audio`, `modalities` other than text, and vLLM's `use_beam_search`,
// `guided_grammar`, `structured_outputs`' grammar / structural_tag and `prompt_logprobs`, so that no answer is
// sampled otherwise than asked.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/common/json.h"
#include "src/engine/logprobs.h"
#include "src/engine/output_grammar.h"
#include "src/engine/sampler.h"
#include "src/main_node/tool_calls.h"
#include "src/model/tokenizer.h"

namespace odmoe::openai {

// An error as the API answers it: the HTTP status and OpenAI's error object.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";  // invalid_request_error, authentication_error, server_error, ...
  std::string param;                           // the request field at fault; "" -> null
  std::string code;                            // e.g. model_not_found; "" -> null
  int retry_after_s = 0;                       // > 0: sent as the Retry-After header (a busy server's 429)
};
// {"error": {"message", "type", "param", "code"}} (param and code null when empty).
std::string ErrorBody(const ApiError& error);
// A serving failure as an ApiError: InvalidArgument / OutOfRange / FailedPrecondition -> 400
// (invalid_request_error), NotFound -> 404, Unavailable -> 503, DeadlineExceeded -> 504, ResourceExhausted ->
// 429, Cancelled -> 499 (the client went away), anything else -> 500 (server_error).
ApiError ErrorOfStatus(const absl::Status& status);

enum class Endpoint { kCompletions, kChatCompletions };

// What a chat request passes its template besides the conversation (vLLM's `chat_template_kwargs`), as far as
// odmoe's formats read it; other keys are left to the template, which ignores them here.
struct ChatTemplateArgs {
  // Qwen3's switch (ChatTemplate::thinking_switch): false opens the answer with an empty "<think>\n\n</think>\n\n",
  // so that the model answers without reasoning first.
  bool enable_thinking = true;
};

struct ChatMessage {
  std::string role;  // system, user, assistant or tool (developer is read as system)
  std::string content;
  std::vector<ToolCall> tool_calls;  // assistant: the calls it made (each one's arguments a JSON object's text)
  std::string tool_call_id;          // tool: the call it answers
};

// One prompt of a completion request: text (tokenized by the server) or token ids.
struct Prompt {
  bool is_text = false;
  std::string text;
  std::vector<int32_t> ids;
};

// A request body, checked for types and ranges (not yet against the model: see CheckAgainstModel).
struct CompletionRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::optional<std::string> model;   // none: the request names no model (vLLM's default, the served one)
  std::vector<Prompt> prompts;        // completions: at least one
  std::vector<ChatMessage> messages;  // chat: at least one
  // Choices per prompt (1..kMaxChoicesPerPrompt): choice j of prompt p has index p * n + j and samples with the
  // seed plus j, so that it is the answer of a request with n = 1 and that seed.
  int64_t n = 1;
  std::optional<int64_t> max_tokens;  // the client's; absent: see MaxTokens
  // SamplingDefaults::max_tokens, the checkpoint's max_new_tokens: chat's max_tokens when the client gives none
  // (MaxTokens, which owns the rule).
  std::optional<int64_t> default_max_tokens;
  // Absent from the request: SamplingDefaults'.
  double temperature = 1.0;  // 0: greedy
  double top_p = 1.0;
  int64_t top_k = 0;             // vLLM's extension: the k likeliest tokens only; 0 (or -1 in the request): all
  double min_p = 0.0;            // vLLM's extension: SamplingOptions::min_p, [0, 1]; 0: off
  double repetition_penalty = 1.0;  // vLLM's extension: SamplingOptions::repetition_penalty, > 0; 1: none
  std::optional<uint64_t> seed;  // absent: a random seed per request
  // SamplingOptions' (src/engine/sampler.h): generated tokens' penalties, and biases by token id (keys of the
  // JSON object `logit_bias`, ids not yet checked against the vocabulary).
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::vector<std::pair<int32_t, double>> logit_bias;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk's `usage` is its choice's so far
  // (its prompt's tokens, the tokens it has generated up to and with that chunk) instead of null.
  bool continuous_usage = false;
  bool ignore_eos = false;     // odmoe's (and vLLM's) extension: generate max_tokens whatever the model says
  // vLLM's extension: no EOS or stop_token_ids id before this many tokens (GenerateOptions::min_tokens, at most
  // max_tokens), and no stop string looked for in the text that comes with them.
  int64_t min_tokens = 0;
  // vLLM's extension: ids that end a choice too (GenerateOptions::stop_token_ids; finish_reason "stop", the token's
  // text left out); checked against the vocabulary when the request is prepared.
  std::vector<int32_t> stop_token_ids;
  // vLLM's extension: the text of the stop string or stop token that ends a choice stays in its answer.
  bool include_stop_str_in_output = false;
  // Completions: the answer starts with the prompt's text and, with logprobs, the prompt tokens' logprobs (the
  // first one null); max_tokens may then be 0.
  bool echo = false;
  // Each token's logprob and this many alternatives (0..kMaxTopLogprobs); -1: no logprobs. Completions'
  // `logprobs`; chat's `top_logprobs` when `logprobs` is true.
  int32_t logprobs = -1;
  // Structured output: `response_format` json_object or json_schema, `guided_choice`, `guided_json`,
  // `guided_regex` or `structured_outputs`; `constraint_param` is the one that asked (errors about the constraint name
  // it).
  OutputConstraint constraint;
  std::string constraint_param;
  // Chat: the functions the model may call (at most kMaxTools, names distinct), and how its answer makes calls
  // (src/main_node/tool_calls.h: `tool_choice`, "auto" by default when there are tools, and `parallel_tool_calls`).
  // "required" and a named function set `constraint` (ToolCallConstraint), with constraint_param "tool_choice".
  std::vector<ToolDefinition> tools;
  ToolCalling tool_calling;
  ChatTemplateArgs template_args;  // chat: `chat_template_kwargs`
};

// The sampling of a request that leaves these options out: OpenAI's defaults, or what the checkpoint's
// generation_config.json recommends (ReadSamplingDefaults), as vLLM applies it unless told otherwise.
struct SamplingDefaults {
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;  // 0: all tokens
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  // generation_config.json's max_new_tokens: chat's max_tokens when a request gives none (vLLM's fallback; the
  // completions endpoint keeps its default of 16, and a request's own max_tokens wins, also above it).
  std::optional<int64_t> max_tokens;
};

// The defaults a checkpoint's generation_config.json (`config`, an object read from `path`) recommends: its
// `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens`, each where it has one
// (vLLM's list).
// FailedPrecondition naming the file and key for a value that is not a number. `ignored` gets, as "key = value
// (why)", the values outside what a request may ask for, which odmoe does not follow (do_sample is not read: vLLM
// does not read it).
absl::StatusOr<SamplingDefaults> ReadSamplingDefaults(const Json& config, const std::string& path,
                                                      std::vector<std::string>* ignored);

// Parses and checks a request body for `endpoint`, with `defaults` for the sampling options it leaves out. Errors
// are 400 with `param` naming the field: malformed JSON, a body that is not an object, a field of the wrong type
// or out of range, an unsupported option set.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body, Endpoint endpoint, ApiError* error,
                                                         const SamplingDefaults& defaults = {});

// vLLM's POST /tokenize: `model` and either `prompt` (a string; `add_special_tokens`, default true, adds what a
// completion's prompt gets, e.g. BOS) or `messages` (the prompt chat would make of them).
struct TokenizeRequest {
  std::optional<std::string> model;  // as CompletionRequest::model
  std::optional<std::string> prompt;
  std::vector<ChatMessage> messages;  // when there is no prompt: at least one
  std::vector<ToolDefinition> tools;  // with messages: as chat's
  ChatTemplateArgs template_args;     // with messages: as chat's
  bool add_special_tokens = true;
};
absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(std::string_view body, ApiError* error);
// vLLM's POST /detokenize: `model` and `tokens` (a list of token ids, possibly empty).
struct DetokenizeRequest {
  std::optional<std::string> model;  // as CompletionRequest::model
  std::vector<int32_t> tokens;
};
absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(std::string_view body, ApiError* error);

// The most tools a request may offer (OpenAI's limit).
inline constexpr size_t kMaxTools = 128;
// The largest `n` (OpenAI's limit).
inline constexpr int64_t kMaxChoicesPerPrompt = 128;
// prompts x n: so much as one request may ask for (each choice is a request to main, held in memory meanwhile).
inline constexpr int64_t kMaxChoicesPerRequest = 4096;
// The default max_tokens of OpenAI's completions endpoint.
inline constexpr int64_t kDefaultCompletionMaxTokens = 16;
// The number of tokens a choice of `r` may generate after a prompt of prompt_len tokens, in a context of
// max_positions: the client's max_tokens; else completions kDefaultCompletionMaxTokens, chat the rest of the context
// (at least 1, so that a full prompt is refused), at most r.default_max_tokens. The request is checked against the
// context afterwards (ValidateRequest): only the client's own value can make it too long.
int64_t MaxTokens(const CompletionRequest& r, int64_t prompt_len, int64_t max_positions);
// At most this many stop strings, each at most kMaxStopBytes bytes.
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopBytes = 256;

// ---- chat templates ----------------------------------------------------------------------------------------

// The chat formats odmoe renders without a Jinja engine.
enum class ChatFormat {
  kNone,         // none known: chat is refused
  kMistralInst,  // <s>[INST] user [/INST] assistant</s>[INST] ... (Mistral / Mixtral instruct)
  kLlama2,       // as kMistralInst, but <s> before every [INST], the system message in <<SYS>> inside the first
  kChatMl,       // <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n (Qwen)
};
std::string_view ChatFormatName(ChatFormat format);  // "none", "mistral-inst", "llama2", "chatml"

// A checkpoint's chat template, as far as odmoe reads it.
struct ChatTemplate {
  ChatFormat format = ChatFormat::kNone;
  // kChatMl: the system message the template writes when the request has none ("" for none), e.g. Qwen2's
  // "You are a helpful assistant."; and whether it drops the reasoning (up to "</think>") of earlier assistant
  // turns, as Qwen3's does.
  std::string default_system;
  bool drop_reasoning = false;
  // kChatMl: the template lists tools in its system turn and teaches <tool_call> blocks (Qwen2.5's and Qwen3's do;
  // Qwen2's and Qwen1.5's do not): RenderChat shows a request's tools, and tool messages, only then.
  bool tools = false;
  // kChatMl: the template reads `enable_thinking` (Qwen3's), which ChatTemplateArgs may turn off.
  bool thinking_switch = false;
};

// The chat template of a checkpoint: tokenizer_config.json's `chat_template` (`tokenizer_config`: its parsed
// content, or null when there is none) when it is one odmoe recognizes (by the markers it writes: [INST] with
// or without <<SYS>>, <|im_start|>), else the built-in format of the architecture (`architecture`,
// config.json's: MixtralForCausalLM -> kMistralInst), else kNone.
ChatTemplate ChooseChatTemplate(const Json& tokenizer_config, std::string_view architecture);

// Why `chat`'s prompts would not come out as its format means with `tokenizer`, or "" when they would: a ChatML
// prompt is one text whose markers must be the tokenizer's special tokens; the [INST] formats need its BOS and
// EOS. Main turns chat off, with this reason, when it is not "".
std::string ChatTemplateMismatch(const ChatTemplate& chat, const Tokenizer& tokenizer);

// Why `chat` cannot show a request's tools, or "" when it can (a ChatML template that knows them).
std::string ChatToolsMismatch(const ChatTemplate& chat);

// One piece of a rendered chat prompt: text to tokenize, or the BOS / EOS control token.
struct PromptPiece {
  enum Kind { kText, kBos, kEos } kind = kText;
  std::string text;
};
// The prompt `messages` make in `chat`'s format, ending where the assistant's answer begins. [INST] formats:
// an optional leading system message goes into the first user turn; then user and assistant alternate,
// starting and ending with user. ChatML: system, user, assistant and tool messages in any order, the last one the
// user's or a tool's; one text piece whose markers (<|im_start|>, <|im_end|>) the tokenizer must read as its
// special tokens. With `tools` (or tool messages: chat.tools only), Qwen's template's: the tools in the system turn
// (after the system message, or the default one), an assistant's calls as <tool_call> blocks, and each run of tool
// messages as one user turn of <tool_response> blocks. InvalidArgument naming the message index otherwise, or when
// the format cannot show tools (ChatToolsMismatch). `args` as the template reads them (enable_thinking: where it
// has the switch). REQUIRES: chat.format != kNone.
absl::StatusOr<std::vector<PromptPiece>> RenderChat(const ChatTemplate& chat, const std::vector<ChatMessage>& messages,
                                                    const std::vector<ToolDefinition>& tools = {},
                                                    const ChatTemplateArgs& args = {});

// ---- stop strings ------------------------------------------------------------------------------------------

// Finds stop strings in generated text that arrives in pieces (a stop string may span pieces, i.e. tokens).
// The text before the first match is released, the match (unless include_stop, vLLM's
// include_stop_str_in_output) and everything after it are dropped: Push(pieces...) + Finish() is that text
// whatever the split into pieces. Without include_stop, text that may still be the start of a stop string is held
// back. The first match is the one that ends earliest (of two ending together, the one that starts first).
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops, bool include_stop = false);
  // Appends `piece`; returns the text now safe to emit. A match counts only where it ends inside a piece pushed
  // with `match` (vLLM's min_tokens: no stop string ends in the text of the first min_tokens tokens, though one
  // may start there). After a match, returns the rest up to it (or through it) and stopped() turns true; later
  // pushes return "".
  std::string Push(std::string_view piece, bool match = true);
  // The held-back text (no match can complete any more); "" after a match.
  std::string Finish();
  bool stopped() const { return !matched_.empty(); }
  // The stop string that matched (vLLM's stop_reason); "" before a match.
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;  // non-empty strings
  bool include_stop_;
  size_t longest_ = 0;  // of stops_
  // The text not yet released, after the last longest_ - 1 bytes already released (where a match may start).
  std::string window_;
  size_t released_ = 0;  // of window_'s bytes
  std::string matched_;
};

// ---- responses ---------------------------------------------------------------------------------------------

// A token as logprobs show it: its bytes (Tokenizer::TokenText, which may be part of a UTF-8 character; without a
// tokenizer "token_id:N", as vLLM's return_tokens_as_token_ids) and its log-probability.
struct LogprobToken {
  std::string bytes;
  float logprob = 0;
};
// A token's logprobs: the token and its position's most likely tokens, best first.
struct TokenLogprobs {
  LogprobToken token;
  std::vector<LogprobToken> top;
  bool no_logprob = false;  // the first token of an echoed prompt: nothing predicts it (null logprob and top)
};
// The engine's logprobs (ids) with each token's text from `tokenizer` (nullptr: "token_id:N").
TokenLogprobs LogprobsWithText(const PositionLogprobs& logprobs, const Tokenizer* tokenizer);

// A choice's `logprobs` for `tokens`, in the endpoint's shape:
//  - completions: {tokens, token_logprobs, top_logprobs, text_offset}; each top_logprobs entry maps the
//    alternatives' texts, and the chosen token's, to their logprobs (OpenAI's "up to logprobs + 1"); a
//    no_logprob token has null for both;
//    text_offset counts characters of the texts before each token, from `*text_offset`, which it advances (a
//    stream's chunks continue it);
//  - chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal: null}.
// Texts are shown with invalid UTF-8 as U+FFFD; chat's `bytes` are the token's own.
Json LogprobsJson(Endpoint endpoint, const std::vector<TokenLogprobs>& tokens, int64_t* text_offset);

// How a choice ended: OpenAI's finish_reason, "stop" (EOS, a stop string, a stop token) or "length" ("" while it
// goes on), and vLLM's stop_reason, the stop string or the stop_token_ids id that ended it (null for EOS, the
// token limit, or while it goes on).
struct ChoiceEnd {
  std::string finish_reason;
  Json stop_reason = nullptr;
};
// The end of a choice that main ended: its stop_reason ("eos", "stop_token", "length"; GenerateResponse) and the
// choice's generated ids (a stop token is the last).
ChoiceEnd ChoiceEndOf(std::string_view main_stop_reason, const std::vector<int32_t>& token_ids);
// The end of a choice that stop string `stop` ended.
inline ChoiceEnd StopStringEnd(const std::string& stop) { return {"stop", stop}; }

// The answer for one prompt.
struct Choice {
  int64_t index = 0;
  std::string text;                // chat: the message's content (null when empty beside tool calls)
  std::vector<int32_t> token_ids;  // the generated ids (odmoe's addition, as vLLM's token_ids)
  ChoiceEnd end;
  bool has_logprobs = false;  // the request asked: `logprobs` (one per token id) is shown, else null
  std::vector<TokenLogprobs> logprobs;
  std::vector<ToolCall> tool_calls;  // chat: the calls the answer made (ToolCallReader)
  // Chat with a reasoning parser ([model] reasoning_parser): the message's reasoning_content (null when empty).
  bool shows_reasoning = false;
  std::string reasoning;
};
struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};

// The whole (non-streamed) response body.
std::string CompletionBody(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                           const std::vector<Choice>& choices, const Usage& usage);

// One server-sent event: "data: <json>\n\n". The stream ends with kSseDone.
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";
std::string SseEvent(const Json& data);
// What a streamed chunk adds to its choice: text (completions' text, chat's delta.content) and, in chat, the pieces
// of its reasoning (delta.reasoning_content) and of its tool calls (delta.tool_calls: a call's id, type and name
// with its first piece).
struct ChunkDelta {
  // A piece of text alone (NOLINT: implicit, as the text it is).
  ChunkDelta(std::string_view text = {}) : text(text) {}  // NOLINT(google-explicit-constructor)
  ChunkDelta(const std::string& text) : text(text) {}     // NOLINT(google-explicit-constructor)
  ChunkDelta(const char* text) : text(text) {}            // NOLINT(google-explicit-constructor)
  std::string_view text;
  std::string_view reasoning;
  std::vector<ToolCallDelta> tool_calls;
};
// A chunk of a streamed response for choice `index`: `delta` (chat: with `first` also delta.role = assistant),
// `end` (finish_reason "" -> null, and stop_reason; {} while the choice goes on), `logprobs` (LogprobsJson of the
// chunk's tokens, or null). With include_usage, every chunk has a "usage": `usage_so_far`
// (CompletionRequest::continuous_usage), or null when that is nullptr.
Json StreamChunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model, int64_t index,
                 const ChunkDelta& delta, const std::vector<int32_t>& token_ids, const ChoiceEnd& end, bool first,
                 bool include_usage, Json logprobs = nullptr, const Usage* usage_so_far = nullptr);
// The last chunk when include_usage: no choices, the usage of every prompt.
Json UsageChunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                const Usage& usage);
// GET /v1/models: one model object per name (the model's name first, then its aliases), each with vLLM's
// `max_model_len` (the longest prompt plus answer, in tokens) and `root` (the first name).
// REQUIRES: models is not empty.
std::string ModelsBody(const std::vector<std::string>& models, int64_t created, int64_t max_model_len);
// GET /v1/models/{model}: that name's object alone (`root` the model's first name).
std::string ModelBody(const std::string& model, const std::string& root, int64_t created, int64_t max_model_len);
// vLLM's answers: {"count", "max_model_len", "tokens"} and {"prompt"} (the text, invalid UTF-8 as U+FFFD).
std::string TokenizeBody(const std::vector<int32_t>& tokens, int64_t max_model_len);
std::string DetokenizeBody(const std::string& text);

}  // namespace odmoe::openai
