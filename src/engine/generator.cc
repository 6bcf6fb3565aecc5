#include "src/engine/generator.h"

#include <algorithm>
#include <chrono>

#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {

bool FitsContext(const ModelConfig& config, int64_t prompt_len, int64_t max_new_tokens) {
  // Compared without computing prompt_len + max_new_tokens, which overflows for a max_new_tokens near INT64_MAX
  // (a request's int64 field; found by fuzz/generate_request_fuzzer).
  return prompt_len <= config.context_length() && max_new_tokens <= config.context_length() - prompt_len;
}

absl::Status ValidateRequest(const ModelConfig& config, std::span<const int32_t> prompt, int64_t max_new_tokens) {
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt is empty: give at least one token");
  if (max_new_tokens < 0) {
    return absl::InvalidArgumentError(StrCat("max_new_tokens must be >= 0, got ", max_new_tokens));
  }
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (!FitsContext(config, prompt_len, 0)) {
    return absl::OutOfRangeError(
        StrCat("the prompt has ", prompt.size(), " tokens, more than ", config.ContextLengthText()));
  }
  if (!FitsContext(config, prompt_len, max_new_tokens)) {
    return absl::OutOfRangeError(StrCat("prompt (", prompt.size(), " tokens) + max_new_tokens (", max_new_tokens,
                                        ") exceeds ", config.ContextLengthText()));
  }
  ODMOE_RETURN_IF_ERROR(CheckSequenceLength(config, prompt_len + max_new_tokens));
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= config.vocab_size) {
      return absl::OutOfRangeError(StrCat("prompt token id ", prompt[i], " at index ", i,
                                          " is outside the vocabulary [0, ", config.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerateResult> Generate(Engine& engine, std::span<const int32_t> prompt, const GenerateOptions& options,
                                        const TokenCallback& on_token) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& c = engine.config();
  ODMOE_RETURN_IF_ERROR(ValidateRequest(c, prompt, options.max_new_tokens));
  ODMOE_RETURN_IF_ERROR(options.Validate(c.vocab_size));

  GenerateResult result;
  Sampler sampler = RequestSampler(c, options, prompt);
  const auto start = Clock::now();
  // The cache needs the prompt's positions and every decode position.
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  ODMOE_RETURN_IF_ERROR(
      engine.StartSequence(std::max(prompt_len, LastDecodePosition(prompt_len, options.max_new_tokens) + 1)));
  std::vector<PositionRouting>* routing = options.record_routing ? &result.routing : nullptr;
  std::vector<float>* last_logits = options.keep_last_logits ? &result.last_logits : nullptr;
  result.stop_reason = "length";
  // The prompt's rows: the logprobs of the prompt token each one predicts.
  const RowLogitsFn prompt_rows = [&](int64_t row, std::span<const float> logits) {
    AppendPromptLogprobs(prompt, options, row, logits, &result);
  };
  const RowLogitsFn* row_logits = options.prompt_logprobs ? &prompt_rows : nullptr;
  if (options.max_new_tokens == 0) {  // the prompt alone: its KV cache, and its logits when kept
    ODMOE_ASSIGN_OR_RETURN(std::vector<float> logits,
                           engine.Forward(prompt, routing, ForwardKind::kPrefill, row_logits));
    if (last_logits != nullptr) *last_logits = std::move(logits);
  }

  auto first_token_time = start;
  const bool wants_logprobs = options.logprobs >= 0;
  std::vector<float> step_logits;
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    // Each token is picked on the engine's device, next to the logits, by the sampler's choice: only its id comes
    // back to the host (and the logits, when the prompt's are kept or logprobs asked for).
    std::vector<float>* logits = wants_logprobs ? &step_logits : (step == 0 ? last_logits : nullptr);
    int32_t next = 0;
    if (step == 0) {
      ODMOE_ASSIGN_OR_RETURN(next, engine.ForwardAndSelect(prompt, routing, ForwardKind::kPrefill, sampler.NextChoice(),
                                                           logits, row_logits, sampler.Deltas()));
      if (last_logits != nullptr && wants_logprobs) *last_logits = step_logits;
    } else {
      const int32_t fed = result.tokens.back();
      ODMOE_ASSIGN_OR_RETURN(next,
                             engine.ForwardAndSelect(std::span<const int32_t>(&fed, 1), routing, ForwardKind::kDecode,
                                                     sampler.NextChoice(), logits, nullptr, sampler.Deltas()));
    }
    if (step == 0) first_token_time = Clock::now();
    sampler.Record(next);
    if (wants_logprobs) result.logprobs.push_back(LogprobsOf(step_logits, next, options.logprobs));
    result.tokens.push_back(next);
    const std::string_view stop = StopReasonOf(c, options, next);
    if (on_token) on_token(next, !stop.empty() || step + 1 == options.max_new_tokens);
    if (!stop.empty()) {
      result.stop_reason = stop;
      break;
    }
  }
  SetRequestTimes(start, first_token_time, Clock::now(), &result);
  return result;
}

absl::Status GenerateOptions::Validate(int64_t vocab_size) const {
  ODMOE_RETURN_IF_ERROR(sampling.Validate(vocab_size));
  auto invalid = [](std::string_view field, const auto&... rest) {
    return RequestFieldError(absl::StatusCode::kInvalidArgument, field, rest...);
  };
  if (logprobs < -1 || logprobs > kMaxTopLogprobs) {
    return invalid("logprobs", " must be -1 (none) or 0..", kMaxTopLogprobs, " (top alternatives per token), got ",
                   logprobs);
  }
  if (prompt_logprobs && logprobs < 0) return invalid("prompt_logprobs", " needs logprobs");
  if (stop_token_ids.size() > kMaxStopTokenIds) {
    return invalid("stop_token_ids", " has ", stop_token_ids.size(), " ids, at most ", kMaxStopTokenIds);
  }
  for (const int32_t id : stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return RequestFieldError(absl::StatusCode::kOutOfRange, "stop_token_ids", " id ", id,
                               " is outside the vocabulary [0, ", vocab_size, ")");
    }
  }
  if (min_tokens < 0 || min_tokens > max_new_tokens) {
    return invalid("min_tokens", " must be in [0, max_new_tokens = ", max_new_tokens, "], got ", min_tokens);
  }
  ODMOE_RETURN_IF_ERROR(constraint.Validate());
  if (constraint.active()) {
    if (ignore_eos) return invalid("ignore_eos", " cannot be set with a structured output, which stops where it ends");
    if (min_tokens > 0) return invalid("min_tokens", " must be 0 with a structured output, got ", min_tokens);
    if (vocabulary == nullptr) {
      return RequestFieldError(absl::StatusCode::kFailedPrecondition, "constraint",
                               " (structured output) needs the model's tokenizer, and this model has none");
    }
  }
  return absl::OkStatus();
}

void AppendPromptLogprobs(std::span<const int32_t> prompt, const GenerateOptions& options, int64_t row,
                          std::span<const float> logits, GenerateResult* result) {
  const size_t next = static_cast<size_t>(row) + 1;
  if (next < prompt.size()) result->prompt_logprobs.push_back(LogprobsOf(logits, prompt[next], options.logprobs));
}

std::string_view StopReasonOf(const ModelConfig& config, const GenerateOptions& options, int32_t id) {
  auto has = [id](const auto& ids) { return std::find(ids.begin(), ids.end(), id) != ids.end(); };
  if (!options.ignore_eos && has(config.eos_token_ids)) return "eos";
  if (has(options.stop_token_ids)) return "stop_token";
  return "";
}

Sampler RequestSampler(const ModelConfig& config, const GenerateOptions& options, std::span<const int32_t> prompt) {
  TokenBan ban{.ids = options.stop_token_ids, .picks = options.min_tokens};
  if (!options.ignore_eos) {
    for (const int64_t id : config.eos_token_ids) ban.ids.push_back(static_cast<int32_t>(id));
  }
  std::optional<TokenConstraint> constraint;
  if (options.constraint.active()) {
    constraint.emplace(MakeGrammar(options.constraint), options.vocabulary, ban.ids);
  }
  return Sampler(options.sampling, std::move(ban), prompt, std::move(constraint));
}

bool ShowsTokenText(const ModelConfig& config, const GenerateOptions& options, int32_t id) {
  return options.include_stop_str_in_output || StopReasonOf(config, options, id) != "stop_token";
}

std::span<const int32_t> ShownTokens(const ModelConfig& config, const GenerateOptions& options,
                                     const GenerateResult& result) {
  std::span<const int32_t> tokens = result.tokens;
  const bool drop_last = !tokens.empty() && !ShowsTokenText(config, options, tokens.back());
  return drop_last ? tokens.first(tokens.size() - 1) : tokens;
}

void SetRequestTimes(std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point first_token,
                     std::chrono::steady_clock::time_point end, GenerateResult* result) {
  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  result->total_ms = ms(start, end);
  if (!result->tokens.empty()) result->ttft_ms = ms(start, first_token);
  if (result->tokens.size() >= 2) {
    const double decode_ms = ms(first_token, end);
    result->decode_tokens_per_s =
        decode_ms > 0 ? static_cast<double>(result->tokens.size() - 1) / (decode_ms / 1e3) : 0;
  }
}

absl::StatusOr<std::unique_ptr<LocalModel>> LocalModel::Open(OpenedModel model, std::unique_ptr<Device> device,
                                                             EngineOptions options) {
  std::unique_ptr<LocalModel> m(new LocalModel());
  m->model_ = std::move(model);
  m->device_ = std::move(device);
  ODMOE_ASSIGN_OR_RETURN(m->weights_,
                         ModelWeights::Load(m->model_.config, *m->model_.source, *m->device_, WeightSelection::All()));
  ODMOE_ASSIGN_OR_RETURN(m->experts_,
                         LocalExpertExecutor::Create(*m->device_, *m->weights_, options.max_tokens_per_forward));
  ODMOE_ASSIGN_OR_RETURN(m->engine_, Engine::Create(*m->weights_, *m->device_, m->experts_.get(), options));
  return m;
}

absl::StatusOr<std::unique_ptr<LocalModel>> LocalModel::Open(const std::string& model_dir,
                                                             std::unique_ptr<Device> device, EngineOptions options) {
  ODMOE_ASSIGN_OR_RETURN(OpenedModel model, OpenModel(ModelSource{}, model_dir));
  return Open(std::move(model), std::move(device), options);
}

absl::StatusOr<std::unique_ptr<LocalModel>> LocalModel::OpenSynthetic(const SyntheticSpec& spec,
                                                                      std::unique_ptr<Device> device,
                                                                      EngineOptions options) {
  ODMOE_ASSIGN_OR_RETURN(OpenedModel model,
                         OpenModel(ModelSource{"", spec.config_path, spec.layers, spec.seed}, /*model_dir=*/""));
  return Open(std::move(model), std::move(device), options);
}

}  // namespace odmoe
