// Picks the next token of a request: greedy (argmax, ties to the lowest id) or seeded sampling with temperature,
// top-k, top-p and min-p. A Sampler owns the request's random stream (std::mt19937_64, whose output the standard fixes)
// and turns its options into one TokenChoice per token (NextChoice); the pick itself follows the one rule of
// kernels/sampling_rule.h, made either next to the logits by Device::SelectTokens (a decode step then brings back
// only the id) or on the host by Next, with the same result. Deterministic: the same seed and logits give the same
// tokens on every machine and backend.
//
// The repetition penalty (HF's and vLLM's), logit bias and the presence / frequency penalties (OpenAI's) change the
// logits before the pick: the Sampler keeps the count of each token it was told was picked (Record) and gives, for
// the next pick, one change per token id (Deltas): the repetition penalty for a token of the prompt or picked
// before, then the delta bias - (count * frequency_penalty + (count > 0 ? presence_penalty : 0)), computed in double
// on the host and applied in fp32 by kernels::ChangedLogit wherever the pick is made. So every backend still picks
// the same ids. A TokenBan (vLLM's min_tokens) makes the delta of its ids -inf for its first picks, whatever their
// bias or count. A TokenConstraint (structured output, output_grammar.h) makes the delta of every id it bans for the
// next pick -inf too. Log-probabilities are those of the logits before these changes.
//
// Thread safety: none; a Sampler is one request's (Deltas works out a constraint's bans when first asked).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/sampling_rule.h"
#include "src/engine/output_grammar.h"

namespace odmoe {

// The most logit_bias entries a request may give (OpenAI's limit).
inline constexpr size_t kMaxLogitBias = 300;
// The largest repetition penalty a request may ask for (HF and vLLM set none; past this every seen logit is
// already near 0 or far below it).
inline constexpr double kMaxRepetitionPenalty = 100;

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no top-k filter
  double top_p = 1.0;        // 1: no nucleus filter
  // [0, 1]: after top-k and top-p, drop the tokens less likely than min_p times the likeliest (vLLM's; 0: off).
  double min_p = 0.0;
  uint64_t seed = 0;
  // Subtracted from a token's logit once it has been generated at least once (presence) and per time it has been
  // (frequency): [-2, 2], as OpenAI's. Tokens of the prompt do not count.
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  // (0, kMaxRepetitionPenalty] (1: none), HF's and vLLM's: the logit of a token of the prompt or generated before is
  // divided by it when positive and multiplied by it when negative, before the other changes (HF's order).
  double repetition_penalty = 1.0;
  // Added to the logits of these token ids at every pick: [-100, 100] each, at most kMaxLogitBias ids, each once.
  std::vector<std::pair<int32_t, double>> logit_bias;

  // InvalidArgument naming the option when a value is out of range; OutOfRange for a logit_bias id outside
  // [0, vocab_size). The option ("sampling.top_p", ...) is named in the message and as its field (WithField).
  absl::Status Validate(int64_t vocab_size) const;
  // Whether the logits change before a pick (Sampler::Deltas may be non-empty).
  bool ChangesLogits() const {
    return presence_penalty != 0 || frequency_penalty != 0 || repetition_penalty != 1 || !logit_bias.empty();
  }
};

// Token ids that may not be picked (their delta is -inf) in the first `picks` picks of a request.
struct TokenBan {
  std::vector<int32_t> ids;
  int64_t picks = 0;
};

// One change to a row of logits before its pick: logits[id] = kernels::ChangedLogit(logits[id], penalty, delta).
struct LogitDelta {
  int32_t id = 0;
  float penalty = 1.0f;
  float delta = 0.0f;
};

// The options as the rule reads them, in fp32 (a temperature that rounds to 0 is greedy, a top_p that rounds to 1
// cuts nothing, a top_k beyond int32 cuts nothing), with `uniform` as the draw.
TokenChoice ToTokenChoice(const SamplingOptions& options, float uniform);

// Index of the largest value; the lowest index among equal maxima. NaN never wins. REQUIRES: not empty.
int32_t ArgMax(std::span<const float> logits);

class Sampler {
 public:
  // `prompt`: the request's prompt ids, which the repetition penalty covers. REQUIRES: options.Validate() is OK and
  // every prompt id is in the vocabulary.
  // `constraint`: the request's structured output, if any.
  explicit Sampler(const SamplingOptions& options, TokenBan ban = {}, std::span<const int32_t> prompt = {},
                   std::optional<TokenConstraint> constraint = std::nullopt);
  // How the next token is to be picked: the options and, when they sample, the next draw of the seeded stream
  // (greedy draws none). Called once per token, by whoever makes the pick.
  TokenChoice NextChoice();
  // The changes to the next pick's logits (see the file comment): one per token id with a bias, a count, a ban in
  // force, a ban of the constraint or (with a repetition penalty) a place in the prompt, in ascending id order;
  // empty when nothing changes a logit. Valid until the next Record.
  std::span<const LogitDelta> Deltas() const;
  // `id` was picked: it counts for the penalties of the picks after it. Called once per token by whoever makes the
  // pick (Next does).
  void Record(int32_t id);
  // The next token picked on the host from its logits ([vocab]): the Deltas applied, cpu::SelectTokens by
  // NextChoice(), and the pick recorded.
  int32_t Next(std::span<const float> logits);

 private:
  float Uniform();  // [0, 1), a multiple of 2^-24 (exact in fp32)
  // deltas_[at]'s penalty and delta from its entry's bias, count, ban and place in the prompt.
  void Refresh(size_t at);
  // The entry of deltas_ (and bias_, counts_, banned_, in_prompt_) for `id`, added with nothing if missing.
  size_t EntryOf(int32_t id);
  // The ban is over: every entry's change without it, and the entries that only the ban kept dropped.
  void LiftBan();
  // constrained_: deltas_ with the constraint's bans (worked out by Deltas, when asked).
  void Constrain() const;

  SamplingOptions options_;
  std::mt19937_64 rng_;
  int64_t ban_picks_left_ = 0;      // picks the ban still covers
  std::vector<LogitDelta> deltas_;  // ascending ids
  std::vector<double> bias_;        // per entry of deltas_
  std::vector<int64_t> counts_;     // per entry of deltas_
  std::vector<bool> banned_;        // per entry of deltas_: one of the ban's ids
  std::vector<bool> in_prompt_;     // per entry of deltas_: in the prompt (kept only with a repetition penalty)
  std::optional<TokenConstraint> constraint_;
  // With a constraint: what Deltas gives (ascending ids), unless stale (a Record since it was worked out).
  mutable std::vector<LogitDelta> constrained_;
  mutable bool constrained_stale_ = true;
};

}  // namespace odmoe
