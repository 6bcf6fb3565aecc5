// A chat answer's reasoning told from its content (src/main_node/reasoning.h), streamed or whole.
#include "src/main_node/reasoning.h"

#include <algorithm>
#include <ostream>
#include <string>

#include "gtest/gtest.h"

namespace odmoe::openai {
namespace {

struct Split {
  std::string reasoning, content;
  bool operator==(const Split&) const = default;
};
std::ostream& operator<<(std::ostream& os, const Split& s) {
  return os << "{reasoning '" << s.reasoning << "', content '" << s.content << "'}";
}

// `text` pushed in pieces of `piece` bytes (0: whole), then finished.
Split Read(ReasoningParser parser, std::string_view text, size_t piece) {
  ReasoningReader reader(parser);
  Split out;
  auto take = [&](const ReasoningReader::Out& o) {
    out.reasoning += o.reasoning;
    out.content += o.content;
  };
  const size_t step = piece == 0 ? std::max<size_t>(text.size(), 1) : piece;
  for (size_t at = 0; at < text.size(); at += step) take(reader.Push(text.substr(at, step)));
  take(reader.Finish());
  const ReasoningReader::Out again = reader.Finish();
  EXPECT_TRUE(again.reasoning.empty() && again.content.empty()) << "Finish again gives nothing";
  return out;
}

// The same split whatever the pieces.
Split ReadEveryWay(ReasoningParser parser, std::string_view text) {
  const Split whole = Read(parser, text, 0);
  for (size_t piece : {1, 2, 3, 4, 7}) EXPECT_EQ(Read(parser, text, piece), whole) << "pieces of " << piece;
  return whole;
}

TEST(ReasoningReader, Qwen3ReadsTheBlockTheAnswerOpensWith) {
  const ReasoningParser qwen3 = ReasoningParser::kQwen3;
  EXPECT_EQ(ReadEveryWay(qwen3, "<think>\nThe user asks 2+2.\n</think>\n\nIt is 4."),
            (Split{"\nThe user asks 2+2.\n", "\n\nIt is 4."}));
  EXPECT_EQ(ReadEveryWay(qwen3, "\n <think>a</think>b</think>c"), (Split{"a", "b</think>c"}))
      << "white space before the block; the first </think> ends it";
  // No block (enable_thinking false wrote an empty one in the prompt): all content, tags and all.
  EXPECT_EQ(ReadEveryWay(qwen3, "It is 4. <think>no</think>"), (Split{"", "It is 4. <think>no</think>"}));
  EXPECT_EQ(ReadEveryWay(qwen3, "<thin"), (Split{"", "<thin"}));
  EXPECT_EQ(ReadEveryWay(qwen3, "  "), (Split{"", "  "}));
  EXPECT_EQ(ReadEveryWay(qwen3, ""), (Split{"", ""}));
  // Cut short inside the block: all reasoning, what may have been "</think>" too.
  EXPECT_EQ(ReadEveryWay(qwen3, "<think>still thinking </thi"), (Split{"still thinking </thi", ""}));
}

TEST(ReasoningReader, DeepSeekR1ReadsUpToTheFirstClose) {
  const ReasoningParser r1 = ReasoningParser::kDeepSeekR1;
  EXPECT_EQ(ReadEveryWay(r1, "Okay, 2+2.\n</think>\n\n4"), (Split{"Okay, 2+2.\n", "\n\n4"}));
  EXPECT_EQ(ReadEveryWay(r1, "<think>x</think>y"), (Split{"x", "y"})) << "an opening tag written anyway is dropped";
  EXPECT_EQ(ReadEveryWay(r1, "no close at all"), (Split{"no close at all", ""}));
  EXPECT_EQ(ReadEveryWay(r1, "<thi"), (Split{"<thi", ""}));
}

TEST(ReasoningReader, NoneIsAllContent) {
  EXPECT_EQ(ReadEveryWay(ReasoningParser::kNone, "<think>a</think>b"), (Split{"", "<think>a</think>b"}));
}

}  // namespace
}  // namespace odmoe::openai
