// guided_regex: a whole answer held to a regular expression (PatternScope::kWholeText, GrammarNode::Kind::kText).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/output_grammar.h"
#include "src/engine/pattern_dfa.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

std::shared_ptr<const ByteGrammar> Regex(const std::string& regex) {
  const OutputConstraint c{.kind = OutputConstraint::Kind::kRegex, .regex = regex};
  EXPECT_TRUE(c.Validate().ok()) << regex << ": " << c.Validate();
  return c.Validate().ok() ? MakeGrammar(c) : nullptr;
}

// Whether `g` takes every byte of `text` and is complete after it.
bool Matches(const ByteGrammar& g, std::string_view text) {
  GrammarState s = g.Start();
  for (const char c : text) {
    if (!g.Advance(s, static_cast<uint8_t>(c))) return false;
  }
  return g.Complete(s);
}

// Whether `g` takes every byte of `text` (a whole answer may still follow).
bool Takes(const ByteGrammar& g, std::string_view text) {
  GrammarState s = g.Start();
  for (const char c : text) {
    if (!g.Advance(s, static_cast<uint8_t>(c))) return false;
  }
  return true;
}

TEST(RegexGrammarTest, TheWholeAnswerMatchesAnchoredOrNot) {
  for (const char* regex : {R"(\d{3}-\d{4})", R"(^\d{3}-\d{4}$)", R"(^\d{3}-\d{4})", R"(\d{3}-\d{4}$)"}) {
    auto g = Regex(regex);
    ASSERT_NE(g, nullptr);
    EXPECT_TRUE(Matches(*g, "555-0123")) << regex;
    EXPECT_FALSE(Matches(*g, "555-012")) << regex;
    EXPECT_TRUE(Takes(*g, "555-012")) << regex;
    EXPECT_FALSE(Takes(*g, "x555-0123")) << regex;  // no search: the answer begins with the match
    EXPECT_FALSE(Takes(*g, "555-01234")) << regex;  // and ends with it
    EXPECT_FALSE(Takes(*g, "\"555")) << regex;      // unquoted
  }
  // The same expression as a JSON Schema pattern is a search inside a quoted string.
  const absl::StatusOr<PatternDfa> search = CompilePattern(R"(\d-\d)", PatternScope::kJsonString);
  ASSERT_TRUE(search.ok());
  uint16_t state = search->start;
  for (const char c : std::string_view("ab1-2cd")) state = search->Step(state, static_cast<uint8_t>(c));
  EXPECT_NE(state, PatternDfa::kNone);
  EXPECT_TRUE(search->accepting[state]);
}

TEST(RegexGrammarTest, AnswersMayHoldAnyCharacterAndStopWhereTheyMatch) {
  // Control characters, quotes and backslashes are the answer's own bytes, not JSON escapes.
  auto g = Regex(R"([\x00-\x1f"\\]+|é{2})");
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(Matches(*g, std::string_view("\x01\"\\\n\0", 5)));
  EXPECT_TRUE(Matches(*g, "éé"));
  EXPECT_FALSE(Takes(*g, "\xed\xa0\x80"));  // a UTF-16 surrogate is no UTF-8 character
  // Lines, and Python's named groups.
  auto lines = Regex(R"((?P<first>[a-z]+)\n(?<second>[a-z]+)\n?)");
  ASSERT_NE(lines, nullptr);
  EXPECT_TRUE(Matches(*lines, "ab\ncd"));
  EXPECT_TRUE(Matches(*lines, "ab\ncd\n"));
  EXPECT_FALSE(Takes(*lines, "ab\n\n"));
  // A text that matches may go on while the expression allows it; once nothing can follow, the answer is whole.
  auto words = Regex("(yes|yesterday)!?");
  ASSERT_NE(words, nullptr);
  EXPECT_TRUE(Matches(*words, "yes"));
  EXPECT_TRUE(Matches(*words, "yesterday!"));
  EXPECT_FALSE(Takes(*words, "yes!!"));
  // The empty text, where the expression takes it.
  EXPECT_TRUE(Matches(*Regex("a*"), ""));
  EXPECT_FALSE(Matches(*Regex("a+"), ""));
}

// A counted class of any character: UTF-8 tails shared in the NFA keep the DFA at a few states per character, and
// its table at a column per class of bytes that behave alike.
TEST(RegexGrammarTest, CountedClassesOfAnyCharacterStaySmall) {
  const absl::StatusOr<PatternDfa> dfa = CompilePattern(R"([^\n]{1,200})", PatternScope::kWholeText);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_LE(dfa->states(), 200u * 8 + 2);
  EXPECT_LE(dfa->classes, 16u);
  EXPECT_EQ(dfa->next.size(), dfa->states() * dfa->classes);
  const StructuredGrammar g(GrammarProgram::Text(*dfa));
  std::string text;
  for (int i = 0; i < 50; ++i) text += "aé€\U0001F600";  // 1, 2, 3 and 4 bytes
  EXPECT_TRUE(Matches(g, text));
  EXPECT_FALSE(Takes(g, text + "b"));
  EXPECT_FALSE(Takes(g, "a\nb"));
  EXPECT_FALSE(Takes(g, "\xc0\x80"));      // an overlong form
  EXPECT_FALSE(Takes(g, "\xf4\x90\x80"));  // past U+10FFFF
  // Exponential blow-up is still refused, by its count of states.
  EXPECT_EQ(CompilePattern("(a|b)*a(a|b){13}", PatternScope::kWholeText).status().message(),
            "needs more than 8192 automaton states");
}

TEST(RegexGrammarTest, ValidateNamesTheRegexAndWhatIsRefused) {
  OutputConstraint c{.kind = OutputConstraint::Kind::kRegex, .regex = "a(?=b)"};
  EXPECT_EQ(c.Validate().message(), "constraint.regex at character 3: lookarounds are not supported");
  EXPECT_EQ(FieldOf(c.Validate()), "constraint.regex");
  c.regex = "(?i)yes";
  EXPECT_EQ(c.Validate().message(),
            "constraint.regex at character 2: '(?i' is not supported: of the groups that begin with '(?', only (?: ), "
            "(?<name> ) and (?P<name> ) are");
  c.regex = R"(\d+\b)";
  EXPECT_EQ(c.Validate().message(), "constraint.regex at character 4: word boundaries (\\b, \\B) are not supported");
  c.regex = "a{2}{3}";
  EXPECT_EQ(c.Validate().message(), "constraint.regex at character 4: a quantifier follows a quantifier");
  c.regex = "{2}a";
  EXPECT_EQ(c.Validate().message(), "constraint.regex at character 0: a quantifier has nothing to repeat");
  c.regex = "a{,2}{";  // braces that make no quantifier are themselves (ECMA-262 Annex B; Python too)
  EXPECT_TRUE(c.Validate().ok());
  c.regex = std::string(PatternDfa::kMaxPatternBytes + 1, 'a');
  EXPECT_EQ(c.Validate().message(), "constraint.regex has 4097 bytes, at most 4096");
  c.regex = "[\\ud800-\\udfff]";
  EXPECT_EQ(c.Validate().message(), "constraint.regex matches no text");
  c.regex = "ok";
  EXPECT_TRUE(c.Validate().ok());
  c.kind = OutputConstraint::Kind::kJsonObject;
  EXPECT_EQ(c.Validate().message(), "constraint.regex is given, but the constraint is not a regular expression");
}

// Random answers, each byte picked among those the grammar takes (printable ASCII, tab and newline: where Python's
// `re` and ECMA-262 read these expressions alike; Python's \s also takes \x1c-\x1f, and its \d and \w non-ASCII
// digits and letters), ending where the grammar is complete, and mutants of them (a byte changed, dropped or added):
// Python's re.fullmatch agrees with the grammar on every one.
TEST(RegexGrammarTest, AgreesWithPythonsFullmatchOnRandomAnswersAndTheirMutants) {
  const std::vector<std::string> regexes = {
      R"(\d{3}-\d{4})",
      R"((yes|no), because [a-z ]{5,30}\.)",
      R"([A-Z][a-z]*( [A-Z][a-z]*){0,3})",
      R"((?P<year>\d{4})-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))",
      R"([\w.+-]+@[\w-]+\.[a-z]{2,4})",
      R"(^[+-]?\d+(\.\d+)?([eE][+-]?\d+)?$)",
      R"((ab|a)*c?)",
      R"([^\s,]+(,\s?[^\s,]+)*)",
      R"(x{2,}y{0,2}|z+)",
      R"([\t\n -~]{1,10}|[\x00-\x08]?)",
      R"((?:a|b){2}\n[.?!]|\((\d+)\))",
  };
  std::mt19937 rng(5);
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "regex_oracle";
  std::filesystem::create_directories(dir);
  const std::filesystem::path cases = dir / "cases.jsonl";
  std::ofstream out(cases);
  int written = 0, matching = 0;
  for (size_t k = 0; k < regexes.size(); ++k) {
    auto g = Regex(regexes[k]);
    ASSERT_NE(g, nullptr);
    int complete = 0;
    for (int walk = 0; walk < 60; ++walk) {
      GrammarState s = g->Start();
      std::string text;
      for (int step = 0; step < 300; ++step) {
        std::vector<uint8_t> next;
        for (int b = '\t'; b < 127; b = b == '\n' ? ' ' : b + 1) {
          GrammarState t = s;
          if (g->Advance(t, static_cast<uint8_t>(b))) next.push_back(static_cast<uint8_t>(b));
        }
        if (g->Complete(s) && (next.empty() || rng() % 5 == 0)) break;
        ASSERT_FALSE(next.empty()) << "stuck after '" << text << "'";
        const uint8_t b = next[rng() % next.size()];
        ASSERT_TRUE(g->Advance(s, b));
        text += static_cast<char>(b);
      }
      if (!g->Complete(s)) continue;
      ++complete;
      std::vector<std::string> texts = {text};
      for (int m = 0; m < 3; ++m) {
        std::string mutant = text;
        const char c = static_cast<char>(' ' + rng() % 95);
        const size_t at = mutant.empty() ? 0 : rng() % mutant.size();
        if (m == 0 && !mutant.empty()) mutant[at] = c;
        if (m == 1 && !mutant.empty()) mutant.erase(at, 1);
        if (m == 2) mutant.insert(mutant.begin() + static_cast<std::ptrdiff_t>(at), c);
        texts.push_back(mutant);
      }
      for (const std::string& t : texts) {
        const bool matches = Matches(*g, t);
        matching += matches ? 1 : 0;
        out << DumpJson(Json{{"regex", regexes[k]}, {"text", t}, {"matches", matches}}) << "\n";
        ++written;
      }
    }
    EXPECT_GE(complete, 30) << regexes[k];
  }
  out.close();
  const std::filesystem::path script = dir / "check.py";
  std::ofstream(script) << R"(
import json, re, sys
n = bad = 0
for line in open(sys.argv[1]):
    case = json.loads(line)
    n += 1
    if (re.fullmatch(case["regex"], case["text"]) is not None) != case["matches"]:
        bad += 1
        print("DISAGREE", case)
print("checked", n, "disagree", bad)
)";
  const testing::RunResult run = testing::RunProgram({"/usr/bin/python3", script.string(), cases.string()});
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_NE(run.out.find(StrCat("checked ", written, " disagree 0")), std::string::npos) << run.out << run.err;
  // Both verdicts were put to the oracle: the walks match, and most mutants do not.
  EXPECT_GT(matching, written / 4);
  EXPECT_LT(matching, written * 3 / 4);
}

// A schema or expression compiles once: the request's validation, sampling and replays find the grammar compiled.
TEST(GrammarCacheTest, CompileGrammarKeepsWhatItCompiled) {
  const OutputConstraint regex{.kind = OutputConstraint::Kind::kRegex, .regex = "kept{1,3}"};
  const GrammarCache::Counts before = GrammarCache::Shared().counts();
  const auto first = CompileGrammar(regex);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(regex.Validate().ok());
  EXPECT_EQ(MakeGrammar(regex), *first);
  const GrammarCache::Counts after = GrammarCache::Shared().counts();
  EXPECT_EQ(after.misses, before.misses + 1);
  EXPECT_EQ(after.hits, before.hits + 2);
  // Whitespace is part of a schema's grammar: compact or not, two grammars.
  OutputConstraint schema{.kind = OutputConstraint::Kind::kJsonSchema, .schema = R"({"type": "array"})"};
  const auto spaced = CompileGrammar(schema);
  schema.compact = true;
  const auto compact = CompileGrammar(schema);
  ASSERT_TRUE(spaced.ok() && compact.ok());
  EXPECT_NE(*spaced, *compact);
  EXPECT_TRUE(Takes(**spaced, "[ 1"));
  EXPECT_FALSE(Takes(**compact, "[ 1"));
  // What does not compile is told, and nothing is kept.
  const OutputConstraint bad{.kind = OutputConstraint::Kind::kRegex, .regex = "(a"};
  const size_t entries = GrammarCache::Shared().counts().entries;
  EXPECT_EQ(CompileGrammar(bad).status().message(), "at character 2: a group is not closed");
  EXPECT_EQ(GrammarCache::Shared().counts().entries, entries);
}

TEST(GrammarCacheTest, TheLeastRecentlyUsedGoFirstPastTheCountOrTheBytes) {
  GrammarCache cache(/*max_entries=*/2, /*max_bytes=*/100);
  auto grammar = [] { return std::make_shared<const ChoiceGrammar>(std::vector<std::string>{"x"}); };
  const auto a = grammar(), b = grammar(), c = grammar(), d = grammar();
  cache.Insert("a", a, 10);
  cache.Insert("b", b, 10);
  EXPECT_EQ(cache.Find("a"), a);  // now the most recently used
  cache.Insert("c", c, 10);       // past the count: b goes
  EXPECT_EQ(cache.Find("b"), nullptr);
  EXPECT_EQ(cache.Find("a"), a);
  EXPECT_EQ(cache.Find("c"), c);
  cache.Insert("d", d, 85);  // past the bytes: a goes (c was used last), and d fits beside c
  EXPECT_EQ(cache.Find("a"), nullptr);
  EXPECT_EQ(cache.Find("d"), d);
  EXPECT_EQ(cache.counts().entries, 2u);
  EXPECT_EQ(cache.counts().bytes, 95u);
  cache.Insert("e", grammar(), 101);  // over the bound alone: not kept, nothing dropped
  EXPECT_EQ(cache.Find("e"), nullptr);
  EXPECT_EQ(cache.counts().entries, 2u);
  cache.Insert("d", d, 20);  // again: replaces its entry
  EXPECT_EQ(cache.counts().bytes, 30u);
  const GrammarCache::Counts counts = cache.counts();
  EXPECT_EQ(counts.hits, 4u);
  EXPECT_EQ(counts.misses, 3u);
}

}  // namespace
}  // namespace odmoe
