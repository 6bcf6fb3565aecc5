// The command-line flags of odmoe's programs: values, booleans, and errors that say what was meant.
#include "src/common/flags.h"

#include "gtest/gtest.h"

namespace odmoe {
namespace {

const std::set<std::string> kWithValue = {"model", "prompt", "max-new-tokens", "min-tokens", "temperature", "top-k"};
const std::set<std::string> kBooleans = {"json", "ignore-eos", "dump-logits"};

std::string ErrorOf(const std::vector<std::string>& args) {
  auto flags = Flags::Parse(args, kWithValue, kBooleans);
  return flags.ok() ? "" : std::string(flags.status().message());
}

TEST(FlagsTest, ValuesAndBooleans) {
  auto flags = Flags::Parse({"--model", "m", "--max-new-tokens=8", "--json"}, kWithValue, kBooleans);
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(*flags->Get("model"), "m");
  EXPECT_EQ(*flags->Int("max-new-tokens", 0), 8);
  EXPECT_TRUE(flags->Has("json"));
  EXPECT_FALSE(flags->Has("ignore-eos"));
  EXPECT_EQ(ErrorOf({"--json=yes"}), "--json takes no value");
  EXPECT_EQ(ErrorOf({"--model"}), "--model needs a value");
  EXPECT_EQ(ErrorOf({"model"}), "unexpected argument 'model' (flags start with --)");
}

// An unknown flag names the known one it most likely stands for: a flag with every one of its words (OpenAI's
// max_tokens is --max-new-tokens here, although --min-tokens is fewer edits away), else a typo (two edits at
// most); nothing when none is close.
TEST(FlagsTest, AnUnknownFlagSuggestsTheOneMeant) {
  EXPECT_EQ(ErrorOf({"--max-tokens", "8"}), "unknown flag --max-tokens (did you mean --max-new-tokens?)");
  EXPECT_EQ(ErrorOf({"--min-token", "2"}), "unknown flag --min-token (did you mean --min-tokens?)");
  EXPECT_EQ(ErrorOf({"--temprature", "0"}), "unknown flag --temprature (did you mean --temperature?)");
  EXPECT_EQ(ErrorOf({"--top_k", "5"}), "unknown flag --top_k (did you mean --top-k?)");
  EXPECT_EQ(ErrorOf({"--ignore_eos"}), "unknown flag --ignore_eos (did you mean --ignore-eos?)");
  EXPECT_EQ(ErrorOf({"--frobnicate"}), "unknown flag --frobnicate");
  EXPECT_EQ(ErrorOf({"--x"}), "unknown flag --x");
}

}  // namespace
}  // namespace odmoe
