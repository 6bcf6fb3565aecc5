// The OpenAI API's pure parts: request parsing and checking, error objects, stop strings across pieces, chat
// templates, and the response / server-sent-event formats.
#include "src/main_node/openai_api.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/model/hf_tokenizer.h"
#include "src/model/tokenizer.h"
#include "tests/test_support.h"

namespace odmoe::openai {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<CompletionRequest> Parse(const std::string& body, Endpoint e = Endpoint::kCompletions,
                                        ApiError* error = nullptr) {
  ApiError ignored;
  return ParseCompletionRequest(body, e, error != nullptr ? error : &ignored);
}

TEST(OpenAiParse, PromptForms) {
  auto text = Parse(R"({"model":"m","prompt":"And God said"})");
  ASSERT_TRUE(text.ok()) << text.status();
  ASSERT_EQ(text->prompts.size(), 1u);
  EXPECT_TRUE(text->prompts[0].is_text);
  EXPECT_EQ(text->prompts[0].text, "And God said");

  auto strings = Parse(R"({"model":"m","prompt":["a","b"]})");
  ASSERT_TRUE(strings.ok());
  ASSERT_EQ(strings->prompts.size(), 2u);
  EXPECT_EQ(strings->prompts[1].text, "b");

  auto ids = Parse(R"({"model":"m","prompt":[1,415,2043]})");
  ASSERT_TRUE(ids.ok());
  ASSERT_EQ(ids->prompts.size(), 1u);
  EXPECT_FALSE(ids->prompts[0].is_text);
  EXPECT_EQ(ids->prompts[0].ids, (std::vector<int32_t>{1, 415, 2043}));

  auto lists = Parse(R"({"model":"m","prompt":[[1,2],[3]]})");
  ASSERT_TRUE(lists.ok());
  ASSERT_EQ(lists->prompts.size(), 2u);
  EXPECT_EQ(lists->prompts[1].ids, (std::vector<int32_t>{3}));
}

// As vLLM's pydantic models: an integer field takes a whole number written as a float (Python's 2048 / 2).
TEST(OpenAiParse, WholeFloatsAreIntegers) {
  auto r = Parse(R"({"model":"m","prompt":"x","max_tokens":1024.0,"n":2.0,"seed":-3.0,"top_k":1e1})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->max_tokens, 1024);
  EXPECT_EQ(r->n, 2);
  EXPECT_EQ(*r->seed, static_cast<uint64_t>(int64_t{-3}));  // as the integer -3 is taken
  EXPECT_EQ(r->top_k, 10);
  for (const char* body :
       {R"({"model":"m","prompt":"x","max_tokens":16.5})", R"({"model":"m","prompt":"x","max_tokens":1e30})"}) {
    ApiError error;
    EXPECT_FALSE(ParseCompletionRequest(body, Endpoint::kCompletions, &error).ok()) << body;
    EXPECT_EQ(error.param, "max_tokens") << body;
    EXPECT_NE(error.message.find("'max_tokens' must be an integer, got 1"), std::string::npos) << error.message;
  }
  // Token ids too (a prompt of ids built by numpy or JavaScript arithmetic).
  r = Parse(R"({"model":"m","prompt":[[1,2.0],[3e0]],"stop_token_ids":[7.0]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(r->prompts[0].ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r->prompts[1].ids, (std::vector<int32_t>{3}));
  EXPECT_EQ(r->stop_token_ids, (std::vector<int32_t>{7}));
}

// As vLLM (and llama.cpp's server): a request may leave `model` out, or send null, for the served model.
TEST(OpenAiParse, ModelIsOptional) {
  auto named = Parse(R"({"model":"m","prompt":"x"})");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->model, "m");
  for (const char* body : {R"({"prompt":"x"})", R"({"model":null,"prompt":"x"})"}) {
    auto r = Parse(body);
    ASSERT_TRUE(r.ok()) << body << ": " << r.status();
    EXPECT_FALSE(r->model.has_value()) << body;
  }
  ApiError error;
  auto t = ParseTokenizeRequest(R"({"prompt":"hi"})", &error);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->model.has_value());
  auto d = ParseDetokenizeRequest(R"({"model":null,"tokens":[1]})", &error);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->model.has_value());
}

TEST(OpenAiParse, DefaultsAndOptions) {
  auto r = Parse(
      R"({"model":"m","prompt":"x","max_tokens":5,"temperature":0,"top_p":0.5,"seed":7,"stop":["\n","And"],
          "stream":true,"stream_options":{"include_usage":true},"user":"someone","n":1,"logprobs":null,
          "echo":false,"presence_penalty":0,"tools":[],"unknown_field":{"x":1}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->max_tokens, 5);
  EXPECT_EQ(r->temperature, 0.0);
  EXPECT_EQ(r->top_p, 0.5);
  EXPECT_EQ(*r->seed, 7u);
  EXPECT_EQ(r->stop, (std::vector<std::string>{"\n", "And"}));
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_FALSE(r->continuous_usage);
  EXPECT_EQ(r->n, 1);
  auto continuous =
      Parse(R"({"model":"m","prompt":"x","stream":true,"stream_options":{"continuous_usage_stats":true}})");
  ASSERT_TRUE(continuous.ok()) << continuous.status();
  EXPECT_TRUE(continuous->continuous_usage);

  auto n = Parse(R"({"model":"m","messages":[{"role":"user","content":"hi"}],"n":3})", Endpoint::kChatCompletions);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->n, 3);

  auto penalties = Parse(
      R"({"model":"m","prompt":"x","presence_penalty":-0.5,"frequency_penalty":1.25,"logit_bias":{"7":-100,"50256":2.5}})");
  ASSERT_TRUE(penalties.ok()) << penalties.status();
  EXPECT_EQ(penalties->presence_penalty, -0.5);
  EXPECT_EQ(penalties->frequency_penalty, 1.25);
  std::vector<std::pair<int32_t, double>> bias = penalties->logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<int32_t, double>>{{7, -100.0}, {50256, 2.5}}));

  // What a client sends that needs nothing odmoe lacks: no tool call demanded, text only, nulls for the rest.
  auto plain = Parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":"auto",
                         "function_call":"none","modalities":["text"],"audio":null,"guided_json":null,
                         "prompt_logprobs":null,"reasoning_effort":"low","store":false})",
                     Endpoint::kChatCompletions);
  EXPECT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->constraint.active());

  // Structured output: one JSON object, or one of the choices.
  auto json_object = Parse(R"({"model":"m","prompt":"x","response_format":{"type":"json_object"}})");
  ASSERT_TRUE(json_object.ok()) << json_object.status();
  EXPECT_EQ(json_object->constraint.kind, OutputConstraint::Kind::kJsonObject);
  auto text = Parse(R"({"model":"m","prompt":"x","response_format":{"type":"text"}})");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_FALSE(text->constraint.active());
  auto choice = Parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],"guided_choice":["yes","no"]})",
                      Endpoint::kChatCompletions);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->constraint.kind, OutputConstraint::Kind::kChoice);
  EXPECT_EQ(choice->constraint.choices, (std::vector<std::string>{"yes", "no"}));
  // vLLM's newer form of both.
  auto so_choice = Parse(R"({"model":"m","prompt":"x","structured_outputs":{"choice":["a","b"],"json":null}})");
  ASSERT_TRUE(so_choice.ok()) << so_choice.status();
  EXPECT_EQ(so_choice->constraint.kind, OutputConstraint::Kind::kChoice);
  EXPECT_EQ(so_choice->constraint.choices, (std::vector<std::string>{"a", "b"}));
  auto so_json = Parse(R"({"model":"m","prompt":"x","structured_outputs":{"json_object":true,
                           "disable_any_whitespace":true}})");
  ASSERT_TRUE(so_json.ok()) << so_json.status();
  EXPECT_EQ(so_json->constraint.kind, OutputConstraint::Kind::kJsonObject);
  auto so_none = Parse(R"({"model":"m","prompt":"x","structured_outputs":{"json_object":false}})");
  ASSERT_TRUE(so_none.ok()) << so_none.status();
  EXPECT_FALSE(so_none->constraint.active());
  // A JSON Schema, its keys kept in the order the client wrote them (the generated properties' order), from
  // OpenAI's response_format, vLLM's guided_json (an object or a string) and structured_outputs.json.
  const std::string schema =
      R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}},"required":["zeta","alpha"],"additionalProperties":false})";
  for (const std::string& body :
       {R"({"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema",
            "json_schema":{"name":"pair","strict":true,"schema":)" +
            schema + "}}}",
        R"({"model":"m","messages":[{"role":"user","content":"x"}],"guided_json":)" + schema + "}",
        R"({"model":"m","messages":[{"role":"user","content":"x"}],"guided_json":)" + Json(schema).dump() + "}",
        R"({"model":"m","messages":[{"role":"user","content":"x"}],"structured_outputs":{"json":)" + schema + "}}"}) {
    auto parsed = Parse(body, Endpoint::kChatCompletions);
    ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << body;
    EXPECT_EQ(parsed->constraint.kind, OutputConstraint::Kind::kJsonSchema);
    EXPECT_EQ(parsed->constraint.schema, schema) << body;
    EXPECT_TRUE(parsed->constraint.Validate().ok());
  }
  // A regular expression the whole answer matches: vLLM's guided_regex and structured_outputs.regex.
  for (const std::string& body : {std::string(R"({"model":"m","prompt":"x","guided_regex":"(?P<area>\\d{3})-\\d{4}"})"),
                                  std::string(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                       "structured_outputs":{"regex":"(?P<area>\\d{3})-\\d{4}","json":null}})")}) {
    auto parsed =
        Parse(body, body.find("messages") != std::string::npos ? Endpoint::kChatCompletions : Endpoint::kCompletions);
    ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << body;
    EXPECT_EQ(parsed->constraint.kind, OutputConstraint::Kind::kRegex);
    EXPECT_EQ(parsed->constraint.regex, R"((?P<area>\d{3})-\d{4})");
    EXPECT_TRUE(parsed->constraint.Validate().ok());
  }

  // vLLM's top_k: -1 and 0 cut nothing; its other sampling extensions at the values that change nothing.
  auto top_k = Parse(R"({"model":"m","prompt":"x","top_k":40,"min_p":0,"repetition_penalty":1,"min_tokens":0,
                         "use_beam_search":false})");
  ASSERT_TRUE(top_k.ok()) << top_k.status();
  EXPECT_EQ(top_k->top_k, 40);
  EXPECT_EQ(top_k->min_p, 0.0);
  EXPECT_EQ(top_k->repetition_penalty, 1.0);
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x","min_p":0.05})")->min_p, 0.05);
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x","repetition_penalty":1.1})")->repetition_penalty, 1.1);
  EXPECT_EQ(top_k->min_tokens, 0);
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x","top_k":-1})")->top_k, 0);
  // vLLM's min_tokens (checked against max_tokens once that is known, when the request is prepared).
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x","min_tokens":4})")->min_tokens, 4);
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x","stop_token_ids":[13,2]})")->stop_token_ids,
            (std::vector<int32_t>{13, 2}));
  EXPECT_TRUE(Parse(R"({"model":"m","prompt":"x","include_stop_str_in_output":true})")->include_stop_str_in_output);
  EXPECT_FALSE(Parse(R"({"model":"m","prompt":"x"})")->include_stop_str_in_output);

  auto d = Parse(R"({"model":"m","prompt":"x"})");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->top_k, 0);
  EXPECT_FALSE(d->max_tokens.has_value());
  EXPECT_EQ(d->temperature, 1.0);
  EXPECT_EQ(d->top_p, 1.0);
  EXPECT_FALSE(d->seed.has_value());
  EXPECT_FALSE(d->stream);

  auto both = Parse(R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":9,
                        "max_completion_tokens":4,"stop":"x"})",
                    Endpoint::kChatCompletions);
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(*both->max_tokens, 4);
  EXPECT_EQ(both->stop, (std::vector<std::string>{"x"}));
}

TEST(OpenAiParse, TokenizeAndDetokenize) {
  ApiError error;
  auto t = ParseTokenizeRequest(R"({"model":"m","prompt":"hi","add_special_tokens":false})", &error);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->model, "m");
  EXPECT_EQ(*t->prompt, "hi");
  EXPECT_FALSE(t->add_special_tokens);
  auto chat = ParseTokenizeRequest(R"({"model":"m","messages":[{"role":"user","content":"hi"}]})", &error);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_FALSE(chat->prompt.has_value());
  ASSERT_EQ(chat->messages.size(), 1u);
  EXPECT_EQ(chat->messages[0].content, "hi");
  auto d = ParseDetokenizeRequest(R"({"model":"m","tokens":[1,2,3]})", &error);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(ParseDetokenizeRequest(R"({"model":"m","tokens":[]})", &error).ok());

  const struct {
    const char* body;
    bool detokenize;
    const char* param;
    const char* message;
  } bad[] = {
      {R"({"model":1,"prompt":"x"})", false, "model", "'model' must be a string"},
      {R"({"model":"m"})", false, "prompt", "give either 'prompt' or 'messages'"},
      {R"({"model":"m","prompt":"x","messages":[]})", false, "prompt", "either"},
      {R"({"model":"m","prompt":[1,2]})", false, "prompt", "must be a string"},
      {R"({"model":"m","prompt":"x","add_special_tokens":1})", false, "add_special_tokens", "a boolean"},
      {R"({"model":"m","messages":[]})", false, "messages", "empty list"},
      {R"({"model":"m"})", true, "tokens", "'tokens' is required"},
      {R"({"model":"m","tokens":"1 2"})", true, "tokens", "a list of token ids"},
      {R"({"model":"m","tokens":[1,-1]})", true, "tokens", "'tokens[1]' is not a token id"},
      {R"([1])", true, "", "a JSON object"},
  };
  for (const auto& c : bad) {
    ApiError e;
    const absl::Status s =
        c.detokenize ? ParseDetokenizeRequest(c.body, &e).status() : ParseTokenizeRequest(c.body, &e).status();
    EXPECT_FALSE(s.ok()) << c.body;
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_NE(e.message.find(c.message), std::string::npos) << c.body << " -> " << e.message;
  }
  EXPECT_EQ(TokenizeBody({1, 5}, 2048), R"({"count":2,"max_model_len":2048,"tokens":[1,5]})");
  EXPECT_EQ(DetokenizeBody("a\xff"), "{\"prompt\":\"a\xef\xbf\xbd\"}");
}

TEST(OpenAiParse, Logprobs) {
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x"})")->logprobs, -1);
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x","logprobs":0})")->logprobs, 0);
  EXPECT_EQ(Parse(R"({"model":"m","prompt":"x","logprobs":20,"top_logprobs":3})")->logprobs, 20);
  const std::string chat = R"({"model":"m","messages":[{"role":"user","content":"x"}])";
  EXPECT_EQ(Parse(chat + "}", Endpoint::kChatCompletions)->logprobs, -1);
  EXPECT_EQ(Parse(chat + R"(,"logprobs":false,"top_logprobs":0})", Endpoint::kChatCompletions)->logprobs, -1);
  EXPECT_EQ(Parse(chat + R"(,"logprobs":true})", Endpoint::kChatCompletions)->logprobs, 0);
  EXPECT_EQ(Parse(chat + R"(,"logprobs":true,"top_logprobs":4})", Endpoint::kChatCompletions)->logprobs, 4);
}

TEST(OpenAiParse, EchoIsACompletionsOptionThatAllowsNoNewTokens) {
  auto r = Parse(R"({"model":"m","prompt":[1,2,3],"echo":true,"logprobs":1,"max_tokens":0})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->echo);
  EXPECT_EQ(*r->max_tokens, 0);
  EXPECT_FALSE(Parse(R"({"model":"m","prompt":"x"})")->echo);
  ApiError error;
  EXPECT_FALSE(Parse(R"({"model":"m","prompt":"x","max_tokens":0})", Endpoint::kCompletions, &error).ok());
  EXPECT_EQ(error.param, "max_tokens");
  EXPECT_NE(error.message.find("0 with 'echo'"), std::string::npos) << error.message;
  EXPECT_FALSE(Parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],"echo":true})",
                     Endpoint::kChatCompletions, &error)
                   .ok());
  EXPECT_EQ(error.param, "echo");
  EXPECT_FALSE(Parse(R"({"model":"m","prompt":"x","echo":1})", Endpoint::kCompletions, &error).ok());
  EXPECT_EQ(error.param, "echo");
}

TEST(OpenAiParse, ChatMessages) {
  auto r = Parse(R"({"model":"m","messages":[{"role":"developer","content":"be brief"},
                     {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                     {"role":"assistant","content":null},{"role":"user","content":"c","name":"x"}]})",
                 Endpoint::kChatCompletions);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages.size(), 4u);
  EXPECT_EQ(r->messages[0].role, "system");
  EXPECT_EQ(r->messages[1].content, "ab");
  EXPECT_EQ(r->messages[2].content, "");
}

TEST(OpenAiParse, ToolsAndToolCalls) {
  // The tools, their schemas in the client's key order; "auto" by default; a conversation with a call and its result.
  auto r = Parse(R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":null,"tool_calls":[
                     {"id":"c1","type":"function","function":{"name":"f","arguments":"{\"z\": 1, \"a\": 2}"}}]},
                     {"role":"tool","tool_call_id":"c1","content":"3"}],
                   "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",
                     "properties":{"z":{"type":"integer"},"a":{"type":"integer"}}}}},
                     {"type":"function","function":{"name":"g-2"}}]})",
                 Endpoint::kChatCompletions);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tools.size(), 2u);
  EXPECT_EQ(r->tools[0].name, "f");
  EXPECT_EQ(DumpOrderedJson(r->tools[0].parameters["properties"]),
            R"({"z":{"type":"integer"},"a":{"type":"integer"}})");
  EXPECT_EQ(DumpOrderedJson(r->tools[1].parameters),
            R"({"type":"object","properties":{},"additionalProperties":false})");
  EXPECT_EQ(r->tool_calling.choice, ToolChoice::kAuto);
  EXPECT_TRUE(r->tool_calling.parallel);
  EXPECT_FALSE(r->constraint.active());
  ASSERT_EQ(r->messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r->messages[1].tool_calls[0].id, "c1");
  EXPECT_EQ(r->messages[1].tool_calls[0].arguments, "{\"z\": 1, \"a\": 2}");
  EXPECT_EQ(r->messages[2].tool_call_id, "c1");

  // "required" without parallel calls: a list of one call, held by the grammar.
  auto one = Parse(R"({"messages":[{"role":"user","content":"a"}],"tool_choice":"required","parallel_tool_calls":false,
                     "tools":[{"type":"function","function":{"name":"f"}}]})",
                   Endpoint::kChatCompletions);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->tool_calling.choice, ToolChoice::kRequired);
  EXPECT_FALSE(one->tool_calling.parallel);
  EXPECT_EQ(one->constraint_param, "tool_choice");
  EXPECT_NE(one->constraint.schema.find(R"("maxItems":1)"), std::string::npos) << one->constraint.schema;
  // A named function: its parameters are the answer's schema; "none" leaves the answer free.
  auto named = Parse(R"({"messages":[{"role":"user","content":"a"}],"tools":[{"type":"function","function":{
                       "name":"f","parameters":{"type":"object","properties":{"x":{"type":"string"}}}}}],
                       "tool_choice":{"type":"function","function":{"name":"f"}}})",
                     Endpoint::kChatCompletions);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->tool_calling.function, "f");
  EXPECT_EQ(named->constraint.schema, R"({"type":"object","properties":{"x":{"type":"string"}}})");
  auto none = Parse(R"({"messages":[{"role":"user","content":"a"}],"tool_choice":"none",
                      "tools":[{"type":"function","function":{"name":"f"}}]})",
                    Endpoint::kChatCompletions);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->tool_calling.choice, ToolChoice::kNone);
  EXPECT_FALSE(none->constraint.active());
}

// Each bad body: the param the error names and a piece of its message.
TEST(OpenAiParse, ErrorsNameTheField) {
  const struct {
    std::string body;
    Endpoint endpoint;
    std::string param;
    std::string message;
  } cases[] = {
      {R"({"model":"m","prompt":"x")", Endpoint::kCompletions, "", "invalid JSON"},
      {R"([1,2])", Endpoint::kCompletions, "", "must be a JSON object"},
      {R"({"model":3,"prompt":"x"})", Endpoint::kCompletions, "model", "'model' must be a string, got integer"},
      {R"({"model":"m"})", Endpoint::kCompletions, "prompt", "'prompt' is required"},
      {R"({"model":"m","prompt":[]})", Endpoint::kCompletions, "prompt", "empty list"},
      {R"({"model":"m","prompt":["a",2]})", Endpoint::kCompletions, "prompt", "'prompt[1]' must be a string"},
      {R"({"model":"m","prompt":[1,-2]})", Endpoint::kCompletions, "prompt", "'prompt[1]' is not a token id"},
      {R"({"model":"m","prompt":[1,4294967296]})", Endpoint::kCompletions, "prompt", "not a token id"},
      {R"({"model":"m","prompt":[1,2.5]})", Endpoint::kCompletions, "prompt", "'prompt[1]' is not a token id: 2.5"},
      {R"({"model":"m","prompt":[1,"2"]})", Endpoint::kCompletions, "prompt", "must be a token id"},
      {R"({"model":"m","prompt":{"a":1}})", Endpoint::kCompletions, "prompt", "got object"},
      {R"({"model":"m","prompt":"x","max_tokens":"5"})", Endpoint::kCompletions, "max_tokens",
       "'max_tokens' must be an integer, got string"},
      {R"({"model":"m","prompt":"x","max_tokens":0})", Endpoint::kCompletions, "max_tokens", "must be >= 1"},
      {R"({"model":"m","prompt":"x","temperature":3})", Endpoint::kCompletions, "temperature", "[0, 2]"},
      {R"({"model":"m","prompt":"x","top_p":0})", Endpoint::kCompletions, "top_p", "(0, 1]"},
      {R"({"model":"m","prompt":"x","seed":1.5})", Endpoint::kCompletions, "seed", "an integer"},
      {R"({"model":"m","prompt":"x","top_k":-2})", Endpoint::kCompletions, "top_k",
       "'top_k' must be -1, 0 (all) or >= 1, got -2"},
      {R"({"model":"m","prompt":"x","top_k":2.5})", Endpoint::kCompletions, "top_k", "an integer"},
      {R"({"model":"m","prompt":"x","min_p":1.5})", Endpoint::kCompletions, "min_p",
       "'min_p' must be in [0, 1], got 1.5"},
      {R"({"model":"m","prompt":"x","repetition_penalty":0})", Endpoint::kCompletions, "repetition_penalty",
       "'repetition_penalty' must be in (0, 100], got 0"},
      {R"({"model":"m","prompt":"x","repetition_penalty":-1})", Endpoint::kCompletions, "repetition_penalty",
       "'repetition_penalty' must be in [0, 100], got -1"},
      {R"({"model":"m","prompt":"x","min_tokens":2.5})", Endpoint::kCompletions, "min_tokens", "an integer"},
      {R"({"model":"m","prompt":"x","stop_token_ids":13})", Endpoint::kCompletions, "stop_token_ids",
       "a list of token ids"},
      {R"({"model":"m","prompt":"x","stop_token_ids":[1,-2]})", Endpoint::kCompletions, "stop_token_ids",
       "'stop_token_ids[1]' is not a token id: -2"},
      {R"({"model":"m","prompt":"x","min_tokens":-1})", Endpoint::kCompletions, "min_tokens", "must be >= 0"},
      {R"({"model":"m","prompt":"x","use_beam_search":true})", Endpoint::kCompletions, "use_beam_search",
       "not supported"},
      {R"({"model":"m","prompt":"x","stop":3})", Endpoint::kCompletions, "stop", "a string or a list"},
      {R"({"model":"m","prompt":"x","stream":"yes"})", Endpoint::kCompletions, "stream", "a boolean"},
      {R"({"model":"m","prompt":"x","stream_options":{"include_usage":true}})", Endpoint::kCompletions,
       "stream_options", "only allowed with 'stream': true"},
      {R"({"model":"m","prompt":"x","n":0})", Endpoint::kCompletions, "n", "'n' must be in [1, 128], got 0"},
      {R"({"model":"m","prompt":"x","n":129})", Endpoint::kCompletions, "n", "[1, 128], got 129"},
      {R"({"model":"m","prompt":"x","n":"2"})", Endpoint::kCompletions, "n", "an integer"},
      {R"({"model":"m","prompt":"x","n":2,"best_of":1})", Endpoint::kCompletions, "best_of",
       "'best_of' must be >= 'n'"},
      {R"({"model":"m","prompt":"x","best_of":0})", Endpoint::kCompletions, "best_of", "must be >= 1"},
      {R"({"model":"m","prompt":"x","best_of":3})", Endpoint::kCompletions, "best_of", "not supported"},
      {R"({"model":"m","prompt":"x","logprobs":21})", Endpoint::kCompletions, "logprobs", "[0, 20], got 21"},
      {R"({"model":"m","prompt":"x","logprobs":-1})", Endpoint::kCompletions, "logprobs", "[0, 20]"},
      {R"({"model":"m","prompt":"x","logprobs":true})", Endpoint::kCompletions, "logprobs", "an integer"},
      {R"({"model":"m","prompt":"x","frequency_penalty":2.5})", Endpoint::kCompletions, "frequency_penalty",
       "'frequency_penalty' must be in [-2, 2], got 2.5"},
      {R"({"model":"m","prompt":"x","presence_penalty":"1"})", Endpoint::kCompletions, "presence_penalty", "a number"},
      {R"({"model":"m","prompt":"x","logit_bias":[1]})", Endpoint::kCompletions, "logit_bias", "an object"},
      {R"({"model":"m","prompt":"x","logit_bias":{"x1":5}})", Endpoint::kCompletions, "logit_bias",
       "'logit_bias' key 'x1' is not a token id"},
      {R"({"model":"m","prompt":"x","logit_bias":{"-1":5}})", Endpoint::kCompletions, "logit_bias", "not a token id"},
      {R"({"model":"m","prompt":"x","logit_bias":{"99999999999":5}})", Endpoint::kCompletions, "logit_bias",
       "not a token id"},
      {R"({"model":"m","prompt":"x","logit_bias":{"7":101}})", Endpoint::kCompletions, "logit_bias",
       "'logit_bias[\"7\"]' must be a number in [-100, 100], got 101"},
      {R"({"model":"m","prompt":"x","logit_bias":{"7":"5"}})", Endpoint::kCompletions, "logit_bias", "got \"5\""},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":3})", Endpoint::kChatCompletions,
       "logprobs", "a boolean"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2})", Endpoint::kChatCompletions,
       "top_logprobs", "needs 'logprobs': true"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":30})",
       Endpoint::kChatCompletions, "top_logprobs", "[0, 20], got 30"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})",
       Endpoint::kChatCompletions, "tools", "'tools[0].function' must be an object"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":{"type":"function"}})",
       Endpoint::kChatCompletions, "tools", "'tools' must be a list of tools"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":
          "f"}},{"type":"function","function":{"name":"f"}}]})",
       Endpoint::kChatCompletions, "tools", "'tools[1].function.name' 'f' is given twice"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":
          "f","parameters":[]}}]})",
       Endpoint::kChatCompletions, "tools", "'tools[0].function.parameters' must be a JSON Schema"},
      {R"({"model":"m","prompt":"x","tools":[{"type":"function","function":{"name":"f"}}]})", Endpoint::kCompletions,
       "tools", "'tools' is a chat option"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"enable_thinking":1}})",
       Endpoint::kChatCompletions, "chat_template_kwargs", "'chat_template_kwargs.enable_thinking' must be a boolean"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"parallel_tool_calls":"no"})",
       Endpoint::kChatCompletions, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"functions":[{"name":"f"}]})",
       Endpoint::kChatCompletions, "functions", "(the legacy form of 'tools') is not supported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":
          "f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}})",
       Endpoint::kChatCompletions, "tool_choice", "names the function 'g', which is not one of 'tools'"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":
          "f"}}],"tool_choice":"required","guided_regex":"a+"})",
       Endpoint::kChatCompletions, "tool_choice", "cannot be combined with 'guided_regex'"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"id":"c",
          "type":"function","function":{"name":"f","arguments":"[1]"}}]}]})",
       Endpoint::kChatCompletions, "messages", "'messages[1].tool_calls[0].function.arguments' must be a JSON"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}})",
       Endpoint::kChatCompletions, "response_format",
       "'response_format.json_schema' must be an object with a 'schema'"},
      {R"({"model":"m","prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n"}}})",
       Endpoint::kCompletions, "response_format", "'response_format.json_schema.schema' is missing"},
      {R"({"model":"m","prompt":"x","response_format":{"type":"json_schema","json_schema":{"schema":
          {"properties":{"a":{"type":"string","pattern":"^a\\b"}}}}}})",
       Endpoint::kCompletions, "response_format",
       "'response_format.json_schema.schema' at '/properties/a': 'pattern' at character 3: word boundaries (\\b, "
       "\\B) are not supported"},
      {R"({"model":"m","prompt":"x","response_format":{"type":"grammar"}})", Endpoint::kCompletions, "response_format",
       "'response_format' of type 'grammar' is not supported (only 'text', 'json_object' and "
       "'json_schema')"},
      {R"({"model":"m","prompt":"x","guided_json":"{\"type\": "})", Endpoint::kCompletions, "guided_json",
       "'guided_json' is not JSON: [json.exception.parse_error.101]"},
      {R"({"model":"m","prompt":"x","guided_json":3})", Endpoint::kCompletions, "guided_json",
       "'guided_json' must be a JSON Schema (an object), got integer"},
      {R"({"model":"m","prompt":"x","guided_json":{},"response_format":{"type":"json_object"}})",
       Endpoint::kCompletions, "guided_json", "'guided_json' cannot be combined with 'response_format'"},
      {R"({"model":"m","prompt":"x","structured_outputs":{"json":{"anyOf":[{"type":"integer"},{"enum":[1]}]}}})",
       Endpoint::kCompletions, "structured_outputs",
       "'structured_outputs.json' at '/': its alternatives at '/anyOf/0' and '/anyOf/1' can both begin with '1'"},
      {R"({"model":"m","prompt":"x","response_format":"json"})", Endpoint::kCompletions, "response_format",
       "an object with a string 'type'"},
      {R"({"model":"m","prompt":"x","response_format":{"type":"json_object"},"guided_choice":["a"]})",
       Endpoint::kCompletions, "guided_choice", "'guided_choice' cannot be combined with 'response_format'"},
      {R"({"model":"m","prompt":"x","guided_choice":["a"],"structured_outputs":{"json_object":true}})",
       Endpoint::kCompletions, "structured_outputs", "cannot be combined with 'guided_choice'"},

      {R"({"model":"m","prompt":"x","structured_outputs":{"grammar":"root ::= x"}})", Endpoint::kCompletions,
       "structured_outputs", "'structured_outputs.grammar' is not supported"},
      {R"({"model":"m","prompt":"x","structured_outputs":{"choice":["a"],"json_object":true}})", Endpoint::kCompletions,
       "structured_outputs", "more than one of 'choice', 'json', 'regex' and 'json_object'"},
      {R"({"model":"m","prompt":"x","structured_outputs":{"regex":"a+","json":{}}})", Endpoint::kCompletions,
       "structured_outputs", "more than one of 'choice', 'json', 'regex' and 'json_object'"},
      {R"({"model":"m","prompt":"x","structured_outputs":{"regex":"(a|b"}})", Endpoint::kCompletions,
       "structured_outputs", "'structured_outputs.regex' at character 4: a group is not closed"},
      {R"({"model":"m","prompt":"x","guided_regex":["a+"]})", Endpoint::kCompletions, "guided_regex",
       "'guided_regex' must be a string"},
      {R"({"model":"m","prompt":"x","guided_regex":"(?<=a)b"})", Endpoint::kCompletions, "guided_regex",
       "'guided_regex' at character 2: lookarounds are not supported"},
      {R"({"model":"m","prompt":"x","guided_regex":"a","guided_choice":["a"]})", Endpoint::kCompletions, "guided_regex",
       "'guided_regex' cannot be combined with 'guided_choice'"},
      {R"({"model":"m","prompt":"x","structured_outputs":{"json_object":1}})", Endpoint::kCompletions,
       "structured_outputs", "'structured_outputs.json_object' must be a boolean"},
      {R"({"model":"m","prompt":"x","structured_outputs":{"choice":[]}})", Endpoint::kCompletions, "structured_outputs",
       "'structured_outputs.choice' must list 1..256 strings, got 0"},
      {R"({"model":"m","prompt":"x","structured_outputs":["a"]})", Endpoint::kCompletions, "structured_outputs",
       "'structured_outputs' must be an object"},
      {R"({"model":"m","prompt":"x","guided_choice":"a"})", Endpoint::kCompletions, "guided_choice",
       "'guided_choice' must be a list of strings"},
      {R"({"model":"m","prompt":"x","guided_choice":[]})", Endpoint::kCompletions, "guided_choice",
       "'guided_choice' must list 1..256 strings, got 0"},
      {R"({"model":"m","prompt":"x","guided_choice":["a",""]})", Endpoint::kCompletions, "guided_choice",
       "'guided_choice[1]' must have 1..1024 bytes, got 0"},
      {R"({"model":"m","prompt":"x","guided_choice":["a",2]})", Endpoint::kCompletions, "guided_choice",
       "'guided_choice[1]' must be a string, got integer"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":"required"})",
       Endpoint::kChatCompletions, "tool_choice", "'tool_choice' demands a call, but 'tools' offers none"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":{"type":"function"}})",
       Endpoint::kChatCompletions, "tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"function_call":{"name":"f"}})",
       Endpoint::kChatCompletions, "function_call", "not supported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"audio":{"voice":"alloy"}})",
       Endpoint::kChatCompletions, "audio", "'audio' (audio output) is not supported"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"modalities":["text","audio"]})",
       Endpoint::kChatCompletions, "modalities", "with \"audio\""},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"guided_grammar":"root ::= x"})",
       Endpoint::kChatCompletions, "guided_grammar",
       "(structured output other than guided_choice, guided_json and guided_regex) is not supported"},
      {R"({"model":"m","prompt":"x","prompt_logprobs":1})", Endpoint::kCompletions, "prompt_logprobs",
       "echo and logprobs"},
      {R"({"model":"m","messages":[]})", Endpoint::kChatCompletions, "messages", "empty list"},
      {R"({"model":"m","messages":[{"role":"tool","content":"x"}]})", Endpoint::kChatCompletions, "messages",
       "'messages[0].tool_call_id' must be a string"},
      {R"({"model":"m","messages":[{"role":"function","content":"x"}]})", Endpoint::kChatCompletions, "messages",
       "supported roles are system, user, assistant and tool"},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]})", Endpoint::kChatCompletions,
       "messages", "only parts of type 'text'"},
  };
  for (const auto& c : cases) {
    ApiError error;
    auto r = Parse(c.body, c.endpoint, &error);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(error.http_status, 400) << c.body;
    EXPECT_EQ(error.type, "invalid_request_error") << c.body;
    EXPECT_EQ(error.param, c.param) << c.body;
    EXPECT_NE(error.message.find(c.message), std::string::npos) << c.body << " -> " << error.message;
  }
  // prompts x n is bounded: 32 x 128 choices may be asked for, 33 x 128 not.
  Json many = {{"model", "m"}, {"prompt", std::vector<std::string>(32, "x")}, {"n", kMaxChoicesPerPrompt}};
  ApiError error;
  EXPECT_TRUE(Parse(many.dump(), Endpoint::kCompletions, &error).ok()) << error.message;
  many["prompt"].push_back("x");
  EXPECT_FALSE(Parse(many.dump(), Endpoint::kCompletions, &error).ok());
  EXPECT_EQ(error.param, "prompt");
  EXPECT_EQ(error.message,
            "'prompt' has 33 prompts and 'n' is 128: 4224 choices, more than the 4096 a request may ask for");
}

// A checkpoint's generation_config.json gives the sampling of requests that leave it out, as vLLM's default does.
TEST(OpenAiRequests, SamplingDefaultsFromGenerationConfig) {
  std::vector<std::string> ignored;
  const Json qwen3 = {{"do_sample", true}, {"temperature", 0.6},         {"top_p", 0.95},    {"top_k", 20},
                      {"min_p", 0.05},     {"repetition_penalty", 1.05}, {"eos_token_id", 2}};
  absl::StatusOr<SamplingDefaults> d = ReadSamplingDefaults(qwen3, "m/generation_config.json", &ignored);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->temperature, 0.6);
  EXPECT_EQ(d->top_p, 0.95);
  EXPECT_EQ(d->top_k, 20);
  EXPECT_EQ(d->min_p, 0.05);
  EXPECT_EQ(d->repetition_penalty, 1.05);
  EXPECT_TRUE(ignored.empty());

  ApiError error;
  auto omitted = ParseCompletionRequest(R"({"model":"m","prompt":"x"})", Endpoint::kCompletions, &error, *d);
  ASSERT_TRUE(omitted.ok()) << error.message;
  EXPECT_EQ(omitted->temperature, 0.6);
  EXPECT_EQ(omitted->top_p, 0.95);
  EXPECT_EQ(omitted->top_k, 20);
  EXPECT_EQ(omitted->min_p, 0.05);
  EXPECT_EQ(omitted->repetition_penalty, 1.05);
  auto given = ParseCompletionRequest(
      R"({"model":"m","prompt":"x","temperature":0,"top_p":1,"top_k":-1,"min_p":0,"repetition_penalty":1})",
      Endpoint::kCompletions, &error, *d);
  ASSERT_TRUE(given.ok()) << error.message;
  EXPECT_EQ(given->temperature, 0.0);  // the request's own values win
  EXPECT_EQ(given->top_p, 1.0);
  EXPECT_EQ(given->top_k, 0);
  EXPECT_EQ(given->min_p, 0.0);
  EXPECT_EQ(given->repetition_penalty, 1.0);

  // Nothing recommended: OpenAI's defaults.
  d = ReadSamplingDefaults({{"min_p", 0}}, "g.json", &ignored);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->temperature, 1.0);
  EXPECT_EQ(d->top_p, 1.0);
  EXPECT_EQ(d->top_k, 0);
  EXPECT_EQ(d->min_p, 0.0);
  EXPECT_EQ(d->repetition_penalty, 1.0);
  EXPECT_TRUE(ignored.empty());

  // Values no request may ask for are left out (the default stands), and reported.
  ignored.clear();
  d = ReadSamplingDefaults({{"temperature", 3}, {"top_p", 0}, {"top_k", -2}, {"min_p", 2}, {"repetition_penalty", 0}},
                           "g.json", &ignored);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->temperature, 1.0);
  EXPECT_EQ(d->top_p, 1.0);
  EXPECT_EQ(d->top_k, 0);
  EXPECT_EQ(d->min_p, 0.0);
  EXPECT_EQ(d->repetition_penalty, 1.0);
  EXPECT_EQ(ignored, (std::vector<std::string>{"temperature = 3 (outside [0, 2])", "top_p = 0 (outside (0, 1])",
                                               "top_k = -2 (below -1)", "min_p = 2 (outside [0, 1])",
                                               "repetition_penalty = 0 (outside (0, 100])"}));
  // One that is not a number stops main, naming the file and key.
  d = ReadSamplingDefaults({{"temperature", "0.7"}}, "g.json", &ignored);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("g.json: field 'temperature'"));
}

// generation_config.json's max_new_tokens is chat's max_tokens where the request gives none (vLLM's fallback),
// within the rest of the context; completions keep OpenAI's 16, and a request's own value wins, also above it.
TEST(OpenAiRequests, MaxNewTokensFromGenerationConfigIsChatsDefault) {
  std::vector<std::string> ignored;
  absl::StatusOr<SamplingDefaults> d = ReadSamplingDefaults({{"max_new_tokens", 50}}, "g.json", &ignored);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->max_tokens, 50);
  EXPECT_TRUE(ignored.empty());

  ApiError error;
  const std::string chat_body = R"({"model":"m","messages":[{"role":"user","content":"x"}]})";
  auto chat = ParseCompletionRequest(chat_body, Endpoint::kChatCompletions, &error, *d);
  ASSERT_TRUE(chat.ok()) << error.message;
  EXPECT_FALSE(chat->max_tokens.has_value());
  EXPECT_EQ(MaxTokens(*chat, 10, 1000), 50);
  EXPECT_EQ(MaxTokens(*chat, 980, 1000), 20) << "the rest of the context when that is less";
  EXPECT_EQ(MaxTokens(*chat, 1000, 1000), 1) << "a full prompt still asks for one token, and is refused";
  auto chat_given =
      ParseCompletionRequest(R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":70})",
                             Endpoint::kChatCompletions, &error, *d);
  ASSERT_TRUE(chat_given.ok()) << error.message;
  EXPECT_EQ(MaxTokens(*chat_given, 10, 1000), 70);
  auto completion = ParseCompletionRequest(R"({"model":"m","prompt":"x"})", Endpoint::kCompletions, &error, *d);
  ASSERT_TRUE(completion.ok()) << error.message;
  EXPECT_EQ(MaxTokens(*completion, 10, 1000), kDefaultCompletionMaxTokens);

  // Without a recommendation chat's default is the rest of the context.
  auto plain = ParseCompletionRequest(chat_body, Endpoint::kChatCompletions, &error);
  ASSERT_TRUE(plain.ok()) << error.message;
  EXPECT_EQ(MaxTokens(*plain, 10, 1000), 990);

  // A value below 1 is left out and reported; null is no value; one that is not an integer stops main.
  d = ReadSamplingDefaults({{"max_new_tokens", 0}}, "g.json", &ignored);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->max_tokens.has_value());
  EXPECT_EQ(ignored, (std::vector<std::string>{"max_new_tokens = 0 (below 1)"}));
  ignored.clear();
  d = ReadSamplingDefaults({{"max_new_tokens", nullptr}}, "g.json", &ignored);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->max_tokens.has_value());
  EXPECT_TRUE(ignored.empty());
  d = ReadSamplingDefaults({{"max_new_tokens", 2.5}}, "g.json", &ignored);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("g.json: field 'max_new_tokens'"));
}

TEST(OpenAiErrors, ErrorObjectAndStatusMapping) {
  ApiError e;
  e.http_status = 404;
  e.message = "The model 'x' does not exist";
  e.param = "model";
  e.code = "model_not_found";
  const Json j = Json::parse(ErrorBody(e));
  EXPECT_EQ(j["error"]["message"], "The model 'x' does not exist");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "model");
  EXPECT_EQ(j["error"]["code"], "model_not_found");
  const Json n = Json::parse(ErrorBody(ApiError{400, "bad", "invalid_request_error", "", ""}));
  EXPECT_TRUE(n["error"]["param"].is_null());
  EXPECT_TRUE(n["error"]["code"].is_null());

  EXPECT_EQ(ErrorOfStatus(absl::OutOfRangeError("too long")).http_status, 400);
  EXPECT_EQ(ErrorOfStatus(absl::FailedPreconditionError("x")).http_status, 400);
  EXPECT_EQ(ErrorOfStatus(absl::UnavailableError("worker w1 down")).http_status, 503);
  EXPECT_EQ(ErrorOfStatus(absl::UnavailableError("w")).type, "server_error");
  EXPECT_EQ(ErrorOfStatus(absl::DeadlineExceededError("x")).http_status, 504);
  EXPECT_EQ(ErrorOfStatus(absl::InternalError("x")).http_status, 500);
  EXPECT_EQ(ErrorOfStatus(absl::UnavailableError("worker w1 down")).message, "worker w1 down");
}

// Feeds `pieces` and returns what the matcher releases; the first `no_match` pieces are pushed without matching
// (as the text of a request's first min_tokens tokens).
std::string Matched(const std::vector<std::string>& stops, const std::vector<std::string>& pieces,
                    bool* stopped = nullptr, bool include_stop = false, size_t no_match = 0,
                    std::string* matched = nullptr) {
  StopMatcher m(stops, include_stop);
  std::string out;
  for (size_t i = 0; i < pieces.size(); ++i) out += m.Push(pieces[i], i >= no_match);
  out += m.Finish();
  if (stopped != nullptr) *stopped = m.stopped();
  if (matched != nullptr) *matched = m.matched();
  return out;
}

TEST(OpenAiStop, MatchesAcrossPiecesAndDropsTheMatch) {
  bool stopped = false;
  EXPECT_EQ(Matched({"\n\n"}, {"In the", " beginning\n", "\nGod"}, &stopped), "In the beginning");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(Matched({"God"}, {"And G", "o", "d said"}, &stopped), "And ");
  EXPECT_TRUE(stopped);
  // A partial match that fails is released whole.
  EXPECT_EQ(Matched({"Gods"}, {"And G", "o", "d said"}, &stopped), "And God said");
  EXPECT_FALSE(stopped);
  // The earliest of several matches wins.
  EXPECT_EQ(Matched({"said", "God"}, {"And God said"}), "And ");
  // No stops: everything passes through at once, and nothing is kept.
  StopMatcher none({});
  EXPECT_EQ(none.Push("abc"), "abc");
  EXPECT_EQ(none.Push("def"), "def");
  EXPECT_EQ(none.Finish(), "");
  // Held text is released as soon as it cannot start a match.
  StopMatcher m({"xyz"});
  EXPECT_EQ(m.Push("abx"), "ab");
  EXPECT_EQ(m.Push("a"), "xa");
  EXPECT_EQ(m.Push("xy"), "");
  EXPECT_EQ(m.Push("z tail"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "xyz");
  EXPECT_EQ(m.Push("more"), "");
  EXPECT_EQ(m.Finish(), "");
}

// The match that ends first wins, so the text does not depend on how it is split into pieces; of two ending
// together, the longer.
TEST(OpenAiStop, TheMatchThatEndsFirstWins) {
  std::string matched;
  EXPECT_EQ(Matched({"abc", "b"}, {"xabc"}, nullptr, false, 0, &matched), "xa");
  EXPECT_EQ(matched, "b");
  EXPECT_EQ(Matched({"abc", "b"}, {"xab", "c"}, nullptr, false, 0, &matched), "xa");
  EXPECT_EQ(Matched({"bc", "abc"}, {"xabcd"}, nullptr, false, 0, &matched), "x");
  EXPECT_EQ(matched, "abc");
}

// vLLM's include_stop_str_in_output: the text runs through the match, nothing after it; nothing is held back.
TEST(OpenAiStop, IncludeStopKeepsTheMatch) {
  bool stopped = false;
  std::string matched;
  EXPECT_EQ(Matched({"\n\n"}, {"In the", " beginning\n", "\nGod"}, &stopped, true, 0, &matched),
            "In the beginning\n\n");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(matched, "\n\n");
  StopMatcher m({"God"}, true);
  EXPECT_EQ(m.Push("And G"), "And G");  // released at once
  EXPECT_EQ(m.Push("od said"), "od");
  EXPECT_EQ(m.matched(), "God");
  EXPECT_EQ(m.Finish(), "");
  EXPECT_EQ(Matched({"Gods"}, {"And G", "o", "d said"}, &stopped, true), "And God said");
  EXPECT_FALSE(stopped);
}

// vLLM's min_tokens: no match ends in the first pieces (the text of the first min_tokens tokens), but one that
// starts there and ends later counts.
TEST(OpenAiStop, NoMatchEndsBeforeMinTokens) {
  bool stopped = false;
  EXPECT_EQ(Matched({"God"}, {"And God", " said God", " saw"}, &stopped, false, 1), "And God said ");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(Matched({"God"}, {"And Go", "d said"}, &stopped, false, 1), "And ");  // across the boundary
  EXPECT_TRUE(stopped);
  EXPECT_EQ(Matched({"God"}, {"And God", " said"}, &stopped, false, 1), "And God said");
  EXPECT_FALSE(stopped);
  EXPECT_EQ(Matched({"God"}, {"And Go", "d said"}, &stopped, true, 1), "And God");
  EXPECT_TRUE(stopped);
}

TEST(OpenAiStop, AnySplitGivesTheSameText) {
  const std::string text = "And God said, Let there be light: and there was light.";
  const std::vector<std::string> stops = {"light:", "xx"};
  for (size_t a = 0; a <= text.size(); ++a) {
    for (size_t b = a; b <= text.size(); b += 7) {
      const std::vector<std::string> pieces = {text.substr(0, a), text.substr(a, b - a), text.substr(b)};
      EXPECT_EQ(Matched(stops, pieces), "And God said, Let there be ") << a << " " << b;
      EXPECT_EQ(Matched(stops, pieces, nullptr, /*include_stop=*/true), "And God said, Let there be light:")
          << a << " " << b;
    }
  }
}

TEST(OpenAiChat, TemplateChoiceAndRendering) {
  const auto format = [](const Json& config, std::string_view arch) { return ChooseChatTemplate(config, arch).format; };
  EXPECT_EQ(format(Json(nullptr), "MixtralForCausalLM"), ChatFormat::kMistralInst);
  EXPECT_EQ(format(Json(nullptr), "Qwen2MoeForCausalLM"), ChatFormat::kNone);
  const Json mistral = {{"chat_template",
                         "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' "
                         "+ message['content'] + ' [/INST]' }}{% endif %}{% endfor %}"}};
  EXPECT_EQ(format(mistral, "OlmoeForCausalLM"), ChatFormat::kMistralInst);
  const Json llama2 = {{"chat_template", "[INST] <<SYS>>\\n' + system + '\\n<</SYS>> [/INST]"}};
  EXPECT_EQ(format(llama2, "MixtralForCausalLM"), ChatFormat::kLlama2);
  const Json chatml = {{"chat_template", "{% for m in messages %}<|im_start|>{{ m.role }}<|im_end|>{% endfor %}"}};
  EXPECT_EQ(format(chatml, "MixtralForCausalLM"), ChatFormat::kChatMl);  // the template wins over the built-in
  EXPECT_EQ(format(chatml, "Qwen3MoeForCausalLM"), ChatFormat::kChatMl);
  const Json unknown = {{"chat_template", "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}"}};
  EXPECT_EQ(format(unknown, "MixtralForCausalLM"), ChatFormat::kMistralInst);  // unknown: built-in
  EXPECT_EQ(format(unknown, "OlmoeForCausalLM"), ChatFormat::kNone);
  const Json named = {{"chat_template", Json::array({{{"name", "tool_use"}, {"template", "x"}},
                                                     {{"name", "default"}, {"template", "[INST] [/INST]"}}})}};
  EXPECT_EQ(format(named, "x"), ChatFormat::kMistralInst);

  const ChatTemplate inst{ChatFormat::kMistralInst};
  auto pieces =
      RenderChat(inst, {{"system", "Be brief."}, {"user", "Who?"}, {"assistant", "Moses."}, {"user", "When?"}});
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  std::string rendered;
  for (const PromptPiece& p : *pieces) {
    rendered += p.kind == PromptPiece::kBos ? "<s>" : p.kind == PromptPiece::kEos ? "</s>" : p.text;
  }
  EXPECT_EQ(rendered, "<s>[INST] Be brief.\n\nWho? [/INST]Moses.</s>[INST] When? [/INST]");
  auto llama = RenderChat({ChatFormat::kLlama2}, {{"system", "S"}, {"user", "U"}, {"assistant", "A"}, {"user", "V"}});
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ((*llama)[1].text, "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST]");
  ASSERT_EQ(llama->size(), 6u);  // BOS, U, A, EOS, BOS, V: BOS before each user turn
  EXPECT_EQ((*llama)[4].kind, PromptPiece::kBos);

  EXPECT_FALSE(RenderChat(inst, {{"system", "S"}}).ok());
  auto order = RenderChat(inst, {{"user", "a"}, {"user", "b"}});
  ASSERT_FALSE(order.ok());
  EXPECT_NE(order.status().message().find("messages[1]"), std::string::npos) << order.status();
  EXPECT_FALSE(RenderChat(inst, {{"user", "a"}, {"assistant", "b"}}).ok());
}

TEST(OpenAiChat, ChatMlTemplates) {
  // Qwen2's template writes a default system message; Qwen3's drops earlier turns' reasoning.
  const Json qwen2 = {
      {"chat_template",
       "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
       "'<|im_start|>system\\nYou are a \\'helpful\\' assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' "
       "+ message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"}};
  const ChatTemplate q2 = ChooseChatTemplate(qwen2, "Qwen2MoeForCausalLM");
  EXPECT_EQ(q2.format, ChatFormat::kChatMl);
  EXPECT_EQ(q2.default_system, "You are a 'helpful' assistant.");
  EXPECT_FALSE(q2.drop_reasoning);
  auto with_default = RenderChat(q2, {{"user", "Hi"}});
  ASSERT_TRUE(with_default.ok()) << with_default.status();
  ASSERT_EQ(with_default->size(), 1u);
  EXPECT_EQ((*with_default)[0].text,
            "<|im_start|>system\nYou are a 'helpful' assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  auto own_system = RenderChat(q2, {{"system", "S"}, {"user", "Hi"}});
  ASSERT_TRUE(own_system.ok());
  EXPECT_EQ((*own_system)[0].text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

  const Json qwen3 = {{"chat_template",
                       "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + "
                       "'<|im_end|>\\n' }}{%- endif %}{%- set content = message.content.split('</think>')[-1] %}"}};
  const ChatTemplate q3 = ChooseChatTemplate(qwen3, "Qwen3MoeForCausalLM");
  EXPECT_EQ(q3.format, ChatFormat::kChatMl);
  EXPECT_EQ(q3.default_system, "");
  EXPECT_TRUE(q3.drop_reasoning);
  auto history = RenderChat(q3, {{"user", "a"}, {"assistant", "<think>\nhm\n</think>\n\nb"}, {"user", "c"}});
  ASSERT_TRUE(history.ok());
  EXPECT_EQ((*history)[0].text,
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
            "<|im_start|>assistant\n");

  // This template knows no tools (it has no <tools>): a tool's message or tools cannot be shown.
  EXPECT_FALSE(q3.tools);
  auto tool = RenderChat(q3, {{"user", "a"}, {"tool", "b"}, {"user", "c"}});
  ASSERT_FALSE(tool.ok());
  EXPECT_THAT(std::string(tool.status().message()),
              HasSubstr("messages[1]: a tool message: this model's chat template has no place for tools"));
  auto offered = RenderChat(q3, {{"user", "a"}}, {ToolDefinition{"f", {}, {}}});
  ASSERT_FALSE(offered.ok());
  EXPECT_THAT(std::string(offered.status().message()), HasSubstr("tools: this model's chat template has no place"));
  auto last = RenderChat(q3, {{"user", "a"}, {"assistant", "b"}});
  ASSERT_FALSE(last.ok());
  EXPECT_THAT(std::string(last.status().message()), HasSubstr("messages[1]: the last message must be the user's"));
  EXPECT_FALSE(RenderChat(q3, {}).ok());
}

// Main turns chat off when the tokenizer cannot carry the template's format.
TEST(OpenAiChat, TheTokenizerMustCarryTheTemplatesFormat) {
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[odmoe::testing::ByteLevelChar(static_cast<uint8_t>(b))] = b;
  Json tokenizer = {{"pre_tokenizer", {{"type", "ByteLevel"}}},
                    {"decoder", {{"type", "ByteLevel"}}},
                    {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array()}}}};
  auto plain = HfTokenizer::FromJson(tokenizer.dump(), "", "plain/tokenizer.json");
  ASSERT_TRUE(plain.ok()) << plain.status();
  tokenizer["added_tokens"] = {{{"id", 256}, {"content", "<|im_start|>"}, {"special", true}},
                               {{"id", 257}, {"content", "<|im_end|>"}, {"special", true}}};
  auto chatml = HfTokenizer::FromJson(tokenizer.dump(), R"({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})",
                                      "chatml/tokenizer.json");
  ASSERT_TRUE(chatml.ok()) << chatml.status();
  auto sentencepiece = Tokenizer::Load(odmoe::testing::SourceDir() + "/models/demo-mixtral-kjv");
  ASSERT_TRUE(sentencepiece.ok()) << sentencepiece.status();

  const ChatTemplate chat_ml{ChatFormat::kChatMl}, inst{ChatFormat::kMistralInst};
  EXPECT_EQ(ChatTemplateMismatch(chat_ml, **chatml), "");
  EXPECT_EQ(ChatTemplateMismatch(chat_ml, **plain),
            "its ChatML template's marker <|im_start|> is not one token of its tokenizer");
  // SentencePiece reads control tokens written in the text as text.
  EXPECT_THAT(ChatTemplateMismatch(chat_ml, **sentencepiece), HasSubstr("is not one token"));
  EXPECT_EQ(ChatTemplateMismatch(inst, **sentencepiece), "");
  EXPECT_EQ(ChatTemplateMismatch(inst, **plain),
            "its mistral-inst template needs BOS and EOS tokens, which its tokenizer does not name");
  EXPECT_EQ(ChatTemplateMismatch({ChatFormat::kNone}, **plain), "");
}

// Qwen's chat templates as @huggingface/jinja renders them and transformers.js's tokenizer encodes them (the
// cases tests/model/js/oracle.mjs writes; run through ctest's hf_tokenizer_oracle).
TEST(ChatTemplateOracleTest, QwenTemplatesMatchJinja) {
  const char* dir = std::getenv("ODMOE_TOKENIZER_ORACLE_DIR");
  if (dir == nullptr) GTEST_SKIP() << "run through ctest (hf_tokenizer_oracle), which renders the reference prompts";
  auto tokenizer = Tokenizer::Load(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::ifstream in(std::string(dir) + "/oracle.json");
  ASSERT_TRUE(in) << dir << "/oracle.json";
  const OrderedJson oracle = OrderedJson::parse(in);  // the tools' keys in their order, as the template shows them
  int cases = 0, tool_cases = 0;
  for (const OrderedJson& c : oracle["chat"]) {
    const std::string name = c["template"].get<std::string>();
    SCOPED_TRACE(name + ": " + c["messages"].dump());
    const ChatTemplate chat =
        ChooseChatTemplate({{"chat_template", oracle["templates"][name].get<std::string>()}}, "Qwen3MoeForCausalLM");
    // The conversation as a client sends it, read by the API.
    OrderedJson body = {{"messages", c["messages"]}};
    if (c.contains("tools")) body["tools"] = c["tools"];
    if (c.contains("kwargs")) body["chat_template_kwargs"] = c["kwargs"];
    ApiError error;
    auto request = ParseCompletionRequest(body.dump(), Endpoint::kChatCompletions, &error);
    ASSERT_TRUE(request.ok()) << error.message;
    auto pieces = RenderChat(chat, request->messages, request->tools, request->template_args);
    ASSERT_TRUE(pieces.ok()) << pieces.status();
    ASSERT_EQ(pieces->size(), 1u);
    EXPECT_EQ((*pieces)[0].text, c["text"].get<std::string>());
    EXPECT_EQ((*tokenizer)->Encode((*pieces)[0].text), c["ids"].get<std::vector<int32_t>>());
    ++cases;
    if (c.contains("tools") || body.dump().find("tool_calls") != std::string::npos) ++tool_cases;
  }
  EXPECT_GE(cases, 19);
  EXPECT_GE(tool_cases, 5);
}

TEST(OpenAiFormat, ResponsesAndChunks) {
  const std::vector<Choice> choices = {{0, "In the beginning", {1, 2, 3}, {"length"}}};
  const Json c = Json::parse(CompletionBody(Endpoint::kCompletions, "cmpl-1", 42, "m", choices, {5, 3}));
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "In the beginning");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(c["choices"][0]["stop_reason"].is_null());
  EXPECT_EQ(c["usage"]["total_tokens"], 8);
  const Json chat = Json::parse(CompletionBody(Endpoint::kChatCompletions, "chatcmpl-1", 42, "m", choices, {5, 3}));
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "In the beginning");

  EXPECT_EQ(SseEvent(Json{{"a", 1}}), "data: {\"a\":1}\n\n");
  const Json first = StreamChunk(Endpoint::kChatCompletions, "id", 1, "m", 0, "", {}, {}, true, true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  EXPECT_TRUE(first["choices"][0]["stop_reason"].is_null());
  const Json last =
      StreamChunk(Endpoint::kChatCompletions, "id", 1, "m", 0, "", {}, StopStringEnd("\n\n"), false, false);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(last["choices"][0]["stop_reason"], "\n\n");
  EXPECT_FALSE(last["choices"][0]["delta"].contains("content"));
  EXPECT_FALSE(last.contains("usage"));
  const Json text = StreamChunk(Endpoint::kCompletions, "id", 1, "m", 2, "abc", {7}, {}, false, false);
  EXPECT_EQ(text["choices"][0]["text"], "abc");
  EXPECT_EQ(text["choices"][0]["index"], 2);
  const Usage so_far{4, 3};  // vLLM's continuous usage: the choice's so far
  const Json counted =
      StreamChunk(Endpoint::kCompletions, "id", 1, "m", 0, "abc", {7}, {}, false, true, nullptr, &so_far);
  EXPECT_EQ(counted["usage"], Json::parse(R"({"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7})"));
  const Json usage = UsageChunk(Endpoint::kCompletions, "id", 1, "m", {4, 6});
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 6);
  // main's stop reasons as a choice's end: a stop token is named by its id, the choice's last.
  EXPECT_EQ(ChoiceEndOf("eos", {5, 2}).finish_reason, "stop");
  EXPECT_TRUE(ChoiceEndOf("eos", {5, 2}).stop_reason.is_null());
  EXPECT_EQ(ChoiceEndOf("stop_token", {5, 13}).finish_reason, "stop");
  EXPECT_EQ(ChoiceEndOf("stop_token", {5, 13}).stop_reason, 13);
  EXPECT_EQ(ChoiceEndOf("length", {5}).finish_reason, "length");
  EXPECT_TRUE(ChoiceEndOf("length", {5}).stop_reason.is_null());
  Choice stopped{1, "x", {5, 13}, ChoiceEndOf("stop_token", {5, 13})};
  const Json stopped_body = Json::parse(CompletionBody(Endpoint::kCompletions, "c", 1, "m", {stopped}, {1, 2}));
  EXPECT_EQ(stopped_body["choices"][0]["stop_reason"], 13);
  const Json models = Json::parse(ModelsBody({"tiny-mixtral-kjv"}, 1700000000, 2048));
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0], Json::parse(R"({"id": "tiny-mixtral-kjv", "object": "model", "created": 1700000000,
      "owned_by": "odmoe", "root": "tiny-mixtral-kjv", "parent": null, "max_model_len": 2048})"));
  const Json aliased = Json::parse(ModelsBody({"mixtral", "kjv"}, 0, 4096));
  ASSERT_EQ(aliased["data"].size(), 2u);
  EXPECT_EQ(aliased["data"][1]["id"], "kjv");
  EXPECT_EQ(aliased["data"][1]["root"], "mixtral");
  EXPECT_EQ(aliased["data"][1]["max_model_len"], 4096);
  EXPECT_EQ(Json::parse(ModelBody("kjv", "mixtral", 0, 4096)), aliased["data"][1]);
  EXPECT_TRUE(c["choices"][0]["logprobs"].is_null());
}

// "é" split over two byte-level tokens, then a whole word: the shapes of both endpoints.
std::vector<TokenLogprobs> SplitCharacterLogprobs() {
  return {{{"\xc3", -0.5f}, {{"\xc3", -0.5f}, {"x", -1.5f}}},
          {{"\xa9", -0.25f}, {{"\xa9", -0.25f}, {"y", -2.0f}}},
          {{" word", -3.0f}, {{" the", -1.0f}, {" a", -2.0f}}}};
}

TEST(OpenAiFormat, CompletionLogprobs) {
  int64_t offset = 0;
  const Json lp = LogprobsJson(Endpoint::kCompletions, SplitCharacterLogprobs(), &offset);
  EXPECT_EQ(lp["tokens"], Json::array({"\xef\xbf\xbd", "\xef\xbf\xbd", " word"}));  // invalid UTF-8 as U+FFFD
  EXPECT_EQ(lp["token_logprobs"], Json::array({-0.5, -0.25, -3.0}));
  EXPECT_EQ(lp["text_offset"], Json::array({0, 1, 2}));  // characters
  EXPECT_EQ(offset, 7);
  // The alternatives and the chosen token, which may be outside them.
  EXPECT_EQ(lp["top_logprobs"][2], (Json{{" the", -1.0}, {" a", -2.0}, {" word", -3.0}}));
  EXPECT_EQ(lp["top_logprobs"][0], (Json{{"\xef\xbf\xbd", -0.5}, {"x", -1.5}}));

  Choice with{0, "é word", {1, 2, 3}, {"length"}, true, SplitCharacterLogprobs()};
  const Json body = Json::parse(CompletionBody(Endpoint::kCompletions, "c", 1, "m", {with}, {1, 3}));
  EXPECT_EQ(body["choices"][0]["logprobs"], lp);
  // A stream's chunks continue the offsets.
  const Json chunk = StreamChunk(Endpoint::kCompletions, "c", 1, "m", 0, " word", {3}, {}, false, false,
                                 LogprobsJson(Endpoint::kCompletions, {SplitCharacterLogprobs()[2]}, &offset));
  EXPECT_EQ(chunk["choices"][0]["logprobs"]["text_offset"], Json::array({7}));

  // An echoed prompt's first token: nothing predicts it.
  std::vector<TokenLogprobs> echoed = SplitCharacterLogprobs();
  echoed[0].no_logprob = true;
  offset = 0;
  const Json with_prompt = LogprobsJson(Endpoint::kCompletions, echoed, &offset);
  EXPECT_EQ(with_prompt["tokens"][0], "\xef\xbf\xbd");
  EXPECT_TRUE(with_prompt["token_logprobs"][0].is_null());
  EXPECT_TRUE(with_prompt["top_logprobs"][0].is_null());
  EXPECT_EQ(with_prompt["token_logprobs"][1], -0.25);
  EXPECT_EQ(with_prompt["text_offset"], Json::array({0, 1, 2}));
}

TEST(OpenAiFormat, ChatLogprobsCarryEachTokensBytes) {
  int64_t offset = 0;
  const Json lp = LogprobsJson(Endpoint::kChatCompletions, SplitCharacterLogprobs(), &offset);
  EXPECT_TRUE(lp["refusal"].is_null());
  ASSERT_EQ(lp["content"].size(), 3u);
  const Json& first = lp["content"][0];
  EXPECT_EQ(first["token"], "\xef\xbf\xbd");
  EXPECT_EQ(first["bytes"], Json::array({0xc3}));
  EXPECT_EQ(first["logprob"], -0.5);
  ASSERT_EQ(first["top_logprobs"].size(), 2u);
  EXPECT_EQ(first["top_logprobs"][1], (Json{{"token", "x"}, {"logprob", -1.5}, {"bytes", Json::array({120})}}));
  EXPECT_EQ(lp["content"][2]["bytes"], Json::array({32, 119, 111, 114, 100}));
  Choice with{0, "é word", {1, 2, 3}, {"stop"}, true, SplitCharacterLogprobs()};
  const Json body = Json::parse(CompletionBody(Endpoint::kChatCompletions, "c", 1, "m", {with}, {1, 3}));
  EXPECT_EQ(body["choices"][0]["logprobs"], lp);
}

}  // namespace
}  // namespace odmoe::openai
