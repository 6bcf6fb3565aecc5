#include "src/main_node/http_server.h"

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "httplib.h"
#include "spdlog/spdlog.h"
#include "src/common/host_port.h"
#include "src/common/logging.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"
#include "src/common/version.h"
#include "src/engine/generator.h"
#include "src/main_node/choices.h"
#include "src/main_node/client_connection.h"
#include "src/main_node/drain.h"
#include "src/main_node/reasoning.h"
#include "src/rpc/http_serving.h"
#include "src/rpc/logprobs_proto.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/request_id.h"
#include "src/rpc/sampling_proto.h"
#include "src/rpc/security.h"

namespace odmoe {
namespace {

using openai::ApiError;
using openai::Endpoint;

constexpr char kJson[] = "application/json";
constexpr size_t kMaxBodyBytes = 8 << 20;
// Idle keep-alive connections served beside the requests (OptionsFor): a client's connection pool may keep tens
// of them open (aiohttp's default limit is 100).
constexpr int kIdleConnections = 256;

void SendError(httplib::Response& res, const ApiError& e) {
  res.status = e.http_status;
  if (e.retry_after_s > 0) res.set_header("Retry-After", std::to_string(e.retry_after_s));
  res.set_content(openai::ErrorBody(e), kJson);
}

// Cross-origin requests (CORS; HttpServerOptions::allowed_origins). A request with an Origin the list allows gets
// the headers that let its page read the answer (a 401 or 429 too); one from another origin is served as any other,
// without them, so that the browser keeps the answer from the page. A browser's preflight (OPTIONS with
// Access-Control-Request-Method) is answered here, before the authorization hook: it never carries the API key.
httplib::Server::HandlerResponse CrossOrigin(const HttpServerOptions& options, const httplib::Request& req,
                                             httplib::Response& res) {
  const std::string origin = req.get_header_value("Origin");
  if (origin.empty()) return httplib::Server::HandlerResponse::Unhandled;  // not a browser's cross-origin call
  const std::vector<std::string>& allowed = options.allowed_origins;
  const bool any = allowed.size() == 1 && allowed.front() == "*";
  const bool ok = any || std::find(allowed.begin(), allowed.end(), origin) != allowed.end();
  // The answer depends on the origin (a cache must not give one origin's answer to another) unless any may read it.
  if (!any && !allowed.empty()) res.set_header("Vary", "Origin");
  if (ok) {
    res.set_header("Access-Control-Allow-Origin", any ? "*" : origin);
    res.set_header("Access-Control-Expose-Headers", "Retry-After, x-request-id");
  }
  if (req.method != "OPTIONS" || !req.has_header("Access-Control-Request-Method")) {
    return httplib::Server::HandlerResponse::Unhandled;
  }
  if (!ok) {
    ApiError e;
    e.http_status = 403;
    e.code = "origin_not_allowed";
    e.message = allowed.empty()
                    ? StrCat("cross-origin requests are off: node '", options.node, "' has no http_allowed_origins")
                    : StrCat("origin '", origin, "' is not in node '", options.node, "' http_allowed_origins");
    SendError(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }
  res.status = 204;
  res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
  const std::string asked = req.get_header_value("Access-Control-Request-Headers");
  res.set_header("Access-Control-Allow-Headers", asked.empty() ? "Authorization, Content-Type" : asked);
  res.set_header("Access-Control-Max-Age", "600");
  return httplib::Server::HandlerResponse::Handled;
}

// The API's routes, each with the `endpoint` label of odmoe_http_requests_total that its answers are counted
// under: the one place that names them.
struct Route {
  const char* path;
  const char* label;
};
constexpr Route kCompletionsRoute{"/v1/completions", "completions"};
constexpr Route kChatCompletionsRoute{"/v1/chat/completions", "chat_completions"};
constexpr Route kTokenizeRoute{"/tokenize", "tokenize"};
constexpr Route kDetokenizeRoute{"/detokenize", "detokenize"};
constexpr Route kModelsRoute{"/v1/models", "models"};  // and /v1/models/ID, under the same label
constexpr char kModelRoutePrefix[] = "/v1/models/";

// The label for an answer to `path` where no handler names it (a refusal before the handler: 401, httplib's own):
// the route's, or "other" for a path that is none.
std::string_view EndpointOf(std::string_view path) {
  for (const Route& route :
       {kCompletionsRoute, kChatCompletionsRoute, kTokenizeRoute, kDetokenizeRoute, kModelsRoute}) {
    if (path == route.path) return route.label;
  }
  if (path.starts_with(kModelRoutePrefix)) return kModelsRoute.label;
  return "other";
}

ApiError BadRequest(std::string message, std::string param = "") {
  ApiError e;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

// The request field of a GenerateOptions error (FieldOf: a GenerateRequest path such as "sampling.logit_bias")
// as request `r` names it (a constraint's: the option that asked for it); "" for none.
std::string ApiParamOf(std::string_view field, const openai::CompletionRequest& r) {
  if (field.starts_with("constraint")) return r.constraint_param;
  if (field.starts_with("sampling.")) field.remove_prefix(std::string_view("sampling.").size());
  if (field == "logprobs" && r.endpoint == Endpoint::kChatCompletions) return "top_logprobs";
  return std::string(field);
}

// The JSON file `name` of the checkpoint folder `dir` (null when absent); FailedPrecondition when it does not parse.
absl::StatusOr<Json> ReadCheckpointJson(const std::string& dir, std::string_view name) {
  if (dir.empty()) return Json(nullptr);
  const std::string path = (std::filesystem::path(dir) / name).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return Json(nullptr);
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<Json> j = ParseJson(text.str(), path);
  if (!j.ok()) return absl::FailedPreconditionError(j.status().message());
  return j;
}

// "cmpl-" / "chatcmpl-" and 24 random hex digits.
std::string NewResponseId(Endpoint endpoint) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = endpoint == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-";
  for (int i = 0; i < 24; ++i) id.push_back(kHex[rng() % 16]);
  return id;
}

}  // namespace

// A streamed request's events waiting to be written, at most (its choices wait beyond that).
constexpr size_t kStreamEventsQueued = 64;
// How often a request's client is checked while its choices run (a stream's, also between its events).
constexpr absl::Duration kClientCheckInterval = absl::Milliseconds(20);

// One prompt, ready to run: the request MainNode gets for its first choice (later ones add their number to its
// seed).
struct PreparedPrompt {
  v1::GenerateRequest request;
  int64_t prompt_tokens = 0;
  bool echo = false;  // the answer starts with the prompt (its text, and its logprobs when asked)
  openai::ToolCalling tool_calling;  // chat: how the answer's tool calls are read (CompletionRequest's)
  // Chat: how the answer's reasoning is told from its content (HttpServerOptions'); completions: kNone.
  ReasoningParser reasoning_parser = ReasoningParser::kNone;
};

struct HttpServer::Impl {
  MainNode* node = nullptr;
  HttpServerOptions options;
  openai::ChatTemplate chat_template;
  std::string no_chat_reason = "it has no chat template odmoe can apply";  // when chat_template.format is kNone
  openai::SamplingDefaults sampling_defaults;  // the checkpoint's generation_config.json's, else OpenAI's
  int64_t started = 0;                         // when the server started (Unix seconds): the model objects' `created`
  metrics::Family<metrics::Counter>* requests = nullptr;                   // {endpoint, code}
  metrics::Counter* disconnects = nullptr;
  // Set by StopAccepting: /health answers 503 (the port stays open while it also serves /metrics).
  std::atomic<bool> draining{false};
  // Set by Shutdown at its deadline: the requests still in flight end now (Unavailable).
  std::atomic<bool> stopping{false};
  mutable RequestDrain drain;  // the completions requests in flight, which Shutdown waits for
  mutable absl::Mutex ready_mu;
  bool ready ABSL_GUARDED_BY(ready_mu) = false;
  std::string ready_reason ABSL_GUARDED_BY(ready_mu) = "main has not judged its readiness yet";

  // Parses, checks and tokenizes a request: every prompt ready to run, or the error to answer.
  absl::StatusOr<std::vector<PreparedPrompt>> Prepare(const openai::CompletionRequest& r, ApiError* error) const;
  // The ids of one prompt: token ids as given, text through the tokenizer (with `special_tokens`, BOS/EOS as the
  // model asks).
  absl::StatusOr<std::vector<int32_t>> IdsOf(const openai::Prompt& p, ApiError* error,
                                             bool special_tokens = true) const;
  // NotFound (404 model_not_found in `error`) unless `model` is a name of the one served or none.
  absl::Status CheckModel(const std::optional<std::string>& model, ApiError* error) const;
  // The model's tokenizer, or InvalidArgument (a 400 naming `param` in `error`) saying the model has none;
  // `instead`, when not empty, tells the client what to send instead.
  absl::StatusOr<const Tokenizer*> NeedTokenizer(std::string_view param, std::string_view instead,
                                                 ApiError* error) const;
  // The prompt of chat `m` offering `tools`, with the template's `args`: a 400 naming `tools` when the model cannot
  // show them.
  absl::StatusOr<std::vector<int32_t>> ChatIds(const std::vector<openai::ChatMessage>& m,
                                               const std::vector<openai::ToolDefinition>& tools,
                                               const openai::ChatTemplateArgs& args, ApiError* error) const;

  // Runs choice `index`, sample `sample` of prompt `p` (its seed is the prompt's plus `sample`); `on_piece` gets
  // each piece of the answer (stop strings removed; chat: its reasoning told from its content,
  // openai::ReasoningReader, and the pieces of the tool calls read out of the content, openai::ToolCallReader) with
  // the ids it came with and their logprobs (when the request asked), and returns false when the client has gone
  // (the choice then stops: Cancelled, unless `halt` gives another reason); `halt` is the choice's StopCheck. The
  // choice's text, reasoning and calls are the concatenation of the pieces, so streamed and whole answers are the
  // same.
  using OnPiece = std::function<bool(const openai::ChunkDelta& piece, const std::vector<int32_t>& ids,
                                     const std::vector<openai::TokenLogprobs>& logprobs)>;
  // `admitted` (nullable): the choice's place in main's queue (its thread's in ParallelChoices), taken before the
  // answer was committed.
  absl::StatusOr<openai::Choice> Run(const PreparedPrompt& p, int64_t sample, const std::vector<std::string>& stop,
                                     int64_t index, const std::string& request_id, const OnPiece& on_piece,
                                     const StopCheck& halt, Admission::Ticket* admitted) const;
  // Why a choice stops before its end, or OK: the client gone, the server stopping, another choice of the same
  // request failed (in that order).
  absl::Status StopReason(bool client_gone, bool sibling_failed) const;
  // Places in main's queue for the choices of a request of `count` (as many as may run at once: the window of
  // ParallelChoices, whose threads run every choice on them), all or none: ServerBusyError when the queue has no
  // room for all of them.
  absl::StatusOr<std::vector<Admission::Ticket>> AdmitWindow(int64_t count) const;

  void Completions(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) const;
  // vLLM's /tokenize and /detokenize, through main's tokenizer and chat template.
  void Tokenize(const httplib::Request& req, httplib::Response& res) const;
  void Detokenize(const httplib::Request& req, httplib::Response& res) const;
  // The answer: `body` (JSON), or `error` when `status` is not OK; counted under `endpoint`.
  void Answer(const char* endpoint, const absl::Status& status, const ApiError& error, const std::string& body,
              httplib::Response& res) const;
  // A streamed answer, written to `sink` (the server's thread, after the 200 and its headers): the chunks of
  // every choice as they come (the choices run side by side, so chunks of different indexes interleave), the
  // usage chunk when asked for, data: [DONE]. False when the client went away.
  struct StreamJob {
    openai::CompletionRequest request;
    std::vector<PreparedPrompt> prompts;
    std::string id;
    int64_t created = 0;
    std::string request_id;
    const char* name = "";  // the endpoint, for logs
    // The choices' places in main's queue (AdmitWindow), taken before the 200, so a full queue is a 429 and not
    // an error event, before or after the first choices. Taken by Stream.
    std::vector<Admission::Ticket> admitted;
    std::optional<RequestDrain::Pass> pass;  // the request's, held until the stream's last byte
    bool started = false;
  };
  bool Stream(StreamJob& job, httplib::DataSink& sink) const;
  void Count(std::string_view endpoint, int code) const {
    requests->With({std::string(endpoint), std::to_string(code)}).Add();
  }
};

absl::StatusOr<std::vector<int32_t>> HttpServer::Impl::IdsOf(const openai::Prompt& p, ApiError* error,
                                                             bool special_tokens) const {
  if (!p.is_text) return p.ids;
  ODMOE_ASSIGN_OR_RETURN(const Tokenizer* tokenizer, NeedTokenizer("prompt", "send the prompt as token ids", error));
  if (absl::Status s = CheckUtf8(p.text, "prompt"); !s.ok()) {
    *error = BadRequest(std::string(s.message()), "prompt");
    return s;
  }
  return special_tokens ? tokenizer->EncodeForModel(p.text) : tokenizer->Encode(p.text);
}

absl::StatusOr<const Tokenizer*> HttpServer::Impl::NeedTokenizer(std::string_view param, std::string_view instead,
                                                                 ApiError* error) const {
  if (const Tokenizer* tokenizer = node->tokenizer()) return tokenizer;
  *error = BadRequest(StrCat("model '", options.model_id, "' has no tokenizer (neither tokenizer.model nor ",
                             "tokenizer.json)", instead.empty() ? "" : ": ", instead),
                      std::string(param));
  return absl::InvalidArgumentError(error->message);
}

absl::Status HttpServer::Impl::CheckModel(const std::optional<std::string>& model, ApiError* error) const {
  if (!model.has_value() || *model == options.model_id) return absl::OkStatus();
  for (const std::string& alias : options.model_aliases) {
    if (*model == alias) return absl::OkStatus();
  }
  std::string aliases;
  for (const std::string& alias : options.model_aliases) {
    aliases += StrCat(aliases.empty() ? " (also named '" : ", '", alias, "'");
  }
  if (!aliases.empty()) aliases += ")";
  *error = BadRequest(
      StrCat("The model '", *model, "' does not exist; this server serves '", options.model_id, "'", aliases), "model");
  error->http_status = 404;
  error->code = "model_not_found";
  return absl::NotFoundError(error->message);
}

absl::StatusOr<std::vector<int32_t>> HttpServer::Impl::ChatIds(const std::vector<openai::ChatMessage>& messages,
                                                               const std::vector<openai::ToolDefinition>& tools,
                                                               const openai::ChatTemplateArgs& args,
                                                               ApiError* error) const {
  ODMOE_ASSIGN_OR_RETURN(const Tokenizer* tokenizer,
                         NeedTokenizer("messages", "use /v1/completions with token ids", error));
  if (chat_template.format == openai::ChatFormat::kNone) {
    *error = BadRequest(StrCat("model '", options.model_id, "' cannot chat: ", no_chat_reason, "; use /v1/completions"),
                        "messages");
    return absl::InvalidArgumentError(error->message);
  }
  if (const std::string why = openai::ChatToolsMismatch(chat_template); !tools.empty() && !why.empty()) {
    *error = BadRequest(StrCat("model '", options.model_id, "' cannot be offered tools: ", why), "tools");
    return absl::InvalidArgumentError(error->message);
  }
  absl::StatusOr<std::vector<openai::PromptPiece>> pieces = openai::RenderChat(chat_template, messages, tools, args);
  if (!pieces.ok()) {
    *error = BadRequest(std::string(pieces.status().message()), "messages");
    return pieces.status();
  }
  std::vector<int32_t> ids;
  for (const openai::PromptPiece& piece : *pieces) {
    if (piece.kind == openai::PromptPiece::kBos) {
      ids.push_back(tokenizer->bos_id());
    } else if (piece.kind == openai::PromptPiece::kEos) {
      ids.push_back(tokenizer->eos_id());
    } else {
      if (absl::Status s = CheckUtf8(piece.text, "messages"); !s.ok()) {
        *error = BadRequest(std::string(s.message()), "messages");
        return s;
      }
      const std::vector<int32_t> text = tokenizer->Encode(piece.text);
      ids.insert(ids.end(), text.begin(), text.end());
    }
  }
  return ids;
}

absl::StatusOr<std::vector<PreparedPrompt>> HttpServer::Impl::Prepare(const openai::CompletionRequest& r,
                                                                      ApiError* error) const {
  std::vector<std::vector<int32_t>> prompts;
  if (r.endpoint == Endpoint::kChatCompletions) {
    ODMOE_ASSIGN_OR_RETURN(std::vector<int32_t> ids, ChatIds(r.messages, r.tools, r.template_args, error));
    prompts.push_back(std::move(ids));
  } else {
    for (const openai::Prompt& p : r.prompts) {
      ODMOE_ASSIGN_OR_RETURN(std::vector<int32_t> ids, IdsOf(p, error));
      prompts.push_back(std::move(ids));
    }
  }
  const ModelConfig& config = node->config();
  const uint64_t seed = r.seed ? *r.seed : std::random_device{}();
  std::vector<PreparedPrompt> out;
  for (std::vector<int32_t>& ids : prompts) {
    const int64_t len = static_cast<int64_t>(ids.size());
    const int64_t max_tokens = openai::MaxTokens(r, len, config.context_length());
    const std::string param = r.endpoint == Endpoint::kCompletions ? "prompt" : "messages";
    if (absl::Status s = ValidateRequest(config, ids, max_tokens); !s.ok()) {
      // ValidateRequest checks the length before the ids, so a request too long is refused as such. The blame
      // goes to max_tokens when the client set it and the prompt alone fits.
      const bool too_long = !FitsContext(config, len, max_tokens);
      const bool blame_max_tokens = too_long && r.max_tokens && FitsContext(config, len, 0);
      *error = BadRequest(std::string(s.message()), blame_max_tokens ? "max_tokens" : param);
      if (too_long) error->code = "context_length_exceeded";
      return s;
    }
    GenerateOptions checked{.max_new_tokens = max_tokens,
                            .sampling = {.temperature = r.temperature,
                                         .top_k = r.top_k,
                                         .top_p = r.top_p,
                                         .min_p = r.min_p,
                                         .seed = seed,
                                         .presence_penalty = r.presence_penalty,
                                         .frequency_penalty = r.frequency_penalty,
                                         .repetition_penalty = r.repetition_penalty,
                                         .logit_bias = r.logit_bias},
                            .ignore_eos = r.ignore_eos,
                            .stop_token_ids = r.stop_token_ids,
                            .include_stop_str_in_output = r.include_stop_str_in_output,
                            .min_tokens = r.min_tokens,
                            .logprobs = r.logprobs,
                            .prompt_logprobs = r.echo && r.logprobs >= 0,
                            .constraint = r.constraint,
                            .vocabulary = node->vocabulary()};
    if (absl::Status s = checked.Validate(config.vocab_size); !s.ok()) {
      const std::string field = FieldOf(s);
      const std::string blamed = ApiParamOf(field, r);
      std::string message(s.message());
      // In the client's words: the field as it sent it, and max_new_tokens (which min_tokens' bound names).
      if (!field.empty()) message = absl::StrReplaceAll(message, {{field, blamed}});
      message = absl::StrReplaceAll(message, {{"max_new_tokens", "max_tokens"}});
      *error = BadRequest(std::move(message), blamed);
      return s;
    }
    PreparedPrompt p;
    p.prompt_tokens = len;
    p.request.mutable_prompt_ids()->Add(ids.begin(), ids.end());
    rpc::OptionsToProto(checked, &p.request);
    p.echo = r.echo;
    p.tool_calling = r.tool_calling;
    if (r.endpoint == Endpoint::kChatCompletions) p.reasoning_parser = options.reasoning_parser;
    out.push_back(std::move(p));
  }
  return out;
}

absl::StatusOr<openai::Choice> HttpServer::Impl::Run(const PreparedPrompt& p, int64_t sample,
                                                     const std::vector<std::string>& stop, int64_t index,
                                                     const std::string& request_id, const OnPiece& on_piece,
                                                     const StopCheck& halt, Admission::Ticket* admitted) const {
  v1::GenerateRequest request = p.request;
  request.mutable_sampling()->set_seed(p.request.sampling().seed() + static_cast<uint64_t>(sample));
  openai::Choice choice;
  choice.index = index;
  choice.has_logprobs = p.request.logprobs();
  openai::StopMatcher matcher(stop, p.request.include_stop_str_in_output());
  bool stop_matched = false;
  openai::ReasoningReader reasoning(p.reasoning_parser);
  openai::ToolCallReader tools(p.tool_calling);
  choice.shows_reasoning = p.reasoning_parser != ReasoningParser::kNone;
  const Tokenizer* tokenizer = node->tokenizer();
  // A message's logprobs (or prompt_logprobs) as the API shows them, each token with its text.
  auto shown = [tokenizer](const auto& list) {
    std::vector<openai::TokenLogprobs> out;
    for (const v1::PositionLogprobs& lp : list) {
      out.push_back(openai::LogprobsWithText(rpc::LogprobsFromProto(lp), tokenizer));
    }
    return out;
  };
  bool client_gone = false;  // on_piece said so
  // The caller's reason first: a failed write may come from the server stopping, which the caller knows.
  const StopCheck stopped = [&]() -> absl::Status {
    if (absl::Status why = halt ? halt() : absl::OkStatus(); !why.ok()) return why;
    return StopReason(client_gone, false);
  };
  bool echo_due = p.echo;
  auto emit = [&](const v1::GenerateResponse& r) {
    if (echo_due) {  // the first message: the prompt's text, and its tokens' logprobs when asked
      echo_due = false;
      const std::span<const int32_t> prompt(p.request.prompt_ids().data(), p.request.prompt_ids().size());
      const std::string text = tokenizer != nullptr ? tokenizer->Decode(prompt) : "";
      std::vector<openai::TokenLogprobs> logprobs;
      if (choice.has_logprobs) {
        logprobs = shown(r.prompt_logprobs());
        // Nothing predicts the prompt's first token.
        openai::TokenLogprobs first = openai::LogprobsWithText(PositionLogprobs{{prompt[0], 0.0f}, {}}, tokenizer);
        first.no_logprob = true;
        logprobs.insert(logprobs.begin(), std::move(first));
      }
      choice.text += text;
      choice.logprobs.insert(choice.logprobs.end(), logprobs.begin(), logprobs.end());
      if (!on_piece(text, {}, logprobs)) client_gone = true;
    }
    const std::vector<int32_t> ids(r.tokens().begin(), r.tokens().end());
    const std::vector<openai::TokenLogprobs> logprobs = shown(r.logprobs());
    // As vLLM: no stop string ends in the text of the first min_tokens tokens (one may start there).
    const bool past_min_tokens = choice.token_ids.size() + ids.size() > static_cast<size_t>(p.request.min_tokens());
    std::string text = matcher.Push(r.text(), past_min_tokens);
    choice.token_ids.insert(choice.token_ids.end(), ids.begin(), ids.end());
    if (r.done()) {
      text += matcher.Finish();
      choice.end = openai::ChoiceEndOf(r.stop_reason(), choice.token_ids);
    }
    // The reasoning first, then the calls in what follows it.
    const bool last = r.done() || matcher.stopped();
    openai::ReasoningReader::Out split = reasoning.Push(text);
    if (last) {
      openai::ReasoningReader::Out rest = reasoning.Finish();
      split.reasoning += rest.reasoning;
      split.content += rest.content;
    }
    openai::ToolCallReader::Out content = tools.Push(split.content);
    if (last) {
      openai::ToolCallReader::Out rest = tools.Finish();
      content.content += rest.content;
      content.calls.insert(content.calls.end(), rest.calls.begin(), rest.calls.end());
    }
    choice.reasoning += split.reasoning;
    choice.text += content.content;
    choice.logprobs.insert(choice.logprobs.end(), logprobs.begin(), logprobs.end());
    openai::ChunkDelta piece(content.content);
    piece.reasoning = split.reasoning;
    piece.tool_calls = std::move(content.calls);
    // A client gone is seen by `stopped` below (the request ends as cancelled); emit's false is a stop.
    if (!on_piece(piece, ids, logprobs)) client_gone = true;
    if (matcher.stopped()) stop_matched = true;
    return !stop_matched;
  };
  MainNode::RequestRecord record;
  record.request_id = request_id;
  record.emit_false_is_stop = true;
  record.admitted = admitted;
  const absl::Status status = node->RunRequest(request, emit, stopped, &record);
  if (!status.ok()) return status;
  if (client_gone) return stopped();
  if (stop_matched) choice.end = openai::StopStringEnd(matcher.matched());
  choice.tool_calls = tools.calls();
  if (tools.finished_by_calls()) choice.end.finish_reason = "tool_calls";
  return choice;
}

void HttpServer::Impl::Completions(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) const {
  const char* name = (endpoint == Endpoint::kCompletions ? kCompletionsRoute : kChatCompletionsRoute).label;
  std::string request_id = req.get_header_value("x-request-id");
  if (request_id.empty() || !rpc::ValidateRequestId(request_id).ok()) request_id = rpc::NewRequestId();
  logging::ScopedRequestId scope(request_id);
  res.set_header("x-request-id", request_id);
  std::optional<RequestDrain::Pass> pass = drain.Enter();
  if (!pass) {  // a request that reached the server as its port closed
    const ApiError e = openai::ErrorOfStatus(absl::UnavailableError("main is shutting down"));
    Count(name, e.http_status);
    return SendError(res, e);
  }
  ApiError error;
  absl::StatusOr<openai::CompletionRequest> parsed =
      openai::ParseCompletionRequest(req.body, endpoint, &error, sampling_defaults);
  if (!parsed.ok()) {
    spdlog::info("http {} from {}: refused: {}", name, req.remote_addr, error.message);
    Count(name, error.http_status);
    return SendError(res, error);
  }
  if (!CheckModel(parsed->model, &error).ok()) {
    Count(name, error.http_status);
    return SendError(res, error);
  }
  absl::StatusOr<std::vector<PreparedPrompt>> prompts = Prepare(*parsed, &error);
  if (!prompts.ok()) {
    spdlog::info("http {} from {}: refused: {}", name, req.remote_addr, error.message);
    Count(name, error.http_status);
    return SendError(res, error);
  }
  const std::string id = NewResponseId(endpoint);
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const int64_t n = parsed->n;
  const int64_t count = static_cast<int64_t>(prompts->size()) * n;
  spdlog::info("http {} from {}: {} prompt(s), n {}, max_tokens {}, stream {}", name, req.remote_addr, prompts->size(),
               n, (*prompts)[0].request.max_new_tokens(), parsed->stream);
  // The first choices' places in main's queue, all or none: a full queue is a 429 (with Retry-After) before any
  // work, and for a stream before the 200, so that every error from there on is an error event.
  absl::StatusOr<std::vector<Admission::Ticket>> admitted = AdmitWindow(count);
  if (!admitted.ok()) {
    spdlog::info("http {} from {}: refused: {}", name, req.remote_addr, std::string(admitted.status().message()));
    const ApiError e = openai::ErrorOfStatus(admitted.status());
    Count(name, e.http_status);
    return SendError(res, e);
  }

  if (!parsed->stream) {
    // This thread watches the client while the choices run; a client gone cancels them, as a stream's does.
    const ClientConnection connection =
        ClientConnection::Find(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
    if (!connection.found()) spdlog::debug("http {}: its connection was not found; a client gone goes unseen", name);
    std::atomic<bool> client_gone{false};
    std::vector<openai::Choice> choices(count);
    ParallelChoices runner(count, std::move(admitted).value());
    runner.Start([&](int64_t c, Admission::Ticket* ticket) {
      logging::ScopedRequestId choice_scope(request_id);
      absl::StatusOr<openai::Choice> choice =
          Run((*prompts)[c / n], c % n, parsed->stop, c, request_id,
              [](const openai::ChunkDelta&, const std::vector<int32_t>&, const std::vector<openai::TokenLogprobs>&) {
                return true;
              },
              [&] { return StopReason(client_gone.load(), runner.failed()); }, ticket);
      if (!choice.ok()) return choice.status();
      choices[c] = std::move(choice).value();
      return absl::OkStatus();
    });
    while (!runner.WaitFor(kClientCheckInterval)) {
      if (!client_gone.load() && connection.Gone()) client_gone.store(true);
    }
    const absl::Status status = runner.Wait();
    if (client_gone.load()) {  // no one to answer: the 499 is for the log and the metrics
      disconnects->Add();
      spdlog::info("http {}: the client closed the connection; request cancelled", name);
      const ApiError e = openai::ErrorOfStatus(StopReason(true, false));
      Count(name, e.http_status);
      return SendError(res, e);
    }
    if (!status.ok()) {
      spdlog::warn("http {} failed: {}", name, status.ToString());
      const ApiError e = openai::ErrorOfStatus(status);
      Count(name, e.http_status);
      return SendError(res, e);
    }
    openai::Usage usage;
    for (const PreparedPrompt& p : *prompts) usage.prompt_tokens += p.prompt_tokens;
    for (const openai::Choice& c : choices) usage.completion_tokens += static_cast<int64_t>(c.token_ids.size());
    Count(name, 200);
    res.set_content(openai::CompletionBody(endpoint, id, created, options.model_id, choices, usage), kJson);
    return;
  }

  // Streamed: every check is done, so the answer is 200 and errors from here on are an error event.
  Count(name, 200);
  res.set_header("Cache-Control", "no-cache");
  auto job = std::make_shared<StreamJob>(StreamJob{std::move(parsed).value(), std::move(prompts).value(), id, created,
                                                   request_id, name, std::move(admitted).value(), std::move(pass)});
  res.set_chunked_content_provider("text/event-stream",
                                   [this, job](size_t, httplib::DataSink& sink) { return Stream(*job, sink); });
}

absl::Status HttpServer::Impl::StopReason(bool client_gone, bool sibling_failed) const {
  if (client_gone) return absl::CancelledError("the client went away");
  if (stopping.load()) return absl::UnavailableError("the HTTP server is shutting down");
  if (sibling_failed) return absl::AbortedError("another choice of the same request failed");
  return absl::OkStatus();
}

void HttpServer::Impl::Tokenize(const httplib::Request& req, httplib::Response& res) const {
  ApiError error;
  absl::StatusOr<std::vector<int32_t>> ids = [&]() -> absl::StatusOr<std::vector<int32_t>> {
    ODMOE_ASSIGN_OR_RETURN(openai::TokenizeRequest r, openai::ParseTokenizeRequest(req.body, &error));
    ODMOE_RETURN_IF_ERROR(CheckModel(r.model, &error));
    if (!r.prompt) return ChatIds(r.messages, r.tools, r.template_args, &error);
    return IdsOf(openai::Prompt{true, *r.prompt, {}}, &error, r.add_special_tokens);
  }();
  Answer(kTokenizeRoute.label, ids.status(), error,
         ids.ok() ? openai::TokenizeBody(*ids, node->config().context_length()) : "", res);
}

void HttpServer::Impl::Detokenize(const httplib::Request& req, httplib::Response& res) const {
  ApiError error;
  absl::StatusOr<std::string> text = [&]() -> absl::StatusOr<std::string> {
    ODMOE_ASSIGN_OR_RETURN(openai::DetokenizeRequest r, openai::ParseDetokenizeRequest(req.body, &error));
    ODMOE_RETURN_IF_ERROR(CheckModel(r.model, &error));
    ODMOE_ASSIGN_OR_RETURN(const Tokenizer* tokenizer, NeedTokenizer("tokens", "", &error));
    const int64_t vocab = node->config().vocab_size;
    for (size_t i = 0; i < r.tokens.size(); ++i) {
      if (r.tokens[i] >= vocab) {
        error = BadRequest(StrCat("'tokens[", i, "]' = ", r.tokens[i], " is outside the vocabulary [0, ", vocab, ")"),
                           "tokens");
        return absl::InvalidArgumentError(error.message);
      }
    }
    return tokenizer->Decode(r.tokens);
  }();
  Answer(kDetokenizeRoute.label, text.status(), error, text.ok() ? openai::DetokenizeBody(*text) : "", res);
}

void HttpServer::Impl::Answer(const char* endpoint, const absl::Status& status, const ApiError& error,
                              const std::string& body, httplib::Response& res) const {
  if (!status.ok()) {
    Count(endpoint, error.http_status);
    return SendError(res, error);
  }
  Count(endpoint, 200);
  res.set_content(body, kJson);
}

absl::StatusOr<std::vector<Admission::Ticket>> HttpServer::Impl::AdmitWindow(int64_t count) const {
  const int64_t window = std::min<int64_t>(count, node->max_running());
  std::vector<Admission::Ticket> tickets;
  tickets.reserve(window);
  while (static_cast<int64_t>(tickets.size()) < window) {
    ODMOE_ASSIGN_OR_RETURN(Admission::Ticket ticket, node->Admit());  // those taken leave the queue on failure
    tickets.push_back(std::move(ticket));
  }
  return tickets;
}

bool HttpServer::Impl::Stream(StreamJob& job, httplib::DataSink& sink) const {
  if (job.started) return false;  // once per response
  job.started = true;
  logging::ScopedRequestId scope(job.request_id);
  const Endpoint endpoint = job.request.endpoint;
  const bool usage_wanted = job.request.include_usage;
  const bool logprobs_wanted = job.request.logprobs >= 0;
  const int64_t n = job.request.n;
  const int64_t count = static_cast<int64_t>(job.prompts.size()) * n;
  EventQueue events(kStreamEventsQueued);
  std::atomic<bool> client_gone{false};  // set by this thread, the writer
  std::vector<int64_t> completion_tokens(count, 0);
  // Its jobs use what is declared after it too: runner.Wait() below ends them before any of it is destroyed.
  ParallelChoices runner(count, std::move(job.admitted));
  // Why the choices stop early. The writer sets client_gone (or sees `stopping`) before it closes the queue, so a
  // failed push always has a reason here.
  const StopCheck stopped = [&] { return StopReason(client_gone.load(), runner.failed()); };
  // Choice c, on a thread of `runner`: its chunks go to `events` as they come.
  auto run_choice = [&](int64_t c, Admission::Ticket* ticket) -> absl::Status {
    logging::ScopedRequestId choice_scope(job.request_id);
    int64_t text_offset = 0;  // completions' logprobs.text_offset
    openai::Usage so_far{.prompt_tokens = job.prompts[c / n].prompt_tokens};  // continuous usage
    auto chunk = [&](const openai::ChunkDelta& piece, const std::vector<int32_t>& ids, const openai::ChoiceEnd& end,
                     bool first, const std::vector<openai::TokenLogprobs>& logprobs = {}) {
      // A piece of generated tokens (their ids), or the echoed prompt's (none).
      Json lp = logprobs_wanted && (!ids.empty() || !logprobs.empty())
                    ? openai::LogprobsJson(endpoint, logprobs, &text_offset)
                    : Json(nullptr);
      so_far.completion_tokens += static_cast<int64_t>(ids.size());
      return events.Push(openai::SseEvent(openai::StreamChunk(endpoint, job.id, job.created, options.model_id, c, piece,
                                                              ids, end, first, usage_wanted, std::move(lp),
                                                              job.request.continuous_usage ? &so_far : nullptr)));
    };
    // Chat opens each choice with the assistant's role; every piece goes out as it comes; a last chunk with no
    // text carries the finish reason.
    if (endpoint == Endpoint::kChatCompletions && !chunk("", {}, {}, true)) return stopped();
    absl::StatusOr<openai::Choice> choice = Run(
        job.prompts[c / n], c % n, job.request.stop, c, job.request_id,
        [&](const openai::ChunkDelta& piece, const std::vector<int32_t>& ids,
            const std::vector<openai::TokenLogprobs>& logprobs) {
          const bool nothing = piece.text.empty() && piece.reasoning.empty() && piece.tool_calls.empty();
          if (nothing && ids.empty() && logprobs.empty()) return true;  // main's last message, with nothing
          return chunk(piece, ids, {}, false, logprobs);
        },
        stopped, ticket);
    if (!choice.ok()) return choice.status();
    if (!chunk("", {}, choice->end, false)) return stopped();
    completion_tokens[c] = static_cast<int64_t>(choice->token_ids.size());
    return absl::OkStatus();
  };
  runner.Start(run_choice, [&events] { events.FinishWriting(); });
  // The writer: every event as it comes, until the choices have ended; the client checked between events.
  for (;;) {
    EventQueue::Next next = events.Pop(kClientCheckInterval);
    if (next.finished) break;
    if (next.event && !client_gone.load() && !sink.write(next.event->data(), next.event->size())) {
      client_gone.store(true);
    }
    if (!client_gone.load() && !sink.is_writable()) client_gone.store(true);
    // The choices' pushes fail from now on: they stop (and the server's stop ends the stream with an error event).
    if (client_gone.load() || stopping.load()) events.CloseReader();
  }
  const absl::Status status = runner.Wait();
  if (client_gone.load()) {
    disconnects->Add();
    spdlog::info("http {}: the client closed the stream; request cancelled", job.name);
    return false;
  }
  if (!status.ok()) {
    spdlog::warn("http {} failed mid-stream: {}", job.name, status.ToString());
    // The error event, then [DONE] as after any stream (vLLM's too), so that a client reading to [DONE] ends.
    const std::string event =
        StrCat("data: ", openai::ErrorBody(openai::ErrorOfStatus(status)), "\n\n", openai::kSseDone);
    sink.write(event.data(), event.size());
    sink.done();
    return true;
  }
  std::string tail;
  if (usage_wanted) {
    openai::Usage usage;
    for (const PreparedPrompt& p : job.prompts) usage.prompt_tokens += p.prompt_tokens;
    for (const int64_t tokens : completion_tokens) usage.completion_tokens += tokens;
    tail = openai::SseEvent(openai::UsageChunk(endpoint, job.id, job.created, options.model_id, usage));
  }
  tail += openai::kSseDone;
  sink.write(tail.data(), tail.size());
  sink.done();
  return true;
}

HttpServerOptions HttpServer::OptionsFor(const rpc::DaemonArgs& args, const metrics::Registry* registry) {
  HttpServerOptions o;
  o.node = args.self.name;
  o.address = args.self.http_address;
  metrics::Labels labels = rpc::DaemonMetricLabels(args.cluster, args.self, args.model_dir);
  for (const auto& [k, v] : labels) {
    if (k == "model") o.model_id = v;
  }
  o.reasoning_parser = args.cluster.model.reasoning_parser;
  const std::vector<std::string>& served = args.cluster.model.served_names;
  if (served.size() > 1) o.model_aliases.assign(served.begin() + 1, served.end());
  // A connection per request main runs or queues (each holds its thread for its whole answer), some for the rest
  // (/health, /metrics, /v1/models, refusals), so that admission control, not the listen backlog, turns requests
  // away; and room for the idle keep-alive connections of clients' pools (each held up to the keep-alive
  // timeout), so that they do not keep a new request waiting.
  o.max_connections =
      kIdleConnections + std::max(8, 2 * args.self.threads) + args.cluster.max_running + args.cluster.max_queued;
  if (!args.self.metrics_address.empty() && args.self.metrics_address == args.self.http_address) {
    o.metrics_to_serve = registry;
  }
  o.allowed_origins = args.self.http_allowed_origins;
  if (!args.cluster.tls_ca.empty()) {
    o.tls_cert = args.self.tls_cert;
    o.tls_key = args.self.tls_key;
  }
  std::shared_ptr<const rpc::Security> security = rpc::ProcessSecurity();
  if (security->has_token()) {
    o.authorize = [security](const httplib::Request& req) {
      const auto it = req.headers.find("Authorization");  // httplib compares header names case-insensitively
      if (it == req.headers.end()) return security->CheckToken(nullptr).ok();
      const std::string_view value = it->second;
      return security->CheckToken(&value).ok();
    };
  }
  return o;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(MainNode* node, HttpServerOptions options,
                                                              metrics::Registry* registry) {
  const absl::StatusOr<HostPort> where = ParseHostPort(options.address);
  if (!where.ok()) {
    return absl::InvalidArgumentError(StrCat("node '", options.node, "': http_address: ", where.status().message()));
  }

  std::unique_ptr<HttpServer> server(new HttpServer());
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  impl.node = node;
  impl.options = options;
  impl.started = absl::ToUnixSeconds(absl::Now());
  ODMOE_ASSIGN_OR_RETURN(const Json tokenizer_config, ReadCheckpointJson(node->model_dir(), "tokenizer_config.json"));
  impl.chat_template = openai::ChooseChatTemplate(tokenizer_config, ArchitectureName(node->config().arch));
  if (node->tokenizer() != nullptr) {
    if (std::string why = openai::ChatTemplateMismatch(impl.chat_template, *node->tokenizer()); !why.empty()) {
      impl.chat_template = {};
      impl.no_chat_reason = std::move(why);
      spdlog::warn("node '{}': chat is off: {}", options.node, impl.no_chat_reason);
    }
  }
  ODMOE_ASSIGN_OR_RETURN(const Json generation_config, ReadCheckpointJson(node->model_dir(), "generation_config.json"));
  if (generation_config.is_object()) {
    const std::string path = (std::filesystem::path(node->model_dir()) / "generation_config.json").string();
    std::vector<std::string> ignored;
    ODMOE_ASSIGN_OR_RETURN(impl.sampling_defaults, openai::ReadSamplingDefaults(generation_config, path, &ignored));
    const openai::SamplingDefaults& d = impl.sampling_defaults;
    if (d.temperature != 1 || d.top_p != 1 || d.top_k != 0 || d.min_p != 0 || d.repetition_penalty != 1 ||
        d.max_tokens) {
      spdlog::info(
          "node '{}': a request's sampling defaults are {}'s: temperature {}, top_p {}, top_k {}, min_p {}, "
          "repetition_penalty {}, chat's max_tokens {}",
          options.node, path, d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty,
          d.max_tokens ? StrCat(*d.max_tokens) : "the rest of the context");
    }
    if (!ignored.empty()) {
      spdlog::warn("node '{}': {} recommends {}, which odmoe does not follow: requests sample without it", options.node,
                   path, absl::StrJoin(ignored, ", "));
    }
  }
  impl.requests = &registry->AddCounter(
      "odmoe_http_requests_total",
      "HTTP API answers (refusals included; not /health, /version or /metrics), by endpoint (completions, "
      "chat_completions, tokenize, detokenize, models, preflight: a browser's CORS preflight, "
      "other: no such route) and HTTP status code.",
      {"endpoint", "code"});
  impl.disconnects = &registry
                          ->AddCounter("odmoe_http_client_disconnects_total",
                                       "OpenAI API requests cancelled because the client closed the connection.")
                          .With({});

  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        StrCat("node '", options.node, "': the HTTP API over TLS needs both a certificate and a key"));
  }
  if (options.tls_cert.empty()) {
    server->http_ = std::make_unique<httplib::Server>();
  } else {
    server->http_ = std::make_unique<httplib::SSLServer>(options.tls_cert.c_str(), options.tls_key.c_str());
    if (!server->http_->is_valid()) {
      return absl::InvalidArgumentError(StrCat("node '", options.node, "': the HTTP API cannot use certificate '",
                                               options.tls_cert, "' with key '", options.tls_key, "'"));
    }
  }
  httplib::Server& http = *server->http_;
  http.set_keep_alive_timeout(5);
  http.set_read_timeout(30);
  http.set_write_timeout(10);
  http.set_payload_max_length(kMaxBodyBytes);

  http.set_pre_routing_handler([&impl](const httplib::Request& req, httplib::Response& res) {
    const httplib::Server::HandlerResponse answered = CrossOrigin(impl.options, req, res);
    if (answered == httplib::Server::HandlerResponse::Handled) impl.Count("preflight", res.status);
    return answered;
  });
  // Every route goes through here: the authorization hook, then the handler.
  auto guarded = [&impl](auto handler) {
    return [&impl, handler](const httplib::Request& req, httplib::Response& res) {
      if (impl.options.authorize && !impl.options.authorize(req)) {
        ApiError e;
        e.http_status = 401;
        e.type = "authentication_error";
        e.code = "invalid_api_key";
        e.message = "missing or wrong API key";
        impl.Count(EndpointOf(req.path), e.http_status);
        return SendError(res, e);
      }
      handler(req, res);
    };
  };
  http.Post(kCompletionsRoute.path, guarded([&impl](const httplib::Request& req, httplib::Response& res) {
              impl.Completions(req, res, Endpoint::kCompletions);
            }));
  http.Post(kChatCompletionsRoute.path, guarded([&impl](const httplib::Request& req, httplib::Response& res) {
              impl.Completions(req, res, Endpoint::kChatCompletions);
            }));
  http.Post(kTokenizeRoute.path,
            guarded([&impl](const httplib::Request& req, httplib::Response& res) { impl.Tokenize(req, res); }));
  http.Post(kDetokenizeRoute.path,
            guarded([&impl](const httplib::Request& req, httplib::Response& res) { impl.Detokenize(req, res); }));
  http.Get(kModelsRoute.path, guarded([&impl](const httplib::Request&, httplib::Response& res) {
             std::vector<std::string> names = {impl.options.model_id};
             names.insert(names.end(), impl.options.model_aliases.begin(), impl.options.model_aliases.end());
             impl.Count(kModelsRoute.label, 200);
             res.set_content(openai::ModelsBody(names, impl.started, impl.node->config().context_length()), kJson);
           }));
  http.Get(StrCat(kModelRoutePrefix, "(.+)"), guarded([&impl](const httplib::Request& req, httplib::Response& res) {
             ApiError error;
             if (!impl.CheckModel(req.matches[1].str(), &error).ok()) {
               impl.Count(kModelsRoute.label, error.http_status);
               return SendError(res, error);
             }
             impl.Count(kModelsRoute.label, 200);
             res.set_content(openai::ModelBody(req.matches[1], impl.options.model_id, impl.started,
                                               impl.node->config().context_length()),
                             kJson);
           }));
  http.Get("/health", [&impl](const httplib::Request&, httplib::Response& res) {
    absl::MutexLock lock(&impl.ready_mu);
    if (impl.ready && !impl.draining.load()) {
      res.set_content(R"({"status":"ok"})", kJson);
      return;
    }
    ApiError e;
    e.http_status = 503;
    e.type = "unavailable_error";
    e.message = impl.draining.load() ? "main is shutting down" : StrCat("main is not ready: ", impl.ready_reason);
    SendError(res, e);
  });
  // vLLM's: the build main runs (BuildVersion), for a deployment check; no API key, as /health.
  http.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(Json{{"version", BuildVersion()}}.dump(), kJson);
  });
  if (options.metrics_to_serve != nullptr) {
    const metrics::Registry* served = options.metrics_to_serve;
    http.Get("/metrics", [served](const httplib::Request&, httplib::Response& res) {
      res.set_content(served->Render(), "text/plain; version=0.0.4; charset=utf-8");
    });
  }
  // Unknown routes and httplib's own refusals (a body too large, ...) in OpenAI's error object too.
  http.set_error_handler(httplib::Server::HandlerWithResponse([&impl](const httplib::Request& req,
                                                                      httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // ours, counted where it was made
    impl.Count(EndpointOf(req.path), res.status);
    ApiError e;
    e.http_status = res.status;
    e.message = res.status == 404 ? StrCat("no route ", req.method, " ", req.path)
                                  : StrCat("HTTP ", res.status, " for ", req.method, " ", req.path);
    if (res.status == 404) e.code = "unknown_url";
    SendError(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));

  const size_t max_connections = static_cast<size_t>(std::max(1, options.max_connections));
  const absl::StatusOr<int> port =
      rpc::StartHttpServer(http, where->host, where->port, max_connections,
                           rpc::HttpConnectionMetrics::In(*registry, "api", max_connections), &server->thread_);
  if (!port.ok()) {
    return absl::UnavailableError(StrCat("node '", options.node, "': cannot serve the HTTP API at http_address '",
                                         options.address, "': ", port.status().message()));
  }
  server->port_ = *port;
  server->url_ = StrCat(options.tls_cert.empty() ? "http://" : "https://", JoinHostPort(where->host, *port));
  return server;
}

void HttpServer::SetReady(bool ready, const std::string& reason) {
  absl::MutexLock lock(&impl_->ready_mu);
  impl_->ready = ready;
  impl_->ready_reason = reason;
}

void HttpServer::StopAccepting() {
  if (impl_ == nullptr || http_ == nullptr || impl_->draining.exchange(true)) return;
  impl_->drain.Close();
  // The listening socket only: requests in flight go on. A port that also serves /metrics stays open until
  // Shutdown, so that the drain can be watched; completions that reach it meanwhile are refused (the drain is
  // closed).
  if (impl_->options.metrics_to_serve == nullptr) CloseListener();
}

void HttpServer::CloseListener() {
  if (!listening_) return;  // httplib's stop() expects a listening socket: once
  listening_ = false;
  http_->stop();
}

void HttpServer::Shutdown(absl::Time deadline) {
  if (impl_ == nullptr || !thread_.joinable()) return;
  StopAccepting();
  if (const int64_t left = impl_->drain.WaitIdle(deadline); left > 0) {
    spdlog::warn("node {}: {} HTTP request(s) still running at the shutdown deadline; they end now",
                 impl_->options.node, left);
  }
  impl_->stopping.store(true);
  CloseListener();  // when StopAccepting left the port open
  thread_.join();  // httplib's pool ends once every connection has
}

HttpServer::~HttpServer() { Shutdown(absl::Now()); }

}  // namespace odmoe
