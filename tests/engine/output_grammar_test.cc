#include "src/engine/output_grammar.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/engine/generator.h"
#include "src/engine/sampler.h"

namespace odmoe {
namespace {

// What `grammar` makes of `text`: every byte taken, and then whether the text is whole.
struct Fed {
  bool taken = false;
  bool complete = false;
};
Fed Feed(const ByteGrammar& grammar, std::string_view text) {
  GrammarState s = grammar.Start();
  for (const char c : text) {
    if (!grammar.Advance(s, static_cast<uint8_t>(c))) return {};
  }
  return {.taken = true, .complete = grammar.Complete(s)};
}

// Whether every run of whitespace outside strings is one the grammar allows: one space, or a newline and at most
// kMaxJsonIndent spaces or tabs.
bool WhitespaceKeepsTheRule(const std::string& text) {
  bool in_string = false, escaped = false;
  std::string run;
  auto run_ok = [&] {
    if (run.empty() || run == " ") return true;
    return run[0] == '\n' && run.size() <= 1 + kMaxJsonIndent && run.find_first_not_of(" \t", 1) == std::string::npos;
  };
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == ' ' || c == '\n' || c == '\t' || c == '\r') {
      run += c;
      continue;
    }
    if (!run_ok()) return false;
    run.clear();
    in_string = c == '"';
  }
  return run_ok();
}

bool NumberOverflows(const std::string& text) {
  try {
    const Json parsed = Json::parse(text);
    (void)parsed;
  } catch (const Json::out_of_range&) {
    return true;
  } catch (const Json::exception&) {
  }
  return false;
}

TEST(JsonObjectGrammarTest, TakesObjectsAndIsCompleteOnlyAtTheirEnd) {
  const JsonObjectGrammar g;
  for (const std::string text :
       {"{}", " {\n}", R"({"a":1})", R"({"a": 1, "b": [true, false, null, -0.5e+3, 0, 12.25E-2, "x\u00e9\n\"\\\/"]})",
        R"({"c": {"d": [], "e": [[{}], {"f": "é ü"}]}})", R"({"":""})", R"({"n": -0})", R"({"n": 1e5})"}) {
    SCOPED_TRACE(text);
    const Fed whole = Feed(g, text);
    EXPECT_TRUE(whole.taken);
    EXPECT_TRUE(whole.complete);
    ASSERT_TRUE(Json::accept(text));
    for (size_t n = 0; n < text.size(); ++n) {
      const Fed prefix = Feed(g, text.substr(0, n));
      EXPECT_TRUE(prefix.taken) << n;
      EXPECT_FALSE(prefix.complete) << n;
    }
  }
}

TEST(JsonObjectGrammarTest, RefusesWhatIsNotOneObject) {
  const JsonObjectGrammar g;
  for (const std::string text : {"[1]",
                                 "\"a\"",
                                 "1",
                                 "null",
                                 R"({"a" 1})",
                                 R"({"a":01})",
                                 R"({"a":1,})",
                                 R"({"a": tru})",
                                 "{\"a\":\"\x01\"}",
                                 R"({"a": 1}})",
                                 R"({"a": 1} )",
                                 "{'a':1}",
                                 R"({"a":1])",
                                 R"({"a":-})",
                                 R"({"a":1.})",
                                 R"({"a":1e})",
                                 R"({"a":1.e3})",
                                 R"({"a":"\x"})",
                                 R"({"a":"\u12G4"})",
                                 R"({1:2})",
                                 R"({"a":[1,]})",
                                 R"({"a":+1})"}) {
    SCOPED_TRACE(text);
    const Fed fed = Feed(g, text);
    EXPECT_FALSE(fed.taken && fed.complete);
  }
}

TEST(JsonObjectGrammarTest, BoundsNestingAndWhitespaceRuns) {
  const JsonObjectGrammar g;
  std::string deep = "{\"a\":";
  for (int i = 1; i < kMaxJsonDepth; ++i) deep += "[";
  EXPECT_TRUE(Feed(g, deep).taken);
  EXPECT_FALSE(Feed(g, deep + "[").taken);
  // Whitespace: one space, or a newline and an indent of spaces and tabs.
  EXPECT_TRUE(Feed(g, "{\n" + std::string(kMaxJsonIndent, ' ') + "\"a\": 1,\n\t\"b\" :\n[ ]\n}").complete);
  EXPECT_FALSE(Feed(g, "{\n" + std::string(kMaxJsonIndent + 1, ' ')).taken);
  EXPECT_FALSE(Feed(g, "{  ").taken);
  EXPECT_FALSE(Feed(g, "{\t").taken);
  EXPECT_FALSE(Feed(g, "{ \n").taken);
  EXPECT_FALSE(Feed(g, "{\r\n").taken);
  // Whitespace inside a string is text.
  EXPECT_TRUE(Feed(g, "{\"" + std::string(100, ' ') + "\":1}").complete);
}

// Random JSON values, written compactly and indented, are taken whole; texts one byte away from them are taken
// exactly when nlohmann's parser accepts them as an object.
TEST(JsonObjectGrammarTest, AgreesWithAJsonParserOnRandomTexts) {
  const JsonObjectGrammar g;
  std::mt19937 rng(7);
  std::function<Json(int)> value = [&](int depth) -> Json {
    switch (rng() % (depth > 3 ? 4 : 6)) {
      case 0:
        return static_cast<int>(rng() % 2000) - 1000;
      case 1:
        return std::ldexp(static_cast<double>(rng() % 10000), -static_cast<int>(rng() % 20));
      case 2:
        return std::string(rng() % 4, static_cast<char>('a' + rng() % 26)) + (rng() % 3 == 0 ? "\"\\\n\t" : "");
      case 3:
        return rng() % 3 == 0 ? Json(nullptr) : Json(rng() % 2 == 0);
      case 4: {
        Json a = Json::array();
        for (int i = static_cast<int>(rng() % 4); i > 0; --i) a.push_back(value(depth + 1));
        return a;
      }
      default: {
        Json o = Json::object();
        for (int i = static_cast<int>(rng() % 4); i > 0; --i) o[std::string(1 + rng() % 3, 'k')] = value(depth + 1);
        return o;
      }
    }
  };
  const std::string alphabet = "{}[]:,\" \n0123456789-+.eEtrufalsn\\/xa";
  int mutants = 0;
  for (int round = 0; round < 200; ++round) {
    Json o = Json::object();
    for (int i = static_cast<int>(rng() % 4); i > 0; --i) o[std::string(1 + rng() % 5, 'a' + rng() % 3)] = value(1);
    for (const std::string& text : {o.dump(), o.dump(2)}) {
      SCOPED_TRACE(text);
      const Fed fed = Feed(g, text);
      ASSERT_TRUE(fed.taken && fed.complete);
      for (int m = 0; m < 20; ++m) {
        std::string mutant = text;
        const size_t at = rng() % (mutant.size() + 1);
        switch (rng() % 3) {
          case 0:
            if (at < mutant.size()) mutant.erase(at, 1);
            break;
          case 1:
            mutant.insert(at, 1, alphabet[rng() % alphabet.size()]);
            break;
          default:
            if (at < mutant.size()) mutant[at] = alphabet[rng() % alphabet.size()];
            break;
        }
        // The grammar stops at the object's end; nlohmann's reader takes whitespace after it.
        if (mutant.empty() || mutant.back() == ' ' || mutant.back() == '\n') continue;
        // nlohmann's reader refuses a number beyond a double (1e625), which JSON's grammar has no bound for.
        if (NumberOverflows(mutant)) continue;
        const Fed mf = Feed(g, mutant);
        if (!WhitespaceKeepsTheRule(mutant)) {
          EXPECT_FALSE(mf.taken && mf.complete) << mutant;
          continue;
        }
        const bool json_object = Json::accept(mutant) && Json::parse(mutant).is_object();
        EXPECT_EQ(mf.taken && mf.complete, json_object) << mutant;
        ++mutants;
      }
    }
  }
  EXPECT_GT(mutants, 5000);
}

TEST(ChoiceGrammarTest, TakesExactlyOneChoice) {
  const ChoiceGrammar g({"yes", "no", "yesterday", "no"});
  EXPECT_TRUE(Feed(g, "yes").complete);
  EXPECT_TRUE(Feed(g, "no").complete);
  EXPECT_TRUE(Feed(g, "yesterday").complete);
  const Fed part = Feed(g, "yest");
  EXPECT_TRUE(part.taken);
  EXPECT_FALSE(part.complete);
  EXPECT_FALSE(Feed(g, "n").complete);
  EXPECT_FALSE(Feed(g, "x").taken);
  EXPECT_FALSE(Feed(g, "yesx").taken);
  EXPECT_FALSE(Feed(g, "nope").taken);
  EXPECT_FALSE(Feed(g, "").complete);
}

TEST(OutputConstraintTest, ValidateNamesTheChoicesAtFault) {
  OutputConstraint c{.kind = OutputConstraint::Kind::kChoice};
  EXPECT_EQ(FieldOf(c.Validate()), "constraint.choices");
  c.choices = {"a", ""};
  EXPECT_EQ(c.Validate().message(), "constraint.choices[1] is empty");
  c.choices = std::vector<std::string>(kMaxChoices + 1, "a");
  EXPECT_FALSE(c.Validate().ok());
  c.choices = {std::string(kMaxChoiceBytes + 1, 'a')};
  EXPECT_FALSE(c.Validate().ok());
  c.choices = {"a"};
  EXPECT_TRUE(c.Validate().ok());
  c.kind = OutputConstraint::Kind::kJsonObject;
  EXPECT_FALSE(c.Validate().ok());
  c.choices.clear();
  EXPECT_TRUE(c.Validate().ok());
}

// A vocabulary of short random tokens: what MarkAllowed finds in its one sorted walk is what feeding each token
// alone finds, from many states of both grammars.
TEST(TokenVocabularyTest, MarkAllowedIsFeedingEachTokenAlone) {
  std::mt19937 rng(3);
  const std::string alphabet = "{}[]:,\" \n019-.etrufalsnyo\\";
  std::vector<std::string> bytes(600);
  for (size_t id = 0; id < bytes.size(); ++id) {
    if (id % 50 == 7) continue;  // a special token
    for (int n = 1 + static_cast<int>(rng() % 4); n > 0; --n) bytes[id] += alphabet[rng() % alphabet.size()];
  }
  const TokenVocabulary vocabulary(bytes);
  const JsonObjectGrammar json;
  const ChoiceGrammar choice({"yes", "no", "yesterday", "[1, 2]"});
  const std::string text = R"( {"key": [1, -0.5e3, true, {"s": "a\"b"}], "n": null, "f": false} )";
  for (const ByteGrammar* g : {static_cast<const ByteGrammar*>(&json), static_cast<const ByteGrammar*>(&choice)}) {
    GrammarState state = g->Start();
    for (size_t n = 0; n < text.size(); ++n) {
      std::vector<char> allowed(bytes.size(), 0);
      vocabulary.MarkAllowed(*g, state, &allowed);
      int count = 0;
      for (size_t id = 0; id < bytes.size(); ++id) {
        GrammarState s = state;
        bool taken = !bytes[id].empty();
        for (const char c : bytes[id]) taken = taken && g->Advance(s, static_cast<uint8_t>(c));
        ASSERT_EQ(allowed[id] != 0, taken) << "token '" << bytes[id] << "' after '" << text.substr(0, n) << "'";
        count += taken ? 1 : 0;
      }
      if (g == &json && !g->Complete(state)) {
        EXPECT_GT(count, 0) << text.substr(0, n);
      }
      if (!g->Advance(state, static_cast<uint8_t>(text[n]))) break;
    }
  }
}

// Vocabulary for the sampler tests: the single bytes of JSON and some longer tokens; EOS is id 0 (special).
std::vector<std::string> SmallVocabulary() {
  std::vector<std::string> bytes = {""};
  for (const char c : std::string("{}[]:,\" 0123456789-.abcdefghijklmnopqrstuvwxyz\\\n")) bytes.push_back({c});
  for (const char* t : {"{\"", "\":", "\",", "true", "false", "null", "\"}", "}}", "yes", "no", "ye", "s."}) {
    bytes.push_back(t);
  }
  return bytes;
}

int32_t IdOf(const std::vector<std::string>& bytes, std::string_view token) {
  return static_cast<int32_t>(std::find(bytes.begin(), bytes.end(), token) - bytes.begin());
}

TEST(SamplerConstraintTest, BannedIdsGetMinusInfinityAndStopIdsComeLast) {
  const std::vector<std::string> bytes = SmallVocabulary();
  auto vocabulary = std::make_shared<const TokenVocabulary>(bytes);
  Sampler s(SamplingOptions{}, {}, {}, TokenConstraint(std::make_shared<JsonObjectGrammar>(), vocabulary, {0}));
  // EOS is the likeliest, then '{', then '}': the pick goes '{', '}' and only then EOS.
  std::vector<float> logits(bytes.size(), 0.0f);
  logits[0] = 9;
  logits[static_cast<size_t>(IdOf(bytes, "{"))] = 8;
  logits[static_cast<size_t>(IdOf(bytes, "}"))] = 7;
  EXPECT_EQ(s.Next(logits), IdOf(bytes, "{"));
  EXPECT_EQ(s.Next(logits), IdOf(bytes, "}"));
  EXPECT_EQ(s.Next(logits), 0);
  // After the object, every id but EOS is banned.
  ASSERT_EQ(s.Deltas().size(), bytes.size() - 1);
  for (const LogitDelta& d : s.Deltas()) EXPECT_TRUE(std::isinf(d.delta) && d.delta < 0) << d.id;
}

TEST(SamplerConstraintTest, KeepsTheSamplersOwnChangesBesideTheBans) {
  const std::vector<std::string> bytes = SmallVocabulary();
  auto vocabulary = std::make_shared<const TokenVocabulary>(bytes);
  const int32_t yes = IdOf(bytes, "yes");
  SamplingOptions options{.logit_bias = {{yes, 2.5}, {IdOf(bytes, "a"), 1.0}}};
  Sampler s(options, {}, {},
            TokenConstraint(std::make_shared<ChoiceGrammar>(std::vector<std::string>{"yes", "no"}), vocabulary, {0}));
  bool saw_yes = false;
  for (const LogitDelta& d : s.Deltas()) {
    if (d.id == yes) {
      saw_yes = true;
      EXPECT_EQ(d.delta, 2.5f);
    } else if (d.id == IdOf(bytes, "a")) {
      EXPECT_TRUE(std::isinf(d.delta));  // biased, but banned
    }
  }
  EXPECT_TRUE(saw_yes);
  std::vector<float> logits(bytes.size(), 0.0f);
  logits[static_cast<size_t>(IdOf(bytes, "no"))] = 2;
  EXPECT_EQ(s.Next(logits), yes);  // 0 + 2.5 > 2
  EXPECT_EQ(s.Next(logits), 0);
}

// Random logits, sampled: whatever is picked, the text stays a prefix the grammar takes, and a request that picks
// EOS holds one JSON object.
TEST(SamplerConstraintTest, RandomPicksMakeValidJson) {
  const std::vector<std::string> bytes = SmallVocabulary();
  auto vocabulary = std::make_shared<const TokenVocabulary>(bytes);
  const JsonObjectGrammar grammar;
  int finished = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal(0.0f, 2.0f);
    Sampler s(SamplingOptions{.temperature = 1.0, .seed = seed}, {}, {},
              TokenConstraint(std::make_shared<JsonObjectGrammar>(), vocabulary, {0}));
    std::string text;
    for (int step = 0; step < 400; ++step) {
      std::vector<float> logits(bytes.size());
      for (float& l : logits) l = normal(rng);
      logits[0] += 3;  // EOS likely once allowed
      for (const char* closing : {"}", "]", "\""}) logits[static_cast<size_t>(IdOf(bytes, closing))] += 2;
      const int32_t id = s.Next(logits);
      if (id == 0) {
        ASSERT_TRUE(Feed(grammar, text).complete) << text;
        const Json parsed = Json::parse(text);
        EXPECT_TRUE(parsed.is_object()) << text;
        ++finished;
        break;
      }
      text += bytes[static_cast<size_t>(id)];
      ASSERT_TRUE(Feed(grammar, text).taken) << text;
    }
  }
  EXPECT_GT(finished, 10);
}

TEST(GenerateOptionsTest, AConstraintNeedsAVocabularyAndAnAnswerThatMayStop) {
  GenerateOptions o{.max_new_tokens = 8, .constraint = {.kind = OutputConstraint::Kind::kJsonObject}};
  absl::Status s = o.Validate(100);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FieldOf(s), "constraint");
  o.vocabulary = std::make_shared<const TokenVocabulary>(std::vector<std::string>(100, "a"));
  EXPECT_TRUE(o.Validate(100).ok());
  o.ignore_eos = true;
  EXPECT_EQ(FieldOf(o.Validate(100)), "ignore_eos");
  o.ignore_eos = false;
  o.min_tokens = 2;
  EXPECT_EQ(FieldOf(o.Validate(100)), "min_tokens");
}

}  // namespace
}  // namespace odmoe
