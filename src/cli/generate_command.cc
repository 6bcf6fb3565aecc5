// odmoe generate: one request on a model in this process.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "src/backend/device_factory.h"
#include "src/cli/commands.h"
#include "src/cli/flags.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "src/model/tokenizer.h"

namespace odmoe::cli {
namespace {

constexpr char kUsage[] =
    "usage: odmoe generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N\n"
    "           [--temperature T --top-k K --top-p P --seed S] [--ignore-eos] [--backend cpu|mock-gpu|cuda]\n"
    "           [--dump-logits] [--dump-routing] [--json]\n"
    "  Greedy unless --temperature > 0. Without --json the text is printed as it is generated; with --json one\n"
    "  JSON object: prompt_ids, tokens, text, stop_reason, last_logits (--dump-logits), routing (--dump-routing),\n"
    "  timings {ttft_ms, decode_tokens_per_s}. Models without tokenizer.model (Qwen, OLMoE) need --prompt-ids.\n";

struct Request {
  std::string model_dir;
  std::string backend = "cpu";
  std::vector<int32_t> prompt_ids;
  bool have_text_prompt = false;
  std::string prompt_text;
  GenerateOptions options;
  bool json = false;
};

absl::StatusOr<Request> ParseRequest(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(
      Flags f, Flags::Parse(args,
                            {"model", "prompt", "prompt-ids", "max-new-tokens", "temperature", "top-k", "top-p",
                             "seed", "backend"},
                            {"ignore-eos", "dump-logits", "dump-routing", "json"}));
  Request r;
  ODMOE_ASSIGN_OR_RETURN(r.model_dir, f.Required("model"));
  if (f.Has("prompt") == f.Has("prompt-ids")) {
    return absl::InvalidArgumentError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3");
  }
  if (f.Has("prompt")) {
    r.have_text_prompt = true;
    r.prompt_text = *f.Get("prompt");
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
  ODMOE_ASSIGN_OR_RETURN(int64_t seed, f.Int("seed", 0));
  r.options.sampling.seed = static_cast<uint64_t>(seed);
  ODMOE_RETURN_IF_ERROR(r.options.sampling.Validate());
  r.options.ignore_eos = f.Has("ignore-eos");
  r.options.keep_last_logits = f.Has("dump-logits");
  r.options.record_routing = f.Has("dump-routing");
  r.json = f.Has("json");
  if (auto b = f.Get("backend")) r.backend = *b;
  return r;
}

absl::Status Run(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Request r, ParseRequest(args));

  std::unique_ptr<Tokenizer> tokenizer;
  auto tok = Tokenizer::Load(r.model_dir);
  if (tok.ok()) {
    tokenizer = std::move(tok).value();
  } else if (!absl::IsNotFound(tok.status())) {
    return tok.status();
  }
  if (r.have_text_prompt) {
    if (tokenizer == nullptr) {
      return absl::FailedPreconditionError(StrCat(
          r.model_dir, "/tokenizer.model not found: this checkpoint has no SentencePiece tokenizer (the Qwen and "
                       "OLMoE families ship tokenizer.json only); pass token ids with --prompt-ids"));
    }
    r.prompt_ids = tokenizer->EncodeForModel(r.prompt_text);
  }

  ODMOE_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(r.model_dir));
  // Reject a bad request before loading any weights.
  ODMOE_RETURN_IF_ERROR(ValidateRequest(config, r.prompt_ids, r.options.max_new_tokens));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(r.backend));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<LocalModel> model, LocalModel::Open(r.model_dir, std::move(device)));

  std::unique_ptr<IncrementalDecoder> stream_decoder;
  std::function<void(int32_t)> on_token;
  if (!r.json) {
    if (tokenizer != nullptr) {
      stream_decoder = std::make_unique<IncrementalDecoder>(*tokenizer, r.prompt_ids);
      on_token = [&](int32_t id) {
        const std::string piece = stream_decoder->Push(id);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      };
    } else {
      on_token = [first = true](int32_t id) mutable {
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
  if (tokenizer != nullptr) out["text"] = tokenizer->Decode(result.tokens);
  out["stop_reason"] = result.stop_reason;
  if (r.options.keep_last_logits) out["last_logits"] = result.last_logits;
  if (r.options.record_routing) out["routing"] = result.routing;
  out["timings"] = {{"ttft_ms", result.ttft_ms}, {"decode_tokens_per_s", result.decode_tokens_per_s},
                    {"total_ms", result.total_ms}};
  out["backend"] = r.backend;
  const std::string text = DumpJson(out);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
  return absl::OkStatus();
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
  std::fprintf(stderr, "odmoe generate: %s%s\n", std::string(status.message()).c_str(),
               absl::IsInvalidArgument(status) ? " (see odmoe generate --help)" : "");
  return ExitCodeFor(status);
}

}  // namespace odmoe::cli
