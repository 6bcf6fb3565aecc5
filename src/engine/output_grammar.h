// Structured output: a request's generated text held to a grammar, token by token. A request asks for one JSON
// object (OpenAI's response_format {"type": "json_object"}) or for exactly one of a list of strings (vLLM's
// guided_choice). Before each pick, every token whose bytes cannot continue the text so far is banned (its logit
// -inf, a Sampler delta); once the text is a whole answer, only the tokens that stop the request remain.
//
// Parts:
//  - OutputConstraint: what a request asks for; plain data, carried by GenerateOptions and GenerateRequest.
//  - ByteGrammar: a byte-level automaton over a small fixed-size state (GrammarState); JsonObjectGrammar and
//    ChoiceGrammar (MakeGrammar picks the one a constraint asks for).
//  - TokenVocabulary: the bytes of each token id, sorted once per model so that the tokens a state allows are
//    found in one walk that shares the work of common prefixes.
//  - TokenConstraint: one request's state, and the ids banned for its next pick.
//
// The text a grammar reads is the concatenation of the generated tokens' bytes (Tokenizer::TokenText: a
// SentencePiece "▁" is a space, a byte piece its byte), which is what the answer shows after the prompt.
// Special tokens stand for no text: a grammar never allows them, apart from the stop ids once complete.
// JSON strings let bytes >= 0x80 through unchecked: an invalid UTF-8 sequence shows as U+FFFD, still valid JSON.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/model/tokenizer.h"

namespace odmoe {

// The most strings a choice constraint may list, and the most bytes of each.
inline constexpr size_t kMaxChoices = 256;
inline constexpr size_t kMaxChoiceBytes = 1024;
// JSON: the deepest nesting of objects and arrays, and the most spaces or tabs after a newline between tokens
// (llama.cpp's json.gbnf rule: whitespace is nothing, one space, or a newline and an indent of at most 20), so
// that a model cannot pad an answer with whitespace forever.
inline constexpr int kMaxJsonDepth = 64;
inline constexpr int kMaxJsonIndent = 20;

struct OutputConstraint {
  enum class Kind { kNone, kJsonObject, kChoice };
  Kind kind = Kind::kNone;
  std::vector<std::string> choices;  // kChoice: 1..kMaxChoices non-empty strings of at most kMaxChoiceBytes

  bool active() const { return kind != Kind::kNone; }
  // InvalidArgument naming the field ("constraint.choices") when the choices are missing, empty, too many or too
  // long, or given without kChoice.
  absl::Status Validate() const;
};

// A grammar's state: what each grammar makes of these fields is its own (plain data, copied freely).
struct GrammarState {
  uint64_t nesting = 0;  // JSON: bit d set when container d (0 outermost) is an object, clear for an array
  int32_t first = 0;     // choices: the range [first, last) of the sorted choices the text is a prefix of
  int32_t last = 0;
  int32_t matched = 0;  // choices: the bytes matched so far
  uint8_t mode = 0;     // JSON: where in the grammar the text stands
  uint8_t sub = 0;      // JSON: the step inside a string escape, number or literal
  uint8_t aux = 0;      // JSON: which literal
  uint8_t depth = 0;    // JSON: open containers
  uint8_t spaces = 0;   // JSON: 0 outside whitespace, 1 after a space, 2 + indent after a newline
  bool dead = false;    // a byte the grammar refused was taken (TokenConstraint::Record of a banned id)

  bool operator==(const GrammarState&) const = default;
};

class ByteGrammar {
 public:
  virtual ~ByteGrammar() = default;
  virtual GrammarState Start() const = 0;
  // Takes `byte` into `state`; false when the byte cannot come next (`state` is then unspecified).
  virtual bool Advance(GrammarState& state, uint8_t byte) const = 0;
  // Whether the text so far is a whole answer, so that the request may stop here.
  virtual bool Complete(const GrammarState& state) const = 0;
};

// One JSON object (RFC 8259), with whitespace before it and between its tokens as kMaxJsonIndent says, nesting
// at most kMaxJsonDepth deep; complete at its closing brace, after which no byte is allowed.
class JsonObjectGrammar final : public ByteGrammar {
 public:
  GrammarState Start() const override;
  bool Advance(GrammarState& state, uint8_t byte) const override;
  bool Complete(const GrammarState& state) const override;
};

// Exactly one of `choices` (as bytes); complete when the text is one of them, which a longer choice may still
// continue.
class ChoiceGrammar final : public ByteGrammar {
 public:
  // REQUIRES: choices non-empty.
  explicit ChoiceGrammar(std::vector<std::string> choices);
  GrammarState Start() const override;
  bool Advance(GrammarState& state, uint8_t byte) const override;
  bool Complete(const GrammarState& state) const override;

 private:
  std::vector<std::string> choices_;  // sorted, each once
};

// The grammar `constraint` asks for; nullptr for none. REQUIRES: constraint.Validate() is OK.
std::shared_ptr<const ByteGrammar> MakeGrammar(const OutputConstraint& constraint);

// The bytes of each token id of a model, as a grammar reads them.
//
// Thread safety: immutable after construction; shared by every request of the model.
class TokenVocabulary {
 public:
  // Ids [0, vocab_size): a token's TokenText, none for a special token (Tokenizer::IsSpecial) or an id past the
  // tokenizer's vocabulary (a model's padding rows).
  static std::shared_ptr<const TokenVocabulary> FromTokenizer(const Tokenizer& tokenizer, int64_t vocab_size);
  // `bytes[id]`: the token's bytes, "" for none.
  explicit TokenVocabulary(std::vector<std::string> bytes);

  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  // Sets allowed[id] for every token whose whole bytes `grammar` takes from `state`. REQUIRES: allowed->size() ==
  // size().
  void MarkAllowed(const ByteGrammar& grammar, const GrammarState& state, std::vector<char>* allowed) const;

 private:
  std::vector<std::string> bytes_;  // by id
  std::vector<int32_t> sorted_;     // the ids with bytes, ordered by their bytes
  std::vector<uint32_t> shared_;    // shared_[i]: the leading bytes sorted_[i] has in common with sorted_[i - 1]
};

// One request's constraint: the grammar's state after the tokens recorded so far, and the ids its next pick may
// not take. Allowed are the tokens the grammar takes, and the stop ids once the text is complete; when nothing
// would be allowed (the vocabulary has no token that goes on, or a banned id was recorded) only the stop ids are.
//
// Thread safety: none; the request's sampler owns it.
class TokenConstraint {
 public:
  // `stop_ids`: the ids that end the request (its EOS ids and stop_token_ids). REQUIRES: grammar and vocabulary
  // non-null.
  TokenConstraint(std::shared_ptr<const ByteGrammar> grammar, std::shared_ptr<const TokenVocabulary> vocabulary,
                  std::vector<int32_t> stop_ids);
  // The ids the next pick may not take, ascending. Valid until the next Record. Worked out when asked, and only
  // when the state differs from the one they were last worked out for (inside a JSON string the state stays the
  // same token after token), so that recording many tokens (a replay) walks the vocabulary once.
  std::span<const int32_t> banned() const;
  // `id` was picked.
  void Record(int32_t id);

 private:
  std::shared_ptr<const ByteGrammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::vector<int32_t> stop_ids_;
  GrammarState state_;
  mutable std::optional<GrammarState> banned_for_;  // the state banned_ was worked out for
  mutable std::vector<int32_t> banned_;
};

}  // namespace odmoe
