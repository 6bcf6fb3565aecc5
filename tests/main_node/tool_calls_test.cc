// Tool calling's pieces (src/main_node/tool_calls.h): the template's JSON, the constraint of a call that the
// request demands, and the calls read out of an answer, streamed or whole.
#include "src/main_node/tool_calls.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/json.h"

namespace odmoe::openai {
namespace {

// What a reader gives for `text` pushed in pieces of `piece` bytes (0: whole), then finished.
struct Read {
  std::string content;
  std::vector<ToolCall> calls;   // reader.calls()
  std::vector<ToolCall> joined;  // the deltas joined by index (ids and names from each call's first)
  bool by_calls = false;
};
Read ReadAll(const ToolCalling& calling, std::string_view text, size_t piece) {
  ToolCallReader reader(calling);
  Read read;
  auto take = [&](const ToolCallReader::Out& out) {
    read.content += out.content;
    for (const ToolCallDelta& d : out.calls) {
      if (d.index == static_cast<int64_t>(read.joined.size())) {
        EXPECT_FALSE(d.id.empty()) << "a call's first piece carries its id";
        read.joined.push_back({d.id, d.name, ""});
      } else {
        EXPECT_TRUE(d.id.empty() && d.name.empty()) << "only a call's first piece names it";
      }
      ASSERT_LT(d.index, static_cast<int64_t>(read.joined.size()));
      read.joined[d.index].arguments += d.arguments;
    }
  };
  for (size_t at = 0; at < text.size(); at += piece == 0 ? text.size() : piece) {
    take(reader.Push(text.substr(at, piece == 0 ? text.size() : piece)));
  }
  take(reader.Finish());
  EXPECT_TRUE(reader.Finish().content.empty()) << "Finish again gives nothing";
  read.calls = reader.calls();
  read.by_calls = reader.finished_by_calls();
  return read;
}

// The same content and calls whatever the pieces; the deltas join into the calls.
Read ReadEveryWay(const ToolCalling& calling, std::string_view text) {
  const Read whole = ReadAll(calling, text, 0);
  for (size_t piece : {1, 2, 3, 5, 7, 11}) {
    SCOPED_TRACE(piece);
    const Read split = ReadAll(calling, text, piece);
    EXPECT_EQ(split.content, whole.content);
    EXPECT_EQ(split.by_calls, whole.by_calls);
    EXPECT_EQ(split.calls.size(), whole.calls.size());
    for (size_t i = 0; i < split.calls.size() && i < whole.calls.size(); ++i) {
      EXPECT_EQ(split.calls[i].name, whole.calls[i].name);
      EXPECT_EQ(split.calls[i].arguments, whole.calls[i].arguments);
      EXPECT_EQ(split.joined[i].id, split.calls[i].id);
      EXPECT_EQ(split.joined[i].name, split.calls[i].name);
      EXPECT_EQ(split.joined[i].arguments, split.calls[i].arguments);
    }
  }
  return whole;
}

TEST(ToolCalls, TemplateJsonIsPythonsJsonDumps) {
  auto v = ParseOrderedJson(R"({"b": [1, 2.5, "é\n\"q\u0001\\", false], "a": {"c": null, "d": true}, "e": {}})", "t");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(TemplateJson(*v), R"({"b": [1, 2.5, "é\n\"q\u0001\\", false], "a": {"c": null, "d": true}, "e": {}})");
  EXPECT_EQ(TemplateJson(OrderedJson::array()), "[]");
}

TEST(ToolCalls, IdsAreFreshAndOpenAiShaped) {
  const std::string a = NewToolCallId(), b = NewToolCallId();
  EXPECT_NE(a, b);
  ASSERT_EQ(a.size(), 29u);
  EXPECT_EQ(a.substr(0, 5), "call_");
  EXPECT_EQ(a.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", 5),
            std::string::npos);
}

TEST(ToolCalls, AutoReadsHermesBlocksAndKeepsTheRestAsContent) {
  const Read r = ReadEveryWay({ToolChoice::kAuto},
                              "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                              "\"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": "
                              "{}}\n</tool_call>\n");
  EXPECT_EQ(r.content, "Let me look.\n");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"city":"Paris","days":2})");
  EXPECT_EQ(r.calls[1].name, "now");
  EXPECT_EQ(r.calls[1].arguments, "{}");
  EXPECT_NE(r.calls[0].id, r.calls[1].id);
  EXPECT_TRUE(r.by_calls);

  // Text after the calls that is more than whitespace stays content, with the whitespace before it.
  const Read after =
      ReadEveryWay({ToolChoice::kAuto}, "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>\n\nDone <tool");
  EXPECT_EQ(after.content, "\n\nDone <tool");
  EXPECT_EQ(after.calls.size(), 1u);
}

TEST(ToolCalls, AutoLeavesWhatIsNoCallAsText) {
  for (const char* text :
       {"no calls at all, only < and <tool and </tool_call>", "<tool_call>not json</tool_call> and after",
        "<tool_call>{\"name\": \"f\"}</tool_call>",                    // no arguments
        "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>",  // no name
        "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>", "<tool_call>[1, 2]</tool_call>",
        "<tool_call>{\"name\": \"f\", \"argu"}) {  // cut short
    SCOPED_TRACE(text);
    const Read r = ReadEveryWay({ToolChoice::kAuto}, text);
    EXPECT_EQ(r.content, text);
    EXPECT_TRUE(r.calls.empty());
    EXPECT_FALSE(r.by_calls);
  }
  // A malformed block between two calls stays in the content, in its place.
  const Read mixed = ReadEveryWay({ToolChoice::kAuto},
                                  "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>oops"
                                  "</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {\"x\": 1}}</tool_call>");
  EXPECT_EQ(mixed.content, "<tool_call>oops</tool_call>");
  ASSERT_EQ(mixed.calls.size(), 2u);
  EXPECT_EQ(mixed.calls[1].arguments, R"({"x":1})");
}

TEST(ToolCalls, AutoWithoutParallelCallsReadsTheFirstCallOnly) {
  const Read r = ReadEveryWay({ToolChoice::kAuto, "", /*parallel=*/false},
                              "a <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": "
                              "\"g\", \"arguments\": {}}</tool_call>");
  EXPECT_EQ(r.content, "a \n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "f");
  EXPECT_TRUE(r.by_calls);
}

TEST(ToolCalls, AutoTakesACallCutShortAfterItsJson) {
  // max_tokens ended the answer after the call's object but before </tool_call> (vLLM's parser takes it too).
  const Read r =
      ReadEveryWay({ToolChoice::kAuto}, "ok <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"b\"}}\n");
  EXPECT_EQ(r.content, "ok ");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, R"({"a":"b"})");
}

TEST(ToolCalls, NoneAndNamed) {
  const std::string text = "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>";
  const Read none = ReadEveryWay({ToolChoice::kNone}, text);
  EXPECT_EQ(none.content, text);
  EXPECT_TRUE(none.calls.empty());

  // A named function's answer is its arguments, streamed as they come; the model's finish_reason stays.
  const Read named = ReadEveryWay({ToolChoice::kNamed, "get_weather"}, "{\"city\": \"Oslo\"}");
  EXPECT_EQ(named.content, "");
  ASSERT_EQ(named.calls.size(), 1u);
  EXPECT_EQ(named.calls[0].name, "get_weather");
  EXPECT_EQ(named.calls[0].arguments, "{\"city\": \"Oslo\"}");
  EXPECT_FALSE(named.by_calls);
  const Read empty = ReadEveryWay({ToolChoice::kNamed, "now"}, "");
  ASSERT_EQ(empty.calls.size(), 1u) << "the call the request named, even with nothing written";
  EXPECT_EQ(empty.calls[0].arguments, "");
}

TEST(ToolCalls, RequiredReadsTheListOfCalls) {
  const Read r = ReadEveryWay({ToolChoice::kRequired},
                              R"([{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {}}])");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].name, "a");
  EXPECT_EQ(r.calls[0].arguments, R"({"x":[1,2]})");
  EXPECT_EQ(r.calls[1].arguments, "{}");
  EXPECT_TRUE(r.by_calls);
  // Cut short (max_tokens): the text, as it came.
  const Read cut = ReadEveryWay({ToolChoice::kRequired}, R"([{"name": "a", "parameters": {"x")");
  EXPECT_EQ(cut.content, R"([{"name": "a", "parameters": {"x")");
  EXPECT_TRUE(cut.calls.empty());
  EXPECT_FALSE(cut.by_calls);
}

// Whether `g` takes every byte of `text` and is complete after it.
bool Matches(const ByteGrammar& g, std::string_view text) {
  GrammarState s = g.Start();
  for (const char c : text) {
    if (!g.Advance(s, static_cast<uint8_t>(c))) return false;
  }
  return g.Complete(s);
}

TEST(ToolCalls, ConstraintsHoldTheAnswerToTheTools) {
  auto parameters = ParseOrderedJson(
      R"({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]})",
      "t");
  ASSERT_TRUE(parameters.ok());
  const std::vector<ToolDefinition> tools = {
      {"get_weather", *parameters, {}},
      {"now", {{"type", "object"}, {"properties", OrderedJson::object()}, {"additionalProperties", false}}, {}}};

  auto named = CompileGrammar(ToolCallConstraint({ToolChoice::kNamed, "get_weather"}, tools));
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE(Matches(**named, R"({"city": "Oslo", "days": 2})"));
  EXPECT_FALSE(Matches(**named, R"({"days": 2})"));

  auto required = CompileGrammar(ToolCallConstraint({ToolChoice::kRequired}, tools));
  ASSERT_TRUE(required.ok()) << required.status();
  EXPECT_TRUE(Matches(**required, R"([{"name": "get_weather", "parameters": {"city": "Oslo"}}])"));
  EXPECT_TRUE(Matches(**required, R"([{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": )"
                                  R"({"city": "x", "days": 1}}])"));
  EXPECT_FALSE(Matches(**required, "[]")) << "at least one call";
  EXPECT_FALSE(Matches(**required, R"([{"name": "later", "parameters": {}}])")) << "only the tools' names";
  EXPECT_FALSE(Matches(**required, R"([{"name": "now", "parameters": {"city": "x"}}])")) << "each its own parameters";

  // Without parallel calls, one call at most.
  auto one = CompileGrammar(ToolCallConstraint({ToolChoice::kRequired, "", /*parallel=*/false}, tools));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(Matches(**one, R"([{"name": "now", "parameters": {}}])"));
  EXPECT_FALSE(Matches(**one, R"([{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}])"));
}

}  // namespace
}  // namespace odmoe::openai
