// A JSON Schema `pattern` (an ECMA-262 regular expression) compiled into a DFA over the bytes of the strings it
// matches, for the grammar (src/engine/output_grammar.h) to generate a matching JSON string byte by byte.
//
// Semantics are JSON Schema's: the pattern matches anywhere in the string unless anchored by `^` / `$`. The DFA
// reads the string's decoded bytes (UTF-8); the grammar feeds it a JSON escape's decoded byte. Characters that a
// JSON string cannot hold without a \u escape (the control characters other than \b \f \n \r \t) are left out of
// every character set, as are UTF-16 surrogates. Every transition leads to a state from which an accepting state
// can still be reached, so a string begun can always be finished.
//
// Taken: literals, `.`, classes (`[a-z_]`, `[^"]`, ranges, escapes inside), `\d \D \w \W \s \S`, the escapes
// `\t \n \r \f \v \0 \xHH \uHHHH \cX` and escaped punctuation, groups `( )`, `(?: )` and `(?<name> )`,
// alternation, the quantifiers `* + ? {n} {n,} {n,m}` (lazy ones too: the language is the same), and `^` / `$` at
// the ends of the pattern or of its top-level alternatives.
// Refused (InvalidArgument naming what): lookarounds, backreferences, word boundaries, Unicode property escapes,
// `^` / `$` elsewhere, patterns over kMaxPatternBytes, and automata over kMaxNfaStates / kMaxDfaStates or
// kMaxCompileWork.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace odmoe {

struct PatternDfa {
  static constexpr uint16_t kNone = 0xffff;  // no transition: the byte cannot come next
  static constexpr size_t kMaxPatternBytes = 4096;
  static constexpr size_t kMaxNfaStates = 20000;
  static constexpr size_t kMaxDfaStates = 1024;
  // The NFA states its subset construction may visit in all: a few milliseconds.
  static constexpr size_t kMaxCompileWork = 2'000'000;

  std::vector<uint16_t> next;      // states x 256: the state after a byte, or kNone
  std::vector<uint8_t> accepting;  // per state: 1 where the string may end
  uint16_t start = 0;

  uint16_t Step(uint16_t state, uint8_t b) const { return next[static_cast<size_t>(state) * 256 + b]; }
  size_t states() const { return accepting.size(); }
};

// The DFA of `pattern` (UTF-8 text of an ECMA-262 regular expression). InvalidArgument, with a message that reads
// after the word "pattern", when it uses what is refused above, or no string that JSON can hold matches it.
absl::StatusOr<PatternDfa> CompilePattern(std::string_view pattern);

}  // namespace odmoe
