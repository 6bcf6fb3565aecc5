#include "src/engine/pattern_dfa.h"

#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "src/common/status.h"
#include "src/common/utf8.h"

namespace odmoe {
namespace {

using absl::StrCat;

constexpr uint32_t kMaxCodePoint = 0x10ffff;

// A set of code points: sorted, disjoint, non-adjacent closed ranges.
using CharSet = std::vector<std::pair<uint32_t, uint32_t>>;

CharSet Normalized(CharSet set) {
  std::sort(set.begin(), set.end());
  CharSet out;
  for (const auto& [lo, hi] : set) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.emplace_back(lo, hi);
    }
  }
  return out;
}

CharSet Complement(const CharSet& set) {
  CharSet out;
  uint32_t from = 0;
  for (const auto& [lo, hi] : set) {
    if (lo > from) out.emplace_back(from, lo - 1);
    from = hi + 1;
  }
  if (from <= kMaxCodePoint) out.emplace_back(from, kMaxCodePoint);
  return out;
}

CharSet Intersect(const CharSet& a, const CharSet& b) {
  CharSet out;
  for (const auto& [alo, ahi] : a) {
    for (const auto& [blo, bhi] : b) {
      const uint32_t lo = std::max(alo, blo), hi = std::min(ahi, bhi);
      if (lo <= hi) out.emplace_back(lo, hi);
    }
  }
  return Normalized(std::move(out));
}

// The characters a text of `scope` may hold: in a JSON string, those it may hold raw and the control characters of
// the short escapes (\b \t \n \f \r); no UTF-16 surrogate in either.
const CharSet& Writable(PatternScope scope) {
  static const CharSet json = {{0x08, 0x0a}, {0x0c, 0x0d}, {0x20, 0xd7ff}, {0xe000, kMaxCodePoint}};
  static const CharSet text = {{0, 0xd7ff}, {0xe000, kMaxCodePoint}};
  return scope == PatternScope::kJsonString ? json : text;
}

const CharSet kDigits = {{'0', '9'}};
const CharSet kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
// ECMA-262's WhiteSpace and LineTerminator.
const CharSet kSpace = {{0x09, 0x0d},     {0x20, 0x20},     {0xa0, 0xa0},     {0x1680, 0x1680}, {0x2000, 0x200a},
                        {0x2028, 0x2029}, {0x202f, 0x202f}, {0x205f, 0x205f}, {0x3000, 0x3000}, {0xfeff, 0xfeff}};
// `.`: anything but a line terminator.
const CharSet kDot = Complement({{0x0a, 0x0a}, {0x0d, 0x0d}, {0x2028, 0x2029}});

// The parsed pattern: a tree of nodes in one vector.
struct Node {
  enum class Kind { kSet, kConcat, kAlternation, kRepeat };
  Kind kind = Kind::kConcat;
  CharSet set;            // kSet
  std::vector<int> kids;  // kConcat, kAlternation (none: the empty string); kRepeat: one
  int min = 0, max = -1;  // kRepeat: -1 unbounded
};

constexpr int kMaxRepeat = 1000;  // ECMA-262 has no bound; a larger count is refused
constexpr int kMaxGroupNesting = 64;

class Parser {
 public:
  Parser(std::vector<uint32_t> text, PatternScope scope) : text_(std::move(text)), scope_(scope) {}

  // The whole pattern; in a JSON string, with the any-string loops its unanchored ends stand for (JSON Schema
  // matches anywhere), while a whole text is anchored at both ends anyway.
  absl::StatusOr<int> Run() {
    std::vector<int> alternatives;
    for (;;) {
      const bool start_anchor = Eat('^');
      ODMOE_ASSIGN_OR_RETURN(int seq, Sequence(0));
      const bool end_anchor = Eat('$');
      if (!AtEnd() && Peek() != '|') return Unexpected();
      std::vector<int> parts;
      const bool search = scope_ == PatternScope::kJsonString;
      if (search && !start_anchor) parts.push_back(AnyString());
      parts.push_back(seq);
      if (search && !end_anchor) parts.push_back(AnyString());
      alternatives.push_back(Add(Node{.kind = Node::Kind::kConcat, .kids = std::move(parts)}));
      if (AtEnd()) break;
      Eat('|');
    }
    return alternatives.size() == 1 ? alternatives[0]
                                    : Add(Node{.kind = Node::Kind::kAlternation, .kids = std::move(alternatives)});
  }

  std::vector<Node>& nodes() { return nodes_; }

 private:
  bool AtEnd() const { return pos_ >= text_.size(); }
  uint32_t Peek(size_t ahead = 0) const { return pos_ + ahead < text_.size() ? text_[pos_ + ahead] : 0; }
  bool Eat(uint32_t c) {
    if (AtEnd() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }
  int Add(Node n) {
    nodes_.push_back(std::move(n));
    return static_cast<int>(nodes_.size() - 1);
  }
  int AnyString() {
    const int any = Add(Node{.kind = Node::Kind::kSet, .set = {{0, kMaxCodePoint}}});
    return Add(Node{.kind = Node::Kind::kRepeat, .kids = {any}, .min = 0, .max = -1});
  }
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(StrCat("at character ", pos_, ": ", what));
  }
  absl::Status Unexpected() const {
    if (Peek() == '^' || Peek() == '$') {
      return Error("'^' and '$' are supported only at the ends of the pattern or of its top-level alternatives");
    }
    return Error(Peek() == ')' ? "')' closes no group" : "unexpected character");
  }

  // Alternatives up to ')' or the end; inside a group at `nesting`.
  absl::StatusOr<int> Alternation(int nesting) {
    std::vector<int> alternatives;
    for (;;) {
      ODMOE_ASSIGN_OR_RETURN(int seq, Sequence(nesting));
      alternatives.push_back(seq);
      if (!Eat('|')) break;
    }
    return alternatives.size() == 1 ? alternatives[0]
                                    : Add(Node{.kind = Node::Kind::kAlternation, .kids = std::move(alternatives)});
  }

  // Quantified atoms up to '|', ')', a top-level '$' or the end.
  absl::StatusOr<int> Sequence(int nesting) {
    std::vector<int> parts;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      if (nesting == 0 && Peek() == '$' && pos_ + 1 == text_.size()) break;
      if (nesting == 0 && Peek() == '$' && Peek(1) == '|') break;
      ODMOE_ASSIGN_OR_RETURN(int atom, Atom(nesting));
      ODMOE_ASSIGN_OR_RETURN(atom, Quantified(atom));
      parts.push_back(atom);
    }
    return Add(Node{.kind = Node::Kind::kConcat, .kids = std::move(parts)});
  }

  // A decimal count of a {n,m} quantifier; false when there is none.
  bool Count(int* out) {
    if (AtEnd() || Peek() < '0' || Peek() > '9') return false;
    int64_t n = 0;
    while (!AtEnd() && Peek() >= '0' && Peek() <= '9') n = std::min<int64_t>(n * 10 + (text_[pos_++] - '0'), 1 << 30);
    *out = static_cast<int>(n);
    return true;
  }

  // Whether a braced quantifier ({n}, {n,} or {n,m}) begins here.
  bool AtBracedQuantifier() {
    const size_t at = pos_;
    int n = 0;
    bool quantifier = Eat('{') && Count(&n);
    if (quantifier && Eat(',')) Count(&n);  // {n,} or {n,m}
    quantifier = quantifier && Eat('}');
    pos_ = at;
    return quantifier;
  }

  absl::StatusOr<int> Quantified(int atom) {
    int min = 0, max = -1;
    if (Eat('*')) {
    } else if (Eat('+')) {
      min = 1;
    } else if (Eat('?')) {
      max = 1;
    } else if (Peek() == '{') {
      const size_t at = pos_;
      ++pos_;
      if (!Count(&min)) {
        pos_ = at;  // a '{' that begins no quantifier is itself (ECMA-262 Annex B)
        return atom;
      }
      max = min;
      if (Eat(',')) {
        if (!Count(&max)) max = -1;
      }
      if (!Eat('}')) {
        pos_ = at;
        return atom;
      }
      if (max >= 0 && max < min) return Error(StrCat("the quantifier {", min, ",", max, "} is out of order"));
      if (min > kMaxRepeat || max > kMaxRepeat) return Error(StrCat("a count above ", kMaxRepeat));
    } else {
      return atom;
    }
    Eat('?');  // lazy: the same strings
    if (Peek() == '*' || Peek() == '+' || Peek() == '?' || AtBracedQuantifier()) {
      return Error("a quantifier follows a quantifier");
    }
    return Add(Node{.kind = Node::Kind::kRepeat, .kids = {atom}, .min = min, .max = max});
  }

  absl::StatusOr<int> Atom(int nesting) {
    const uint32_t c = text_[pos_++];
    switch (c) {
      case '(': {
        if (nesting >= kMaxGroupNesting) return Error(StrCat("groups nest deeper than ", kMaxGroupNesting));
        if (Eat('?')) {
          if (Eat(':')) {
          } else if ((Peek() == '<' && Peek(1) != '=' && Peek(1) != '!') || (Peek() == 'P' && Peek(1) == '<')) {
            while (!AtEnd() && Peek() != '>') ++pos_;  // a named group
            if (!Eat('>')) return Error("a group name is not closed");
          } else if (Peek() == '=' || Peek() == '!' || Peek() == '<') {
            return Error("lookarounds are not supported");
          } else {
            // Python's inline flags (?i) and (?x), its conditionals, comments and atomic groups.
            return Error(StrCat("'(?", AtEnd() ? std::string() : EncodeUtf8(Peek()),
                                "' is not supported: of the groups that begin with '(?', only (?: ), (?<name> ) and "
                                "(?P<name> ) are"));
          }
        }
        ODMOE_ASSIGN_OR_RETURN(int inner, Alternation(nesting + 1));
        if (!Eat(')')) return Error("a group is not closed");
        return inner;
      }
      case '[':
        return Class();
      case '.':
        return Add(Node{.kind = Node::Kind::kSet, .set = kDot});
      case '\\':
        return Escape();
      case '*':
      case '+':
      case '?':
        --pos_;
        return Error("a quantifier has nothing to repeat");
      case '{':
        --pos_;
        if (AtBracedQuantifier()) return Error("a quantifier has nothing to repeat");
        ++pos_;
        return Add(Node{.kind = Node::Kind::kSet, .set = {{c, c}}});
      case '^':
      case '$':
        --pos_;
        return Unexpected();
      default:
        return Add(Node{.kind = Node::Kind::kSet, .set = {{c, c}}});
    }
  }

  // After a backslash outside a class.
  absl::StatusOr<int> Escape() {
    if (AtEnd()) return Error("the pattern ends in a backslash");
    const uint32_t c = Peek();
    if (c == 'b' || c == 'B') return Error("word boundaries (\\b, \\B) are not supported");
    if ((c >= '1' && c <= '9') || c == 'k') return Error("backreferences are not supported");
    ODMOE_ASSIGN_OR_RETURN(CharSet set, EscapedSet(false));
    return Add(Node{.kind = Node::Kind::kSet, .set = std::move(set)});
  }

  // Hex digits of \x or \u: `n` of them.
  absl::StatusOr<uint32_t> Hex(int n) {
    uint32_t v = 0;
    for (int i = 0; i < n; ++i) {
      const uint32_t h = Peek();
      uint32_t d = 0;
      if (h >= '0' && h <= '9') {
        d = h - '0';
      } else if (h >= 'a' && h <= 'f') {
        d = h - 'a' + 10;
      } else if (h >= 'A' && h <= 'F') {
        d = h - 'A' + 10;
      } else {
        return Error("a \\x or \\u escape needs hex digits");
      }
      ++pos_;
      v = v * 16 + d;
    }
    return v;
  }

  // The set an escape stands for, after the backslash (`in_class`: \b is a backspace there).
  absl::StatusOr<CharSet> EscapedSet(bool in_class) {
    const uint32_t c = text_[pos_++];
    auto one = [](uint32_t v) { return CharSet{{v, v}}; };
    switch (c) {
      case 'd':
        return kDigits;
      case 'D':
        return Complement(kDigits);
      case 'w':
        return kWord;
      case 'W':
        return Complement(kWord);
      case 's':
        return kSpace;
      case 'S':
        return Complement(kSpace);
      case 't':
        return one('\t');
      case 'n':
        return one('\n');
      case 'r':
        return one('\r');
      case 'f':
        return one('\f');
      case 'v':
        return one('\v');
      case '0':
        return one(0);
      case 'b':
        if (in_class) return one('\b');
        break;
      case 'x': {
        ODMOE_ASSIGN_OR_RETURN(uint32_t v, Hex(2));
        return one(v);
      }
      case 'u': {
        if (Peek() == '{') return Error("\\u{...} escapes are not supported");
        ODMOE_ASSIGN_OR_RETURN(uint32_t v, Hex(4));
        if (v >= 0xd800 && v <= 0xdbff && Peek() == '\\' && Peek(1) == 'u') {  // a surrogate pair: one character
          pos_ += 2;
          ODMOE_ASSIGN_OR_RETURN(uint32_t low, Hex(4));
          if (low < 0xdc00 || low > 0xdfff) return Error("a \\u surrogate pair is not whole");
          v = 0x10000 + ((v - 0xd800) << 10) + (low - 0xdc00);
        }
        return one(v);
      }
      case 'c': {
        const uint32_t letter = Peek();
        if (!((letter >= 'a' && letter <= 'z') || (letter >= 'A' && letter <= 'Z'))) break;
        ++pos_;
        return one(letter % 32);
      }
      case 'p':
      case 'P':
        return Error("Unicode property escapes (\\p, \\P) are not supported");
      default:
        break;
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) {
      --pos_;
      return Error(StrCat("the escape \\", std::string(1, static_cast<char>(c)), " is not supported"));
    }
    return one(c);  // escaped punctuation (or any other character): itself
  }

  // After '[': the class up to its ']'.
  absl::StatusOr<int> Class() {
    const bool negated = Eat('^');
    CharSet set;
    while (!AtEnd() && Peek() != ']') {
      ODMOE_ASSIGN_OR_RETURN(CharSet lo, ClassAtom());
      const bool single = lo.size() == 1 && lo[0].first == lo[0].second;
      if (single && Peek() == '-' && pos_ + 1 < text_.size() && Peek(1) != ']') {
        ++pos_;
        ODMOE_ASSIGN_OR_RETURN(CharSet hi, ClassAtom());
        if (hi.size() != 1 || hi[0].first != hi[0].second) return Error("a class range ends in a class escape");
        if (hi[0].first < lo[0].first) return Error("a class range is out of order");
        set.emplace_back(lo[0].first, hi[0].first);
      } else {
        set.insert(set.end(), lo.begin(), lo.end());
      }
    }
    if (!Eat(']')) return Error("a class is not closed");
    set = Normalized(std::move(set));
    if (negated) set = Complement(set);
    return Add(Node{.kind = Node::Kind::kSet, .set = std::move(set)});
  }

  absl::StatusOr<CharSet> ClassAtom() {
    const uint32_t c = text_[pos_++];
    if (c != '\\') return CharSet{{c, c}};
    if (AtEnd()) return Error("the pattern ends in a backslash");
    return EscapedSet(true);
  }

  std::vector<uint32_t> text_;
  PatternScope scope_;
  size_t pos_ = 0;
  std::vector<Node> nodes_;
};

// ---- the NFA: byte ranges and epsilon moves, built backward from each node's continuation ----------------------

struct NfaState {
  bool range = false;  // a byte in [lo, hi] moves to `out`; otherwise epsilon moves to each of `eps`
  uint8_t lo = 0, hi = 0;
  int out = -1;
  std::vector<int> eps;
  bool match = false;
};

// The UTF-8 byte sequences of the code points in [lo, hi]: each a list of byte ranges, one per byte, any
// combination of which encodes a code point in the range (split as the regex crates of RE2 and Rust do).
void Utf8Sequences(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>* out) {
  std::vector<std::pair<uint32_t, uint32_t>> todo = {{lo, hi}};
  while (!todo.empty()) {
    auto [a, b] = todo.back();
    todo.pop_back();
    bool split = false;
    for (const uint32_t m : {0x7fu, 0x7ffu, 0xffffu}) {  // the largest code point of each encoded length
      if (a <= m && b > m) {
        todo.emplace_back(m + 1, b);
        todo.emplace_back(a, m);
        split = true;
        break;
      }
    }
    for (int i = 1; i < 4 && !split; ++i) {
      const uint32_t low = (1u << (6 * i)) - 1;
      if ((a & ~low) == (b & ~low)) continue;
      if ((a & low) != 0) {
        todo.emplace_back((a | low) + 1, b);
        todo.emplace_back(a, a | low);
        split = true;
      } else if ((b & low) != low) {
        todo.emplace_back(b & ~low, b);
        todo.emplace_back(a, (b & ~low) - 1);
        split = true;
      }
    }
    if (split) continue;
    const std::string ea = EncodeUtf8(a), eb = EncodeUtf8(b);
    std::vector<std::pair<uint8_t, uint8_t>> seq;
    for (size_t k = 0; k < ea.size(); ++k) seq.emplace_back(static_cast<uint8_t>(ea[k]), static_cast<uint8_t>(eb[k]));
    out->push_back(std::move(seq));
  }
}

class NfaBuilder {
 public:
  NfaBuilder(const std::vector<Node>& nodes, PatternScope scope) : nodes_(nodes), writable_(Writable(scope)) {}

  absl::StatusOr<int> Run(int root) {
    const int match = NewState();
    states_[static_cast<size_t>(match)].match = true;
    return Build(root, match);
  }
  std::vector<NfaState>& states() { return states_; }

 private:
  int NewState() {
    states_.emplace_back();
    return static_cast<int>(states_.size() - 1);
  }
  absl::Status TooLarge() const {
    return absl::InvalidArgumentError(
        StrCat("needs more than ", PatternDfa::kMaxNfaStates, " automaton states (fewer or smaller counts help)"));
  }

  // A start state for node `n` followed by state `next`.
  absl::StatusOr<int> Build(int n, int next) {
    if (states_.size() > PatternDfa::kMaxNfaStates) return TooLarge();
    const Node& node = nodes_[static_cast<size_t>(n)];
    switch (node.kind) {
      case Node::Kind::kSet: {
        const int split = NewState();
        // One state per byte range and continuation: sequences that end alike share their tails (every lead byte
        // of a 2-byte character, and the second byte of a 3-byte one, go on to one "a continuation byte, then
        // `next`"), so that the DFA too has one state for each and a counted class stays small.
        std::map<std::tuple<uint8_t, uint8_t, int>, int> made;
        for (const auto& [lo, hi] : Intersect(node.set, writable_)) {
          std::vector<std::vector<std::pair<uint8_t, uint8_t>>> sequences;
          Utf8Sequences(lo, hi, &sequences);
          for (const auto& seq : sequences) {
            int to = next;
            bool fresh = false;
            for (size_t k = seq.size(); k-- > 0;) {
              const auto [it, inserted] = made.try_emplace({seq[k].first, seq[k].second, to}, -1);
              if (inserted) {
                it->second = NewState();
                states_[static_cast<size_t>(it->second)] =
                    NfaState{.range = true, .lo = seq[k].first, .hi = seq[k].second, .out = to};
              }
              fresh = inserted;
              to = it->second;
            }
            if (fresh) states_[static_cast<size_t>(split)].eps.push_back(to);
          }
        }
        return split;
      }
      case Node::Kind::kConcat: {
        int to = next;
        for (size_t k = node.kids.size(); k-- > 0;) {
          ODMOE_ASSIGN_OR_RETURN(to, Build(node.kids[k], to));
        }
        return to;
      }
      case Node::Kind::kAlternation: {
        const int split = NewState();
        for (const int kid : node.kids) {
          ODMOE_ASSIGN_OR_RETURN(const int start, Build(kid, next));
          states_[static_cast<size_t>(split)].eps.push_back(start);
        }
        return split;
      }
      case Node::Kind::kRepeat: {
        const int kid = node.kids[0];
        int to = next;
        if (node.max < 0) {  // kid*: a loop
          const int loop = NewState();
          ODMOE_ASSIGN_OR_RETURN(const int body, Build(kid, loop));
          states_[static_cast<size_t>(loop)].eps = {body, next};
          to = loop;
        } else {  // (kid (kid ...)?)?, max - min deep
          for (int k = node.min; k < node.max; ++k) {
            const int optional = NewState();
            ODMOE_ASSIGN_OR_RETURN(const int body, Build(kid, to));
            states_[static_cast<size_t>(optional)].eps = {body, next};
            to = optional;
          }
        }
        for (int k = 0; k < node.min; ++k) {
          ODMOE_ASSIGN_OR_RETURN(to, Build(kid, to));
        }
        return to;
      }
    }
    return absl::InternalError("unknown pattern node");
  }

  const std::vector<Node>& nodes_;
  const CharSet& writable_;
  std::vector<NfaState> states_;
};

// The states reachable from sets of states by epsilon moves, each set's range and match states sorted (a DFA
// state's identity). One mark array serves every closure: a state counts as seen when its mark is the current
// closure's number, so no closure clears it. `work` counts the states visited.
class Closures {
 public:
  explicit Closures(const std::vector<NfaState>& nfa) : nfa_(nfa), mark_(nfa.size(), 0) {}

  std::vector<int> Of(const std::vector<int>& set) {
    ++round_;
    std::vector<int> todo = set, out;
    while (!todo.empty()) {
      const int s = todo.back();
      todo.pop_back();
      if (mark_[static_cast<size_t>(s)] == round_) continue;
      mark_[static_cast<size_t>(s)] = round_;
      ++work_;
      const NfaState& st = nfa_[static_cast<size_t>(s)];
      if (st.range || st.match) out.push_back(s);
      for (const int e : st.eps) todo.push_back(e);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  size_t work() const { return work_; }

 private:
  const std::vector<NfaState>& nfa_;
  std::vector<uint32_t> mark_;
  uint32_t round_ = 0;
  size_t work_ = 0;
};

// Sets `dfa`'s byte classes and its table of them from `table` (states x 256): bytes whose columns are equal share
// a class, numbered in the order of their first byte.
void SplitByteClasses(const std::vector<uint16_t>& table, PatternDfa* dfa) {
  const size_t states = table.size() / 256;
  auto same = [&](size_t a, size_t b) {
    for (size_t d = 0; d < states; ++d) {
      if (table[d * 256 + a] != table[d * 256 + b]) return false;
    }
    return true;
  };
  std::array<uint64_t, 256> hash{};
  for (size_t b = 0; b < 256; ++b) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the column
    for (size_t d = 0; d < states; ++d) h = (h ^ table[d * 256 + b]) * 1099511628211ull;
    hash[b] = h;
  }
  std::vector<size_t> first;  // per class: its first byte
  for (size_t b = 0; b < 256; ++b) {
    size_t c = 0;
    while (c < first.size() && !(hash[first[c]] == hash[b] && same(first[c], b))) ++c;
    if (c == first.size()) first.push_back(b);
    dfa->byte_class[b] = static_cast<uint8_t>(c);
  }
  dfa->classes = first.size();
  dfa->next.resize(states * first.size());
  for (size_t d = 0; d < states; ++d) {
    for (size_t c = 0; c < first.size(); ++c) dfa->next[d * first.size() + c] = table[d * 256 + first[c]];
  }
}

}  // namespace

absl::StatusOr<PatternDfa> CompilePattern(std::string_view pattern, PatternScope scope) {
  if (pattern.size() > PatternDfa::kMaxPatternBytes) {
    return absl::InvalidArgumentError(StrCat("has ", pattern.size(), " bytes, at most ", PatternDfa::kMaxPatternBytes));
  }
  std::vector<uint32_t> text;
  if (!DecodeUtf8(pattern, &text)) return absl::InvalidArgumentError("is not valid UTF-8");
  Parser parser(std::move(text), scope);
  ODMOE_ASSIGN_OR_RETURN(const int root, parser.Run());
  NfaBuilder builder(parser.nodes(), scope);
  ODMOE_ASSIGN_OR_RETURN(const int start, builder.Run(root));
  const std::vector<NfaState>& nfa = builder.states();

  // Subset construction, byte by byte over the elementary intervals of each state's ranges.
  PatternDfa dfa;
  std::vector<uint16_t> table;  // states x 256
  std::map<std::vector<int>, uint16_t> ids;
  std::vector<std::vector<int>> sets;
  Closures closures(nfa);  // its work is bounded, so that no pattern takes long to compile
  auto id_of = [&](std::vector<int> set) -> absl::StatusOr<uint16_t> {
    if (closures.work() > PatternDfa::kMaxCompileWork) {
      return absl::InvalidArgumentError("is too complex: its automaton takes too long to build");
    }
    const auto it = ids.find(set);
    if (it != ids.end()) return it->second;
    if (sets.size() >= PatternDfa::kMaxDfaStates) {
      return absl::InvalidArgumentError(StrCat("needs more than ", PatternDfa::kMaxDfaStates, " automaton states"));
    }
    const auto id = static_cast<uint16_t>(sets.size());
    ids.emplace(set, id);
    sets.push_back(std::move(set));
    table.resize(sets.size() * 256, PatternDfa::kNone);
    dfa.accepting.push_back(0);
    return id;
  };
  ODMOE_ASSIGN_OR_RETURN(dfa.start, id_of(closures.Of({start})));
  for (size_t d = 0; d < sets.size(); ++d) {
    std::vector<int> cuts = {0, 256};
    for (const int s : sets[d]) {
      const NfaState& st = nfa[static_cast<size_t>(s)];
      if (st.match) dfa.accepting[d] = 1;
      if (st.range) {
        cuts.push_back(st.lo);
        cuts.push_back(st.hi + 1);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      std::vector<int> targets;
      for (const int s : sets[d]) {
        const NfaState& st = nfa[static_cast<size_t>(s)];
        if (st.range && st.lo <= cuts[k] && cuts[k] <= st.hi) targets.push_back(st.out);
      }
      if (targets.empty()) continue;
      ODMOE_ASSIGN_OR_RETURN(const uint16_t to, id_of(closures.Of(targets)));
      for (int b = cuts[k]; b < cuts[k + 1]; ++b) table[d * 256 + static_cast<size_t>(b)] = to;
    }
  }

  // Only states from which a string can still end (a search back from the accepting ones): a transition to any
  // other is none.
  const size_t n = sets.size();
  std::vector<std::vector<uint16_t>> from(n);
  for (size_t d = 0; d < n; ++d) {
    for (size_t b = 0; b < 256; ++b) {
      const uint16_t to = table[d * 256 + b];
      if (to != PatternDfa::kNone && (from[to].empty() || from[to].back() != d)) {
        from[to].push_back(static_cast<uint16_t>(d));
      }
    }
  }
  std::vector<char> live(n, 0);
  std::vector<uint16_t> todo;
  for (size_t d = 0; d < n; ++d) {
    if (dfa.accepting[d] != 0) {
      live[d] = 1;
      todo.push_back(static_cast<uint16_t>(d));
    }
  }
  while (!todo.empty()) {
    const uint16_t d = todo.back();
    todo.pop_back();
    for (const uint16_t f : from[d]) {
      if (!live[f]) {
        live[f] = 1;
        todo.push_back(f);
      }
    }
  }
  if (!live[dfa.start]) {
    return absl::InvalidArgumentError(scope == PatternScope::kJsonString ? "matches no string that JSON can hold"
                                                                         : "matches no text");
  }
  for (uint16_t& to : table) {
    if (to != PatternDfa::kNone && !live[to]) to = PatternDfa::kNone;
  }
  SplitByteClasses(table, &dfa);
  return dfa;
}

}  // namespace odmoe
