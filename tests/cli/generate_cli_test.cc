// The `odmoe generate` program as users and scripts call it: the README's command prints the golden
// continuation, --json carries what later tools parse, and bad requests exit with one stderr line and a
// specific code.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

#include "gtest/gtest.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/model_config.h"
#include "src/model/tokenizer.h"
#include "tests/engine/golden_support.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using odmoe::testing::ProgramPath;
using odmoe::testing::RunProgram;
using odmoe::testing::RunResult;
using odmoe::testing::SharedModel;

int Lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

class GenerateCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!odmoe::testing::HaveSharedModel("tiny-mixtral-kjv")) {
      GTEST_SKIP() << "needs " << SharedModel("tiny-mixtral-kjv");
    }
  }
  // `odmoe generate ARGS --json` on tiny-mixtral-kjv: its JSON (null, with a test failure, if it did not exit 0).
  Json GenerateJson(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {odmoe_, "generate", "--model", SharedModel("tiny-mixtral-kjv"), "--json"};
    argv.insert(argv.end(), args.begin(), args.end());
    RunResult r = RunProgram(argv);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    absl::StatusOr<Json> j = ParseJson(r.out, "stdout");
    return r.exit_code == 0 && j.ok() ? *j : Json();
  }

  std::string odmoe_ = ProgramPath("odmoe");
};

TEST_F(GenerateCliTest, ReadmeCommandPrintsTheGoldenContinuation) {
  const std::string dir = SharedModel("tiny-mixtral-kjv");
  auto golden = odmoe::testing::LoadGolden(dir);
  ASSERT_TRUE(golden.ok()) << golden.status();
  const auto& gc = golden->cases.at(0);
  ASSERT_EQ(gc.text, "In the beginning God created the heaven and the earth.");
  RunResult r = RunProgram({odmoe_, "generate", "--model", dir, "--prompt", gc.text, "--max-new-tokens", "64"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto tok = Tokenizer::Load(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::vector<int32_t> all = gc.prompt_ids, ids;
  for (const auto& s : gc.greedy) ids.push_back(s.id);
  all.insert(all.end(), ids.begin(), ids.end());
  const std::string full = (*tok)->Decode(all), prompt_text = (*tok)->Decode(gc.prompt_ids);
  ASSERT_EQ(full.compare(0, prompt_text.size(), prompt_text), 0);
  EXPECT_EQ(r.out, full.substr(prompt_text.size()) + "\n");
  // --json's text is the same text: the continuation as it reads after the prompt, its leading space kept.
  const Json j = GenerateJson({"--prompt", gc.text, "--max-new-tokens", "64"});
  ASSERT_TRUE(j.contains("text"));
  EXPECT_EQ(j["text"].get<std::string>() + "\n", r.out);
}

TEST_F(GenerateCliTest, JsonCarriesTokensTextLogitsRoutingLogprobsAndTimings) {
  const std::string dir = SharedModel("tiny-mixtral-kjv");
  auto golden = odmoe::testing::LoadGolden(dir);
  ASSERT_TRUE(golden.ok()) << golden.status();
  const auto& gc = golden->cases.at(0);
  RunResult r = RunProgram({odmoe_, "generate", "--model", dir, "--prompt", gc.text, "--max-new-tokens", "8",
                            "--dump-logits", "--dump-routing", "--logprobs", "3", "--prompt-logprobs", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r.out, "stdout");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["prompt_ids"].get<std::vector<int32_t>>(), gc.prompt_ids);
  const auto tokens = (*j)["tokens"].get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 8u);
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(tokens[i], gc.greedy[i].id) << "step " << i;
  EXPECT_TRUE((*j)["text"].is_string());
  EXPECT_EQ((*j)["last_logits"].size(), gc.last_logits.size());
  // Routing: prompt positions, then the input token of each decode step after the first.
  const Json& routing = (*j)["routing"];
  ASSERT_EQ(routing.size(), gc.prompt_ids.size() + 7);
  EXPECT_EQ(routing[0].size(), 8u);      // 8 sparse layers
  EXPECT_EQ(routing[0][0].size(), 2u);   // top-2
  const Json& logprobs = (*j)["logprobs"];
  ASSERT_EQ(logprobs.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(logprobs[i]["id"], tokens[i]);
    ASSERT_EQ(logprobs[i]["top"].size(), 3u);
    EXPECT_EQ(logprobs[i]["top"][0], (Json{{"id", tokens[i]}, {"logprob", logprobs[i]["logprob"]}}));  // greedy
    EXPECT_LE(logprobs[i]["logprob"].get<double>(), 0.0);
  }
  const Json& prompt_logprobs = (*j)["prompt_logprobs"];
  ASSERT_EQ(prompt_logprobs.size(), gc.prompt_ids.size() - 1);
  for (size_t i = 0; i < prompt_logprobs.size(); ++i) EXPECT_EQ(prompt_logprobs[i]["id"], gc.prompt_ids[i + 1]);
  EXPECT_GT((*j)["timings"]["ttft_ms"].get<double>(), 0.0);
  EXPECT_GT((*j)["timings"]["decode_tokens_per_s"].get<double>(), 0.0);
}

// --logit-bias at every pick: +100 makes token 13 greedy's pick each time; -100 keeps the golden first token out.
TEST_F(GenerateCliTest, LogitBiasSteersEveryPick) {
  const std::string dir = SharedModel("tiny-mixtral-kjv");
  auto golden = odmoe::testing::LoadGolden(dir);
  ASSERT_TRUE(golden.ok()) << golden.status();
  const auto& gc = golden->cases.at(0);
  std::string prompt_ids;
  for (int32_t id : gc.prompt_ids) prompt_ids += StrCat(prompt_ids.empty() ? "" : ",", id);
  auto tokens = [&](const std::string& bias) {
    RunResult r = RunProgram({odmoe_, "generate", "--model", dir, "--prompt-ids", prompt_ids, "--max-new-tokens", "6",
                              "--ignore-eos", "--logit-bias", bias, "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    auto j = ParseJson(r.out, "stdout");
    return j.ok() ? (*j)["tokens"].get<std::vector<int32_t>>() : std::vector<int32_t>{};
  };
  EXPECT_EQ(tokens("13:100"), std::vector<int32_t>(6, 13));
  const std::vector<int32_t> banned = tokens(StrCat(gc.greedy[0].id, ":-100, 13:0"));
  ASSERT_EQ(banned.size(), 6u);
  EXPECT_NE(banned[0], gc.greedy[0].id);
}

// --min-tokens keeps EOS out of the first picks, even when a bias makes it the likeliest token.
TEST_F(GenerateCliTest, MinTokensKeepsEosOutOfTheFirstTokens) {
  auto config = LoadModelConfig(SharedModel("tiny-mixtral-kjv"));
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t eos = config->eos_token_ids.at(0);
  auto tokens = [&](const std::string& min_tokens) {
    const Json j = GenerateJson({"--prompt-ids", "1,415,2043", "--max-new-tokens", "6", "--logit-bias",
                                 StrCat(eos, ":100"), "--min-tokens", min_tokens});
    return j.is_null() ? std::vector<int64_t>{} : j["tokens"].get<std::vector<int64_t>>();
  };
  EXPECT_EQ(tokens("0"), std::vector<int64_t>{eos});
  const std::vector<int64_t> later = tokens("2");
  ASSERT_EQ(later.size(), 3u);
  EXPECT_NE(later[0], eos);
  EXPECT_NE(later[1], eos);
  EXPECT_EQ(later[2], eos);
}

// Structured output: --choice answers one of the texts, --json-object one JSON object, each ended by EOS; the
// greedy answer of the local engine, which the cluster's HTTP tests check the same way.
TEST_F(GenerateCliTest, StructuredOutputEndsWhereItsGrammarDoes) {
  auto config = LoadModelConfig(SharedModel("tiny-mixtral-kjv"));
  ASSERT_TRUE(config.ok()) << config.status();
  const Json chosen = GenerateJson({"--prompt", "And God said", "--max-new-tokens", "20", "--choice",
                                    "Let there be light,Yes,No", "--temperature", "1", "--seed", "5"});
  ASSERT_FALSE(chosen.is_null());
  const std::string text = chosen["text"];
  EXPECT_TRUE(text == "Let there be light" || text == "Yes" || text == "No") << chosen.dump();
  EXPECT_EQ(chosen["stop_reason"], "eos");
  EXPECT_EQ(chosen["tokens"].back(), config->eos_token_ids.at(0));
  const Json object = GenerateJson({"--prompt", "The ark, as JSON:", "--max-new-tokens", "48", "--json-object"});
  ASSERT_FALSE(object.is_null());
  const std::string json_text = object["text"];
  ASSERT_NE(json_text.find('{'), std::string::npos) << object.dump();
  if (object["stop_reason"] == "eos") {
    auto parsed = ParseJson(json_text, "the answer");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_TRUE(parsed->is_object()) << json_text;
  } else {
    EXPECT_EQ(object["tokens"].size(), 48u) << object.dump();
  }
  // Refused before any weight is read: with --ignore-eos the answer could not stop at its end.
  const RunResult endless = RunProgram({odmoe_, "generate", "--model", SharedModel("tiny-mixtral-kjv"), "--prompt",
                                        "x", "--max-new-tokens", "4", "--json-object", "--ignore-eos"});
  EXPECT_EQ(endless.exit_code, 2) << endless.err;
  EXPECT_NE(endless.err.find("--ignore-eos cannot be set with a structured output"), std::string::npos)
      << endless.err;
}

// --json-schema: the answer is one object of the schema, properties in its order; --compact-json leaves
// whitespace out. A schema odmoe cannot generate is refused naming the flag and where in the schema.
TEST_F(GenerateCliTest, JsonSchemaAnswersHoldToTheSchema) {
  const std::string dir = ::testing::TempDir() + "/generate_json_schema";
  std::filesystem::create_directories(dir);
  const std::string schema = dir + "/person.json";
  std::ofstream(schema) << R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "city": {"enum": ["Jerusalem", "Babylon", "Egypt"]}}, "required": ["name", "age", "city"],
      "additionalProperties": false})";
  for (const char* temperature : {"0", "1"}) {
    const Json answer = GenerateJson({"--prompt", "The ark, as JSON:", "--max-new-tokens", "64", "--json-schema",
                                      schema, "--compact-json", "--temperature", temperature, "--seed", "4"});
    ASSERT_FALSE(answer.is_null());
    EXPECT_EQ(answer["stop_reason"], "eos") << answer.dump();
    absl::StatusOr<OrderedJson> parsed = ParseOrderedJson(answer["text"].get<std::string>(), "the answer");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ASSERT_EQ(parsed->size(), 3u) << answer.dump();
    EXPECT_EQ(parsed->begin().key(), "name");
    EXPECT_LE((*parsed)["name"].get<std::string>().size(), 20u * 4);
    EXPECT_TRUE((*parsed)["age"].is_number_integer());
    EXPECT_GE((*parsed)["age"].get<int>(), 0);
    EXPECT_LE((*parsed)["age"].get<int>(), 120);
    const std::string city = (*parsed)["city"];
    EXPECT_TRUE(city == "Jerusalem" || city == "Babylon" || city == "Egypt") << city;
    EXPECT_EQ(DumpOrderedJson(*parsed).size(), answer["text"].get<std::string>().size()) << "compact";
  }
  const std::string bad = dir + "/bad.json";
  std::ofstream(bad) << R"({"properties": {"a": {"type": "string", "multipleOf": 2}}})";
  const RunResult refused = RunProgram({odmoe_, "generate", "--model", SharedModel("tiny-mixtral-kjv"), "--prompt", "x",
                                        "--max-new-tokens", "4", "--json-schema", bad});
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("--json-schema at '/properties/a': 'multipleOf' is not supported"), std::string::npos)
      << refused.err;
}

// --regex: the whole answer matches the expression, and ends (EOS) once nothing can follow; a refused expression
// is named with the flag.
TEST_F(GenerateCliTest, RegexAnswersMatchWhole) {
  const std::regex reference(R"([A-Z][a-z]+ (said|spake) unto [A-Z][a-z]+\.)");
  for (const char* temperature : {"0", "1"}) {
    const Json answer =
        GenerateJson({"--prompt", "And the man said", "--max-new-tokens", "40", "--regex",
                      R"([A-Z][a-z]+ (said|spake) unto [A-Z][a-z]+\.)", "--temperature", temperature, "--seed", "2"});
    ASSERT_FALSE(answer.is_null());
    EXPECT_EQ(answer["stop_reason"], "eos") << answer.dump();
    EXPECT_TRUE(std::regex_match(answer["text"].get<std::string>(), reference)) << answer.dump();
  }
  const RunResult refused = RunProgram({odmoe_, "generate", "--model", SharedModel("tiny-mixtral-kjv"), "--prompt", "x",
                                        "--max-new-tokens", "4", "--regex", "a(?=b)"});
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("--regex at character 3: lookarounds are not supported"), std::string::npos)
      << refused.err;
}

// --stop-token-ids ends generation at the first of them: the id among the tokens, its text left out.
TEST_F(GenerateCliTest, StopTokenIdsEndGenerationAndLeaveTheirTextOut) {
  auto run = [&](int max_new_tokens, const std::string& stop_ids) {
    std::vector<std::string> args = {"--prompt-ids", "1,415,2043", "--max-new-tokens", std::to_string(max_new_tokens),
                                     "--ignore-eos"};
    if (!stop_ids.empty()) args.insert(args.end(), {"--stop-token-ids", stop_ids});
    return GenerateJson(args);
  };
  const Json free = run(6, "");
  ASSERT_FALSE(free.is_null());
  const std::vector<int32_t> all = free["tokens"].get<std::vector<int32_t>>();
  ASSERT_EQ(all.size(), 6u);
  const int32_t stop_id = all[2];
  const auto before = std::find(all.begin(), all.end(), stop_id) - all.begin();
  const Json stopped = run(6, StrCat("7, ", stop_id));
  ASSERT_FALSE(stopped.is_null());
  EXPECT_EQ(stopped["tokens"].get<std::vector<int32_t>>(), std::vector<int32_t>(all.begin(), all.begin() + before + 1));
  EXPECT_EQ(stopped["stop_reason"], "stop_token");
  const std::string text_before = before > 0 ? run(static_cast<int>(before), "")["text"].get<std::string>() : "";
  EXPECT_EQ(stopped["text"], text_before);
  // --include-stop-text keeps the stop token's text (vLLM's include_stop_str_in_output).
  const Json kept = GenerateJson({"--prompt-ids", "1,415,2043", "--max-new-tokens", "6", "--ignore-eos",
                                  "--stop-token-ids", StrCat(stop_id), "--include-stop-text"});
  ASSERT_FALSE(kept.is_null());
  EXPECT_EQ(kept["tokens"], stopped["tokens"]);
  EXPECT_EQ(kept["text"], run(static_cast<int>(before) + 1, "")["text"]);
}

TEST_F(GenerateCliTest, PromptIdsWorkAndSamplingIsSeeded) {
  const std::string dir = SharedModel("tiny-mixtral-kjv");
  auto run = [&](const std::string& seed) {
    return RunProgram({odmoe_, "generate", "--model", dir, "--prompt-ids", "1,457,3155,890", "--max-new-tokens",
                       "12", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", seed,
                       "--ignore-eos", "--json"});
  };
  RunResult a = run("5"), b = run("5"), c = run("6");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  auto ja = ParseJson(a.out, "a"), jb = ParseJson(b.out, "b"), jc = ParseJson(c.out, "c");
  ASSERT_TRUE(ja.ok() && jb.ok() && jc.ok());
  EXPECT_EQ((*ja)["tokens"], (*jb)["tokens"]);
  EXPECT_EQ((*ja)["tokens"].size(), 12u);
  EXPECT_NE((*ja)["tokens"], (*jc)["tokens"]);
}

struct BadCase {
  std::vector<std::string> args;
  int code;
  std::string needle;  // must appear in the one stderr line
};

TEST_F(GenerateCliTest, BadRequestsExitWithOneLineAndASpecificCode) {
  const std::string kjv = SharedModel("tiny-mixtral-kjv");
  const std::string qwen = SharedModel("qwen2moe-tiny");
  const std::vector<BadCase> cases = {
      {{"--model", kjv, "--prompt-ids", "1,4096", "--max-new-tokens", "4"}, kExitOutOfRange, "4096"},
      {{"--model", kjv, "--prompt-ids", "1,-3", "--max-new-tokens", "4"}, kExitOutOfRange, "-3"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "100000"}, kExitOutOfRange, "max_position_embeddings"},
      {{"--model", kjv, "--prompt", "x"}, kExitUsage, "--max-new-tokens"},
      {{"--model", kjv, "--prompt", "x", "--prompt-ids", "1", "--max-new-tokens", "1"}, kExitUsage, "--prompt-ids"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--bogus"}, kExitUsage, "--bogus"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "two"}, kExitUsage, "--max-new-tokens"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--temperature", "-1"}, kExitUsage,
       "--temperature"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--backend", "tpu"}, kExitUsage, "tpu"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--frequency-penalty", "3"}, kExitUsage,
       "--frequency-penalty must be in [-2, 2], got 3"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--logit-bias", "7:101"}, kExitUsage,
       "--logit-bias of token 7 must be in [-100, 100], got 101"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--logit-bias", "7=1"}, kExitUsage,
       "--logit-bias: '7=1' is not TOKEN_ID:BIAS"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--logit-bias", "4096:1"}, kExitOutOfRange,
       "--logit-bias token id 4096 is outside the vocabulary [0, 4096)"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--logprobs", "21"}, kExitUsage, "--logprobs"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "2", "--min-tokens", "3"}, kExitUsage,
       "--min-tokens must be in [0, --max-new-tokens = 2], got 3"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "2", "--stop-token-ids", "1,-2"}, kExitUsage,
       "--stop-token-ids: -2 is not a token id"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "2", "--stop-token-ids", "4096"}, kExitOutOfRange,
       "--stop-token-ids id 4096 is outside the vocabulary [0, 4096)"},
      {{"--model", kjv, "--prompt", "x", "--max-new-tokens", "1", "--prompt-logprobs"}, kExitUsage, "--logprobs N"},
      {{"--model", qwen, "--prompt", "hello", "--max-new-tokens", "1"}, kExitInvalidModel, "--prompt-ids"},
      {{"--model", "/nonexistent/model", "--prompt-ids", "1", "--max-new-tokens", "1"}, kExitNotFound,
       "/nonexistent/model"},
  };
  for (const BadCase& c : cases) {
    std::vector<std::string> argv = {odmoe_, "generate"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    RunResult r = RunProgram(argv);
    SCOPED_TRACE(c.needle);
    EXPECT_EQ(r.signal, 0) << "crashed";
    EXPECT_EQ(r.exit_code, c.code) << r.err;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

}  // namespace
}  // namespace odmoe
