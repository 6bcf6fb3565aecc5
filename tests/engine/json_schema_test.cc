// JSON Schemas compiled into grammars: what each keyword lets through and what it refuses, the messages of the
// schemas refused, and random answers that python3-jsonschema (Debian's) reads as valid for their schema.
#include "src/engine/json_schema.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/engine/output_grammar.h"

namespace odmoe {
namespace {

std::shared_ptr<const StructuredGrammar> Grammar(std::string_view schema) {
  absl::StatusOr<GrammarProgram> program = CompileJsonSchema(schema);
  EXPECT_TRUE(program.ok()) << program.status() << "\n" << schema;
  if (!program.ok()) return nullptr;
  return std::make_shared<StructuredGrammar>(*std::move(program));
}

// "complete", "prefix" (taken, not whole) or "refused at N" (the byte at N refused).
std::string Read(const ByteGrammar& g, std::string_view text) {
  GrammarState s = g.Start();
  for (size_t i = 0; i < text.size(); ++i) {
    if (!g.Advance(s, static_cast<uint8_t>(text[i]))) return "refused at " + std::to_string(i);
  }
  return g.Complete(s) ? "complete" : "prefix";
}

std::string CompileError(std::string_view schema) {
  absl::StatusOr<GrammarProgram> program = CompileJsonSchema(schema);
  return program.ok() ? "compiled" : std::string(program.status().message());
}

TEST(JsonSchemaTest, PropertiesComeInTheirOrderAndTheRequiredOnesAlways) {
  auto g = Grammar(R"({"type": "object", "properties": {
      "name": {"type": "string"}, "nick": {"type": "string"}, "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age"]})");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(Read(*g, R"({"name": "Ann", "age": 30})"), "complete");
  EXPECT_EQ(Read(*g, R"({"name":"Ann","nick":"A","age":-3,"tags":["x", "y"]})"), "complete");
  EXPECT_EQ(Read(*g, "{\n  \"name\": \"Ann\",\n  \"age\": 30\n}"), "complete");
  EXPECT_EQ(Read(*g, R"( {"name": "Ann", "age": 30, "tags": []})"), "complete");
  EXPECT_EQ(Read(*g, R"({"name": "Ann")"), "prefix");
  EXPECT_EQ(Read(*g, R"({"name": "Ann"})"), "refused at 14");                        // age is required
  EXPECT_EQ(Read(*g, R"({"age": 30})"), "refused at 2");                             // name comes first
  EXPECT_EQ(Read(*g, R"({"name": "Ann", "tags": [], "age": 1})"), "refused at 17");  // past the required age
  EXPECT_EQ(Read(*g, R"({"name": "Ann", "age": 30, "x": 1})"), "refused at 28");     // not a property
  EXPECT_EQ(Read(*g, R"({"name": "Ann", "age": 3.5})"), "refused at 24");
  EXPECT_EQ(Read(*g, R"({"name": "Ann", "age": 30} )"), "refused at 26");  // nothing after the answer
  EXPECT_EQ(Read(*g, R"({"name": 5)"), "refused at 9");
  EXPECT_EQ(Read(*g, R"({"name": "Ann", "age": 1, "tags": [1]})"), "refused at 35");
  // Pydantic's extra='allow' (additionalProperties true) or a schema for the extra keys: the listed properties only,
  // as when it is left out.
  for (const char* extra : {"true", R"({"type": "string"})"}) {
    auto open = Grammar(StrCat(R"({"properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": )",
                               extra, "}"));
    ASSERT_NE(open, nullptr) << extra;
    EXPECT_EQ(Read(*open, R"({"a": 1})"), "complete");
    EXPECT_EQ(Read(*open, R"({"a": 1, "b": "x"})"), "refused at 7");
  }
}

TEST(JsonSchemaTest, IntegersKeepTheirBoundsDigitByDigit) {
  auto g = Grammar(R"({"type": "integer", "minimum": 10, "exclusiveMaximum": 50})");
  ASSERT_NE(g, nullptr);
  for (const char* ok : {"10", "49", "25", " 33"}) EXPECT_EQ(Read(*g, ok), "complete") << ok;
  EXPECT_EQ(Read(*g, "5"), "refused at 0");
  EXPECT_EQ(Read(*g, "1"), "prefix");         // 10..19 may follow
  EXPECT_EQ(Read(*g, "50"), "refused at 0");  // no number in bounds begins with 5
  EXPECT_EQ(Read(*g, "4"), "prefix");
  EXPECT_EQ(Read(*g, "100"), "refused at 2");
  EXPECT_EQ(Read(*g, "-1"), "refused at 0");
  EXPECT_EQ(Read(*g, "012"), "refused at 0");

  auto neg = Grammar(R"({"type": "integer", "minimum": -120, "maximum": -7})");
  ASSERT_NE(neg, nullptr);
  for (const char* ok : {"-7", "-99", "-120", "-8"}) EXPECT_EQ(Read(*neg, ok), "complete") << ok;
  EXPECT_EQ(Read(*neg, "-1"), "prefix");
  EXPECT_EQ(Read(*neg, "-121"), "refused at 3");
  EXPECT_EQ(Read(*neg, "-0"), "refused at 1");
  EXPECT_EQ(Read(*neg, "7"), "refused at 0");

  // Without bounds: at most 18 digits; -0 and 0 are both zero.
  auto any = Grammar(R"({"type": "integer"})");
  ASSERT_NE(any, nullptr);
  EXPECT_EQ(Read(*any, "-0"), "complete");
  EXPECT_EQ(Read(*any, std::string(18, '9')), "complete");
  EXPECT_EQ(Read(*any, std::string(19, '9')), "refused at 18");
  EXPECT_EQ(Read(*any, "1e3"), "refused at 1");
}

// Bounds on a number (Pydantic's confloat, PositiveFloat): such a number is written without an exponent in at most
// 15 digits, and kept within its bounds digit by digit, compared exactly as decimals.
TEST(JsonSchemaTest, NumbersKeepTheirBoundsDigitByDigit) {
  auto unit = Grammar(R"({"type": "number", "minimum": 0, "maximum": 1})");
  ASSERT_NE(unit, nullptr);
  for (const char* ok : {"0", "1", "0.5", "1.000", "0.999", "-0", "-0.0", "0.00000000000001"}) {
    EXPECT_EQ(Read(*unit, ok), "complete") << ok;
  }
  EXPECT_EQ(Read(*unit, "1.5"), "refused at 2");
  EXPECT_EQ(Read(*unit, "-0.5"), "refused at 3");
  EXPECT_EQ(Read(*unit, "2"), "refused at 0");
  EXPECT_EQ(Read(*unit, "10"), "refused at 1");
  EXPECT_EQ(Read(*unit, "0.5e1"), "refused at 3");               // no exponent
  EXPECT_EQ(Read(*unit, "0.000000000000001"), "refused at 16");  // a 16th digit
  EXPECT_EQ(Read(*unit, "01"), "refused at 1");

  auto positive = Grammar(R"({"type": "number", "exclusiveMinimum": 0})");
  ASSERT_NE(positive, nullptr);
  EXPECT_EQ(Read(*positive, "0"), "prefix");  // 0 is not above 0, but 0.1 is
  EXPECT_EQ(Read(*positive, "0.1"), "complete");
  EXPECT_EQ(Read(*positive, "123456789012345"), "complete");
  EXPECT_EQ(Read(*positive, "-"), "refused at 0");
  EXPECT_EQ(Read(*positive, "0.00000000000000"), "refused at 15");  // 15 digits, all 0: nothing left above 0

  auto below = Grammar(R"({"type": "number", "minimum": -2.5, "exclusiveMaximum": -1})");
  ASSERT_NE(below, nullptr);
  EXPECT_EQ(Read(*below, "-2.5"), "complete");
  EXPECT_EQ(Read(*below, "-1.0001"), "complete");
  EXPECT_EQ(Read(*below, "-1"), "prefix");
  EXPECT_EQ(Read(*below, "-2.51"), "refused at 4");
  EXPECT_EQ(Read(*below, "-3"), "refused at 1");
  EXPECT_EQ(Read(*below, "0"), "refused at 0");

  auto point = Grammar(R"({"type": "number", "minimum": 0.1, "maximum": 0.1})");
  ASSERT_NE(point, nullptr);
  EXPECT_EQ(Read(*point, "0.10"), "complete");
  EXPECT_EQ(Read(*point, "0.2"), "refused at 2");
  // Draft 4's boolean exclusive flags, and an integer beside a number that holds it.
  auto draft4 = Grammar(R"({"type": "number", "minimum": 0, "exclusiveMinimum": true, "maximum": 1e3})");
  ASSERT_NE(draft4, nullptr);
  EXPECT_EQ(Read(*draft4, "0"), "prefix");
  EXPECT_EQ(Read(*draft4, "1000"), "complete");
  EXPECT_EQ(Read(*draft4, "1000.1"), "refused at 5");
  auto either = Grammar(R"({"type": ["integer", "number"], "minimum": 0, "maximum": 10})");
  ASSERT_NE(either, nullptr);
  EXPECT_EQ(Read(*either, "5.5"), "complete");
  EXPECT_EQ(Read(*either, "10"), "complete");
  EXPECT_EQ(Read(*either, "11"), "refused at 1");

  EXPECT_EQ(CompileError(R"({"type": "number", "minimum": 1e20})"),
            "at '/': no number of at most 15 digits, written without an exponent, meets its bounds");
  EXPECT_EQ(CompileError(R"({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.0000000000000002})"),
            "at '/': no number of at most 15 digits, written without an exponent, meets its bounds");
}

// Random bounds and random digit-by-digit walks: a walk never reaches a state it cannot finish, and every number it
// ends with, read as a double (as validators read it), meets the bounds as doubles.
TEST(JsonSchemaTest, BoundedNumbersNeverStickAndEndWithinTheirBounds) {
  const std::vector<std::string> values = {"-1e3", "-273.15", "-2.5",  "-1",         "-0.001",
                                           "0",    "1e-9",    "0.1",   "0.3",        "0.30000000000000004",
                                           "1",    "1.5",     "99.99", "123456.789", "1e14"};
  std::mt19937 rng(5);
  int walks = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::string& a = values[rng() % values.size()];
    const std::string& b = values[rng() % values.size()];
    const bool exclusive_lo = rng() % 2 == 0, exclusive_hi = rng() % 2 == 0;
    const std::string schema = std::string(R"({"type": "number", ")") +
                               (exclusive_lo ? "exclusiveMinimum" : "minimum") + "\": " + a + ", \"" +
                               (exclusive_hi ? "exclusiveMaximum" : "maximum") + "\": " + b + "}";
    absl::StatusOr<GrammarProgram> program = CompileJsonSchema(schema);
    const double lo = std::stod(a), hi = std::stod(b);
    if (!program.ok()) {
      // Refused only where no number meets the bounds (or none of 15 digits does, between two close doubles).
      EXPECT_TRUE(lo > hi || (lo == hi && (exclusive_lo || exclusive_hi)) || b == "0.30000000000000004")
          << schema << ": " << program.status();
      continue;
    }
    const StructuredGrammar g(*std::move(program));
    for (int walk = 0; walk < 20; ++walk, ++walks) {
      GrammarState s = g.Start();
      std::string text;
      for (;;) {
        std::vector<uint8_t> next;
        for (const char c : std::string_view("-0123456789.")) {
          GrammarState t = s;
          if (g.Advance(t, static_cast<uint8_t>(c))) next.push_back(static_cast<uint8_t>(c));
        }
        if (g.Complete(s) && (next.empty() || rng() % 5 == 0)) break;
        ASSERT_FALSE(next.empty()) << schema << " stuck after '" << text << "'";
        const uint8_t c = next[rng() % next.size()];
        ASSERT_TRUE(g.Advance(s, c));
        text += static_cast<char>(c);
      }
      const double v = std::stod(text);
      EXPECT_TRUE(exclusive_lo ? v > lo : v >= lo) << schema << ": " << text;
      EXPECT_TRUE(exclusive_hi ? v < hi : v <= hi) << schema << ": " << text;
    }
  }
  EXPECT_GE(walks, 1000);
}

// Patterns (ECMA-262, as JSON Schema reads them: matched anywhere unless anchored), through a DFA over the string's
// bytes; a JSON escape feeds the byte it stands for.
TEST(JsonSchemaTest, StringsMatchTheirPattern) {
  auto phone = Grammar(R"({"type": "string", "pattern": "^\\d{3}-\\d{4}$"})");
  ASSERT_NE(phone, nullptr);
  EXPECT_EQ(Read(*phone, R"("555-1234")"), "complete");
  EXPECT_EQ(Read(*phone, R"("55-1234")"), "refused at 3");
  EXPECT_EQ(Read(*phone, R"("555-12345")"), "refused at 9");
  EXPECT_EQ(Read(*phone, R"("555-123")"), "refused at 8");
  auto anywhere = Grammar(R"({"pattern": "cat"})");
  ASSERT_NE(anywhere, nullptr);
  EXPECT_EQ(Read(*anywhere, R"("a cat!")"), "complete");
  EXPECT_EQ(Read(*anywhere, R"("dog)"), "prefix");
  EXPECT_EQ(Read(*anywhere, R"("")"), "refused at 1");
  auto words = Grammar(R"js({"type": "string", "pattern": "^(?:[A-Z][a-z]+ ?)+$|^é{2,3}$"})js");
  ASSERT_NE(words, nullptr);
  EXPECT_EQ(Read(*words, R"("Hello World")"), "complete");
  EXPECT_EQ(Read(*words, "\"\xc3\xa9\xc3\xa9\""), "complete");
  EXPECT_EQ(Read(*words, "\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"), "refused at 7");
  EXPECT_EQ(Read(*words, R"("hello")"), "refused at 1");
  EXPECT_EQ(Read(*words, R"("Hello  World")"), "refused at 7");
  // Characters a JSON string holds only escaped: a quote, a backslash, a newline.
  auto quoted = Grammar(R"({"pattern": "^say \"[^\"\\\\]*\"\\n?$"})");
  ASSERT_NE(quoted, nullptr);
  EXPECT_EQ(Read(*quoted, R"("say \"hi\"")"), "complete");
  EXPECT_EQ(Read(*quoted, R"("say \"hi\"\n")"), "complete");
  EXPECT_EQ(Read(*quoted, R"("say \"h\\")"), "refused at 9");        // no backslash inside the quotes
  EXPECT_EQ(Read(*quoted, R"("say \"h\u0069\"")"), "refused at 9");  // \u escapes are not written

  const std::pair<const char*, const char*> refused[] = {
      {R"js({"type": "string", "pattern": "^(?=a)"})js",
       "at '/': 'pattern' at character 3: lookarounds are not supported"},
      {R"js({"pattern": "(a)\\1"})js", "at '/': 'pattern' at character 4: backreferences are not supported"},
      {R"({"pattern": "\\bword"})", "at '/': 'pattern' at character 1: word boundaries (\\b, \\B) are not supported"},
      {R"({"pattern": "a^b"})",
       "at '/': 'pattern' at character 1: '^' and '$' are supported only at the ends of the pattern or of its "
       "top-level alternatives"},
      {R"({"pattern": "[z-a]"})", "at '/': 'pattern' at character 4: a class range is out of order"},
      {R"({"pattern": "a{3,2}"})", "at '/': 'pattern' at character 6: the quantifier {3,2} is out of order"},
      {R"({"pattern": "(ab"})", "at '/': 'pattern' at character 3: a group is not closed"},
      {R"({"pattern": "*a"})", "at '/': 'pattern' at character 0: a quantifier has nothing to repeat"},
      {R"({"pattern": "\\p{L}"})",
       "at '/': 'pattern' at character 2: Unicode property escapes (\\p, \\P) are not supported"},
      {R"({"pattern": "^\\x01$"})", "at '/': 'pattern' matches no string that JSON can hold"},
      {R"js({"pattern": "^(a|b)*a(a|b){13}$"})js", "at '/': 'pattern' needs more than 8192 automaton states"},
      {R"js({"pattern": "(a?){1000}a{1000}"})js",
       "at '/': 'pattern' is too complex: its automaton takes too long to build"},
      {R"({"type": "string", "pattern": "^a+$", "maxLength": 3})",
       "at '/': 'minLength' and 'maxLength' beside 'pattern' are not supported; put the length in the pattern (as "
       "{1,20})"},
      {R"({"pattern": 5})", "at '/': 'pattern' must be a string, got integer"},
  };
  for (const auto& [schema, message] : refused) {
    EXPECT_EQ(CompileError(schema), message) << schema;
  }
}

TEST(JsonSchemaTest, StringsCountCharactersNotBytes) {
  auto g = Grammar(R"({"type": "string", "minLength": 2, "maxLength": 3})");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(Read(*g, R"("ab")"), "complete");
  EXPECT_EQ(Read(*g, "\"\xc3\xa9\xc3\xa9\xc3\xa9\""), "complete");  // three two-byte characters
  EXPECT_EQ(Read(*g, R"("a\u00e9\n")"), "complete");                // escapes count one each
  EXPECT_EQ(Read(*g, R"("a")"), "refused at 2");
  EXPECT_EQ(Read(*g, R"("abcd")"), "refused at 4");
  EXPECT_EQ(Read(*g, "\"a\x01\""), "refused at 2");
}

// Strings hold valid UTF-8 (RFC 3629), a sequence whole before the closing quote, in any JSON string.
TEST(JsonSchemaTest, StringsHoldValidUtf8) {
  auto g = Grammar(R"({"type": "object", "additionalProperties": {"type": "string"}})");
  ASSERT_NE(g, nullptr);
  for (const char* ok : {"{\"\xe2\x82\xac\": \"\xf0\x9f\x98\x80\xc3\xa9\xed\x9f\xbf\xf4\x8f\xbf\xbf\"}"}) {
    EXPECT_EQ(Read(*g, ok), "complete") << ok;
  }
  const std::pair<const char*, const char*> refused[] = {
      {"{\"a\": \"\xc3\"}", "refused at 8"},              // a sequence cut short by the quote
      {"{\"a\": \"\x80\"}", "refused at 7"},              // a lone continuation byte
      {"{\"a\": \"\xc0\xaf\"}", "refused at 7"},          // an overlong lead
      {"{\"a\": \"\xe0\x80\x80\"}", "refused at 8"},      // an overlong three-byte form
      {"{\"a\": \"\xed\xa0\x80\"}", "refused at 8"},      // a surrogate
      {"{\"a\": \"\xf4\x90\x80\x80\"}", "refused at 8"},  // past U+10FFFF
      {"{\"\xff\": \"a\"}", "refused at 2"},              // in a key
  };
  for (const auto& [text, where] : refused) EXPECT_EQ(Read(*g, text), where) << text;
  EXPECT_EQ(Read(JsonObjectGrammar(), "{\"a\": \"\xe2\x82\"}"), "refused at 9");
}

// A \u escape of a UTF-16 surrogate comes in a pair, high then low, and the pair is one character.
TEST(JsonSchemaTest, SurrogateEscapesComeInPairs) {
  auto g = Grammar(R"({"type": "string", "maxLength": 1})");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(Read(*g, R"("\ud83d\ude00")"), "complete");
  EXPECT_EQ(Read(*g, R"("\uD83D\uDE00")"), "complete");
  EXPECT_EQ(Read(*g, R"("\ud7ff")"), "complete");
  EXPECT_EQ(Read(*g, R"("\ue000")"), "complete");
  EXPECT_EQ(Read(*g, R"("\ud800")"), "refused at 7");          // a high surrogate alone
  EXPECT_EQ(Read(*g, R"("\ud800\u0041")"), "refused at 9");    // followed by no low one
  EXPECT_EQ(Read(*g, R"("\udc00")"), "refused at 4");          // a low surrogate alone
  EXPECT_EQ(Read(*g, R"("\ud83d\ude00a")"), "refused at 13");  // two characters
  for (const std::string text : {R"({"a": "\ud83d\ude00"})", R"({"a": "\ud800"})", R"({"a": "\udfff"})"}) {
    const bool parses = ParseJson(text, "text").ok();
    EXPECT_EQ(Read(JsonObjectGrammar(), text) == "complete", parses) << text;
  }
}

TEST(JsonSchemaTest, ArraysCountTheirItems) {
  auto g = Grammar(R"({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2})");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(Read(*g, "[true]"), "complete");
  EXPECT_EQ(Read(*g, "[ false, true ]"), "complete");
  EXPECT_EQ(Read(*g, "[]"), "refused at 1");
  EXPECT_EQ(Read(*g, "[true, true, true]"), "refused at 11");
  EXPECT_EQ(Read(*g, "[null]"), "refused at 1");
  // Any array, and items of any value, when nothing bounds them.
  auto any = Grammar(R"({"type": "array"})");
  ASSERT_NE(any, nullptr);
  EXPECT_EQ(Read(*any, R"([1, "a", {"b": [null]}])"), "complete");
  EXPECT_EQ(Read(*any, "{}"), "refused at 0");
  // No item at all.
  auto empty = Grammar(R"({"type": "array", "items": false})");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(Read(*empty, "[]"), "complete");
  EXPECT_EQ(Read(*empty, "[1"), "refused at 1");
}

// Formats written to the letter: RFC 3339's date, time and date-time, uuid and ipv4; others stay annotations.
TEST(JsonSchemaTest, DateTimesUuidsAndAddressesAreWrittenToTheLetter) {
  auto g = Grammar(R"({"type": "array", "prefixItems": [{"type": "string", "format": "date-time"},
      {"type": "string", "format": "date"}, {"type": "string", "format": "time"}, {"type": "string", "format": "uuid"},
      {"type": "string", "format": "ipv4"}, {"type": "string", "format": "email"}]})");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(Read(*g, R"(["2024-02-28T23:59:60Z")"), "refused at 19");  // no leap second
  const std::string head = R"(["2024-02-28T23:59:59.5+05:30", "1999-12-31", "00:00:00Z", )";
  EXPECT_EQ(Read(*g, head + R"("0f8fad5b-d9cb-469f-A165-70867728950e", "192.168.0.1", "any text"])"), "complete");
  EXPECT_EQ(Read(*g, R"(["2024-02-28T23:59:59")"), "refused at 21");  // the offset is required
  EXPECT_EQ(Read(*g, R"(["2024-13)"), "refused at 8");
  EXPECT_EQ(Read(*g, R"(["2024-04-31)"), "refused at 11");  // April has 30 days
  EXPECT_EQ(Read(*g, R"(["2024-02-29)"), "refused at 11");  // not in every year
  EXPECT_EQ(Read(*g, head + R"("0f8fad5b-d9cb")"), StrCat("refused at ", head.size() + 14));
  EXPECT_EQ(Read(*g, head + R"("0f8fad5b-d9cb-469f-a165-70867728950e", "01)"),
            StrCat("refused at ", head.size() + 42));  // no leading zero
}

// uniqueItems over an enum's values (Pydantic's Set[Color]) or booleans: a value taken is out for the next items.
TEST(JsonSchemaTest, UniqueItemsOfAnEnumTakeEachValueOnce) {
  auto colors = Grammar(R"({"$defs": {"Color": {"enum": ["red", "green", "blue", "a", "ab"]}},
                            "type": "array", "items": {"$ref": "#/$defs/Color"}, "uniqueItems": true})");
  ASSERT_NE(colors, nullptr);
  EXPECT_EQ(Read(*colors, R"(["red", "blue", "green", "ab", "a"])"), "complete");
  EXPECT_EQ(Read(*colors, R"(["red", "red"])"), "refused at 9");
  EXPECT_EQ(Read(*colors, R"(["a", "a"])"), "refused at 8");  // "a" is taken; "ab" goes on
  EXPECT_EQ(Read(*colors, R"(["a", "ab"])"), "complete");
  EXPECT_EQ(Read(*colors, R"(["ab", "a"])"), "complete");
  EXPECT_EQ(Read(*colors, R"(["red", "blue", "green", "ab", "a",)"), "refused at 34");  // every value taken
  auto flags = Grammar(R"({"type": "array", "items": {"type": "boolean"}, "uniqueItems": true, "minItems": 1})");
  ASSERT_NE(flags, nullptr);
  EXPECT_EQ(Read(*flags, "[true, false]"), "complete");
  EXPECT_EQ(Read(*flags, "[false, false]"), "refused at 8");
  // The same enum outside the set takes any value.
  auto both = Grammar(R"({"$defs": {"C": {"enum": ["x", "y"]}}, "type": "object", "properties": {
      "set": {"type": "array", "items": {"$ref": "#/$defs/C"}, "uniqueItems": true},
      "list": {"type": "array", "items": {"$ref": "#/$defs/C"}}}, "required": ["set", "list"]})");
  ASSERT_NE(both, nullptr);
  EXPECT_EQ(Read(*both, R"({"set": ["x", "y"], "list": ["x", "x", "y"]})"), "complete");
}

// Tuples: Pydantic's Tuple[float, str] (prefixItems with minItems = maxItems), draft 7's items as a list, and
// what follows a tuple: items (a schema, false, or any value where absent).
TEST(JsonSchemaTest, TuplesHoldEachPositionToItsSchema) {
  auto pair = Grammar(R"({"type": "array", "prefixItems": [{"type": "number"}, {"type": "string", "maxLength": 2}],
                          "minItems": 2, "maxItems": 2})");
  ASSERT_NE(pair, nullptr);
  EXPECT_EQ(Read(*pair, R"([1.5, "ab"])"), "complete");
  EXPECT_EQ(Read(*pair, R"(["ab", 1.5])"), "refused at 1");
  EXPECT_EQ(Read(*pair, "[1.5]"), "refused at 4");
  EXPECT_EQ(Read(*pair, R"([1.5, "ab", 2])"), "refused at 10");
  EXPECT_EQ(Read(*pair, R"([1.5, "abc"])"), "refused at 9");
  // Draft 7, then integers after the tuple; a tuple's items may be left out from the end down to minItems.
  auto draft7 = Grammar(R"({"items": [{"const": "op"}, {"type": "boolean"}], "additionalItems": {"type": "integer"},
                            "minItems": 1})");
  ASSERT_NE(draft7, nullptr);
  EXPECT_EQ(Read(*draft7, R"(["op"])"), "complete");
  EXPECT_EQ(Read(*draft7, R"(["op", true, 1, -2])"), "complete");
  EXPECT_EQ(Read(*draft7, R"(["op", 1])"), "refused at 7");
  EXPECT_EQ(Read(*draft7, R"(["op", true, false])"), "refused at 13");
  // Nothing past the tuple, or any value.
  auto closed = Grammar(R"({"prefixItems": [{"type": "null"}], "items": false})");
  ASSERT_NE(closed, nullptr);
  EXPECT_EQ(Read(*closed, "[null]"), "complete");
  EXPECT_EQ(Read(*closed, "[]"), "complete");
  EXPECT_EQ(Read(*closed, "[null, null]"), "refused at 5");
  auto open = Grammar(R"({"prefixItems": [{"type": "null"}]})");
  ASSERT_NE(open, nullptr);
  EXPECT_EQ(Read(*open, R"([null, {"a": 1}, "x"])"), "complete");
  // A tuple's later item may nest deeper than its first: a comma is taken only where that item can still end.
  std::string deep = "{}";  // kMaxGrammarDepth - 1 values deep at least
  for (int i = 0; i < kMaxGrammarDepth - 2; ++i) deep = R"({"type": "array", "items": )" + deep + R"(, "minItems": 1})";
  const std::string defs =
      R"("$defs": {"deep": )" + deep + R"(, "pair": {"prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/deep"}]}})";
  auto top = Grammar("{" + defs + R"(, "$ref": "#/$defs/pair"})");
  ASSERT_NE(top, nullptr);
  EXPECT_EQ(Read(*top, "[1,"), "prefix");
  auto inner = Grammar("{" + defs + R"(, "type": "array", "items": {"$ref": "#/$defs/pair"}})");
  ASSERT_NE(inner, nullptr);
  EXPECT_EQ(Read(*inner, "[[1]]"), "complete");
  EXPECT_EQ(Read(*inner, "[[1,"), "refused at 3");
}

TEST(JsonSchemaTest, EnumsConstsAndAlternatives) {
  auto e = Grammar(R"({"enum": ["red", "green", 1, 12, null, {"a": [1]}]})");
  ASSERT_NE(e, nullptr);
  for (const char* ok : {R"("red")", R"("green")", "1", "12", "null", R"({"a":[1]})"}) {
    EXPECT_EQ(Read(*e, ok), "complete") << ok;
  }
  EXPECT_EQ(Read(*e, R"("blue")"), "refused at 1");
  EXPECT_EQ(Read(*e, "2"), "refused at 0");
  // The values of another type than the schema's are left out.
  auto typed = Grammar(R"({"type": "string", "enum": ["a", 1]})");
  ASSERT_NE(typed, nullptr);
  EXPECT_EQ(Read(*typed, "1"), "refused at 0");
  // Optional[str], a type list, and consts merged with an enum and null.
  auto optional = Grammar(R"({"anyOf": [{"type": "string", "maxLength": 1}, {"type": "null"}]})");
  ASSERT_NE(optional, nullptr);
  EXPECT_EQ(Read(*optional, R"("x")"), "complete");
  EXPECT_EQ(Read(*optional, "null"), "complete");
  EXPECT_EQ(Read(*optional, R"("xy")"), "refused at 2");
  auto list = Grammar(R"({"type": ["integer", "boolean"], "maximum": 3})");
  ASSERT_NE(list, nullptr);
  EXPECT_EQ(Read(*list, "true"), "complete");
  EXPECT_EQ(Read(*list, "3"), "complete");
  EXPECT_EQ(Read(*list, "4"), "refused at 0");
  auto merged = Grammar(R"({"oneOf": [{"const": "a"}, {"enum": ["b", "a"]}, {"type": "null"}, {"type": "number"},
                                     {"type": "integer"}]})");
  ASSERT_NE(merged, nullptr);
  EXPECT_EQ(Read(*merged, R"("b")"), "complete");
  EXPECT_EQ(Read(*merged, "null"), "complete");
  EXPECT_EQ(Read(*merged, "-2.5e1"), "complete");
}

// Unions of object models (Pydantic's Union[Cat, Dog], zod's discriminatedUnion): the objects of an anyOf are told
// apart by their first property, its key or, where several share the key, its const or enum value.
TEST(JsonSchemaTest, ObjectsOfAnAnyOfAreToldApartByTheirFirstProperty) {
  auto g = Grammar(R"({"$defs": {
      "Cat": {"type": "object", "properties": {"pet_type": {"type": "string", "const": "cat"},
              "meows": {"type": "integer"}}, "required": ["pet_type", "meows"]},
      "Dog": {"type": "object", "properties": {"pet_type": {"enum": ["dog", "puppy"]}, "barks": {"type": "number"},
              "name": {"type": "string"}}, "required": ["pet_type", "barks"], "additionalProperties": false},
      "Fish": {"type": "object", "properties": {"fins": {"type": "integer", "minimum": 0}}, "required": ["fins"]}},
    "type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"},
      {"$ref": "#/$defs/Fish"}, {"type": "null"}]}}, "required": ["pet"]})");
  ASSERT_NE(g, nullptr);
  for (const char* ok :
       {R"({"pet": {"pet_type": "cat", "meows": 3}})", R"({"pet": {"pet_type": "puppy", "barks": 1.5, "name": "Rex"}})",
        R"({"pet":{"pet_type":"dog","barks":0}})", "{\"pet\": {\n  \"fins\": 2\n}}", R"({"pet": null})"}) {
    EXPECT_EQ(Read(*g, ok), "complete") << ok;
  }
  EXPECT_EQ(Read(*g, R"({"pet": {"pet_type": "cat", "barks": 1}})"), "refused at 29");  // a cat meows
  EXPECT_EQ(Read(*g, R"({"pet": {"pet_type": "dog", "meows": 1}})"), "refused at 29");
  EXPECT_EQ(Read(*g, R"({"pet": {"pet_type": "cow")"), "refused at 23");
  EXPECT_EQ(Read(*g, R"({"pet": {"pet_type": 1)"), "refused at 21");
  EXPECT_EQ(Read(*g, R"({"pet": {}})"), "refused at 9");  // every object begins with its required first property
  EXPECT_EQ(Read(*g, R"({"pet": {"meows": 3}})"), "refused at 10");
  EXPECT_EQ(Read(*g, R"({"pet": {"fins": -1}})"), "refused at 18");                    // -0 is 0
  EXPECT_EQ(Read(*g, R"({"pet": {"fins": 1, "pet_type": "cat"}})"), "refused at 18");  // no more properties

  // Objects told apart by their first key alone, beside other types, and a union in a union.
  auto keyed = Grammar(R"({"anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
      {"anyOf": [{"properties": {"b": {"type": "string"}, "c": {}}, "required": ["b"]}, {"type": "string"}]},
      {"type": "array"}]})");
  ASSERT_NE(keyed, nullptr);
  for (const char* ok : {R"({"a": 1})", R"({"b": "x", "c": [1]})", R"("s")", "[]"}) {
    EXPECT_EQ(Read(*keyed, ok), "complete") << ok;
  }
  EXPECT_EQ(Read(*keyed, R"({"a": "x"})"), "refused at 6");
  EXPECT_EQ(Read(*keyed, R"({"c": 1})"), "refused at 2");
  // A discriminator's values through a $ref and an anyOf of consts, whichever anyOf the compiler resolves first.
  auto tagged = Grammar(R"({"$defs": {"kind": {"anyOf": [{"const": "a"}, {"const": "b"}]}}, "anyOf": [
      {"properties": {"t": {"$ref": "#/$defs/kind"}, "x": {"type": "integer"}}, "required": ["t", "x"]},
      {"properties": {"t": {"anyOf": [{"const": "c"}, {"enum": ["d", "c"]}]}, "y": {"type": "null"}},
       "required": ["t", "y"]}]})");
  ASSERT_NE(tagged, nullptr);
  EXPECT_EQ(Read(*tagged, R"({"t": "b", "x": 1})"), "complete");
  EXPECT_EQ(Read(*tagged, R"({"t": "c", "y": null})"), "complete");
  EXPECT_EQ(Read(*tagged, R"({"t": "d", "x": 1})"), "refused at 12");  // "d" begins the second

  // Pydantic's discriminated union with its tag written after other properties: each object of the union is
  // generated with the tag first, the first property that every object requires with a const or enum value, no
  // value in two. The object used alone keeps the written order.
  auto tag_later = Grammar(R"({"$defs": {
      "Cat": {"properties": {"name": {"type": "string"}, "pet_type": {"const": "cat"}, "meows": {"type": "integer"}},
              "required": ["name", "pet_type", "meows"]},
      "Dog": {"properties": {"name": {"type": "string"}, "barks": {"type": "number"}, "pet_type": {"const": "dog"}},
              "required": ["name", "barks", "pet_type"]}},
    "type": "object", "properties": {"favourite": {"$ref": "#/$defs/Cat"}, "pets": {"type": "array",
      "items": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {
        "propertyName": "pet_type", "mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}}}}},
    "required": ["favourite", "pets"]})");
  ASSERT_NE(tag_later, nullptr);
  EXPECT_EQ(Read(*tag_later, R"({"favourite": {"name": "Tom", "pet_type": "cat", "meows": 1}, "pets": [
      {"pet_type": "dog", "name": "Rex", "barks": 2}, {"pet_type": "cat", "name": "Tom", "meows": 3}]})"),
            "complete");
  EXPECT_EQ(Read(*tag_later, R"({"favourite": {"pet_type": "cat")"), "refused at 16");
  EXPECT_EQ(Read(*tag_later, R"({"favourite": {"name": "", "pet_type": "cat", "meows": 1}, "pets": [{"name")"),
            "refused at 70");  // the tag comes first in a pet
  EXPECT_EQ(Read(*tag_later, R"({"favourite": {"name": "", "pet_type": "cat", "meows": 1}, "pets": [
      {"pet_type": "dog", "name": "Rex", "meows": 2})"),
            "refused at 111");  // a dog barks

  // Many objects with their tag written later: the copies grow (and move) the node list while the union is built.
  std::string many = R"({"anyOf": [)";
  for (int i = 0; i < 24; ++i) {
    many += StrCat(i == 0 ? "" : ", ", R"({"properties": {"name": {"type": "string"}, "kind": {"const": )", i,
                   R"(}}, "required": ["name", "kind"]})");
  }
  auto tagged_many = Grammar(many + "]}");
  ASSERT_NE(tagged_many, nullptr);
  EXPECT_EQ(Read(*tagged_many, R"({"kind": 17, "name": "x"})"), "complete");

  // Models whose first fields have defaults: each object's first required property, no key in two, goes first.
  auto defaults = Grammar(R"({"anyOf": [
      {"properties": {"note": {"type": "string"}, "a": {"type": "integer"}}, "required": ["a"]},
      {"properties": {"note": {"type": "string"}, "b": {"type": "boolean"}, "c": {}}, "required": ["b", "c"]}]})");
  ASSERT_NE(defaults, nullptr);
  EXPECT_EQ(Read(*defaults, R"({"a": 1, "note": "x"})"), "complete");
  EXPECT_EQ(Read(*defaults, R"({"b": true, "note": "", "c": null})"), "complete");
  EXPECT_EQ(Read(*defaults, R"({"note": "x")"), "refused at 2");

  const std::pair<const char*, const char*> refused[] = {
      {R"({"anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}, "required": ["b"]}]})",
       "at '/anyOf/0': an object that is one of several in an anyOf must begin with a required property: odmoe "
       "tells the objects apart by it (its key, or its const or enum value)"},
      {R"({"anyOf": [{"properties": {"k": {"type": "string"}}, "required": ["k"]},
                     {"properties": {"k": {"const": "x"}}, "required": ["k"]}]})",
       "at '/anyOf/0/properties/k': objects of an anyOf that begin with the same property \"k\" are told apart by "
       "its value, which must be a 'const' or an 'enum'"},
      {R"({"anyOf": [{"properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]},
                     {"properties": {"k": {"const": "y"}, "n": {}}, "required": ["k"]}]})",
       "at '/': its objects at '/anyOf/0' and '/anyOf/1' both begin with \"k\": \"y\"; odmoe tells objects apart "
       "by their first property"},
      {R"({"anyOf": [{"type": "object", "additionalProperties": false},
                     {"properties": {"k": {}}, "required": ["k"]}]})",
       "at '/anyOf/0': an object that is one of several in an anyOf must begin with a required property"},
      {R"({"anyOf": [{"properties": {"n": {}, "k": {"type": "string"}}, "required": ["k"]},
                     {"properties": {"m": {}, "k": {"type": "integer"}}, "required": ["k"]}]})",
       "at '/anyOf/0': an object that is one of several in an anyOf must begin with a required property"},
  };
  for (const auto& [schema, message] : refused) {
    EXPECT_TRUE(CompileError(schema).starts_with(message)) << schema << "\n" << CompileError(schema);
  }
}

TEST(JsonSchemaTest, RefsRecurseAndMapsTakeAnyKey) {
  auto tree = Grammar(R"({"$defs": {"node": {"type": "object",
      "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
      "required": ["v"]}}, "$ref": "#/$defs/node"})");
  ASSERT_NE(tree, nullptr);
  EXPECT_EQ(Read(*tree, R"({"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]})"), "complete");
  EXPECT_EQ(Read(*tree, R"({"v": 1, "kids": [{"kids": []}]})"), "refused at 20");
  // An answer goes as deep as kMaxGrammarDepth lets it, and then no deeper: the last kids array it may open is
  // one whose node it could still finish there ("v" is required), and from there it can always end.
  GrammarState s = tree->Start();
  for (const char c : std::string("{\"v\": 0")) ASSERT_TRUE(tree->Advance(s, static_cast<uint8_t>(c)));
  int levels = 0;
  for (;; ++levels) {
    GrammarState t = s;
    bool taken = true;
    for (const char c : std::string(", \"kids\": [{\"v\": 0"))
      taken = taken && tree->Advance(t, static_cast<uint8_t>(c));
    if (!taken) break;
    s = t;
  }
  // Level L's object is frame 2L + 1 (the root, then an array and an object per level), its "v" frame 2L + 2.
  EXPECT_EQ(levels, (kMaxGrammarDepth - 2) / 2);
  for (int i = 0; i < levels; ++i) {
    for (const char c : std::string("}]")) ASSERT_TRUE(tree->Advance(s, static_cast<uint8_t>(c)));
  }
  ASSERT_TRUE(tree->Advance(s, '}'));
  EXPECT_TRUE(tree->Complete(s));

  auto map = Grammar(R"({"type": "object", "additionalProperties": {"type": "number"}})");
  ASSERT_NE(map, nullptr);
  EXPECT_EQ(Read(*map, R"({"x\"y": 1, "x\"y": 2.5, "": -1})"), "complete");
  EXPECT_EQ(Read(*map, "{}"), "complete");
  EXPECT_EQ(Read(*map, R"({"a": "b"})"), "refused at 6");
  auto empty = Grammar(R"({"type": "object", "additionalProperties": false})");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(Read(*empty, "{ }"), "complete");
  EXPECT_EQ(Read(*empty, R"({"a": 1})"), "refused at 1");
  auto anything = Grammar("true");
  ASSERT_NE(anything, nullptr);
  EXPECT_EQ(Read(*anything, "[1, {}]"), "complete");
  EXPECT_EQ(Read(*anything, " 7"), "complete");
}

TEST(JsonSchemaTest, RefusedSchemasSayWhereAndWhy) {
  const std::pair<const char*, const char*> cases[] = {
      {R"js({"type": "string", "pattern": "^(?!a)"})js", "at '/': 'pattern' at character 3: lookarounds are not"},
      {R"({"properties": {"a/b": {"type": "number", "multipleOf": 0.5}}})",
       "at '/properties/a~1b': 'multipleOf' is not supported"},
      {R"({"anyOf": [{"type": "object"}, {"type": "object", "properties": {"a": {}}}]})",
       "at '/': its alternatives at '/anyOf/0' and '/anyOf/1' can both begin with '{'; odmoe tells alternatives "
       "apart by their first byte"},
      {R"({"$ref": "other.json#/a"})",
       "at '/': '$ref' 'other.json#/a' is outside the schema; only '#...' refs are taken"},
      {R"({"$ref": "#/$defs/missing"})", "at '/': '$ref' '#/$defs/missing' names nothing in the schema"},
      {R"({"properties": {"a": {}}, "required": ["b"]})",
       "at '/': 'required' names 'b', which 'properties' does not list"},
      {R"({"type": "array", "items": {"type": "string"}, "uniqueItems": true})",
       "at '/': 'uniqueItems' is supported for items of an 'enum' (or 'const's, or booleans) of at most 64 values, "
       "without 'prefixItems'"},
      {R"({"uniqueItems": true, "items": {"enum": [1, 2]}})",
       "at '/': 'uniqueItems' is supported beside \"type\": \"array\" only"},
      {R"({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": true, "minItems": 3})",
       "at '/': 'minItems' 3 is more than the 2 different values of its items"},
      {R"({"items": false, "minItems": 1})", "at '/': 'minItems' 1 is more than the 0 items 'items' false allows"},
      {R"({"prefixItems": [{}, {}], "items": false, "minItems": 3})",
       "at '/': 'minItems' 3 is more than the 2 items 'items' false allows"},
      {R"({"prefixItems": {}})", "at '/': 'prefixItems' must be a list of at most 64 schemas"},
      {R"({"prefixItems": [{"type": "integer"}, {"not": {}}]})", "at '/prefixItems/1': 'not' is not supported"},
      {R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"})",
       "at '/$defs/a': the schema refers to itself before any byte of its value"},
      {R"({"type": "integer", "minimum": 5, "maximum": 4.5})",
       "at '/': no integer of at most 18 digits meets its bounds"},
      {R"({"type": "strin"})", "at '/': 'type' 'strin' is not a JSON Schema type"},
      {R"({"type": "array", "minItems": 3, "maxItems": 2})", "at '/': 'minItems' 3 is more than 'maxItems' 2"},
      {R"({"type": "string", "maxLength": -1})", "at '/': 'maxLength' must be a non-negative integer, got -1"},
      {R"({"enum": [1], "type": "string"})", "at '/': no value of 'enum' or 'const' is of the schema's 'type'"},
      {R"({"$ref": "#/$defs/a", "type": "object", "$defs": {"a": {}}})",
       "at '/': '$ref' beside 'type' is not supported; put them in one schema"},
      {R"({"allOf": [{}, {}]})", "at '/': 'allOf' is supported with one schema only"},
      {R"({"properties": {"next": {"$ref": "#"}}, "required": ["next"]})",
       "at '/': no value of the schema nests at most 24 objects and arrays deep (required properties or minItems "
       "recurse without end, or nest deeper)"},
      {R"({"$defs": {"a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"})",
       "at '/': no value of the schema nests at most 24"},
      {"[1]", "at '/': a schema must be an object or a boolean, got array"},
      {"{", "is not JSON: [json.exception.parse_error.101]"},
  };
  for (const auto& [schema, message] : cases) {
    EXPECT_TRUE(CompileError(schema).starts_with(message)) << schema << "\n" << CompileError(schema);
  }
  std::string deep = "{}";
  for (int i = 0; i <= kMaxSchemaNesting; ++i) deep = R"({"items": )" + deep + "}";
  EXPECT_EQ(CompileError(deep).substr(0, 6), "at '/i");
  EXPECT_EQ(CompileError(std::string(kMaxSchemaBytes + 1, ' ')), "has 65537 bytes, at most 65536");
  // Annotations, format among them, are left alone.
  EXPECT_EQ(CompileError(R"({"title": "t", "description": "d", "type": "string", "format": "date-time",
                             "default": "x", "examples": ["y"], "x-vendor": 1})"),
            "compiled");

  OutputConstraint c{.kind = OutputConstraint::Kind::kJsonSchema, .schema = R"({"type": "string", "format": 1,
                                                                                "not": {}})"};
  EXPECT_EQ(c.Validate().message(), "constraint.schema at '/': 'not' is not supported");
  EXPECT_EQ(FieldOf(c.Validate()), "constraint.schema");
  c.kind = OutputConstraint::Kind::kJsonObject;
  EXPECT_EQ(c.Validate().message(), "constraint.schema is given, but the constraint is not a JSON schema");
}

// Random answers, each byte picked among those the grammar takes (ASCII only, so that every answer is UTF-8),
// ending where the grammar is complete: python3-jsonschema reads every one as valid for its schema.
TEST(JsonSchemaTest, RandomAnswersAreValidForTheirSchemaAsJsonschemaReadsThem) {
  const std::vector<std::string> schemas = {
      R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
          "age": {"type": "integer", "minimum": 0, "maximum": 130}, "email": {"type": "string"},
          "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": false})",
      R"({"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer", "exclusiveMinimum": -5,
          "maximum": 5}, "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}, "required": ["v", "next"]}},
          "$ref": "#/$defs/n"})",
      R"({"type": "array", "items": {"type": ["number", "string", "null"], "minLength": 1}, "minItems": 2})",
      R"({"type": "object", "additionalProperties": {"type": "array", "items": {"type": "boolean"}}})",
      R"({"type": "object", "properties": {"any": {}, "obj": {"type": "object"}, "c": {"const": {"k": [1, "x"]}}},
          "required": ["c"]})",
      R"({"type": "integer", "minimum": -1000000, "maximum": 999})",
      R"({"type": "string", "minLength": 3, "maxLength": 5})",
      R"js({"type": "object", "properties": {"code": {"pattern": "^[A-Z]{2}-\\d{2,4}$"},
          "tag": {"type": "string", "pattern": "[0-9]z?"}, "q": {"pattern": "^\"?[a\\\\/]+(!|\\?)?$"}},
          "required": ["code", "tag", "q"]})js",
      R"({"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
          "t": {"type": "number", "minimum": -273.15, "exclusiveMaximum": 1e4},
          "n": {"type": "number", "minimum": -0.001, "maximum": 0.001}}, "required": ["p", "t", "n"]})",
      R"({"$defs": {"expr": {"oneOf": [
          {"type": "object", "properties": {"op": {"enum": ["+", "*"]}, "args": {"type": "array",
           "items": {"$ref": "#/$defs/expr"}, "maxItems": 3}}, "required": ["op", "args"],
           "additionalProperties": false},
          {"type": "object", "properties": {"op": {"const": "neg"}, "arg": {"$ref": "#/$defs/expr"}},
           "required": ["op", "arg"], "additionalProperties": false},
          {"type": "object", "properties": {"num": {"type": "integer"}}, "required": ["num"]},
          {"const": 0}]}}, "$ref": "#/$defs/expr"})",
      R"({"$defs": {"Cat": {"properties": {"name": {"type": "string", "maxLength": 5}, "pet_type": {"const": "cat"},
          "meows": {"type": "integer"}}, "required": ["name", "pet_type", "meows"]}, "Dog": {"properties": {
          "name": {"type": "string", "maxLength": 5}, "pet_type": {"enum": ["dog", "puppy"]}}, "required": ["name",
          "pet_type"]}}, "type": "array", "items": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
          "discriminator": {"propertyName": "pet_type"}}, "maxItems": 3})",
      R"({"type": "array", "maxItems": 3, "items": {"anyOf": [{"properties": {"note": {"type": "string",
          "maxLength": 3}, "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false},
          {"properties": {"note": {"type": "string", "maxLength": 3}, "b": {"type": "boolean"}}, "required": ["b"],
          "additionalProperties": false}]}})",
      R"({"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue",
          "a", "ab", 1, null]}, "uniqueItems": true}, "flags": {"type": "array", "items": {"type": "boolean"},
          "uniqueItems": true}}, "required": ["colors", "flags"]})",
      R"({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}, "day": {"type":
          "string", "format": "date"}, "at": {"type": "string", "format": "time"}, "id": {"type": "string",
          "format": "uuid"}, "ip": {"type": "string", "format": "ipv4"}, "site": {"type": "string", "format": "uri",
          "maxLength": 3}}, "required": ["when", "day", "at", "id", "ip", "site"]})",
      R"({"type": "object", "properties": {"point": {"type": "array", "prefixItems": [
          {"type": "number", "minimum": -90, "maximum": 90}, {"type": "number", "minimum": -180, "maximum": 180}],
          "minItems": 2, "maxItems": 2}, "tags": {"type": "array", "prefixItems": [{"const": "a"}, {"type": "boolean"}],
          "items": {"type": "integer"}, "maxItems": 4}}, "required": ["point", "tags"]})",
  };
  std::mt19937 rng(7);
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "json_schema_oracle";
  std::filesystem::create_directories(dir);
  const std::filesystem::path cases = dir / "answers.jsonl";
  std::ofstream out(cases);
  int answers = 0;
  for (size_t k = 0; k < schemas.size(); ++k) {
    auto g = Grammar(schemas[k]);
    ASSERT_NE(g, nullptr);
    int complete = 0;
    for (int walk = 0; walk < 150; ++walk) {
      GrammarState s = g->Start();
      std::string text;
      bool ended = false;
      for (int step = 0; step < 300 && !ended; ++step) {
        std::vector<uint8_t> next;
        for (int b = 1; b < 128; ++b) {
          GrammarState t = s;
          if (g->Advance(t, static_cast<uint8_t>(b))) next.push_back(static_cast<uint8_t>(b));
        }
        if (g->Complete(s) && (next.empty() || rng() % 4 == 0)) {
          ended = true;
          break;
        }
        ASSERT_FALSE(next.empty()) << "stuck after '" << text << "'";
        // Favour the bytes that close something, so that most walks end.
        uint8_t b = next[rng() % next.size()];
        for (const uint8_t closing : {'"', '}', ']', 'n'}) {
          if (std::find(next.begin(), next.end(), closing) != next.end() && rng() % 3 == 0) b = closing;
        }
        ASSERT_TRUE(g->Advance(s, b));
        text += static_cast<char>(b);
      }
      if (!ended) continue;
      ++complete;
      out << DumpJson(Json{{"schema", k}, {"text", text}}) << "\n";
    }
    EXPECT_GE(complete, 40) << schemas[k];
    answers += complete;
  }
  out.close();
  const std::filesystem::path schema_file = dir / "schemas.json";
  std::ofstream(schema_file) << "[" << [&] {
    std::string joined;
    for (const std::string& s : schemas) joined += (joined.empty() ? "" : ",") + s;
    return joined;
  }() << "]";
  // Formats are checked too: jsonschema's own date, uuid and ipv4, and date-time and time (which need a package
  // Debian's python3-jsonschema does not pull in) by Python's fromisoformat, an offset required as RFC 3339 asks.
  const std::string script = R"(
import datetime, json, sys
import jsonschema
schemas = json.load(open(sys.argv[1]))
formats = jsonschema.Draft202012Validator.FORMAT_CHECKER
formats.checks("date-time", raises=ValueError)(lambda s: datetime.datetime.fromisoformat(s).tzinfo is not None)
formats.checks("time", raises=ValueError)(lambda s: datetime.time.fromisoformat(s).tzinfo is not None)
bad = 0
n = 0
for line in open(sys.argv[2]):
    case = json.loads(line)
    n += 1
    try:
        value = json.loads(case["text"])
        jsonschema.validate(value, schemas[case["schema"]], cls=jsonschema.Draft202012Validator,
                            format_checker=formats)
    except Exception as e:
        bad += 1
        print("INVALID", case["schema"], repr(case["text"]), str(e).splitlines()[0])
print("checked", n, "invalid", bad)
)";
  const std::filesystem::path script_file = dir / "check.py";
  std::ofstream(script_file) << script;
  const std::string command =
      "/usr/bin/python3 " + script_file.string() + " " + schema_file.string() + " " + cases.string() + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string report;
  char buffer[4096];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) report += buffer;
  const int rc = pclose(pipe);
  EXPECT_EQ(rc, 0) << report;
  EXPECT_NE(report.find("checked " + std::to_string(answers) + " invalid 0"), std::string::npos) << report;
  EXPECT_GE(answers, static_cast<int>(schemas.size()) * 40);
}

// The states of a schema grammar copy their open frames only: MarkAllowed's sorted walk, which copies a state per
// byte, finds what feeding each token alone finds.
TEST(JsonSchemaTest, MarkAllowedIsFeedingEachTokenAloneUnderASchema) {
  std::mt19937 rng(11);
  const std::string alphabet = "{}[]:,\" \n0159-.etrufalsn\\abgv";
  std::vector<std::string> bytes(500);
  for (std::string& b : bytes) {
    for (int n = 1 + static_cast<int>(rng() % 5); n > 0; --n) b += alphabet[rng() % alphabet.size()];
  }
  const TokenVocabulary vocabulary(bytes);
  auto g = Grammar(R"({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object",
      "properties": {"b": {"type": "integer", "minimum": -9, "maximum": 15}, "g": {"enum": ["ab", "abv"]}}}}},
      "required": ["a"]})");
  ASSERT_NE(g, nullptr);
  const std::string text = R"({"a": [{"b": 15, "g": "abv"}, {}, {"g": "ab"}, {"b": -9}]})";
  GrammarState state = g->Start();
  for (size_t n = 0; n <= text.size(); ++n) {
    std::vector<char> allowed(bytes.size(), 0);
    vocabulary.MarkAllowed(*g, state, &allowed);
    for (size_t id = 0; id < bytes.size(); ++id) {
      GrammarState s = state;
      bool taken = true;
      for (const char c : bytes[id]) taken = taken && g->Advance(s, static_cast<uint8_t>(c));
      ASSERT_EQ(allowed[id] != 0, taken) << "token '" << bytes[id] << "' after '" << text.substr(0, n) << "'";
    }
    if (n < text.size()) {
      ASSERT_TRUE(g->Advance(state, static_cast<uint8_t>(text[n]))) << text.substr(0, n + 1);
    }
  }
  EXPECT_TRUE(g->Complete(state));
}

}  // namespace
}  // namespace odmoe
