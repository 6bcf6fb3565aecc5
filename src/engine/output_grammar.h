// Structured output: a request's generated text held to a grammar, token by token. A request asks for one JSON
// object (OpenAI's response_format {"type": "json_object"}), for one JSON value a JSON Schema describes (OpenAI's
// {"type": "json_schema"}, vLLM's guided_json; src/engine/json_schema.h says which schemas), for exactly one of
// a list of strings (vLLM's guided_choice) or for a text a regular expression matches whole (vLLM's guided_regex;
// src/engine/pattern_dfa.h says which expressions). Before each pick, every token whose bytes cannot continue the text
// so far is banned (its logit -inf, a Sampler delta); once the text is a whole answer, only the tokens that stop the
// request remain.
//
// Parts:
//  - OutputConstraint: what a request asks for; plain data, carried by GenerateOptions and GenerateRequest.
//  - ByteGrammar: a byte-level automaton over a small state (GrammarState). StructuredGrammar runs a
//    GrammarProgram (src/engine/grammar_program.h): JsonObjectGrammar, ChoiceGrammar, a compiled JSON Schema and
//    a compiled regular expression are each one (MakeGrammar picks the one a constraint asks for).
//  - TokenVocabulary: the bytes of each token id, sorted once per model so that the tokens a state allows are
//    found in one walk that shares the work of common prefixes.
//  - TokenConstraint: one request's state, and the ids banned for its next pick.
//
// The text a grammar reads is the concatenation of the generated tokens' bytes (Tokenizer::TokenText: a
// SentencePiece "▁" is a space, a byte piece its byte), which is what the answer shows after the prompt.
// Special tokens stand for no text: a grammar never allows them, apart from the stop ids once complete.
// JSON strings hold valid UTF-8 only (a token may end inside a sequence; the next must finish it).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "src/engine/grammar_program.h"
#include "src/model/tokenizer.h"

namespace odmoe {

// JSON: the deepest nesting of objects and arrays, and the most spaces or tabs after a newline between tokens
// (llama.cpp's json.gbnf rule: whitespace is nothing, one space, or a newline and an indent of at most 20), so
// that a model cannot pad an answer with whitespace forever.
inline constexpr int kMaxJsonDepth = 64;
inline constexpr int kMaxJsonIndent = 20;

struct OutputConstraint {
  enum class Kind { kNone, kJsonObject, kChoice, kJsonSchema, kRegex };
  Kind kind = Kind::kNone;
  std::vector<std::string> choices;  // kChoice: 1..kMaxChoices non-empty strings of at most kMaxChoiceBytes
  // kJsonSchema: the schema as JSON text, its objects' keys in the order the client wrote them (properties are
  // generated in that order); at most kMaxSchemaBytes.
  std::string schema;
  // kRegex: the regular expression, the whole answer to match it; at most PatternDfa::kMaxPatternBytes.
  std::string regex;
  // JSON: no whitespace before the value or between its tokens (vLLM's disable_any_whitespace); choices and regex
  // answers have none but their own.
  bool compact = false;

  bool active() const { return kind != Kind::kNone; }
  // InvalidArgument naming the field when the choices are missing, empty, too many or too long, or given without
  // kChoice ("constraint.choices"); when a schema is given without kJsonSchema, or does not compile
  // ("constraint.schema", with CompileJsonSchema's message); when a regex is given without kRegex, or does not
  // compile ("constraint.regex", with CompilePattern's message).
  absl::Status Validate() const;
};

// One value being read: what a GrammarProgram node makes of these fields is its own (output_grammar.cc).
struct GrammarFrame {
  uint64_t bits = 0;   // JSON: bit d set when container d is an object; an object: the keys still matching; an
                       // integer: its magnitude; literals: the bytes matched
  uint32_t count = 0;  // items, characters, properties, digits, a literal range, or JSON's literal and depth
  uint16_t node = 0;   // GrammarProgram::nodes index
  uint8_t phase = 0;   // where in the value the text stands
  uint8_t sub = 0;     // the step inside a string escape, number or literal

  bool operator==(const GrammarFrame&) const = default;
};

// A grammar's state: the values open, outermost first. Copying and comparing look at the open frames only, so
// that a state is as cheap to copy as it is deep.
struct GrammarState {
  std::array<GrammarFrame, kMaxGrammarDepth> frames;
  uint8_t depth = 0;    // frames open; 0 once the answer is whole
  uint8_t spaces = 0;   // 0 outside whitespace, 1 after a space, 2 + indent after a newline
  bool dead = false;    // a byte the grammar refused was taken (TokenConstraint::Record of a banned id)

  GrammarState() = default;
  GrammarState(const GrammarState& other) { *this = other; }
  GrammarState& operator=(const GrammarState& other) {
    depth = other.depth;
    spaces = other.spaces;
    dead = other.dead;
    // The first two frames always (two moves; most states are no deeper), the rest one by one.
    frames[0] = other.frames[0];
    frames[1] = other.frames[1];
    for (size_t i = 2; i < depth; ++i) frames[i] = other.frames[i];
    return *this;
  }
  bool operator==(const GrammarState& other) const {
    return depth == other.depth && spaces == other.spaces && dead == other.dead &&
           std::equal(frames.begin(), frames.begin() + depth, other.frames.begin());
  }
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

// Runs a GrammarProgram: the text is one value of the program's root node, with whitespace before it when the
// program allows it and, inside JSON, between its tokens as kMaxJsonIndent says; complete when that value is,
// after which no byte is allowed (a number or literal that another byte could still continue is complete, too).
class StructuredGrammar : public ByteGrammar {
 public:
  // REQUIRES: program is one CompileJsonSchema or GrammarProgram's factories made.
  explicit StructuredGrammar(GrammarProgram program);
  GrammarState Start() const override;
  bool Advance(GrammarState& state, uint8_t byte) const override;
  bool Complete(const GrammarState& state) const override;

 private:
  enum class Step : uint8_t;
  Step Enter(GrammarState& s, int32_t node, uint8_t b) const;
  Step Take(GrammarState& s, uint8_t b) const;
  bool CanEnd(const GrammarFrame& f) const;
  void Pop(GrammarState& s) const;

  GrammarProgram program_;
};

// One JSON object (RFC 8259), nesting at most kMaxJsonDepth deep.
class JsonObjectGrammar final : public StructuredGrammar {
 public:
  JsonObjectGrammar();
};

// Exactly one of `choices` (as bytes); complete when the text is one of them, which a longer choice may still
// continue.
class ChoiceGrammar final : public StructuredGrammar {
 public:
  // REQUIRES: choices non-empty.
  explicit ChoiceGrammar(std::vector<std::string> choices);
};

// The grammar `constraint` asks for, compiled, or found in GrammarCache::Shared() when a schema or expression was
// compiled lately; nullptr for none. InvalidArgument with the compiler's message (CompileJsonSchema's, or
// CompilePattern's with PatternScope::kWholeText) when the schema or expression does not compile. The choices are
// not checked here (Validate checks them).
absl::StatusOr<std::shared_ptr<const ByteGrammar>> CompileGrammar(const OutputConstraint& constraint);

// CompileGrammar's grammar. REQUIRES: constraint.Validate() is OK.
std::shared_ptr<const ByteGrammar> MakeGrammar(const OutputConstraint& constraint);

// Grammars compiled from a JSON Schema or a regular expression, by what they were compiled from, so that a schema
// a client sends with every request, and the same request's validation, sampling on main and replays on the
// shadow, compile it once. Bounded by a count and by bytes (a large expression's DFA is megabytes): past either,
// the least recently used go first.
//
// Thread safety: thread-safe; the grammars are immutable and shared.
class GrammarCache {
 public:
  static constexpr size_t kMaxEntries = 64;
  static constexpr size_t kMaxBytes = size_t{64} << 20;

  GrammarCache(size_t max_entries, size_t max_bytes) : max_entries_(max_entries), max_bytes_(max_bytes) {}
  // The process's cache, kMaxEntries and kMaxBytes.
  static GrammarCache& Shared();

  // The grammar kept for `key`, or nullptr; one found becomes the most recently used.
  std::shared_ptr<const ByteGrammar> Find(const std::string& key);
  // Keeps `grammar` (of about `bytes`) for `key`, in place of one kept already; nothing when `bytes` alone is over
  // the bound.
  void Insert(const std::string& key, std::shared_ptr<const ByteGrammar> grammar, size_t bytes);

  struct Counts {
    uint64_t hits = 0;
    uint64_t misses = 0;
    size_t entries = 0;
    size_t bytes = 0;
  };
  Counts counts() const;

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<const ByteGrammar> grammar;
    size_t bytes = 0;
  };

  const size_t max_entries_;
  const size_t max_bytes_;
  mutable absl::Mutex mu_;
  std::list<Entry> entries_ ABSL_GUARDED_BY(mu_);  // the most recently used first
  absl::flat_hash_map<std::string, std::list<Entry>::iterator> index_ ABSL_GUARDED_BY(mu_);
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

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
  // The bytes of sorted_[i] at [offsets_[i], offsets_[i + 1]) of sorted_bytes_: one walk reads them in order
  // rather than each token's string wherever it lies.
  std::string sorted_bytes_;
  std::vector<uint32_t> offsets_;
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
