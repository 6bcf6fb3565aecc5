// Continuous batching over one Engine, in nano-vllm's shape: a step is Schedule (pure bookkeeping: which
// requests run which tokens, no tensors) -> Run (one Engine::ForwardBatch, which also picks each request's next
// token on the device by the choice its sampler made) -> Postprocess (each request's token taken, its stop decided).
// Requests join and leave at token boundaries: a new one is prefilled in chunks of at most prefill_chunk_tokens, one
// chunk between two decode steps of the running ones, so a long prompt never stalls their decoding for more than one
// chunk; every decode step runs one token of every request that is decoding, through every layer together (one expert
// computation per layer over all their rows).
//
// Batching never changes a request's tokens: Engine::ForwardBatch gives each row what it gets alone, each row is
// picked by its own request's choice (options and draw: Device::SelectTokens takes one per row), the sampler and
// the stop rule are Generate's, and a request's sampler draws only for its own tokens. So a request gives, bit for
// bit, the tokens Generate gives it alone (tests/engine/batching_test.cc).
//
// Thread safety: none; one thread drives a BatchRunner and the requests it holds (main's batch loop).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "src/engine/engine.h"
#include "src/engine/generator.h"
#include "src/engine/sampler.h"

namespace odmoe {

struct BatchOptions {
  // While other requests decode, a prompt goes through in chunks of at most this many tokens (alone, in chunks
  // of the engine's max_tokens_per_forward).
  int64_t prefill_chunk_tokens = 64;
};

// One request of a batch: its prompt and options (checked by ValidateRequest beforehand), its sampler, its
// sequence and what it has generated. Its owner makes it and keeps it alive while it is in a BatchRunner.
class BatchRequest {
 public:
  // `tag`: the sequence's tag (what the executor sees, ForwardSegment::tag); `config`: the model's (its stop ids).
  // `on_token` (optional) is called with each generated token (result() already holds it), `last` true for the
  // request's last one, as Generate's callback is.
  BatchRequest(uint64_t tag, const ModelConfig& config, std::vector<int32_t> prompt, GenerateOptions options,
               TokenCallback on_token = nullptr);

  uint64_t tag() const { return tag_; }
  const std::vector<int32_t>& prompt() const { return prompt_; }
  const GenerateOptions& options() const { return options_; }
  // Tokens generated so far (and routing, logits, stop reason); the times are set when it finishes (or is
  // taken out of its runner unfinished).
  const GenerateResult& result() const { return result_; }
  // Stopped (EOS or its token limit) or failed (status() not OK).
  bool finished() const { return finished_; }
  const absl::Status& status() const { return status_; }
  // Prompt tokens already run.
  int64_t prefilled() const { return prefilled_; }
  bool decoding() const { return prefilled_ == static_cast<int64_t>(prompt_.size()) && !finished_; }
  // Its KV cache (nullptr before BatchRunner::Add). Read by the caller between steps (KV alignment).
  const Sequence* sequence() const { return sequence_.get(); }
  // The positions its KV cache holds (BatchRunner::Add allocates them): the prompt's and every decode position.
  int64_t cache_positions() const;

 private:
  friend class BatchRunner;
  using Clock = std::chrono::steady_clock;
  // Takes the token picked for its last row: its logprobs when asked for, the stop rule, on_token.
  void TakeToken(int32_t next, const ModelConfig& config);
  void Finish(absl::Status status);

  uint64_t tag_;
  std::vector<int32_t> prompt_;
  GenerateOptions options_;
  TokenCallback on_token_;
  Sampler sampler_;
  std::unique_ptr<Sequence> sequence_;
  int64_t prefilled_ = 0;
  GenerateResult result_;
  // Written by the step that runs its last row: how its next token is picked (drawn in Run), the token, and the
  // logits of that row when the prompt's are kept or logprobs asked for.
  TokenChoice choice_;
  int32_t token_ = 0;
  std::vector<float> logits_;
  bool finished_ = false;
  absl::Status status_;
  Clock::time_point start_, first_token_;
};

class BatchRunner {
 public:
  // `engine` must outlive the runner.
  BatchRunner(Engine& engine, BatchOptions options);

  // The request joins at the next step (first come, first served among waiting prompts); its KV cache is
  // allocated now. Errors are the engine's (the request is not added then).
  absl::Status Add(BatchRequest* request);
  // Takes a request out between steps (finished, cancelled or its client gone); its sequence is freed. One that
  // had not finished ends now with status `why`: result() keeps its tokens, and its times run to now.
  void Remove(BatchRequest* request, absl::Status why = absl::CancelledError("taken out of the batch"));
  bool empty() const { return requests_.empty(); }
  size_t size() const { return requests_.size(); }
  const std::vector<BatchRequest*>& requests() const { return requests_; }

  // What one step runs: a chunk of one request's prompt (kPrefill) or one token of every decoding request
  // (kDecode). Empty when there is nothing to run.
  struct Plan {
    ForwardKind kind = ForwardKind::kDecode;
    std::vector<BatchRequest*> requests;
    std::vector<std::span<const int32_t>> ids;  // per request
    bool empty() const { return requests.empty(); }
  };
  // Pure bookkeeping: a prefill chunk of the oldest request with prompt left, alternating with decode steps
  // while any request decodes; otherwise a decode step of every decoding request.
  Plan Schedule();
  // Runs the plan's rows through the engine, and picks the next token of each request whose prompt is done (its
  // sampler's next choice). On error every request of the plan has failed (finished, with the error); the runner
  // keeps them until Remove.
  absl::Status Run(const Plan& plan);
  // Takes the next token of each request whose prompt is done; returns the requests that finished.
  std::vector<BatchRequest*> Postprocess(const Plan& plan);
  // Schedule, Run and Postprocess. Returns the requests that finished (stopped or failed) in this step.
  std::vector<BatchRequest*> Step();

 private:
  Engine& engine_;
  const BatchOptions options_;
  std::vector<BatchRequest*> requests_;  // in arrival order
  bool last_was_prefill_ = false;
  std::vector<int32_t> fed_;  // a decode step's fed-back tokens, one per request (Plan::ids point here)
};

}  // namespace odmoe
