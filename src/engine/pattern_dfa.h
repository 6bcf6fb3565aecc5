// A regular expression (ECMA-262's syntax) compiled into a DFA over the bytes of the texts it matches, for the
// grammar (src/engine/output_grammar.h) to generate a matching text byte by byte. Two scopes:
//  - kJsonString: a JSON Schema `pattern`. It matches anywhere in the string unless anchored by `^` / `$`. The DFA
//    reads the string's decoded bytes (UTF-8); the grammar feeds it a JSON escape's decoded byte. Characters that a
//    JSON string cannot hold without a \u escape (the control characters other than \b \f \n \r \t) are left out
//    of every character set.
//  - kWholeText: vLLM's guided_regex. The whole answer matches, as Python's re.fullmatch reads it: both ends are
//    anchored whether or not the pattern says `^` / `$`. Any character may appear.
// UTF-16 surrogates are left out in both, so that the text is valid UTF-8. Every transition leads to a state from
// which an accepting state can still be reached, so a text begun can always be finished.
//
// Taken: literals, `.`, classes (`[a-z_]`, `[^"]`, ranges, escapes inside), `\d \D \w \W \s \S`, the escapes
// `\t \n \r \f \v \0 \xHH \uHHHH \cX` and escaped punctuation, groups `( )`, `(?: )` and `(?<name> )`,
// `(?P<name> )` (Python's), alternation, the quantifiers `* + ? {n} {n,} {n,m}` (lazy ones too: the language is the
// same), and `^` / `$` at the ends of the pattern or of its top-level alternatives.
// Refused (InvalidArgument naming what): lookarounds, backreferences, word boundaries, Unicode property escapes,
// `^` / `$` elsewhere, patterns over kMaxPatternBytes, and automata over kMaxNfaStates / kMaxDfaStates or
// kMaxCompileWork.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace odmoe {

struct PatternDfa {
  static constexpr uint16_t kNone = 0xffff;  // no transition: the byte cannot come next
  static constexpr size_t kMaxPatternBytes = 4096;
  static constexpr size_t kMaxNfaStates = 20000;
  // About 8 states per character of a counted class that takes non-ASCII (`.{1,200}` has some 1600).
  static constexpr size_t kMaxDfaStates = 8192;
  // The NFA states its subset construction may visit in all: a few milliseconds.
  static constexpr size_t kMaxCompileWork = 2'000'000;

  // Bytes that lead every state to the same next state share a class, and the table has a column per class (a few
  // dozen at most, mostly), not per byte.
  std::array<uint8_t, 256> byte_class{};
  size_t classes = 1;
  std::vector<uint16_t> next;      // states x classes: the state after a byte of the class, or kNone
  std::vector<uint8_t> accepting;  // per state: 1 where the string may end
  uint16_t start = 0;

  uint16_t Step(uint16_t state, uint8_t b) const { return next[state * classes + byte_class[b]]; }
  size_t states() const { return accepting.size(); }
};

enum class PatternScope { kJsonString, kWholeText };

// The DFA of `pattern` (UTF-8 text of an ECMA-262 regular expression) in `scope`. InvalidArgument, with a message
// that reads after the word "pattern", when it uses what is refused above, or no text of the scope matches it.
absl::StatusOr<PatternDfa> CompilePattern(std::string_view pattern, PatternScope scope);

}  // namespace odmoe
