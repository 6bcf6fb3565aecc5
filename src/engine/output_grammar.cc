#include "src/engine/output_grammar.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {

absl::Status OutputConstraint::Validate() const {
  auto bad = [](const auto&... rest) {
    return RequestFieldError(absl::StatusCode::kInvalidArgument, "constraint.choices", rest...);
  };
  if (kind != Kind::kChoice) {
    if (!choices.empty()) return bad(" are given, but the constraint is not a choice");
    return absl::OkStatus();
  }
  if (choices.empty()) return bad(" must list at least one choice");
  if (choices.size() > kMaxChoices) return bad(" has ", choices.size(), " choices, at most ", kMaxChoices);
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i].empty()) return bad("[", i, "] is empty");
    if (choices[i].size() > kMaxChoiceBytes) {
      return bad("[", i, "] has ", choices[i].size(), " bytes, at most ", kMaxChoiceBytes);
    }
  }
  return absl::OkStatus();
}

// ---- JSON -------------------------------------------------------------------------------------------------------

namespace {

enum JsonMode : uint8_t {
  kTop,          // before the object: whitespace or '{'
  kObjectFirst,  // after '{': whitespace, a key or '}'
  kObjectKey,    // after ',' in an object: whitespace or a key
  kColon,        // after a key: whitespace or ':'
  kValue,        // after ':', or ',' in an array: whitespace or a value
  kArrayFirst,   // after '[': whitespace, a value or ']'
  kAfterValue,   // whitespace, ',' or the innermost container's closing bracket
  kKeyString,    // inside a key (sub: JsonEscape)
  kValueString,  // inside a string value (sub: JsonEscape)
  kNumber,       // sub: JsonNumber
  kLiteral,      // aux: the literal, sub: its bytes matched
  kDone,         // the object closed
};

// Inside a string: plain, after a backslash, or 4..1 hex digits of a \u escape still to come (kHex4 - n + 1).
enum JsonEscape : uint8_t { kPlain, kBackslash, kHex4, kHex3, kHex2, kHex1 };

// Inside a number: after the part named. Those marked (end) may end the number.
enum JsonNumber : uint8_t {
  kMinus,      // '-'
  kZero,       // a leading 0 (end)
  kInteger,    // a digit 1-9 and more digits (end)
  kPoint,      // '.'
  kFraction,   // digits after the point (end)
  kExponent,   // 'e' or 'E'
  kExpSign,    // its '+' or '-'
  kExpDigits,  // its digits (end)
};

constexpr const char* kLiterals[] = {"true", "false", "null"};

bool IsJsonSpace(uint8_t b) { return b == ' ' || b == '\t' || b == '\n' || b == '\r'; }
bool IsDigit(uint8_t b) { return b >= '0' && b <= '9'; }
bool IsHex(uint8_t b) { return IsDigit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F'); }

// A whitespace byte between JSON's tokens: one space, or a newline and then up to kMaxJsonIndent spaces or tabs.
bool Whitespace(GrammarState& s, uint8_t b) {
  if (s.spaces == 0 && (b == ' ' || b == '\n')) {
    s.spaces = b == ' ' ? 1 : 2;
    return true;
  }
  if (s.spaces >= 2 && (b == ' ' || b == '\t') && s.spaces < 2 + kMaxJsonIndent) {
    ++s.spaces;
    return true;
  }
  return false;
}

bool InObject(const GrammarState& s) { return s.depth > 0 && ((s.nesting >> (s.depth - 1)) & 1) != 0; }

bool Open(GrammarState& s, bool object) {
  if (s.depth >= kMaxJsonDepth) return false;
  const uint64_t bit = uint64_t{1} << s.depth;
  s.nesting = object ? s.nesting | bit : s.nesting & ~bit;
  ++s.depth;
  s.mode = object ? kObjectFirst : kArrayFirst;
  return true;
}

// After a container closed or a value ended: the next mode at this depth.
void ValueDone(GrammarState& s) { s.mode = s.depth == 0 ? kDone : kAfterValue; }

bool Close(GrammarState& s, uint8_t b) {
  if (s.depth == 0 || (b == '}') != InObject(s)) return false;
  --s.depth;
  ValueDone(s);
  return true;
}

// The first byte of a value (a string, number, literal, object or array).
bool StartValue(GrammarState& s, uint8_t b) {
  switch (b) {
    case '{':
      return Open(s, true);
    case '[':
      return Open(s, false);
    case '"':
      s.mode = kValueString;
      s.sub = kPlain;
      return true;
    case '-':
      s.mode = kNumber;
      s.sub = kMinus;
      return true;
    default:
      break;
  }
  if (IsDigit(b)) {
    s.mode = kNumber;
    s.sub = b == '0' ? kZero : kInteger;
    return true;
  }
  for (uint8_t i = 0; i < 3; ++i) {
    if (b == static_cast<uint8_t>(kLiterals[i][0])) {
      s.mode = kLiteral;
      s.aux = i;
      s.sub = 1;
      return true;
    }
  }
  return false;
}

bool StringByte(GrammarState& s, uint8_t b, bool key) {
  switch (s.sub) {
    case kPlain:
      if (b == '"') {
        if (key) {
          s.mode = kColon;
        } else {
          ValueDone(s);
        }
        return true;
      }
      if (b == '\\') s.sub = kBackslash;
      return b >= 0x20;
    case kBackslash:
      if (b == 'u') {
        s.sub = kHex4;
        return true;
      }
      s.sub = kPlain;
      return b == '"' || b == '\\' || b == '/' || b == 'b' || b == 'f' || b == 'n' || b == 'r' || b == 't';
    default:  // a hex digit of \u
      s.sub = s.sub == kHex1 ? uint8_t{kPlain} : static_cast<uint8_t>(s.sub + 1);
      return IsHex(b);
  }
}

// A byte in a number; `ends` is set when the byte is not the number's but may follow it.
bool NumberByte(GrammarState& s, uint8_t b, bool* ends) {
  *ends = false;
  const bool digit = IsDigit(b);
  switch (s.sub) {
    case kMinus:
      s.sub = b == '0' ? kZero : kInteger;
      return digit;
    case kZero:
    case kInteger:
      if (digit && s.sub == kInteger) return true;
      if (b == '.') {
        s.sub = kPoint;
        return true;
      }
      break;
    case kPoint:
      s.sub = kFraction;
      return digit;
    case kFraction:
      if (digit) return true;
      break;
    case kExponent:
      if (b == '+' || b == '-') {
        s.sub = kExpSign;
        return true;
      }
      s.sub = kExpDigits;
      return digit;
    case kExpSign:
      s.sub = kExpDigits;
      return digit;
    case kExpDigits:
      if (digit) return true;
      *ends = true;
      return true;
    default:
      return false;
  }
  // After a whole integer or fraction: an exponent, or the number's end.
  if (b == 'e' || b == 'E') {
    s.sub = kExponent;
    return true;
  }
  *ends = true;
  return true;
}

}  // namespace

GrammarState JsonObjectGrammar::Start() const { return GrammarState{.mode = kTop}; }

bool JsonObjectGrammar::Complete(const GrammarState& s) const { return !s.dead && s.mode == kDone; }

bool JsonObjectGrammar::Advance(GrammarState& s, uint8_t b) const {
  if (s.dead) return false;
  switch (s.mode) {
    case kKeyString:
    case kValueString:
      return StringByte(s, b, s.mode == kKeyString);
    case kLiteral: {
      const char* literal = kLiterals[s.aux];
      if (b != static_cast<uint8_t>(literal[s.sub])) return false;
      if (literal[++s.sub] == '\0') ValueDone(s);
      return true;
    }
    case kNumber: {
      bool ends = false;
      if (!NumberByte(s, b, &ends)) return false;
      if (!ends) return true;
      ValueDone(s);  // a number is never the whole answer: it ends inside a container, and `b` comes after it
      break;
    }
    default:
      break;
  }
  if (s.mode == kDone) return false;
  if (IsJsonSpace(b)) return Whitespace(s, b);
  s.spaces = 0;
  switch (s.mode) {
    case kTop:
      return b == '{' && Open(s, true);
    case kObjectFirst:
    case kObjectKey:
      if (b == '"') {
        s.mode = kKeyString;
        s.sub = kPlain;
        return true;
      }
      return s.mode == kObjectFirst && b == '}' && Close(s, b);
    case kColon:
      s.mode = kValue;
      return b == ':';
    case kValue:
      return StartValue(s, b);
    case kArrayFirst:
      return b == ']' ? Close(s, b) : StartValue(s, b);
    case kAfterValue:
      if (b == ',') {
        s.mode = InObject(s) ? kObjectKey : kValue;
        return true;
      }
      return (b == '}' || b == ']') && Close(s, b);
    default:
      return false;
  }
}

// ---- choices ----------------------------------------------------------------------------------------------------

ChoiceGrammar::ChoiceGrammar(std::vector<std::string> choices) : choices_(std::move(choices)) {
  ODMOE_CHECK(!choices_.empty());
  std::sort(choices_.begin(), choices_.end());
  choices_.erase(std::unique(choices_.begin(), choices_.end()), choices_.end());
}

GrammarState ChoiceGrammar::Start() const {
  return GrammarState{.first = 0, .last = static_cast<int32_t>(choices_.size()), .matched = 0};
}

bool ChoiceGrammar::Complete(const GrammarState& s) const {
  return !s.dead && s.first < s.last && static_cast<int32_t>(choices_[s.first].size()) == s.matched;
}

bool ChoiceGrammar::Advance(GrammarState& s, uint8_t b) const {
  if (s.dead) return false;
  // The choices in [first, last) share their first `matched` bytes and are sorted, so those whose next byte is
  // `b` stand together (a choice that ends here sorts first, as -1).
  const size_t at = static_cast<size_t>(s.matched);
  auto next = [at](const std::string& c) { return c.size() > at ? static_cast<int>(static_cast<uint8_t>(c[at])) : -1; };
  const auto begin = choices_.begin() + s.first;
  const auto end = choices_.begin() + s.last;
  const auto lo = std::partition_point(begin, end, [&](const std::string& c) { return next(c) < b; });
  const auto hi = std::partition_point(lo, end, [&](const std::string& c) { return next(c) <= b; });
  if (lo == hi) return false;
  s.first = static_cast<int32_t>(lo - choices_.begin());
  s.last = static_cast<int32_t>(hi - choices_.begin());
  ++s.matched;
  return true;
}

std::shared_ptr<const ByteGrammar> MakeGrammar(const OutputConstraint& constraint) {
  switch (constraint.kind) {
    case OutputConstraint::Kind::kJsonObject:
      return std::make_shared<JsonObjectGrammar>();
    case OutputConstraint::Kind::kChoice:
      return std::make_shared<ChoiceGrammar>(constraint.choices);
    case OutputConstraint::Kind::kNone:
      break;
  }
  return nullptr;
}

// ---- the vocabulary ---------------------------------------------------------------------------------------------

std::shared_ptr<const TokenVocabulary> TokenVocabulary::FromTokenizer(const Tokenizer& tokenizer, int64_t vocab_size) {
  std::vector<std::string> bytes(static_cast<size_t>(std::max<int64_t>(vocab_size, 0)));
  const int64_t known = std::min<int64_t>(vocab_size, tokenizer.vocab_size());
  for (int32_t id = 0; id < known; ++id) {
    if (!tokenizer.IsSpecial(id)) bytes[static_cast<size_t>(id)] = tokenizer.TokenText(id);
  }
  return std::make_shared<const TokenVocabulary>(std::move(bytes));
}

TokenVocabulary::TokenVocabulary(std::vector<std::string> bytes) : bytes_(std::move(bytes)) {
  for (size_t id = 0; id < bytes_.size(); ++id) {
    if (!bytes_[id].empty()) sorted_.push_back(static_cast<int32_t>(id));
  }
  std::sort(sorted_.begin(), sorted_.end(), [&](int32_t a, int32_t b) { return bytes_[a] < bytes_[b]; });
  shared_.assign(sorted_.size(), 0);
  for (size_t i = 1; i < sorted_.size(); ++i) {
    const std::string& a = bytes_[sorted_[i - 1]];
    const std::string& b = bytes_[sorted_[i]];
    const auto diff = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
    shared_[i] = static_cast<uint32_t>(diff.first - a.begin());
  }
}

void TokenVocabulary::MarkAllowed(const ByteGrammar& grammar, const GrammarState& state,
                                  std::vector<char>* allowed) const {
  ODMOE_CHECK(allowed->size() == bytes_.size());
  // states[d]: the state after the first d bytes of the token walked last; valid for d <= valid. A token whose
  // byte `refused` (0-based) the grammar refused leaves every later token that shares its first refused + 1
  // bytes refused too (they are sorted, so those come next).
  std::vector<GrammarState> states(1, state);
  size_t valid = 0;
  size_t refused_at = SIZE_MAX;
  for (size_t i = 0; i < sorted_.size(); ++i) {
    const std::string& token = bytes_[sorted_[i]];
    const size_t shared = shared_[i];
    if (refused_at != SIZE_MAX && shared > refused_at) continue;  // shares the refused prefix
    refused_at = SIZE_MAX;
    size_t d = std::min(shared, valid);
    if (states.size() < token.size() + 1) states.resize(token.size() + 1);
    for (; d < token.size(); ++d) {
      states[d + 1] = states[d];
      if (!grammar.Advance(states[d + 1], static_cast<uint8_t>(token[d]))) break;
    }
    valid = d;
    if (d == token.size()) {
      (*allowed)[static_cast<size_t>(sorted_[i])] = 1;
    } else {
      refused_at = d;
    }
  }
}

// ---- one request ------------------------------------------------------------------------------------------------

TokenConstraint::TokenConstraint(std::shared_ptr<const ByteGrammar> grammar,
                                 std::shared_ptr<const TokenVocabulary> vocabulary, std::vector<int32_t> stop_ids)
    : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)), stop_ids_(std::move(stop_ids)) {
  ODMOE_CHECK(grammar_ != nullptr && vocabulary_ != nullptr);
  state_ = grammar_->Start();
}

void TokenConstraint::Record(int32_t id) {
  if (id < 0 || id >= vocabulary_->size()) {
    state_.dead = true;
  } else {
    const std::string& bytes = vocabulary_->bytes(id);
    if (bytes.empty()) state_.dead = true;  // a special token is no text of the grammar's
    for (const char c : bytes) {
      if (!state_.dead && !grammar_->Advance(state_, static_cast<uint8_t>(c))) state_.dead = true;
    }
  }
}

std::span<const int32_t> TokenConstraint::banned() const {
  if (banned_for_ == state_) return banned_;
  banned_for_ = state_;
  std::vector<char> allowed(static_cast<size_t>(vocabulary_->size()), 0);
  if (!state_.dead) vocabulary_->MarkAllowed(*grammar_, state_, &allowed);
  const bool none = std::find(allowed.begin(), allowed.end(), 1) == allowed.end();
  if (none || grammar_->Complete(state_)) {
    for (const int32_t id : stop_ids_) {
      if (id >= 0 && id < vocabulary_->size()) allowed[static_cast<size_t>(id)] = 1;
    }
  }
  banned_.clear();
  for (size_t id = 0; id < allowed.size(); ++id) {
    if (allowed[id] == 0) banned_.push_back(static_cast<int32_t>(id));
  }
  return banned_;
}

}  // namespace odmoe
