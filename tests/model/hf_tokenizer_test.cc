// Tests for the tokenizer.json tokenizer (src/model/hf_tokenizer.h):
//  - the pipeline's rules on small tokenizers written here (merge order, added tokens, \s as Oniguruma reads it,
//    normalization, templates, decoding with replacement, the incremental decoder);
//  - errors that name the field;
//  - Qwen3's real tokenizer.json against an independent implementation (transformers.js's tokenizers, run by
//    tests/model/run_tokenizer_oracle.sh, which sets ODMOE_TOKENIZER_ORACLE_DIR).
#include "src/model/hf_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/model/tokenizer.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using ::odmoe::testing::TempDir;
using ::odmoe::testing::WriteFile;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string ByteChar(uint8_t byte) { return odmoe::testing::ByteLevelChar(byte); }
std::string Chars(std::string_view bytes) { return odmoe::testing::ByteLevelChars(bytes); }

// A tokenizer.json: the 256 byte characters as ids 0..255 (in byte order), then one token per merge, in order.
struct SmallTokenizer {
  std::vector<std::pair<std::string, std::string>> merges;  // as bytes, not byte characters
  Json added = Json::array();
  Json normalizer = nullptr;
  Json pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  Json post_processor = {{"type", "ByteLevel"}};
  Json decoder = {{"type", "ByteLevel"}};
  Json model_extra = Json::object();

  Json ToJson() const {
    Json vocab = Json::object();
    for (int b = 0; b < 256; ++b) vocab[ByteChar(static_cast<uint8_t>(b))] = b;
    Json merge_list = Json::array();
    for (const auto& [l, r] : merges) {
      const std::string merged = Chars(l + r);
      if (!vocab.contains(merged)) vocab[merged] = static_cast<int>(vocab.size());
      merge_list.push_back(Chars(l) + " " + Chars(r));
    }
    Json model = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}};
    model.update(model_extra);
    return {{"version", "1.0"},
            {"added_tokens", added},
            {"normalizer", normalizer},
            {"pre_tokenizer", pre_tokenizer},
            {"post_processor", post_processor},
            {"decoder", decoder},
            {"model", model}};
  }
  absl::StatusOr<std::unique_ptr<HfTokenizer>> Build(std::string config = "") const {
    return HfTokenizer::FromJson(ToJson().dump(), config, "test/tokenizer.json");
  }
  std::unique_ptr<HfTokenizer> BuildOrDie(std::string config = "") const {
    auto t = Build(config);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(t).value() : nullptr;
  }
  // The id the merge of `bytes` got (merged tokens follow the 256 byte ids in merge order).
  int32_t MergedId(std::string_view bytes) const {
    int32_t id = 256;
    std::vector<std::string> seen;
    for (const auto& [l, r] : merges) {
      if (std::find(seen.begin(), seen.end(), l + r) != seen.end()) continue;
      if (l + r == bytes) return id;
      seen.push_back(l + r);
      ++id;
    }
    return -1;
  }
};

int32_t B(char c) { return static_cast<uint8_t>(c); }

TEST(HfTokenizerTest, MergesGoByRankThenLeftmost) {
  SmallTokenizer s;
  s.merges = {{"b", "c"}, {"a", "b"}, {"a", "a"}};
  auto t = s.BuildOrDie();
  ASSERT_NE(t, nullptr);
  // "bc" has the lower rank, so it is merged first although "ab" starts further left.
  EXPECT_THAT(t->Encode("abc"), ElementsAre(B('a'), s.MergedId("bc")));
  // The same pair twice overlapping: the leftmost merges.
  EXPECT_THAT(t->Encode("aaa"), ElementsAre(s.MergedId("aa"), B('a')));
  EXPECT_THAT(t->Encode("aaaa"), ElementsAre(s.MergedId("aa"), s.MergedId("aa")));
  EXPECT_EQ(t->Decode(t->Encode("abcaaa")), "abcaaa");
}

TEST(HfTokenizerTest, MergesChainIntoLongerTokens) {
  SmallTokenizer s;
  s.merges = {{"h", "e"}, {" ", "t"}, {" t", "he"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}};
  auto t = s.BuildOrDie();
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode(" the hello"), ElementsAre(s.MergedId(" the"), B(' '), s.MergedId("hello")));
  EXPECT_EQ(t->vocab_size(), 256 + 6);
}

TEST(HfTokenizerTest, IgnoreMergesTakesAWholeWordThatIsAToken) {
  SmallTokenizer s;
  s.merges = {{"b", "c"}, {"a", "b"}, {"ab", "c"}};  // "abc" is a token, but the merges never reach it
  auto merged = s.BuildOrDie();
  ASSERT_NE(merged, nullptr);
  EXPECT_THAT(merged->Encode("abc"), ElementsAre(B('a'), s.MergedId("bc")));
  s.model_extra = {{"ignore_merges", true}};
  auto whole = s.BuildOrDie();
  ASSERT_NE(whole, nullptr);
  EXPECT_THAT(whole->Encode("abc"), ElementsAre(s.MergedId("abc")));
}

TEST(HfTokenizerTest, WhitespaceIsUnicodeWhiteSpaceAsInOniguruma) {
  // U+000B and U+0085 are White_Space (Oniguruma's \s, which tokenizers uses) though not ICU's \s. As
  // whitespace, "a\v\vb" pre-tokenizes as "a" "\v" "\v" "b"; read as punctuation it would be "a" "\v\v" "b",
  // and the merge of "\v\v" would apply.
  SmallTokenizer s;
  s.merges = {{"\v", "\v"}, {"\xc2", "\x85"}, {"\xc2\x85", "\xc2\x85"}};
  auto t = s.BuildOrDie();
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("a\v\vb"), ElementsAre(B('a'), B('\v'), B('\v'), B('b')));
  EXPECT_THAT(t->Encode("a\v\v"), ElementsAre(B('a'), s.MergedId("\v\v")));  // a trailing run stays whole
  EXPECT_THAT(t->Encode("x\xc2\x85\xc2\x85y"),
              ElementsAre(B('x'), s.MergedId("\xc2\x85"), s.MergedId("\xc2\x85"), B('y')));
}

TEST(HfTokenizerTest, Gpt2SplitKeepsContractionsDigitsAndSpaces) {
  SmallTokenizer s;
  s.merges = {{"'", "s"}, {" ", "a"}, {"1", "2"}};
  auto t = s.BuildOrDie();
  ASSERT_NE(t, nullptr);
  // "'s" is its own piece; " a" keeps its space; digits run together under the GPT-2 pattern.
  EXPECT_THAT(t->Encode("x's a12"), ElementsAre(B('x'), s.MergedId("'s"), s.MergedId(" a"), s.MergedId("12")));
  // Spaces before a word: all but the last form their own piece.
  EXPECT_THAT(t->Encode("   a"), ElementsAre(B(' '), B(' '), s.MergedId(" a")));
}

TEST(HfTokenizerTest, SplitRegexIsolatesMatchesAndCanRemoveThem) {
  SmallTokenizer s;
  s.merges = {{"a", "b"}, {"b", "c"}};
  s.pre_tokenizer = {{"type", "Sequence"},
                     {"pretokenizers",
                      {{{"type", "Split"}, {"pattern", {{"Regex", "\\p{N}"}}}, {"behavior", "Isolated"}},
                       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  auto isolated = s.BuildOrDie();
  ASSERT_NE(isolated, nullptr);
  // Without the GPT-2 split "ab c" stays one word; the digit splits "a1bc".
  EXPECT_THAT(isolated->Encode("a1bc"), ElementsAre(B('a'), B('1'), s.MergedId("bc")));
  s.pre_tokenizer["pretokenizers"][0]["behavior"] = "Removed";
  auto removed = s.BuildOrDie();
  ASSERT_NE(removed, nullptr);
  EXPECT_THAT(removed->Encode("a1bc"), ElementsAre(B('a'), s.MergedId("bc")));
  s.pre_tokenizer["pretokenizers"][0] = {{"type", "Split"}, {"pattern", {{"String", "b"}}}, {"behavior", "Isolated"}};
  auto literal = s.BuildOrDie();
  ASSERT_NE(literal, nullptr);
  EXPECT_THAT(literal->Encode("abc"), ElementsAre(B('a'), B('b'), B('c')));
}

TEST(HfTokenizerTest, AddPrefixSpace) {
  SmallTokenizer s;
  s.merges = {{" ", "a"}};
  s.pre_tokenizer["add_prefix_space"] = true;
  auto t = s.BuildOrDie();
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("a"), ElementsAre(s.MergedId(" a")));
  EXPECT_THAT(t->Encode(" a"), ElementsAre(s.MergedId(" a")));
}

TEST(HfTokenizerTest, NormalizersRunBeforeSplitting) {
  SmallTokenizer s;
  s.normalizer = {{"type", "NFC"}};
  auto nfc = s.BuildOrDie();
  ASSERT_NE(nfc, nullptr);
  EXPECT_EQ(nfc->Encode("e\xcc\x81"), nfc->Encode("\xc3\xa9"));  // e + U+0301 -> U+00E9
  EXPECT_EQ(nfc->Encode("\xc3\xa9").size(), 2u);
  s.normalizer = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFKC"}}, {{"type", "Lowercase"}}}}};
  auto nfkc_lower = s.BuildOrDie();
  ASSERT_NE(nfkc_lower, nullptr);
  EXPECT_EQ(nfkc_lower->Decode(nfkc_lower->Encode("\xef\xbc\xa1"
                                                  "BC")),
            "abc");  // fullwidth A -> a
}

TEST(HfTokenizerTest, AddedTokensAreMatchedInTheText) {
  SmallTokenizer s;
  s.merges = {{"a", "b"}};
  s.added = {{{"id", 300}, {"content", "<|x|>"}, {"special", true}},
             {{"id", 301}, {"content", "<|x|>y"}, {"special", false}},
             {{"id", 302}, {"content", "[L]"}, {"special", false}, {"lstrip", true}},
             {{"id", 303}, {"content", "[R]"}, {"special", false}, {"rstrip", true}},
             {{"id", 304}, {"content", "w"}, {"special", false}, {"single_word", true}}};
  auto t = s.BuildOrDie();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->vocab_size(), 305);
  EXPECT_THAT(t->Encode("ab<|x|>ab"), ElementsAre(s.MergedId("ab"), 300, s.MergedId("ab")));
  EXPECT_THAT(t->Encode("<|x|>y"), ElementsAre(301));  // the longest match
  EXPECT_THAT(t->Encode("<|x|"), ElementsAre(B('<'), B('|'), B('x'), B('|')));
  EXPECT_THAT(t->Encode("a  [L]  b"), ElementsAre(B('a'), 302, B(' '), B(' '), B('b')));
  EXPECT_THAT(t->Encode("a  [R]  b"), ElementsAre(B('a'), B(' '), B(' '), 303, B('b')));
  EXPECT_THAT(t->Encode("a w b"), ElementsAre(B('a'), B(' '), 304, B(' '), B('b')));
  EXPECT_THAT(t->Encode("awb"), ElementsAre(B('a'), B('w'), B('b')));  // inside a word: not the token
  // Special tokens are left out of the text; the others decode to their content.
  EXPECT_EQ(t->Decode(std::vector<int32_t>{s.MergedId("ab"), 300, 301, 302}), "ab<|x|>y[L]");
  EXPECT_TRUE(t->IsSpecial(300));
  EXPECT_FALSE(t->IsSpecial(301));
  // One token on its own (logprobs): its bytes, a special token's content too, nothing out of range.
  EXPECT_EQ(t->TokenText(300), "<|x|>");
  EXPECT_EQ(t->TokenText(301), "<|x|>y");
  EXPECT_EQ(t->TokenText(s.MergedId("ab")), "ab");
  EXPECT_EQ(t->TokenText(0xe2), "\xe2");  // part of a character
  EXPECT_EQ(t->TokenText(' '), " ");
  EXPECT_EQ(t->TokenText(-1), "");
  EXPECT_EQ(t->TokenText(305), "");
}

TEST(HfTokenizerTest, BosAndEosFromTheConfigAndTemplateTokensAroundThePrompt) {
  SmallTokenizer s;
  s.added = {{{"id", 300}, {"content", "<s>"}, {"special", true}},
             {{"id", 301}, {"content", "</s>"}, {"special", true}}};
  s.post_processor = {{"type", "TemplateProcessing"},
                      {"single",
                       {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                        {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
                      {"special_tokens",
                       {{"<s>", {{"id", "<s>"}, {"ids", {300}}, {"tokens", {"<s>"}}}},
                        {"</s>", {{"id", "</s>"}, {"ids", {301}}, {"tokens", {"</s>"}}}}}}};
  auto t = s.BuildOrDie(R"({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>"})");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bos_id(), 300);
  EXPECT_EQ(t->eos_id(), 301);
  EXPECT_THAT(t->EncodeForModel("a"), ElementsAre(300, B('a'), 301));
  EXPECT_THAT(t->Encode("a"), ElementsAre(B('a')));
  auto plain = SmallTokenizer().BuildOrDie();
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->bos_id(), -1);
  EXPECT_EQ(plain->eos_id(), -1);
  EXPECT_THAT(plain->EncodeForModel("a"), ElementsAre(B('a')));
}

TEST(HfTokenizerTest, DecodingReplacesEachMaximalInvalidSubpart) {
  auto t = SmallTokenizer().BuildOrDie();
  ASSERT_NE(t, nullptr);
  const auto bytes = [](std::string_view s) {
    std::vector<int32_t> ids;
    for (char c : s) ids.push_back(static_cast<uint8_t>(c));
    return ids;
  };
  EXPECT_EQ(t->Decode(bytes("\xe2\x82\xac")), "\xe2\x82\xac");  // U+20AC
  EXPECT_EQ(t->Decode(bytes("\xe2\x82"
                            "A")),
            "\xef\xbf\xbd"
            "A");  // a cut character: one U+FFFD
  EXPECT_EQ(t->Decode(bytes("\xf0\x80"
                            "A")),
            "\xef\xbf\xbd\xef\xbf\xbd"
            "A");                                                   // F0 80 is no prefix: two
  EXPECT_EQ(t->Decode(bytes("A\xf0\x9f\x98")), "A\xef\xbf\xbd");    // truncated at the end
  EXPECT_EQ(t->Decode(std::vector<int32_t>{-1, 65, 100000}), "A");  // unknown ids: nothing
}

// Push(ids one by one) + Finish() == Decode(context + ids) - Decode(context), on random byte streams that cut
// characters everywhere, with and without a context.
TEST(HfTokenizerTest, IncrementalDecoderMatchesDecode) {
  SmallTokenizer s;
  s.added = {{{"id", 300}, {"content", "<|x|>"}, {"special", true}}};
  auto t = s.BuildOrDie();
  ASSERT_NE(t, nullptr);
  const std::string text = "a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 z\xe4\xb8\xad";
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int32_t> ids;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      const uint32_t r = rng() % 10;
      ids.push_back(r == 0  ? 300
                    : r < 3 ? static_cast<int32_t>(rng() % 256)
                            : static_cast<uint8_t>(text[rng() % text.size()]));
    }
    const size_t k = rng() % (ids.size() + 1);
    const std::vector<int32_t> context(ids.begin(), ids.begin() + k);
    const std::string before = t->Decode(context), all = t->Decode(ids);
    std::unique_ptr<IncrementalDecoder> d = t->NewDecoder(context);
    std::string streamed;
    for (size_t i = k; i < ids.size(); ++i) streamed += d->Push(ids[i]);
    streamed += d->Finish();
    if (all.compare(0, before.size(), before) == 0) {
      EXPECT_EQ(streamed, all.substr(before.size())) << "trial " << trial;
    } else {  // the context ended in a character that the pushed bytes complete
      EXPECT_TRUE(before.size() >= 3 && before.compare(before.size() - 3, 3, "\xef\xbf\xbd") == 0) << trial;
      EXPECT_EQ(before.substr(0, before.size() - 3) + streamed, all) << "trial " << trial;
    }
  }
}

TEST(HfTokenizerTest, IncrementalDecoderNeverEmitsPartOfACharacter) {
  auto t = SmallTokenizer().BuildOrDie();
  ASSERT_NE(t, nullptr);
  std::unique_ptr<IncrementalDecoder> d = t->NewDecoder({});
  EXPECT_EQ(d->Push(0xf0), "");
  EXPECT_EQ(d->Push(0x9f), "");
  EXPECT_EQ(d->Push(0x98), "");
  EXPECT_EQ(d->Push(0x80), "\xf0\x9f\x98\x80");
  EXPECT_EQ(d->Push(0xe2), "");
  EXPECT_EQ(d->Push('A'),
            "\xef\xbf\xbd"
            "A");
  EXPECT_EQ(d->Push(0xc3), "");
  EXPECT_EQ(d->Finish(), "\xef\xbf\xbd");
}

// ---- errors ----------------------------------------------------------------------------------------------------

void ExpectError(const SmallTokenizer& s, absl::StatusCode code, const std::string& message) {
  auto t = s.Build();
  ASSERT_FALSE(t.ok()) << "accepted; expected: " << message;
  EXPECT_EQ(t.status().code(), code) << t.status();
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(message));
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("test/tokenizer.json"));
}

TEST(HfTokenizerErrorsTest, UnsupportedPartsAreRefusedNamingTheField) {
  SmallTokenizer s;
  s.model_extra = {{"type", "WordPiece"}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'model.type': 'WordPiece'");
  s.model_extra = {{"byte_fallback", true}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'model.byte_fallback'");
  s.model_extra = {{"continuing_subword_prefix", "##"}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'model.continuing_subword_prefix'");
  s.model_extra = Json::object();
  s.normalizer = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Precompiled"}}}}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'normalizer.normalizers[1].type': normalizer 'Precompiled'");
  s.normalizer = nullptr;
  s.pre_tokenizer = {{"type", "Metaspace"}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'pre_tokenizer.type': pre-tokenizer 'Metaspace'");
  s.pre_tokenizer = {{"type", "Split"}, {"pattern", {{"Regex", "\\p{N}"}}}, {"behavior", "Isolated"}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'pre_tokenizer': no ByteLevel step");
  s.pre_tokenizer = {{"type", "Sequence"},
                     {"pretokenizers",
                      {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
                       {{"type", "ByteLevel"}}}}};
  ExpectError(s, absl::StatusCode::kUnimplemented,
              "field 'pre_tokenizer.pretokenizers[0].pattern': the regular expression '(unclosed' does not compile");
  s.pre_tokenizer = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Contiguous"}}, {{"type", "ByteLevel"}}}}};
  ExpectError(s, absl::StatusCode::kUnimplemented,
              "field 'pre_tokenizer.pretokenizers[0].behavior': split behavior 'Contiguous'");
  s.pre_tokenizer = SmallTokenizer().pre_tokenizer;
  s.decoder = {{"type", "Metaspace"}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'decoder.type': 'Metaspace'");
  s.decoder = SmallTokenizer().decoder;
  s.post_processor = {{"type", "BertProcessing"}};
  ExpectError(s, absl::StatusCode::kUnimplemented, "field 'post_processor.type': post-processor 'BertProcessing'");
}

TEST(HfTokenizerErrorsTest, MalformedFilesNameTheFieldOrTheFile) {
  auto bad_json = HfTokenizer::FromJson("{\"model\": ", "", "dir/tokenizer.json");
  ASSERT_FALSE(bad_json.ok());
  EXPECT_EQ(bad_json.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad_json.status().message()), HasSubstr("dir/tokenizer.json: invalid JSON"));

  Json j = SmallTokenizer().ToJson();
  j["model"]["merges"].push_back("nospace");
  auto no_space = HfTokenizer::FromJson(j.dump(), "", "dir/tokenizer.json");
  ASSERT_FALSE(no_space.ok());
  EXPECT_THAT(std::string(no_space.status().message()), HasSubstr("field 'model.merges[0]': expected 'a b'"));

  j = SmallTokenizer().ToJson();
  j["model"]["merges"].push_back("a b");  // "ab" is not in the vocab
  auto unknown = HfTokenizer::FromJson(j.dump(), "", "dir/tokenizer.json");
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("field 'model.merges[0]': 'a' + 'b'"));

  j = SmallTokenizer().ToJson();
  j["added_tokens"] = {{{"id", "x"}, {"content", "<x>"}}};
  auto bad_id = HfTokenizer::FromJson(j.dump(), "", "dir/tokenizer.json");
  ASSERT_FALSE(bad_id.ok());
  EXPECT_THAT(std::string(bad_id.status().message()), HasSubstr("field 'added_tokens[0].id'"));

  auto bad_config =
      HfTokenizer::FromJson(SmallTokenizer().ToJson().dump(), R"({"eos_token": 7})", "dir/tokenizer.json");
  ASSERT_FALSE(bad_config.ok());
  EXPECT_THAT(std::string(bad_config.status().message()), HasSubstr("dir/tokenizer_config.json: field 'eos_token'"));
}

TEST(HfTokenizerLoadTest, TokenizerLoadReadsTokenizerJsonWhenThereIsNoSentencePieceModel) {
  TempDir tmp;
  SmallTokenizer s;
  s.merges = {{"a", "b"}};
  s.added = {{{"id", 300}, {"content", "<|end|>"}, {"special", true}}};
  WriteFile(tmp.File("tokenizer.json"), s.ToJson().dump());
  WriteFile(tmp.File("tokenizer_config.json"), R"({"eos_token": "<|end|>", "bos_token": null})");
  auto t = Tokenizer::Load(tmp.path());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT((*t)->EncodeForModel("ab"), ElementsAre(s.MergedId("ab")));
  EXPECT_EQ((*t)->eos_id(), 300);
  EXPECT_EQ((*t)->bos_id(), -1);
}

// ---- against transformers.js, on Qwen3's tokenizer --------------------------------------------------------------

TEST(HfTokenizerOracleTest, Qwen3MatchesTransformersJs) {
  const char* dir = std::getenv("ODMOE_TOKENIZER_ORACLE_DIR");
  if (dir == nullptr) GTEST_SKIP() << "run through ctest (hf_tokenizer_oracle), which makes the reference ids";
  auto t = Tokenizer::Load(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  auto text = ReadFileToString(std::string(dir) + "/oracle.json");
  ASSERT_TRUE(text.ok()) << text.status();
  auto oracle = ParseJson(*text, "oracle.json");
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  EXPECT_EQ((*t)->eos_id(), 151645);  // tokenizer_config.json: <|im_end|>
  EXPECT_EQ((*t)->bos_id(), -1);
  int encoded = 0, decoded = 0;
  for (const Json& c : (*oracle)["encode"]) {
    const std::string s = c["text"].get<std::string>();
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ((*t)->Encode(s), want) << "text: " << Json(s).dump();
    EXPECT_EQ((*t)->EncodeForModel(s), want) << "text: " << Json(s).dump();  // Qwen adds nothing
    ++encoded;
  }
  for (const Json& c : (*oracle)["decode"]) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ((*t)->Decode(ids), c["text"].get<std::string>()) << "ids: " << Json(ids).dump();
    ++decoded;
  }
  EXPECT_GE(encoded, 300);
  EXPECT_GE(decoded, 300);
}

}  // namespace
}  // namespace odmoe
