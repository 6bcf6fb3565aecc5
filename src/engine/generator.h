// Text generation over an Engine: validate the request, prefill the prompt, then decode token by token until
// EOS (any of the model's EOS ids) or the token limit. Also `LocalModel`, which assembles everything a
// single process needs (config, checkpoint, device, weights, experts, engine) from a model folder.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/engine/engine.h"
#include "src/engine/logprobs.h"
#include "src/engine/model_weights.h"
#include "src/engine/output_grammar.h"
#include "src/engine/sampler.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/open_model.h"
#include "src/model/synthetic.h"

namespace odmoe {

// The most stop_token_ids a request may give.
inline constexpr size_t kMaxStopTokenIds = 64;

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  SamplingOptions sampling;
  bool ignore_eos = false;  // keep generating past EOS (benchmarks need fixed lengths)
  // Ids that end the request when generated, besides EOS and whatever ignore_eos (vLLM's stop_token_ids): the
  // token stays in GenerateResult::tokens, its text is left out of the answer unless include_stop_str_in_output
  // (ShowsTokenText). At most kMaxStopTokenIds, each inside the vocabulary.
  std::vector<int32_t> stop_token_ids;
  // vLLM's include_stop_str_in_output: a stop token's text stays in the answer (the HTTP API keeps a stop string's
  // too). The engine does not read it; it decides what an answer shows.
  bool include_stop_str_in_output = false;
  // No token that would stop the request (StopReasonOf) is picked before this many tokens (vLLM's min_tokens):
  // their logits are -inf for the first min_tokens picks (Sampler's TokenBan). 0..max_new_tokens.
  int64_t min_tokens = 0;
  bool record_routing = false;    // fill GenerateResult::routing
  bool keep_last_logits = false;  // fill GenerateResult::last_logits
  // >= 0: fill GenerateResult::logprobs with each generated token's log-probability and the `logprobs` most likely
  // tokens of its position (src/engine/logprobs.h; at most kMaxTopLogprobs). The logits of every position that
  // picks a token then come back to the host. -1: none.
  int32_t logprobs = -1;
  // With logprobs >= 0: fill GenerateResult::prompt_logprobs too, the logprobs of each prompt token after the
  // first (what the model gives it after the tokens before it; OpenAI's `echo`). Every prompt row's logits then
  // come back to the host.
  bool prompt_logprobs = false;
  // Structured output (src/engine/output_grammar.h): the generated text is held to this grammar, and the request
  // stops (at an EOS or stop token, the only ids then allowed) once the text is whole. Needs `vocabulary`, and
  // neither ignore_eos nor min_tokens (an answer must be able to stop where its grammar does).
  OutputConstraint constraint;
  // The model's tokens as bytes (TokenVocabulary::FromTokenizer); needed with a constraint.
  std::shared_ptr<const TokenVocabulary> vocabulary;

  // InvalidArgument naming the option when a value is out of range (sampling, logprobs, stop_token_ids, min_tokens,
  // constraint) or a constraint meets ignore_eos or min_tokens; OutOfRange for a logit_bias or stop_token_ids id
  // outside [0, vocab_size); FailedPrecondition for a constraint without a vocabulary. max_new_tokens is checked
  // against the prompt and the model by ValidateRequest. The option is named in the message and as its field
  // (WithField).
  absl::Status Validate(int64_t vocab_size) const;
};

struct GenerateResult {
  std::vector<int32_t> tokens;     // generated ids (an EOS that stopped generation included)
  std::vector<float> last_logits;  // logits at the last prompt position
  // One per generated token, when options.logprobs >= 0.
  std::vector<PositionLogprobs> logprobs;
  // One per prompt token but the first (prompt[1..]), when options.prompt_logprobs.
  std::vector<PositionLogprobs> prompt_logprobs;
  // For every position processed (prompt, then each decode step's input token): [sparse layer][k].
  std::vector<PositionRouting> routing;
  std::string stop_reason;         // "eos", "stop_token" (one of options.stop_token_ids) or "length"
  double ttft_ms = 0;              // request start to the first generated token
  double decode_tokens_per_s = 0;  // tokens after the first / time after the first (0 if fewer than 2)
  double total_ms = 0;
};

// Whether a prompt of prompt_len tokens plus max_new_tokens generated ones fits the model's positions
// (max_position_embeddings). Never overflows, whatever max_new_tokens. The one rule of a request's length:
// ValidateRequest refuses a request that does not fit, and the HTTP API tells such a refusal from others by it.
bool FitsContext(const ModelConfig& config, int64_t prompt_len, int64_t max_new_tokens);

// Checks a prompt against the model: non-empty, prompt + max_new_tokens within the model's positions, then ids
// inside the vocabulary. InvalidArgument for an empty prompt or a negative max_new_tokens, else OutOfRange, with a
// message naming the value: a request whose length fits the model is refused for its ids alone.
absl::Status ValidateRequest(const ModelConfig& config, std::span<const int32_t> prompt, int64_t max_new_tokens);

// The last position a request decodes at (feeds a generated token back at): prompt_len + max_new_tokens - 2,
// since the last generated token is never fed back. Less than prompt_len when at most one token is generated
// (no decode step). The one definition main, its shadow link and the shadow use.
inline int64_t LastDecodePosition(int64_t prompt_len, int64_t max_new_tokens) {
  return prompt_len + max_new_tokens - 2;
}

// The stop rule Generate, continuous batching (batching.h) and main share: why generated token `id` ends the
// request, "eos" (one of the model's EOS ids, unless options.ignore_eos) or "stop_token" (one of
// options.stop_token_ids), or "" when it does not. The token limit is the caller's.
std::string_view StopReasonOf(const ModelConfig& config, const GenerateOptions& options, int32_t id);
// The sampler of a request, Generate's and continuous batching's: options.sampling over the request's `prompt`
// (which its repetition penalty covers), with the ids StopReasonOf stops on banned for the first
// options.min_tokens picks, and options.constraint's bans (its stop ids: those StopReasonOf stops on).
Sampler RequestSampler(const ModelConfig& config, const GenerateOptions& options, std::span<const int32_t> prompt);
// Whether an answer shows generated token `id`'s text: always, but for a stop_token_ids id (which ends the
// request, so it is the last token) unless options.include_stop_str_in_output, as vLLM. An EOS is shown; its text
// is nothing. The one rule of streamed text (main, the CLI) and of whole answers (ShownTokens).
bool ShowsTokenText(const ModelConfig& config, const GenerateOptions& options, int32_t id);
// The generated tokens whose text an answer shows (ShowsTokenText): all of them, or all but the stop token that
// ended the request.
std::span<const int32_t> ShownTokens(const ModelConfig& config, const GenerateOptions& options,
                                     const GenerateResult& result);
// Prompt logprobs (GenerateOptions::prompt_logprobs), the one rule Generate and batching share: the logits of
// prompt row `row` give the logprobs of prompt[row + 1] (nothing for the last row, whose logits pick the first
// generated token), appended to result->prompt_logprobs.
void AppendPromptLogprobs(std::span<const int32_t> prompt, const GenerateOptions& options, int64_t row,
                          std::span<const float> logits, GenerateResult* result);
// The request's times in `result` (total_ms, ttft_ms, decode_tokens_per_s) from its start, its first token
// (ignored without tokens) and its end.
void SetRequestTimes(std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point first_token,
                     std::chrono::steady_clock::time_point end, GenerateResult* result);

// Called with each generated id as soon as it is known; `last` is true for the request's last token (the
// token limit, or an EOS that stops it). Generate owns the stop rule: callers never re-decide it.
using TokenCallback = std::function<void(int32_t id, bool last)>;

// Runs one request: the prompt as one kPrefill Forward, each later token as a kDecode Forward, each token picked on
// the engine's device by the request's Sampler (Engine::ForwardAndSelect). `on_token` (optional) sees every
// generated token.
absl::StatusOr<GenerateResult> Generate(Engine& engine, std::span<const int32_t> prompt, const GenerateOptions& options,
                                        const TokenCallback& on_token = nullptr);

// A whole model in one process on one device.
class LocalModel {
 public:
  // The model OpenModel opened (checkpoint or synthetic), every tensor uploaded to `device`.
  static absl::StatusOr<std::unique_ptr<LocalModel>> Open(OpenedModel model, std::unique_ptr<Device> device,
                                                          EngineOptions options = {});
  static absl::StatusOr<std::unique_ptr<LocalModel>> Open(const std::string& model_dir, std::unique_ptr<Device> device,
                                                          EngineOptions options = {});
  // The model of `spec` with synthetic weights (src/model/synthetic.h), generated on the host and uploaded.
  static absl::StatusOr<std::unique_ptr<LocalModel>> OpenSynthetic(const SyntheticSpec& spec,
                                                                   std::unique_ptr<Device> device,
                                                                   EngineOptions options = {});
  const ModelConfig& config() const { return model_.config; }
  Engine& engine() { return *engine_; }
  Device& device() { return *device_; }
  const ModelWeights& weights() const { return *weights_; }
  // REQUIRES: opened with Open (a synthetic model has no checkpoint).
  Checkpoint& checkpoint() { return *model_.checkpoint; }

 private:
  LocalModel() = default;
  OpenedModel model_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<LocalExpertExecutor> experts_;
  std::unique_ptr<Engine> engine_;
};

}  // namespace odmoe
