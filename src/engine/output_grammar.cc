#include "src/engine/output_grammar.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/json_schema.h"

namespace odmoe {

absl::Status OutputConstraint::Validate() const {
  if (kind != Kind::kJsonSchema && !schema.empty()) {
    return RequestFieldError(absl::StatusCode::kInvalidArgument, "constraint.schema",
                             " is given, but the constraint is not a JSON schema");
  }
  if (kind != Kind::kRegex && !regex.empty()) {
    return RequestFieldError(absl::StatusCode::kInvalidArgument, "constraint.regex",
                             " is given, but the constraint is not a regular expression");
  }
  if (kind == Kind::kJsonSchema || kind == Kind::kRegex) {
    if (const auto grammar = CompileGrammar(*this); !grammar.ok()) {
      return RequestFieldError(absl::StatusCode::kInvalidArgument,
                               kind == Kind::kRegex ? "constraint.regex" : "constraint.schema", " ",
                               grammar.status().message());
    }
  }
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

// ---- reading a grammar program ---------------------------------------------------------------------------------

namespace {

using Kind = GrammarNode::Kind;

// Where a value stands; 0 (kStart) before its first byte, for every kind.
constexpr uint8_t kStart = 0;

// Any JSON value (GrammarNode::Kind::kJson): the frame's phase, sub, count (its literal in the low byte, its open
// containers in the next) and bits (its containers' kinds).
enum JsonMode : uint8_t {
  kObjectFirst = 1,  // after '{': whitespace, a key or '}'
  kObjectKey,        // after ',' in an object: whitespace or a key
  kColon,            // after a key: whitespace or ':'
  kValue,            // after ':', or ',' in an array: whitespace or a value
  kArrayFirst,       // after '[': whitespace, a value or ']'
  kAfterValue,       // whitespace, ',' or the innermost container's closing bracket
  kKeyString,        // inside a key (sub: JsonEscape)
  kValueString,      // inside a string value (sub: JsonEscape)
  kNumber,           // sub: JsonNumber
  kLiteral,          // count's low byte: the literal, sub: its bytes matched
  kJsonDone,         // the value ended
};

// Inside a string: plain, after a backslash, 4..1 hex digits of a \u escape still to come (kHex4 - n + 1), or
// inside a UTF-8 sequence (RFC 3629): 1..3 continuation bytes to come (kCont1..3), or the second byte of a lead
// byte whose second byte is narrower (E0: A0-BF, no overlong form; ED: 80-9F, no surrogate; F0: 90-BF; F4: 80-8F,
// nothing past U+10FFFF). A \u escape of a UTF-16 surrogate comes in a pair, high (D800-DBFF) then low
// (DC00-DFFF), as strict parsers (nlohmann's, serde's) demand: after a first hex digit D (kHexD), after a high
// surrogate's third and fourth digits to come (kHigh2, kHigh1), and its low half's '\\', 'u', 'D' and C-F
// (kLowBackslash .. kLowC).
enum JsonEscape : uint8_t {
  kPlain,
  kBackslash,
  kHex4,
  kHex3,
  kHex2,
  kHex1,
  kHexD,
  kHigh2,
  kHigh1,
  kLowBackslash,
  kLowU,
  kLowD,
  kLowC,
  kCont1,
  kCont2,
  kCont3,
  kE0,
  kED,
  kF0,
  kF4
};

// The escape state after UTF-8 lead byte `b` (>= 0x80), or kPlain when `b` cannot lead a sequence.
uint8_t Utf8Lead(uint8_t b) {
  if (b >= 0xc2 && b <= 0xdf) return kCont1;
  if (b == 0xe0) return kE0;
  if (b == 0xed) return kED;
  if (b >= 0xe1 && b <= 0xef) return kCont2;
  if (b == 0xf0) return kF0;
  if (b >= 0xf1 && b <= 0xf3) return kCont3;
  if (b == 0xf4) return kF4;
  return kPlain;
}

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

bool NumberCanEnd(uint8_t sub) { return sub == kZero || sub == kInteger || sub == kFraction || sub == kExpDigits; }

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

uint32_t JsonDepth(const GrammarFrame& f) { return (f.count >> 8) & 0xff; }
void SetJsonDepth(GrammarFrame& f, uint32_t depth) { f.count = (f.count & 0xff) | (depth << 8); }
uint32_t JsonLiteral(const GrammarFrame& f) { return f.count & 0xff; }

bool InObject(const GrammarFrame& f) {
  const uint32_t depth = JsonDepth(f);
  return depth > 0 && ((f.bits >> (depth - 1)) & 1) != 0;
}

bool Open(GrammarFrame& f, bool object) {
  const uint32_t depth = JsonDepth(f);
  if (depth >= kMaxJsonDepth) return false;
  const uint64_t bit = uint64_t{1} << depth;
  f.bits = object ? f.bits | bit : f.bits & ~bit;
  SetJsonDepth(f, depth + 1);
  f.phase = object ? kObjectFirst : kArrayFirst;
  return true;
}

// After a container closed or a value ended: the next mode at this depth.
void ValueDone(GrammarFrame& f) { f.phase = JsonDepth(f) == 0 ? kJsonDone : kAfterValue; }

bool Close(GrammarFrame& f, uint8_t b) {
  if (JsonDepth(f) == 0 || (b == '}') != InObject(f)) return false;
  SetJsonDepth(f, JsonDepth(f) - 1);
  ValueDone(f);
  return true;
}

// The first byte of a value (a string, number, literal, object or array).
bool StartValue(GrammarFrame& f, uint8_t b) {
  switch (b) {
    case '{':
      return Open(f, true);
    case '[':
      return Open(f, false);
    case '"':
      f.phase = kValueString;
      f.sub = kPlain;
      return true;
    case '-':
      f.phase = kNumber;
      f.sub = kMinus;
      return true;
    default:
      break;
  }
  if (IsDigit(b)) {
    f.phase = kNumber;
    f.sub = b == '0' ? kZero : kInteger;
    return true;
  }
  for (uint32_t i = 0; i < 3; ++i) {
    if (b == static_cast<uint8_t>(kLiterals[i][0])) {
      f.phase = kLiteral;
      f.count = (f.count & ~0xffu) | i;
      f.sub = 1;
      return true;
    }
  }
  return false;
}

// A byte inside a string whose opening quote was taken, escapes at `escape`; *closed when it is the closing quote,
// *starts_char when it begins a character (an ASCII byte, a UTF-8 lead byte, or an escape's backslash, the low
// half of a surrogate pair's apart). The string's bytes are valid UTF-8, and its escapes name Unicode scalars.
bool StringByte(uint8_t& escape, uint8_t b, bool* closed, bool* starts_char) {
  *closed = false;
  *starts_char = false;
  const bool continuation = (b & 0xc0) == 0x80;
  switch (escape) {
    case kPlain:
      if (b == '"') {
        *closed = true;
        return true;
      }
      *starts_char = true;
      if (b == '\\') escape = kBackslash;
      if (b >= 0x80) {
        escape = Utf8Lead(b);
        return escape != kPlain;
      }
      return b >= 0x20;
    case kCont1:
    case kCont2:
    case kCont3:
      escape = escape == kCont1 ? uint8_t{kPlain} : static_cast<uint8_t>(escape - 1);
      return continuation;
    case kE0:
      escape = kCont1;
      return b >= 0xa0 && b <= 0xbf;
    case kED:
      escape = kCont1;
      return b >= 0x80 && b <= 0x9f;
    case kF0:
      escape = kCont2;
      return b >= 0x90 && b <= 0xbf;
    case kF4:
      escape = kCont2;
      return b >= 0x80 && b <= 0x8f;
    case kBackslash:
      if (b == 'u') {
        escape = kHex4;
        return true;
      }
      escape = kPlain;
      return b == '"' || b == '\\' || b == '/' || b == 'b' || b == 'f' || b == 'n' || b == 'r' || b == 't';
    case kHex4:
      escape = b == 'd' || b == 'D' ? kHexD : kHex3;
      return IsHex(b);
    case kHexD:  // 0-7: below the surrogates; 8-B: a high surrogate; C-F: a low one with no high before it
      escape = b <= '7' ? kHex2 : kHigh2;
      return (b >= '0' && b <= '9') || (b >= 'a' && b <= 'b') || (b >= 'A' && b <= 'B');
    case kHex3:
    case kHex2:
    case kHigh2:
      ++escape;
      return IsHex(b);
    case kHex1:
      escape = kPlain;
      return IsHex(b);
    case kHigh1:
      escape = kLowBackslash;
      return IsHex(b);
    case kLowBackslash:
      escape = kLowU;
      return b == '\\';
    case kLowU:
      escape = kLowD;
      return b == 'u';
    case kLowD:
      escape = kLowC;
      return b == 'd' || b == 'D';
    case kLowC:
      escape = kHex2;
      return (b >= 'c' && b <= 'f') || (b >= 'C' && b <= 'F');
    default:
      return false;
  }
}

// A byte in a number; `ends` is set when the byte is not the number's but may follow it.
bool NumberByte(uint8_t& sub, uint8_t b, bool* ends) {
  *ends = false;
  const bool digit = IsDigit(b);
  switch (sub) {
    case kMinus:
      sub = b == '0' ? kZero : kInteger;
      return digit;
    case kZero:
    case kInteger:
      if (digit && sub == kInteger) return true;
      if (b == '.') {
        sub = kPoint;
        return true;
      }
      break;
    case kPoint:
      sub = kFraction;
      return digit;
    case kFraction:
      if (digit) return true;
      break;
    case kExponent:
      if (b == '+' || b == '-') {
        sub = kExpSign;
        return true;
      }
      sub = kExpDigits;
      return digit;
    case kExpSign:
      sub = kExpDigits;
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
    sub = kExponent;
    return true;
  }
  *ends = true;
  return true;
}

// Objects, maps and object unions: after '{', after ',', inside a key, before ':', before a value, after a value.
// An object's count holds the index of its next property (low 16 bits) and the bytes of the key matched (high 16
// bits), its bits the properties whose key still matches. An object union reads its first key so, every first key
// a candidate, and its frame becomes the chosen object's at that key's end or, for a shared key, its value's.
enum ObjectPhase : uint8_t { kFirstKey = 1, kNextKey, kInKey, kBeforeColon, kBeforeValue, kAfterMember };
// Arrays: after '[', after ',', after an item; count holds the items begun.
enum ArrayPhase : uint8_t { kFirstItem = 1, kNextItem, kAfterItem };
// Strings, numbers and literals: after their first byte.
constexpr uint8_t kInside = 1;
// Integers: after '-', after a leading 0, after a digit 1-9 and more digits; count holds the digits, bits the
// magnitude, sub 1 when negative.
enum IntegerPhase : uint8_t { kIntMinus = 1, kIntZero, kIntDigits };

uint32_t NextProperty(const GrammarFrame& f) { return f.count & 0xffff; }
uint32_t KeyMatched(const GrammarFrame& f) { return f.count >> 16; }

// Whether a property at or after `from` must still come.
bool RequiredFrom(const GrammarNode& n, size_t from) {
  for (size_t i = from; i < n.properties.size(); ++i) {
    if (n.properties[i].required) return true;
  }
  return false;
}

// The properties whose key may begin at `from`: the optional ones up to the next required one, and it.
uint64_t KeyCandidates(const GrammarNode& n, size_t from) {
  uint64_t mask = 0;
  for (size_t i = from; i < n.properties.size(); ++i) {
    mask |= uint64_t{1} << i;
    if (n.properties[i].required) break;
  }
  return mask;
}

// Every property's key: an object union's first keys, one of which begins its value.
uint64_t EveryKey(const GrammarNode& n) {
  return n.properties.size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << n.properties.size()) - 1;
}

// Whether an integer whose sign is `negative` and whose digits so far read `magnitude` (`digits` of them) can
// still become one in [n.minimum, n.maximum] by more digits (none: itself), within kMaxIntegerDigits.
bool IntegerReachable(const GrammarNode& n, bool negative, int64_t magnitude, int digits) {
  const int extra = magnitude == 0 ? 0 : GrammarNode::kMaxIntegerDigits - digits;  // a leading 0 ends the number
  __int128 scale = 1;
  for (int m = 0; m <= extra; ++m, scale *= 10) {
    const __int128 lo = magnitude * scale;
    const __int128 hi = lo + scale - 1;
    const __int128 low = negative ? -hi : lo;
    const __int128 high = negative ? -lo : hi;
    if (high >= n.minimum && low <= n.maximum) return true;
  }
  return false;
}

bool IntegerInRange(const GrammarNode& n, const GrammarFrame& f) {
  const int64_t v = f.sub != 0 ? -static_cast<int64_t>(f.bits) : static_cast<int64_t>(f.bits);
  return v >= n.minimum && v <= n.maximum;
}

// Bounded numbers: the phase is the sign (after the first byte), sub the JsonNumber step (kMinus: no digit yet),
// bits every digit written as one integer, count the digits before the point (low 8 bits) and after it (next 8).
enum DecimalPhase : uint8_t { kDecimalPositive = 1, kDecimalNegative };

// A bounded number's text so far.
struct DecimalPrefix {
  bool negative = false;
  uint64_t digits = 0;  // all of them, as one integer
  int whole = 0;        // digits before the point
  int fraction = 0;     // digits after it
  bool point = false;
};

DecimalPrefix PrefixOf(const GrammarFrame& f) {
  return DecimalPrefix{.negative = f.phase == kDecimalNegative,
                       .digits = f.bits,
                       .whole = static_cast<int>(f.count & 0xff),
                       .fraction = static_cast<int>((f.count >> 8) & 0xff),
                       .point = f.sub == kPoint || f.sub == kFraction};
}

// Whether the number written so far (`p`, at least one digit) can still end within n's bounds, with more digits
// (at most kMaxNumberDigits in all) or none. Its values form, for each count of whole digits still to come, an
// interval of multiples of the unit its last fraction digit would have; one must fall within the bounds.
bool DecimalReachable(const GrammarNode& n, const DecimalPrefix& p) {
  constexpr int kScale = GrammarNode::kNumberScale;
  const int left = GrammarNode::kMaxNumberDigits - p.whole - p.fraction;
  if (left < 0 || (p.point && p.fraction == 0 && left == 0)) return false;
  // Whether a multiple of `unit` in [a, b] (magnitudes, in units of 10^-18) lies within the bounds.
  auto meets = [&](__int128 a, __int128 b, __int128 unit) {
    const __int128 lo = std::max(p.negative ? -b : a, n.number_minimum);
    const __int128 hi = std::min(p.negative ? -a : b, n.number_maximum);
    if (lo > hi) return false;
    __int128 first = lo / unit * unit;  // rounded toward zero
    if (first < lo) first += unit;
    return first <= hi;
  };
  const auto digits = static_cast<__int128>(p.digits);
  if (!p.point && p.digits != 0) {  // 1-9 and more: k more whole digits, then up to left - k fraction digits
    for (int k = 0; k <= left; ++k) {
      const __int128 unit = Pow10(kScale - (left - k));
      const __int128 start = digits * Pow10(k) * Pow10(kScale);
      if (meets(start, start + Pow10(k) * Pow10(kScale) - unit, unit)) return true;
    }
    return false;
  }
  // A leading 0, or after the point: only fraction digits to come.
  const __int128 unit = Pow10(kScale - p.fraction - left);
  const __int128 start = digits * Pow10(kScale - p.fraction);
  return meets(start, start + Pow10(kScale - p.fraction) - unit, unit);
}

bool DecimalInRange(const GrammarNode& n, const DecimalPrefix& p) {
  const __int128 magnitude = static_cast<__int128>(p.digits) * Pow10(GrammarNode::kNumberScale - p.fraction);
  const __int128 v = p.negative ? -magnitude : magnitude;
  return v >= n.number_minimum && v <= n.number_maximum;
}

// The byte a JSON short escape (after its backslash) stands for, or -1 for none (\u is not one).
int ShortEscape(uint8_t b) {
  switch (b) {
    case '"':
    case '\\':
    case '/':
      return b;
    case 'b':
      return '\b';
    case 'f':
      return '\f';
    case 'n':
      return '\n';
    case 'r':
      return '\r';
    case 't':
      return '\t';
    default:
      return -1;
  }
}

bool DecimalCanEnd(uint8_t sub) { return sub == kZero || sub == kInteger || sub == kFraction; }

// Whether a bounded number whose sign is `negative` can go on to a value within bounds from its first digit.
bool DecimalCanBeginWith(const GrammarNode& n, bool negative, uint8_t b) {
  return IsDigit(b) &&
         DecimalReachable(n, DecimalPrefix{.negative = negative, .digits = static_cast<uint64_t>(b - '0'), .whole = 1});
}

}  // namespace

enum class StructuredGrammar::Step : uint8_t {
  kTaken,    // the byte is the frame's; the frame stays open
  kDone,     // the byte is the frame's last: the frame closes
  kEnded,    // the frame's value ended before the byte: the frame closes, and its parent reads the byte
  kRefused,  // the byte cannot come next
};

StructuredGrammar::StructuredGrammar(GrammarProgram program) : program_(std::move(program)) {
  ODMOE_CHECK(!program_.nodes.empty() && program_.nodes.size() <= GrammarProgram::kMaxNodes);
}

GrammarState StructuredGrammar::Start() const {
  GrammarState s;
  s.depth = 1;
  s.frames[0] = GrammarFrame{.node = static_cast<uint16_t>(program_.root)};
  return s;
}

bool StructuredGrammar::Complete(const GrammarState& s) const {
  return !s.dead && (s.depth == 0 || (s.depth == 1 && CanEnd(s.frames[0])));
}

bool StructuredGrammar::CanEnd(const GrammarFrame& f) const {
  const GrammarNode& n = program_.nodes[f.node];
  switch (n.kind) {
    case Kind::kJson:
      return f.phase == kNumber && JsonDepth(f) == 0 && NumberCanEnd(f.sub);
    case Kind::kNumber:
      return f.phase == kInside && NumberCanEnd(f.sub);
    case Kind::kInteger:
      return (f.phase == kIntZero || f.phase == kIntDigits) && IntegerInRange(n, f);
    case Kind::kBoundedNumber:
      return f.phase != kStart && DecimalCanEnd(f.sub) && DecimalInRange(n, PrefixOf(f));
    case Kind::kText:
      return n.pattern.accepting[f.phase == kStart ? n.pattern.start : static_cast<uint16_t>(f.bits)] != 0;
    case Kind::kLiterals: {
      const uint32_t first = f.count & 0xffff;
      const uint32_t last = f.count >> 16;
      return f.phase == kInside && first < last && n.literals[first].size() == f.bits;
    }
    default:
      return false;
  }
}

bool StructuredGrammar::Advance(GrammarState& s, uint8_t b) const {
  if (s.dead) return false;
  if (!IsJsonSpace(b)) s.spaces = 0;  // inside a string or literal it is 0 already
  for (;;) {
    if (s.depth == 0) return false;  // the answer is whole
    switch (Take(s, b)) {
      case Step::kTaken:
        return true;
      case Step::kDone:
        Pop(s);
        return true;
      case Step::kEnded:
        Pop(s);
        break;
      case Step::kRefused:
        return false;
    }
  }
}

void StructuredGrammar::Pop(GrammarState& s) const {
  const GrammarFrame child = s.frames[s.depth - 1];
  s.frames[--s.depth] = GrammarFrame{};
  if (s.depth == 0) return;
  GrammarFrame& parent = s.frames[s.depth - 1];
  switch (program_.nodes[parent.node].kind) {
    case Kind::kObjectUnion: {
      // The shared first key's value picks the object (the literal that ended is the first of its frame's range);
      // the frame goes on as that object's, after its first property.
      const GrammarNode& value = program_.nodes[program_.nodes[parent.node].properties[NextProperty(parent)].node];
      parent.node = static_cast<uint16_t>(value.literal_objects[child.count & 0xffff]);
      parent.count = 1;
      parent.phase = kAfterMember;
      break;
    }
    case Kind::kObject:
      parent.count = NextProperty(parent) + 1;
      parent.phase = kAfterMember;
      break;
    case Kind::kMap:
      parent.phase = kAfterMember;
      break;
    case Kind::kArray:
      parent.phase = kAfterItem;
      // A uniqueItems array's item is a kLiterals frame: the literal that ended is the first of its range.
      if (program_.nodes[parent.node].unique_items) parent.bits |= uint64_t{1} << (child.count & 0xffff);
      break;
    default:
      ODMOE_CHECK(false);  // only containers hold a frame above them
  }
}

StructuredGrammar::Step StructuredGrammar::Enter(GrammarState& s, int32_t node, uint8_t b) const {
  if (s.depth + program_.nodes[node].min_depth > kMaxGrammarDepth) return Step::kRefused;
  s.frames[s.depth++] = GrammarFrame{.node = static_cast<uint16_t>(node)};
  return Take(s, b);
}

StructuredGrammar::Step StructuredGrammar::Take(GrammarState& s, uint8_t b) const {
  GrammarFrame& f = s.frames[s.depth - 1];
  auto taken = [](bool ok) { return ok ? Step::kTaken : Step::kRefused; };
  auto space = [&] { return taken(program_.whitespace && Whitespace(s, b)); };
  if (f.phase == kStart) {
    if (s.depth == 1 && program_.whitespace && IsJsonSpace(b)) return space();
    if (program_.nodes[f.node].kind == Kind::kAnyOf) {
      const int32_t alternative = program_.nodes[f.node].by_first_byte[b];
      if (alternative < 0 || s.depth - 1 + program_.nodes[alternative].min_depth > kMaxGrammarDepth) {
        return Step::kRefused;
      }
      f.node = static_cast<uint16_t>(alternative);
    }
  }
  const GrammarNode& n = program_.nodes[f.node];
  switch (n.kind) {
    case Kind::kJson: {
      bool ends = false;
      bool closed = false;
      bool starts_char = false;
      switch (f.phase) {
        case kStart:
          if ((n.json == GrammarNode::JsonValues::kObjects && b != '{') ||
              (n.json == GrammarNode::JsonValues::kArrays && b != '[')) {
            return Step::kRefused;
          }
          return taken(StartValue(f, b));
        case kKeyString:
        case kValueString:
          if (!StringByte(f.sub, b, &closed, &starts_char)) return Step::kRefused;
          if (closed && f.phase == kKeyString) {
            f.phase = kColon;
          } else if (closed) {
            ValueDone(f);
          }
          return f.phase == kJsonDone ? Step::kDone : Step::kTaken;
        case kLiteral: {
          const char* literal = kLiterals[JsonLiteral(f)];
          if (b != static_cast<uint8_t>(literal[f.sub])) return Step::kRefused;
          if (literal[++f.sub] == '\0') ValueDone(f);
          return f.phase == kJsonDone ? Step::kDone : Step::kTaken;
        }
        case kNumber:
          if (!NumberByte(f.sub, b, &ends)) return Step::kRefused;
          if (!ends) return Step::kTaken;
          if (JsonDepth(f) == 0) return Step::kEnded;
          ValueDone(f);  // `b` comes after the number, in its container
          break;
        default:
          break;
      }
      if (IsJsonSpace(b)) return space();
      switch (f.phase) {
        case kObjectFirst:
        case kObjectKey:
          if (b == '"') {
            f.phase = kKeyString;
            f.sub = kPlain;
            return Step::kTaken;
          }
          if (f.phase != kObjectFirst || b != '}' || !Close(f, b)) return Step::kRefused;
          break;
        case kColon:
          f.phase = kValue;
          return taken(b == ':');
        case kValue:
          return taken(StartValue(f, b));
        case kArrayFirst:
          if (b != ']') return taken(StartValue(f, b));
          if (!Close(f, b)) return Step::kRefused;
          break;
        case kAfterValue:
          if (b == ',') {
            f.phase = InObject(f) ? kObjectKey : kValue;
            return Step::kTaken;
          }
          if ((b != '}' && b != ']') || !Close(f, b)) return Step::kRefused;
          break;
        default:
          return Step::kRefused;
      }
      return f.phase == kJsonDone ? Step::kDone : Step::kTaken;
    }

    case Kind::kObject:
    case Kind::kMap:
    case Kind::kObjectUnion: {
      const bool map = n.kind == Kind::kMap;
      const bool union_of_objects = n.kind == Kind::kObjectUnion;
      if (f.phase == kStart) {
        f.phase = kFirstKey;
        return taken(b == '{');
      }
      if (f.phase == kInKey) {
        if (map) {
          bool closed = false;
          bool starts_char = false;
          if (!StringByte(f.sub, b, &closed, &starts_char)) return Step::kRefused;
          if (closed) f.phase = kBeforeColon;
          return Step::kTaken;
        }
        const uint32_t at = KeyMatched(f);
        uint64_t still = 0;
        int32_t whole = -1;
        for (uint64_t m = f.bits; m != 0; m &= m - 1) {
          const int i = __builtin_ctzll(m);
          const std::string& key = n.properties[static_cast<size_t>(i)].key;
          if (key.size() <= at || static_cast<uint8_t>(key[at]) != b) continue;
          still |= uint64_t{1} << i;
          if (key.size() == at + 1) whole = i;  // a key ends at its unescaped closing quote: no other goes on
        }
        if (still == 0) return Step::kRefused;
        f.bits = still;
        f.count = NextProperty(f) | ((at + 1) << 16);
        if (whole >= 0) {
          f.bits = 0;
          f.count = static_cast<uint32_t>(whole);
          f.phase = kBeforeColon;
          if (union_of_objects && n.alternatives[static_cast<size_t>(whole)] >= 0) {
            f.node = static_cast<uint16_t>(n.alternatives[static_cast<size_t>(whole)]);  // its first property
            f.count = 0;
          }
        }
        return Step::kTaken;
      }
      if (IsJsonSpace(b)) return space();
      const size_t next = NextProperty(f);
      switch (f.phase) {
        case kFirstKey:
        case kNextKey:
          if (b == '"' && (map || next < n.properties.size())) {
            f.phase = kInKey;
            f.sub = kPlain;
            if (!map) {
              f.bits = union_of_objects ? EveryKey(n) : KeyCandidates(n, next);
              f.count = static_cast<uint32_t>(next) | (1u << 16);
            }
            return Step::kTaken;
          }
          if (f.phase == kFirstKey && b == '}' && (map || !RequiredFrom(n, next))) return Step::kDone;
          return Step::kRefused;
        case kBeforeColon:
          f.phase = kBeforeValue;
          return taken(b == ':');
        case kBeforeValue:
          return Enter(s, map ? n.item : n.properties[next].node, b);
        case kAfterMember:
          if (b == ',' && (map || next < n.properties.size())) {
            f.phase = kNextKey;
            return Step::kTaken;
          }
          if (b == '}' && (map || !RequiredFrom(n, next))) return Step::kDone;
          return Step::kRefused;
        default:
          return Step::kRefused;
      }
    }

    case Kind::kArray:
      if (f.phase == kStart) {
        f.phase = kFirstItem;
        return taken(b == '[');
      }
      if (IsJsonSpace(b)) return space();
      switch (f.phase) {
        case kFirstItem:
          if (b == ']') return n.min_count == 0 ? Step::kDone : Step::kRefused;
          [[fallthrough]];
        case kNextItem: {
          if (f.count >= n.max_count) return Step::kRefused;
          const int32_t item = n.ItemAt(f.count);
          ++f.count;
          return Enter(s, item, b);
        }
        case kAfterItem:
          // Another item only where one can follow and be finished (a tuple's next may nest deeper).
          if (b == ',' && f.count < n.max_count &&
              s.depth + program_.nodes[n.ItemAt(f.count)].min_depth <= kMaxGrammarDepth) {
            f.phase = kNextItem;
            return Step::kTaken;
          }
          return b == ']' && f.count >= n.min_count ? Step::kDone : Step::kRefused;
        default:
          return Step::kRefused;
      }

    case Kind::kString: {
      if (f.phase == kStart) {
        f.phase = kInside;
        f.sub = kPlain;
        return taken(b == '"');
      }
      bool closed = false;
      bool starts_char = false;
      if (!StringByte(f.sub, b, &closed, &starts_char)) return Step::kRefused;
      const bool counted = n.min_count > 0 || n.max_count != GrammarNode::kUnbounded;
      if (closed) return f.count >= n.min_count ? Step::kDone : Step::kRefused;
      if (starts_char && counted) {
        if (f.count >= n.max_count) return Step::kRefused;
        ++f.count;
      }
      return Step::kTaken;
    }

    case Kind::kPattern: {
      const PatternDfa& dfa = n.pattern;
      if (f.phase == kStart) {
        f.phase = kInside;
        f.bits = dfa.start;
        return taken(b == '"');
      }
      const auto state = static_cast<uint16_t>(f.bits);
      auto move = [&](uint8_t decoded) {
        const uint16_t to = dfa.Step(state, decoded);
        f.bits = to;
        return taken(to != PatternDfa::kNone);
      };
      if (f.sub == kBackslash) {
        f.sub = kPlain;
        const int decoded = ShortEscape(b);
        return decoded < 0 ? Step::kRefused : move(static_cast<uint8_t>(decoded));
      }
      if (b == '"') return dfa.accepting[state] != 0 ? Step::kDone : Step::kRefused;
      if (b == '\\') {
        f.sub = kBackslash;
        for (const char e : std::string_view("\"\\/bfnrt")) {
          if (dfa.Step(state, static_cast<uint8_t>(ShortEscape(static_cast<uint8_t>(e)))) != PatternDfa::kNone) {
            return Step::kTaken;
          }
        }
        return Step::kRefused;
      }
      return b < 0x20 ? Step::kRefused : move(b);
    }

    case Kind::kText: {
      // The whole answer: every byte a step of the DFA, none a quote or escape.
      const uint16_t from = f.phase == kStart ? n.pattern.start : static_cast<uint16_t>(f.bits);
      const uint16_t to = n.pattern.Step(from, b);
      f.phase = kInside;
      f.bits = to;
      return taken(to != PatternDfa::kNone);
    }

    case Kind::kNumber:
      if (f.phase == kStart) {
        f.phase = kInside;
        if (b == '-') {
          f.sub = kMinus;
          return Step::kTaken;
        }
        f.sub = b == '0' ? kZero : kInteger;
        return taken(IsDigit(b));
      } else {
        bool ends = false;
        if (!NumberByte(f.sub, b, &ends)) return Step::kRefused;
        return ends ? Step::kEnded : Step::kTaken;
      }

    case Kind::kInteger: {
      const bool digit = IsDigit(b);
      const int64_t d = b - '0';
      switch (f.phase) {
        case kStart:
          if (b == '-') {
            for (int64_t first = 0; first <= 9; ++first) {
              if (IntegerReachable(n, true, first, 1)) {
                f.phase = kIntMinus;
                f.sub = 1;
                return Step::kTaken;
              }
            }
            return Step::kRefused;
          }
          [[fallthrough]];
        case kIntMinus:
          if (!digit || !IntegerReachable(n, f.sub != 0, d, 1)) return Step::kRefused;
          f.phase = d == 0 ? kIntZero : kIntDigits;
          f.bits = static_cast<uint64_t>(d);
          f.count = 1;
          return Step::kTaken;
        case kIntDigits:
          if (digit) {
            const int digits = static_cast<int>(f.count) + 1;
            if (digits > GrammarNode::kMaxIntegerDigits) return Step::kRefused;
            const int64_t grown = static_cast<int64_t>(f.bits) * 10 + d;
            if (!IntegerReachable(n, f.sub != 0, grown, digits)) return Step::kRefused;
            f.bits = static_cast<uint64_t>(grown);
            f.count = static_cast<uint32_t>(digits);
            return Step::kTaken;
          }
          [[fallthrough]];
        case kIntZero:
          return !digit && IntegerInRange(n, f) ? Step::kEnded : Step::kRefused;
        default:
          return Step::kRefused;
      }
    }

    case Kind::kBoundedNumber: {
      if (f.phase == kStart) {
        f.phase = b == '-' ? kDecimalNegative : kDecimalPositive;
        f.sub = kMinus;  // no digit yet
        if (b == '-') return taken(BoundedNumberCanBegin(n, b));
      }
      DecimalPrefix p = PrefixOf(f);
      const bool digit = IsDigit(b);
      if (digit && f.sub != kZero) {
        p.digits = p.digits * 10 + static_cast<uint64_t>(b - '0');
        (p.point ? p.fraction : p.whole) += 1;
        if (!DecimalReachable(n, p)) return Step::kRefused;
        if (p.point) {
          f.sub = kFraction;
        } else if (f.sub == kMinus) {
          f.sub = b == '0' ? kZero : kInteger;
        }
        f.bits = p.digits;
        f.count = static_cast<uint32_t>(p.whole) | (static_cast<uint32_t>(p.fraction) << 8);
        return Step::kTaken;
      }
      if (b == '.' && (f.sub == kZero || f.sub == kInteger)) {
        p.point = true;
        f.sub = kPoint;
        return taken(DecimalReachable(n, p));
      }
      return !digit && DecimalCanEnd(f.sub) && DecimalInRange(n, p) ? Step::kEnded : Step::kRefused;
    }

    case Kind::kLiterals: {
      // The literals in [first, last) share their first `bits` bytes and are sorted, so those whose next byte is
      // `b` stand together (a literal that ends here sorts first, as -1).
      const size_t at = static_cast<size_t>(f.bits);
      const uint32_t first = f.phase == kStart ? 0 : f.count & 0xffff;
      const uint32_t last = f.phase == kStart ? static_cast<uint32_t>(n.literals.size()) : f.count >> 16;
      auto next = [at](const std::string& c) {
        return c.size() > at ? static_cast<int>(static_cast<uint8_t>(c[at])) : -1;
      };
      const auto begin = n.literals.begin() + first;
      const auto end = n.literals.begin() + last;
      const auto lo = std::partition_point(begin, end, [&](const std::string& c) { return next(c) < b; });
      const auto hi = std::partition_point(lo, end, [&](const std::string& c) { return next(c) <= b; });
      // An item of a uniqueItems array: the values its earlier items took are out.
      const GrammarFrame* parent = s.depth >= 2 ? &s.frames[s.depth - 2] : nullptr;
      const uint64_t taken_values = parent != nullptr && program_.nodes[parent->node].unique_items ? parent->bits : 0;
      auto unused = [&](size_t from, size_t to) {  // whether a value in [from, to) is still free (to <= 64 then)
        if (taken_values == 0) return true;
        const uint64_t range = (to - from >= 64 ? ~uint64_t{0} : ((uint64_t{1} << (to - from)) - 1)) << from;
        return (range & ~taken_values) != 0;
      };
      if (lo == hi) {
        return f.phase != kStart && n.literals[first].size() == at && unused(first, first + 1) ? Step::kEnded
                                                                                               : Step::kRefused;
      }
      if (!unused(static_cast<size_t>(lo - n.literals.begin()), static_cast<size_t>(hi - n.literals.begin()))) {
        return Step::kRefused;
      }
      f.phase = kInside;
      f.count = static_cast<uint32_t>(lo - n.literals.begin()) | (static_cast<uint32_t>(hi - n.literals.begin()) << 16);
      f.bits = at + 1;
      return hi - lo == 1 && lo->size() == at + 1 ? Step::kDone : Step::kTaken;
    }

    case Kind::kAnyOf:
      break;  // resolved above, before the first byte
  }
  return Step::kRefused;
}

bool BoundedNumberCanBegin(const GrammarNode& n, uint8_t b) {
  if (b != '-') return DecimalCanBeginWith(n, false, b);
  for (uint8_t d = '0'; d <= '9'; ++d) {
    if (DecimalCanBeginWith(n, true, d)) return true;
  }
  return false;
}

JsonObjectGrammar::JsonObjectGrammar() : StructuredGrammar(GrammarProgram::AnyJsonObject()) {}

ChoiceGrammar::ChoiceGrammar(std::vector<std::string> choices)
    : StructuredGrammar(GrammarProgram::Literals(std::move(choices))) {}

GrammarProgram GrammarProgram::AnyJsonObject() {
  GrammarProgram p;
  p.nodes.push_back(GrammarNode{.kind = GrammarNode::Kind::kJson, .json = GrammarNode::JsonValues::kObjects});
  return p;
}

GrammarProgram GrammarProgram::Literals(std::vector<std::string> texts) {
  ODMOE_CHECK(!texts.empty());
  std::sort(texts.begin(), texts.end());
  texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
  GrammarProgram p;
  p.nodes.push_back(GrammarNode{.kind = GrammarNode::Kind::kLiterals, .literals = std::move(texts)});
  p.whitespace = false;
  return p;
}

GrammarProgram GrammarProgram::Text(PatternDfa regex) {
  GrammarProgram p;
  p.nodes.push_back(GrammarNode{.kind = GrammarNode::Kind::kText, .pattern = std::move(regex)});
  p.whitespace = false;
  return p;
}

namespace {

// About the bytes a compiled program holds: its nodes, their DFAs and literals.
size_t ProgramBytes(const GrammarProgram& program) {
  size_t bytes = sizeof(program) + program.nodes.size() * sizeof(GrammarNode);
  for (const GrammarNode& n : program.nodes) {
    bytes += n.pattern.next.size() * sizeof(uint16_t) + n.pattern.accepting.size() + n.path.size();
    for (const std::string& l : n.literals) bytes += sizeof(l) + l.size();
    for (const GrammarNode::Property& p : n.properties) bytes += sizeof(p) + p.key.size();
    bytes += (n.alternatives.size() + n.literal_objects.size() + n.prefix_items.size()) * sizeof(int32_t);
  }
  return bytes;
}

// What a compiled grammar is kept by: its kind, text and, for a schema, whitespace (a regex has its own).
std::string CacheKey(const OutputConstraint& c) {
  if (c.kind == OutputConstraint::Kind::kRegex) return StrCat("regex:", c.regex);
  return StrCat(c.compact ? "compact schema:" : "schema:", c.schema);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const ByteGrammar>> CompileGrammar(const OutputConstraint& constraint) {
  GrammarProgram program;
  switch (constraint.kind) {
    case OutputConstraint::Kind::kNone:
      return nullptr;
    case OutputConstraint::Kind::kJsonObject:
      program = GrammarProgram::AnyJsonObject();
      program.whitespace = !constraint.compact;
      return std::make_shared<StructuredGrammar>(std::move(program));
    case OutputConstraint::Kind::kChoice:
      return std::make_shared<ChoiceGrammar>(constraint.choices);
    case OutputConstraint::Kind::kJsonSchema:
    case OutputConstraint::Kind::kRegex:
      break;
  }
  GrammarCache& cache = GrammarCache::Shared();
  const std::string key = CacheKey(constraint);
  if (std::shared_ptr<const ByteGrammar> found = cache.Find(key)) return found;
  if (constraint.kind == OutputConstraint::Kind::kRegex) {
    ODMOE_ASSIGN_OR_RETURN(PatternDfa dfa, CompilePattern(constraint.regex, PatternScope::kWholeText));
    program = GrammarProgram::Text(std::move(dfa));
  } else {
    ODMOE_ASSIGN_OR_RETURN(program, CompileJsonSchema(constraint.schema));
    program.whitespace = !constraint.compact;
  }
  const size_t bytes = ProgramBytes(program);
  auto grammar = std::make_shared<const StructuredGrammar>(std::move(program));
  cache.Insert(key, grammar, bytes);
  return grammar;
}

std::shared_ptr<const ByteGrammar> MakeGrammar(const OutputConstraint& constraint) {
  absl::StatusOr<std::shared_ptr<const ByteGrammar>> grammar = CompileGrammar(constraint);
  ODMOE_CHECK(grammar.ok());  // Validate compiled it
  return *std::move(grammar);
}

GrammarCache& GrammarCache::Shared() {
  static GrammarCache* const cache = new GrammarCache(kMaxEntries, kMaxBytes);
  return *cache;
}

std::shared_ptr<const ByteGrammar> GrammarCache::Find(const std::string& key) {
  absl::MutexLock lock(&mu_);
  const auto it = index_.find(key);
  if (it == index_.end()) {
    counts_.misses += 1;
    return nullptr;
  }
  counts_.hits += 1;
  entries_.splice(entries_.begin(), entries_, it->second);
  return it->second->grammar;
}

void GrammarCache::Insert(const std::string& key, std::shared_ptr<const ByteGrammar> grammar, size_t bytes) {
  if (bytes > max_bytes_ || max_entries_ == 0) return;
  absl::MutexLock lock(&mu_);
  if (const auto it = index_.find(key); it != index_.end()) {
    counts_.bytes -= it->second->bytes;
    entries_.erase(it->second);
    index_.erase(it);
  }
  while (!entries_.empty() && (entries_.size() >= max_entries_ || counts_.bytes + bytes > max_bytes_)) {
    counts_.bytes -= entries_.back().bytes;
    index_.erase(entries_.back().key);
    entries_.pop_back();
  }
  entries_.push_front(Entry{.key = key, .grammar = std::move(grammar), .bytes = bytes});
  index_.emplace(key, entries_.begin());
  counts_.bytes += bytes;
}

GrammarCache::Counts GrammarCache::counts() const {
  absl::MutexLock lock(&mu_);
  Counts c = counts_;
  c.entries = entries_.size();
  return c;
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
  offsets_.assign(1, 0);
  for (size_t i = 0; i < sorted_.size(); ++i) {
    const std::string& b = bytes_[sorted_[i]];
    if (i > 0) {
      const std::string& a = bytes_[sorted_[i - 1]];
      const auto diff = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
      shared_[i] = static_cast<uint32_t>(diff.first - a.begin());
    }
    sorted_bytes_ += b;
    offsets_.push_back(static_cast<uint32_t>(sorted_bytes_.size()));
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
    const std::string_view token(sorted_bytes_.data() + offsets_[i], offsets_[i + 1] - offsets_[i]);
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
