// odmoe generate: one request on a model in this process, or (--endpoint) through a cluster's main node.
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "src/backend/device_factory.h"
#include "src/cli/client_security.h"
#include "src/cli/commands.h"
#include "src/cluster/client.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"
#include "src/engine/generator.h"
#include "src/model/tokenizer.h"
#include "src/rpc/proto_json.h"
#include "src/rpc/request_id.h"
#include "src/rpc/sampling_proto.h"

namespace odmoe::cli {
namespace {

constexpr char kUsage[] =
    "usage: odmoe generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N\n"
    "           [--temperature T --top-k K --top-p P --min-p M --seed S] [--presence-penalty P]\n"
    "           [--frequency-penalty F] [--repetition-penalty R] [--logit-bias ID:BIAS,...]\n"
    "           [--ignore-eos] [--stop-token-ids 1,2 [--include-stop-text]] [--min-tokens N]\n"
    "           [--json-object | --json-schema FILE | --choice TEXT,TEXT,... | --regex REGEX] [--compact-json]\n"
    "           [--backend cpu|mock-gpu|cuda]\n"
    "           [--dump-logits] [--dump-routing] [--logprobs N [--prompt-logprobs]] [--json]\n"
    "       odmoe generate --synthetic CONFIG [--layers N] [--weights-seed S] --prompt-ids 1,2,3 --max-new-tokens N\n"
    "           [the same sampling, backend and output flags]\n"
    "       odmoe generate --endpoint HOST:PORT (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N\n"
    "           [the same sampling and output flags] [--timeout-ms MS] [--request-id ID]\n"
    "           [--token-file FILE] [--tls-ca FILE [--tls-cert FILE --tls-key FILE] [--tls-server-name NAME]]\n"
    "  Greedy unless --temperature > 0; --min-p M ([0, 1], vLLM's min_p) keeps only the tokens at least M times as\n"
    "  likely as the likeliest. --presence-penalty and --frequency-penalty ([-2, 2], OpenAI's) lower the\n"
    "  logits of tokens already generated, once and per time; --repetition-penalty R ((0, 100], HF's) divides the\n"
    "  positive logits of the prompt's and generated tokens by R and multiplies the negative ones; --logit-bias\n"
    "  adds BIAS ([-100, 100]) to token ID's logit at every pick (-100 keeps it out). --stop-token-ids ends\n"
    "  generation at any of these ids too (its text left out, unless --include-stop-text), --min-tokens N keeps\n"
    "  EOS and them out of the first N tokens (vLLM's stop_token_ids, include_stop_str_in_output and min_tokens; N\n"
    "  at most --max-new-tokens). Structured output: --json-object makes the answer one JSON object,\n"
    "  --json-schema one JSON value the JSON Schema in FILE describes (src/engine/json_schema.h says which),\n"
    "  --choice exactly one of the comma-separated texts, --regex a text REGEX matches whole\n"
    "  (src/engine/pattern_dfa.h says which); generation stops once it is whole (not with --ignore-eos or\n"
    "  --min-tokens; needs the model's tokenizer). --compact-json: no whitespace in the JSON.\n"
    "  Without --json the text is printed as it is\n"
    "  generated; with --json one JSON object: prompt_ids, tokens, text, stop_reason, last_logits\n"
    "  (--dump-logits), routing (--dump-routing), logprobs (--logprobs N: per token {id, logprob, top: the N\n"
    "  (0..20) likeliest [{id, logprob}]}, the model's log_softmax before penalties, temperature, top-k and\n"
    "  top-p), prompt_logprobs (--prompt-logprobs: the same for each prompt token after the first), timings\n"
    "  {ttft_ms, decode_tokens_per_s}.\n"
    "  Models without a tokenizer need --prompt-ids.\n"
    "  --endpoint sends the request to a cluster's main node (which has the model: no --model, no --backend);\n"
    "  the JSON then also has `stats`: per worker the experts computed and on-demand loads, bytes loaded\n"
    "  host-to-device, on-demand loads and their total ms, ttft, decode tokens/s, and the expert tensors main\n"
    "  opened (0), and `request_id`, the id main's, the shadow's and the workers' logs carry for the request\n"
    "  (--request-id ID chooses it: letters, digits, '.', '_', ':', '-'; else main makes one). --timeout-ms\n"
    "  bounds the whole request (default 600000). A text prompt must be valid UTF-8.\n"
    "  --token-file sends the cluster's client token ([auth]); --tls-ca talks TLS to main, whose certificate\n"
    "  must name the endpoint's host or --tls-server-name (e.g. main); --tls-cert/--tls-key present a client\n"
    "  certificate.\n"
    "  --synthetic runs the model of CONFIG (a config.json or a folder with one) with seeded random weights\n"
    "  (--weights-seed, default 0; --seed stays the sampling seed), --layers N of them (default: the config's).\n";

struct Request {
  std::string model_dir;
  bool synthetic = false;  // --synthetic: `spec` instead of model_dir
  SyntheticSpec spec;
  std::string endpoint;  // --endpoint: run on a cluster
  int64_t timeout_ms = 600000;
  std::string request_id;  // --request-id (with --endpoint): x-request-id, "" to let main make one
  std::string backend = "cpu";
  std::vector<int32_t> prompt_ids;
  bool have_text_prompt = false;
  std::string prompt_text;
  GenerateOptions options;
  bool json = false;
};

// --logit-bias ID:BIAS,ID:BIAS (spaces around items allowed).
absl::StatusOr<std::vector<std::pair<int32_t, double>>> LogitBiasFlag(const Flags& f) {
  ODMOE_ASSIGN_OR_RETURN(const std::vector<std::string> items, f.List("logit-bias"));
  std::vector<std::pair<int32_t, double>> out;
  for (absl::string_view item : items) {
    const size_t colon = item.find(':');
    int32_t id = 0;
    double bias = 0;
    if (colon == absl::string_view::npos || !absl::SimpleAtoi(item.substr(0, colon), &id) || id < 0 ||
        !absl::SimpleAtod(item.substr(colon + 1), &bias)) {
      return absl::InvalidArgumentError(
          StrCat("--logit-bias: '", item, "' is not TOKEN_ID:BIAS (a token id >= 0, a colon, a number)"));
    }
    out.emplace_back(id, bias);
  }
  return out;
}

// The JSON Schema in the file `path`, as JSON text with its keys in the file's order (properties are generated in
// that order). InvalidArgument naming the file when it cannot be read or is not JSON.
absl::StatusOr<std::string> ReadSchemaFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return absl::InvalidArgumentError(StrCat("--json-schema: ", text.status().message()));
  absl::StatusOr<OrderedJson> schema = ParseOrderedJson(*text, StrCat("--json-schema ", path));
  if (!schema.ok()) return absl::InvalidArgumentError(schema.status().message());
  return DumpOrderedJson(*schema);
}

absl::StatusOr<Request> ParseRequest(const std::vector<std::string>& args) {
  // clang-format off
  ODMOE_ASSIGN_OR_RETURN(
      Flags f,
      Flags::Parse(args, {"model",       "prompt",           "prompt-ids",        "max-new-tokens",
                          "temperature", "top-k",            "top-p",             "min-p",
                          "seed",        "presence-penalty", "frequency-penalty", "repetition-penalty",
                          "logit-bias",  "stop-token-ids",   "min-tokens",        "logprobs",
                          "backend",     "endpoint",         "timeout-ms",        "synthetic",
                          "layers",      "weights-seed",     "request-id",        "tls-ca",
                          "tls-cert",    "tls-key",          "token-file",        "tls-server-name",
                          "choice",      "json-schema",      "regex"},
                   {"ignore-eos", "include-stop-text", "dump-logits", "dump-routing", "prompt-logprobs", "json",
                    "json-object", "compact-json"}));
  // clang-format on
  Request r;
  if (f.Has("endpoint")) {
    r.endpoint = *f.Get("endpoint");
    if (r.endpoint.empty()) return absl::InvalidArgumentError("--endpoint: expected HOST:PORT of a main node");
    if (f.Has("model")) {
      return absl::InvalidArgumentError("--model cannot be combined with --endpoint: the main node has the model");
    }
    if (f.Has("backend")) {
      return absl::InvalidArgumentError(
          "--backend cannot be combined with --endpoint: the cluster file sets each node's device");
    }
    ODMOE_ASSIGN_OR_RETURN(r.timeout_ms, f.Int("timeout-ms", r.timeout_ms));
    if (auto id = f.Get("request-id")) {
      if (absl::Status s = rpc::ValidateRequestId(*id); !s.ok()) {
        return absl::InvalidArgumentError(StrCat("--request-id: ", s.message()));
      }
      r.request_id = *id;
    }
    if (r.timeout_ms < 1) {
      return absl::InvalidArgumentError(StrCat("--timeout-ms must be positive, got ", r.timeout_ms));
    }
    ODMOE_RETURN_IF_ERROR(InstallClientSecurity(f, nullptr, r.endpoint));
  } else {
    for (const char* flag : kSecurityFlags) {
      if (f.Has(flag)) return absl::InvalidArgumentError(StrCat("--", flag, " needs --endpoint"));
    }
    if (f.Has("timeout-ms")) return absl::InvalidArgumentError("--timeout-ms needs --endpoint");
    if (f.Has("request-id")) return absl::InvalidArgumentError("--request-id needs --endpoint");
    if (f.Has("synthetic")) {
      if (f.Has("model")) return absl::InvalidArgumentError("give one of --model DIR and --synthetic CONFIG");
      if (f.Has("prompt")) {
        return absl::InvalidArgumentError("--synthetic has no tokenizer: pass token ids with --prompt-ids");
      }
      r.synthetic = true;
      r.spec.config_path = *f.Get("synthetic");
      ODMOE_ASSIGN_OR_RETURN(r.spec.layers, f.Int("layers", 0));
      if (r.spec.layers < 0) return absl::InvalidArgumentError(StrCat("--layers must be >= 1, got ", r.spec.layers));
      ODMOE_ASSIGN_OR_RETURN(int64_t wseed, f.Int("weights-seed", 0));
      r.spec.seed = static_cast<uint64_t>(wseed);
    } else {
      if (f.Has("layers") || f.Has("weights-seed")) {
        return absl::InvalidArgumentError("--layers and --weights-seed need --synthetic CONFIG");
      }
      ODMOE_ASSIGN_OR_RETURN(r.model_dir, f.Required("model"));
    }
  }
  if (!r.endpoint.empty() && (f.Has("synthetic") || f.Has("layers") || f.Has("weights-seed"))) {
    return absl::InvalidArgumentError("--synthetic cannot be combined with --endpoint: the main node has the model");
  }
  if (f.Has("prompt") == f.Has("prompt-ids")) {
    return absl::InvalidArgumentError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3");
  }
  if (f.Has("prompt")) {
    r.have_text_prompt = true;
    r.prompt_text = *f.Get("prompt");
    ODMOE_RETURN_IF_ERROR(CheckUtf8(r.prompt_text, "--prompt"));
  } else {
    ODMOE_ASSIGN_OR_RETURN(std::vector<int64_t> ids, f.IntList("prompt-ids"));
    for (int64_t id : ids) {
      if (id < 0 || id > INT32_MAX) {
        return absl::OutOfRangeError(StrCat("--prompt-ids: token id ", id, " is outside the vocabulary"));
      }
      r.prompt_ids.push_back(static_cast<int32_t>(id));
    }
  }
  ODMOE_RETURN_IF_ERROR(f.Required("max-new-tokens").status());
  ODMOE_ASSIGN_OR_RETURN(r.options.max_new_tokens, f.Int("max-new-tokens", 0));
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.temperature, f.Double("temperature", 0.0));
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.top_k, f.Int("top-k", 0));
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.top_p, f.Double("top-p", 1.0));
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.min_p, f.Double("min-p", 0.0));
  ODMOE_ASSIGN_OR_RETURN(int64_t seed, f.Int("seed", 0));
  r.options.sampling.seed = static_cast<uint64_t>(seed);
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.presence_penalty, f.Double("presence-penalty", 0.0));
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.frequency_penalty, f.Double("frequency-penalty", 0.0));
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.repetition_penalty, f.Double("repetition-penalty", 1.0));
  ODMOE_ASSIGN_OR_RETURN(int64_t logprobs, f.Int("logprobs", -1));
  if (f.Has("logprobs") && (logprobs < 0 || logprobs > kMaxTopLogprobs)) {
    return absl::InvalidArgumentError(
        StrCat("--logprobs: the alternatives per token must be 0..", kMaxTopLogprobs, ", got ", logprobs));
  }
  r.options.logprobs = static_cast<int32_t>(logprobs);
  r.options.prompt_logprobs = f.Has("prompt-logprobs");
  if (r.options.prompt_logprobs && !f.Has("logprobs")) {
    return absl::InvalidArgumentError("--prompt-logprobs needs --logprobs N");
  }
  ODMOE_ASSIGN_OR_RETURN(r.options.sampling.logit_bias, LogitBiasFlag(f));
  ODMOE_ASSIGN_OR_RETURN(const std::vector<int64_t> stop_ids, f.IntList("stop-token-ids"));
  for (const int64_t id : stop_ids) {
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(StrCat("--stop-token-ids: ", id, " is not a token id"));
    }
    r.options.stop_token_ids.push_back(static_cast<int32_t>(id));
  }
  ODMOE_ASSIGN_OR_RETURN(r.options.min_tokens, f.Int("min-tokens", 0));
  r.options.include_stop_str_in_output = f.Has("include-stop-text");
  // The ids are checked against the model's vocabulary where it is known: by Generate, or by main.
  ODMOE_RETURN_IF_ERROR(r.options.Validate(std::numeric_limits<int64_t>::max()));
  r.options.ignore_eos = f.Has("ignore-eos");
  // The constraint's vocabulary comes with the tokenizer (Run), or main's (--endpoint): checked with it there.
  if (static_cast<int>(f.Has("json-object")) + static_cast<int>(f.Has("choice")) +
          static_cast<int>(f.Has("json-schema")) + static_cast<int>(f.Has("regex")) >
      1) {
    return absl::InvalidArgumentError(
        "--json-object, --json-schema, --choice and --regex each ask for an answer of their own: give one of them");
  }
  if (f.Has("json-object")) r.options.constraint.kind = OutputConstraint::Kind::kJsonObject;
  if (auto path = f.Get("json-schema")) {
    r.options.constraint.kind = OutputConstraint::Kind::kJsonSchema;
    ODMOE_ASSIGN_OR_RETURN(r.options.constraint.schema, ReadSchemaFile(*path));
  }
  if (f.Has("choice")) {
    r.options.constraint.kind = OutputConstraint::Kind::kChoice;
    ODMOE_ASSIGN_OR_RETURN(r.options.constraint.choices, f.List("choice"));
  }
  if (auto regex = f.Get("regex")) {
    r.options.constraint.kind = OutputConstraint::Kind::kRegex;
    r.options.constraint.regex = *regex;
  }
  r.options.constraint.compact = f.Has("compact-json");
  ODMOE_RETURN_IF_ERROR(r.options.constraint.Validate());
  r.options.keep_last_logits = f.Has("dump-logits");
  r.options.record_routing = f.Has("dump-routing");
  r.json = f.Has("json");
  if (auto b = f.Get("backend")) r.backend = *b;
  return r;
}

// --logprobs' output: per token {id, logprob, top: [{id, logprob}]}.
Json LogprobsJson(const std::vector<PositionLogprobs>& logprobs) {
  auto entry = [](const TokenLogprob& t) { return Json{{"id", t.id}, {"logprob", FloatJson(t.logprob)}}; };
  Json out = Json::array();
  for (const PositionLogprobs& p : logprobs) {
    Json top = Json::array();
    for (const TokenLogprob& t : p.top) top.push_back(entry(t));
    Json e = entry(p.token);
    e["top"] = std::move(top);
    out.push_back(std::move(e));
  }
  return out;
}

void PrintJson(const Json& out) {
  const std::string text = DumpJson(out);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
}

// The request through a cluster's main node: same output as a local run, plus `stats`.
absl::Status RunRemote(const Request& r) {
  v1::GenerateRequest req;
  if (r.have_text_prompt) {
    req.set_prompt(r.prompt_text);
  } else {
    req.mutable_prompt_ids()->Add(r.prompt_ids.begin(), r.prompt_ids.end());
  }
  rpc::OptionsToProto(r.options, &req);

  std::function<void(const v1::GenerateResponse&)> on_chunk;
  bool first_id = true;
  if (!r.json) {
    on_chunk = [&](const v1::GenerateResponse& chunk) {
      if (chunk.has_text()) {
        std::fwrite(chunk.text().data(), 1, chunk.text().size(), stdout);
      } else {
        for (int32_t id : chunk.tokens()) {
          std::printf(first_id ? "%d" : " %d", id);
          first_id = false;
        }
      }
      std::fflush(stdout);
    };
  }
  ODMOE_ASSIGN_OR_RETURN(RemoteResult result, GenerateRemote(r.endpoint, req, r.timeout_ms, on_chunk, r.request_id));
  if (!r.json) {
    std::fputc('\n', stdout);
    return absl::OkStatus();
  }
  Json out = Json::object();
  out["prompt_ids"] = result.prompt_ids;
  out["tokens"] = result.tokens;
  if (result.has_text) out["text"] = result.text;
  out["stop_reason"] = result.stop_reason;
  if (r.options.keep_last_logits) out["last_logits"] = result.last_logits;
  if (r.options.record_routing) out["routing"] = result.routing;
  if (r.options.logprobs >= 0) out["logprobs"] = LogprobsJson(result.logprobs);
  if (r.options.prompt_logprobs) out["prompt_logprobs"] = LogprobsJson(result.prompt_logprobs);
  const v1::RequestStats& st = result.stats;
  out["timings"] = {
      {"ttft_ms", st.ttft_ms()}, {"decode_tokens_per_s", st.decode_tokens_per_s()}, {"total_ms", st.total_ms()}};
  out["stats"] = ProtoToJson(st);  // every field of v1::RequestStats, by its .proto name
  out["endpoint"] = r.endpoint;
  out["request_id"] = result.request_id;
  PrintJson(out);
  return absl::OkStatus();
}

absl::Status Run(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Request r, ParseRequest(args));
  if (!r.endpoint.empty()) return RunRemote(r);

  ModelSource source;
  if (r.synthetic) source = ModelSource{"", r.spec.config_path, r.spec.layers, r.spec.seed};
  ODMOE_ASSIGN_OR_RETURN(OpenedModel opened, OpenModel(source, r.synthetic ? std::string() : r.model_dir));
  const ModelConfig config = opened.config;
  ODMOE_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer, OpenTokenizer(opened, r.model_dir));
  if (r.have_text_prompt) {
    if (tokenizer == nullptr) {
      return absl::FailedPreconditionError(
          StrCat(r.model_dir,
                 ": no tokenizer (neither tokenizer.model nor tokenizer.json); pass token ids with --prompt-ids"));
    }
    r.prompt_ids = tokenizer->EncodeForModel(r.prompt_text);
  }
  if (tokenizer != nullptr) r.options.vocabulary = TokenVocabulary::FromTokenizer(*tokenizer, config.vocab_size);
  // Reject a bad request before loading any weights.
  ODMOE_RETURN_IF_ERROR(ValidateRequest(config, r.prompt_ids, r.options.max_new_tokens));
  ODMOE_RETURN_IF_ERROR(r.options.Validate(config.vocab_size));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(r.backend));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<LocalModel> model, LocalModel::Open(std::move(opened), std::move(device)));

  std::unique_ptr<IncrementalDecoder> stream_decoder;
  TokenCallback on_token;
  if (!r.json) {
    if (tokenizer != nullptr) {
      stream_decoder = tokenizer->NewDecoder(r.prompt_ids);
      on_token = [&](int32_t id, bool last) {
        if (last && !ShowsTokenText(config, r.options, id)) return;  // only the last token can be a stop token
        const std::string piece = stream_decoder->Push(id);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      };
    } else {
      on_token = [first = true](int32_t id, bool /*last*/) mutable {
        std::printf(first ? "%d" : " %d", id);
        first = false;
        std::fflush(stdout);
      };
    }
  }
  ODMOE_ASSIGN_OR_RETURN(GenerateResult result, Generate(model->engine(), r.prompt_ids, r.options, on_token));

  if (!r.json) {
    if (stream_decoder != nullptr) {
      const std::string rest = stream_decoder->Finish();
      std::fwrite(rest.data(), 1, rest.size(), stdout);
    }
    std::fputc('\n', stdout);
    return absl::OkStatus();
  }
  Json out = Json::object();
  out["prompt_ids"] = r.prompt_ids;
  out["tokens"] = result.tokens;
  if (tokenizer != nullptr) out["text"] = tokenizer->DecodeAfter(r.prompt_ids, ShownTokens(config, r.options, result));
  out["stop_reason"] = result.stop_reason;
  if (r.options.keep_last_logits) out["last_logits"] = result.last_logits;
  if (r.options.record_routing) out["routing"] = result.routing;
  if (r.options.logprobs >= 0) out["logprobs"] = LogprobsJson(result.logprobs);
  if (r.options.prompt_logprobs) out["prompt_logprobs"] = LogprobsJson(result.prompt_logprobs);
  out["timings"] = {
      {"ttft_ms", result.ttft_ms}, {"decode_tokens_per_s", result.decode_tokens_per_s}, {"total_ms", result.total_ms}};
  out["backend"] = r.backend;
  if (r.synthetic) {
    out["synthetic"] = {{"config", r.spec.config_path}, {"layers", config.num_layers}, {"seed", r.spec.seed}};
  }
  PrintJson(out);
  return absl::OkStatus();
}

// Engine and server errors name request fields (GenerateRequest's max_new_tokens, sampling.temperature, ...);
// this command's user typed flags, so its messages name those instead.
std::string FlagsForFields(std::string message) {
  static constexpr std::pair<std::string_view, std::string_view> kFieldFlags[] = {
      {"max_new_tokens", "--max-new-tokens"},
      {"min_tokens", "--min-tokens"},
      {"stop_token_ids", "--stop-token-ids"},
      {"sampling.temperature", "--temperature"},
      {"sampling.top_k", "--top-k"},
      {"sampling.top_p", "--top-p"},
      {"sampling.min_p", "--min-p"},
      {"sampling.presence_penalty", "--presence-penalty"},
      {"sampling.frequency_penalty", "--frequency-penalty"},
      {"sampling.repetition_penalty", "--repetition-penalty"},
      {"sampling.logit_bias", "--logit-bias"},
      {"constraint.choices", "--choice"},
      {"constraint.schema", "--json-schema"},
      {"constraint.regex", "--regex"},
      {"constraint", "--json-object/--json-schema/--choice/--regex"},
      {"ignore_eos", "--ignore-eos"},
  };
  for (const auto& [field, flag] : kFieldFlags) {
    for (size_t at = message.find(field); at != std::string::npos; at = message.find(field, at + flag.size())) {
      message.replace(at, field.size(), flag);
    }
  }
  return message;
}

}  // namespace

int RunGenerate(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
  }
  absl::Status status = Run(args);
  if (status.ok()) return kExitOk;
  // Exactly one line: scripts and tests read it.
  std::fprintf(stderr, "odmoe generate: %s%s\n", FlagsForFields(std::string(status.message())).c_str(),
               absl::IsInvalidArgument(status) ? " (see odmoe generate --help)" : "");
  return ExitCodeFor(status);
}

}  // namespace odmoe::cli
