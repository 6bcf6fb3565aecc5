// The `odmoe tokenize` program: text to ids and back with a checkpoint's tokenizer of either kind (the demo
// model's tokenizer.model, and a tokenizer.json), the same ids as the library's, and errors with their exit code.
#include "gtest/gtest.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/tokenizer.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using odmoe::testing::ProgramPath;
using odmoe::testing::RunProgram;
using odmoe::testing::RunResult;

std::string DemoModel() { return odmoe::testing::SourceDir() + "/models/demo-mixtral-kjv"; }

std::string Joined(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += StrCat(i > 0 ? "," : "", ids[i]);
  return s;
}

TEST(TokenizeCliTest, TextToIdsAndBackWithTheSentencePieceModel) {
  auto tok = Tokenizer::Load(DemoModel());
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "In the beginning God created the heaven";
  const RunResult plain = RunProgram({ProgramPath("odmoe"), "tokenize", "--model", DemoModel(), "--text", text});
  ASSERT_EQ(plain.exit_code, kExitOk) << plain.err;
  EXPECT_EQ(plain.out, Joined((*tok)->Encode(text)) + "\n");
  const RunResult for_model =
      RunProgram({ProgramPath("odmoe"), "tokenize", "--model", DemoModel(), "--text", text, "--for-model", "--json"});
  ASSERT_EQ(for_model.exit_code, kExitOk) << for_model.err;
  const Json j = Json::parse(for_model.out);
  const std::vector<int32_t> ids = j["ids"].get<std::vector<int32_t>>();
  EXPECT_EQ(ids, (*tok)->EncodeForModel(text));
  EXPECT_EQ(ids.front(), (*tok)->bos_id());
  EXPECT_EQ(j["count"], ids.size());

  const RunResult back = RunProgram({ProgramPath("odmoe"), "tokenize", "--model", DemoModel(), "--ids", Joined(ids)});
  ASSERT_EQ(back.exit_code, kExitOk) << back.err;
  EXPECT_EQ(back.out, text + "\n");
}

TEST(TokenizeCliTest, TokenizerJson) {
  odmoe::testing::TempDir dir;
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[odmoe::testing::ByteLevelChar(static_cast<uint8_t>(b))] = b;
  vocab[odmoe::testing::ByteLevelChars(" G")] = 256;
  const Json tokenizer = {
      {"added_tokens", {{{"id", 257}, {"content", "<|im_end|>"}, {"special", true}}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {odmoe::testing::ByteLevelChars(" ") + " G"}}}}};
  odmoe::testing::WriteFile(dir.File("tokenizer.json"), tokenizer.dump());
  const RunResult ids =
      RunProgram({ProgramPath("odmoe"), "tokenize", "--model", dir.path(), "--text", "a God<|im_end|>"});
  ASSERT_EQ(ids.exit_code, kExitOk) << ids.err;
  EXPECT_EQ(ids.out, "97,256,111,100,257\n");
  const RunResult text =
      RunProgram({ProgramPath("odmoe"), "tokenize", "--model", dir.path(), "--ids", "97,256,257,111"});
  ASSERT_EQ(text.exit_code, kExitOk) << text.err;
  EXPECT_EQ(text.out, "a Go\n");  // the special token is left out
}

TEST(TokenizeCliTest, ErrorsSayWhatAndExitWithTheirCode) {
  odmoe::testing::TempDir empty;
  const RunResult none = RunProgram({ProgramPath("odmoe"), "tokenize", "--model", empty.path(), "--text", "x"});
  EXPECT_EQ(none.exit_code, kExitNotFound);
  EXPECT_NE(none.err.find(empty.path() + ": no tokenizer"), std::string::npos) << none.err;
  const RunResult both =
      RunProgram({ProgramPath("odmoe"), "tokenize", "--model", DemoModel(), "--text", "x", "--ids", "1"});
  EXPECT_EQ(both.exit_code, kExitUsage);
  EXPECT_NE(both.err.find("exactly one of --text and --ids"), std::string::npos) << both.err;
  const RunResult range = RunProgram({ProgramPath("odmoe"), "tokenize", "--model", DemoModel(), "--ids", "1,999999"});
  EXPECT_EQ(range.exit_code, kExitOutOfRange);
  EXPECT_NE(range.err.find("token id 999999"), std::string::npos) << range.err;
  const RunResult bad_utf8 =
      RunProgram({ProgramPath("odmoe"), "tokenize", "--model", DemoModel(), "--text", "bad \xff byte"});
  EXPECT_EQ(bad_utf8.exit_code, kExitUsage);
  EXPECT_NE(bad_utf8.err.find("--text is not valid UTF-8"), std::string::npos) << bad_utf8.err;
}

}  // namespace
}  // namespace odmoe
