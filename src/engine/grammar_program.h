// A grammar program: the values a structured answer may take, as a graph of nodes that StructuredGrammar
// (src/engine/output_grammar.h) runs byte by byte. CompileJsonSchema (src/engine/json_schema.h) writes one from a
// JSON Schema; AnyJsonObject, Literals and Text write those of response_format json_object, guided_choice and
// guided_regex.
//
// Every node's values are told apart from the other alternatives of an anyOf by their first byte, objects among
// them by their first property (its key, or where several share the key, its value), and every choice inside a
// value (which property comes next, whether an array goes on) by the next byte, so the program is read with one
// frame per open value and no backtracking.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "src/engine/pattern_dfa.h"

namespace odmoe {

// The most strings a choice constraint (or a schema's enum) may list, and the most bytes of each.
inline constexpr size_t kMaxChoices = 256;
inline constexpr size_t kMaxChoiceBytes = 1024;
// The most values open at once in an answer (GrammarState's frames): a JSON Schema's objects and arrays nest at
// most this deep (an "any value" node's own JSON counts once, whatever its nesting up to kMaxJsonDepth).
inline constexpr int kMaxGrammarDepth = 24;

struct GrammarNode {
  enum class Kind : uint8_t {
    kJson,     // any JSON value `json` allows (RFC 8259)
    kObject,   // an object with `properties`, in their order; the optional ones may be left out
    kMap,      // an object with any keys, each value an `item`
    kArray,    // an array of min_count..max_count items: `prefix_items` first, then `item`s (none where -1)
    kString,   // a JSON string of min_count..max_count characters (code points; an escape is one)
    kPattern,  // a JSON string that `pattern` matches (its short escapes read as the bytes they stand for)
    kText,     // text that `pattern` (PatternScope::kWholeText) matches whole, unquoted: a whole answer only
    kInteger,  // a JSON integer in [minimum, maximum], without a fraction or exponent
    kNumber,   // any JSON number
    // A JSON number in [number_minimum, number_maximum], written without an exponent in at most
    // kMaxNumberDigits digits.
    kBoundedNumber,
    kLiterals,  // exactly one of `literals` (JSON texts, or a guided_choice's strings)
    kAnyOf,     // one of `alternatives`, told apart by the first byte (`by_first_byte`)
    // An object of one of several kObject nodes, each beginning with a required property: `properties[i]` is a
    // first key (required), `alternatives[i]` the object it begins, or -1 where several objects begin with it;
    // that key's node is then a kLiterals whose `literal_objects` name the object each of its values begins. Its
    // frame reads the first key (and value) and then becomes the chosen object's, as after its first property.
    kObjectUnion,
  };
  enum class JsonValues : uint8_t { kAny, kObjects, kArrays };
  struct Property {
    std::string key;  // as written in the answer: the name as a JSON string, quotes included
    int32_t node = -1;
    bool required = false;
  };
  static constexpr uint32_t kUnbounded = std::numeric_limits<uint32_t>::max();

  Kind kind = Kind::kJson;
  std::string path;  // where the node comes from (a JSON pointer into the schema), for messages
  JsonValues json = JsonValues::kAny;
  std::vector<Property> properties;  // kObject: at most kMaxProperties
  int32_t item = -1;                 // kMap, kArray (-1: no items past prefix_items)
  std::vector<int32_t> prefix_items;  // kArray: the items at the first positions (a tuple); at most kMaxProperties
  // kArray: no value twice (uniqueItems), its `item` then a kLiterals of at most kMaxUniqueLiterals values; its
  // frame's `bits` holds the values taken so far.
  bool unique_items = false;
  uint32_t min_count = 0;            // kArray: items; kString: characters
  uint32_t max_count = kUnbounded;
  int64_t minimum = -kMaxIntegerMagnitude;  // kInteger, inclusive
  int64_t maximum = kMaxIntegerMagnitude;
  // kBoundedNumber, in units of 10^-kNumberScale, inclusive (an exclusive bound is one unit in).
  __int128 number_minimum = 0;
  __int128 number_maximum = 0;
  PatternDfa pattern;                        // kPattern, kText
  std::vector<std::string> literals;         // kLiterals: sorted, each once, none empty
  std::vector<int32_t> alternatives;         // kAnyOf: none a kAnyOf itself; kObjectUnion: as said above
  std::vector<int32_t> literal_objects;      // kLiterals under a kObjectUnion's shared key: parallel to `literals`
  std::array<int32_t, 256> by_first_byte{};  // kAnyOf: the alternative a value starting with the byte is, or -1
  // The fewest values open at once that a whole value of this node needs, itself included (an anyOf: its
  // shallowest alternative's; an object union: its deepest object's, since its first property picks the object). A
  // value is begun only where it can be finished within kMaxGrammarDepth, so an answer never reaches a state with no
  // way to end.
  int32_t min_depth = 1;

  // An object's properties fit a 64-bit mask of the keys still matching, and a unique array's values one of those
  // taken.
  static constexpr size_t kMaxProperties = 64;
  static constexpr size_t kMaxUniqueLiterals = 64;

  // kArray: the item at `position` (0-based), or -1 where there is none.
  int32_t ItemAt(size_t position) const { return position < prefix_items.size() ? prefix_items[position] : item; }
  // Integers have at most 18 digits, so that every one fits an int64.
  static constexpr int kMaxIntegerDigits = 18;
  static constexpr int64_t kMaxIntegerMagnitude = 999'999'999'999'999'999;
  // A bounded number has at most 15 digits in all, so that two of them are two doubles (DBL_DIG): a bound that
  // excludes one value excludes it for a validator that reads both as doubles too. Its value in units of 10^-18
  // then fits an __int128 (below 10^33).
  static constexpr int kMaxNumberDigits = 15;
  static constexpr int kNumberScale = 18;
};

// 10^e as an __int128, for bounded numbers' arithmetic in units of 10^-kNumberScale. REQUIRES: 0 <= e <= 38.
inline __int128 Pow10(int e) {
  static constexpr auto kPowers = [] {
    std::array<__int128, 39> p{};
    p[0] = 1;
    for (size_t i = 1; i < p.size(); ++i) p[i] = p[i - 1] * 10;
    return p;
  }();
  return kPowers[static_cast<size_t>(e)];
}

// Whether a kBoundedNumber's value can begin with byte `b` and still end within its bounds. A node none of whose
// first bytes can is refused by the compiler.
bool BoundedNumberCanBegin(const GrammarNode& n, uint8_t b);

struct GrammarProgram {
  std::vector<GrammarNode> nodes;  // at most kMaxNodes
  int32_t root = 0;
  // JSON whitespace (as kMaxJsonIndent says) before the root value and between JSON's tokens; none for choices,
  // or for JSON asked to be compact.
  bool whitespace = true;

  static constexpr size_t kMaxNodes = 4096;

  // One JSON object of any content (response_format json_object).
  static GrammarProgram AnyJsonObject();
  // Exactly one of `texts` as bytes (guided_choice). REQUIRES: texts non-empty, none empty.
  static GrammarProgram Literals(std::vector<std::string> texts);
  // Text that `regex` matches whole (guided_regex). REQUIRES: regex compiled with PatternScope::kWholeText.
  static GrammarProgram Text(PatternDfa regex);
};

}  // namespace odmoe
