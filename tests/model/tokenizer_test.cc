// Tests for the SentencePiece tokenizer (src/model/sentencepiece_tokenizer.h):
//  - the reference cases of ../shared/models/tiny-mixtral-kjv (made with SentencePiece 0.1.97), both ways;
//  - IncrementalDecoder against Decode, on every reference case and split and on random id streams;
//  - the BPE merge order, normalizer options, byte fallback, user-defined / control / unused pieces and the
//    decoding rules, on small models built here;
//  - errors for missing, corrupt and unsupported files, and tokenizer_config.json.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "odmoe/spm/sentencepiece_model.pb.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/model/sentencepiece_tokenizer.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using ::odmoe::testing::HaveSharedModel;
using ::odmoe::testing::SharedModel;
using ::odmoe::testing::TempDir;
using ::odmoe::testing::WriteFile;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using SentencePiece = spm::ModelProto::SentencePiece;

constexpr char kModelName[] = "tiny-mixtral-kjv";
const std::string kFffd = "\xef\xbf\xbd";  // U+FFFD

// Strict UTF-8 validation (RFC 3629: no overlong forms, surrogates or code points above U+10FFFF), written
// independently of the tokenizer's own UTF-8 code.
bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    uint32_t min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const uint8_t t = static_cast<uint8_t>(s[i + k]);
      if ((t & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (t & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

std::string BytePiece(int byte) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "<0x%02X>", byte);
  return buf;
}

std::string IdsToString(std::span<const int32_t> ids) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < ids.size(); ++i) out << (i ? ", " : "") << ids[i];
  out << "]";
  return out.str();
}

std::vector<std::string> Pieces(const SentencePieceTokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.emplace_back(tok.IdToPiece(id));
  return pieces;
}

// What an IncrementalDecoder produced for one stream.
struct Streamed {
  std::vector<std::string> pushes;  // the output of each Push
  std::string finish;               // the output of Finish
  std::string all;                  // everything, concatenated
};

Streamed Stream(const SentencePieceTokenizer& tok, const std::vector<int32_t>& context,
                const std::vector<int32_t>& ids) {
  Streamed s;
  SentencePieceDecoder decoder(tok, context);
  for (int32_t id : ids) {
    s.pushes.push_back(decoder.Push(id));
    s.all += s.pushes.back();
  }
  s.finish = decoder.Finish();
  s.all += s.finish;
  return s;
}

struct StreamStats {
  int streams = 0;     // streams checked
  int exact = 0;       // streams where the header's contract (a string suffix) was checked exactly
  int exceptions = 0;  // streams in the documented exception (context ends inside a completed character)
};

// Checks the IncrementalDecoder contract for ids[0:k] as context and ids[k:] pushed one by one: every Push
// output is valid UTF-8 (so never part of a character), and all of it together is Decode(ids) minus
// Decode(ids[0:k]). Where Decode(ids[0:k]) is not a prefix of Decode(ids) (the header's exception: the context
// ends with bytes that the pushed bytes complete into a character), the output must be Decode(ids) from the
// first character where the two differ.
void ExpectStreamMatchesDecode(const SentencePieceTokenizer& tok, std::span<const int32_t> ids, size_t k,
                               StreamStats* stats) {
  const std::span<const int32_t> context = ids.subspan(0, k);
  const std::string full = tok.Decode(ids);
  const std::string before = tok.Decode(context);
  const Streamed s = Stream(tok, std::vector<int32_t>(context.begin(), context.end()),
                            std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end()));
  const std::string where = "ids " + IdsToString(ids) + ", context = first " + std::to_string(k);
  ASSERT_TRUE(IsValidUtf8(full)) << where;
  for (size_t i = 0; i < s.pushes.size(); ++i) {
    EXPECT_TRUE(IsValidUtf8(s.pushes[i])) << where << ": Push #" << i << " gave a partial character";
  }
  EXPECT_TRUE(IsValidUtf8(s.finish)) << where;
  ++stats->streams;
  if (full.starts_with(before)) {
    ++stats->exact;
    EXPECT_EQ(s.all, full.substr(before.size())) << where;
  } else {
    ++stats->exceptions;
    EXPECT_TRUE(k > 0 && tok.IsByte(ids[k - 1]))
        << where << ": Decode(context) '" << before << "' is not a prefix of '" << full << "'";
    size_t same = 0;
    while (same < before.size() && same < full.size() && before[same] == full[same]) ++same;
    while (same > 0 && same < full.size() && (static_cast<uint8_t>(full[same]) & 0xC0) == 0x80) --same;
    EXPECT_EQ(s.all, full.substr(same)) << where << ": Decode(context) '" << before << "', full '" << full << "'";
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Small models built in the test.
// ---------------------------------------------------------------------------------------------------------------

// A BPE model: <unk>=0, <s>=1, </s>=2, then what the test adds. Normalizer: identity, Llama's defaults unless
// changed (add_dummy_prefix on, remove_extra_whitespaces off).
class ModelBuilder {
 public:
  ModelBuilder() {
    proto_.mutable_trainer_spec()->set_model_type(spm::TrainerSpec::BPE);
    proto_.mutable_normalizer_spec()->set_name("identity");
    proto_.mutable_normalizer_spec()->set_remove_extra_whitespaces(false);
    Add("<unk>", 0, SentencePiece::UNKNOWN);
    Add("<s>", 0, SentencePiece::CONTROL);
    Add("</s>", 0, SentencePiece::CONTROL);
  }

  ModelBuilder& Add(const std::string& piece, float score = 0, SentencePiece::Type type = SentencePiece::NORMAL) {
    auto* p = proto_.add_pieces();
    p->set_piece(piece);
    p->set_score(score);
    p->set_type(type);
    return *this;
  }
  // Single characters (as pieces of low score: the start of BPE, never the result of a merge).
  ModelBuilder& Chars(const std::vector<std::string>& chars) {
    for (const auto& c : chars) Add(c, -100);
    return *this;
  }
  // The 256 byte pieces, and byte_fallback.
  ModelBuilder& Bytes() {
    proto_.mutable_trainer_spec()->set_byte_fallback(true);
    for (int b = 0; b < 256; ++b) Add(BytePiece(b), 0, SentencePiece::BYTE);
    return *this;
  }
  spm::NormalizerSpec& normalizer() { return *proto_.mutable_normalizer_spec(); }
  spm::TrainerSpec& trainer() { return *proto_.mutable_trainer_spec(); }
  spm::ModelProto& proto() { return proto_; }

  std::string Serialize() const { return proto_.SerializeAsString(); }
  absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Build(bool add_bos = true, bool add_eos = false) const {
    return SentencePieceTokenizer::FromSerializedModel(Serialize(), add_bos, add_eos, "test.model");
  }

 private:
  spm::ModelProto proto_;
};

// Builds `b` or fails the test (returns nullptr: callers ASSERT_NE).
std::unique_ptr<SentencePieceTokenizer> BuildOrFail(const ModelBuilder& b) {
  auto tok = b.Build();
  if (!tok.ok()) {
    ADD_FAILURE() << tok.status();
    return nullptr;
  }
  return std::move(*tok);
}

// The id of `piece`, by scanning the vocabulary.
int32_t IdOf(const SentencePieceTokenizer& tok, std::string_view piece) {
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    if (tok.IdToPiece(id) == piece) return id;
  }
  ADD_FAILURE() << "no piece '" << piece << "'";
  return -1;
}

// Random id streams that exercise decoding: byte pieces forming valid characters, stray and invalid bytes,
// control and unknown pieces, "▁" pieces, ordinary pieces and ids outside the vocabulary.
std::vector<int32_t> RandomStream(const SentencePieceTokenizer& tok, const std::vector<int32_t>& byte_ids,
                                  std::mt19937& rng) {
  std::vector<int32_t> ids;
  const int length = static_cast<int>(rng() % 16);
  const auto pick = [&](uint32_t n) { return static_cast<uint32_t>(rng() % n); };
  while (static_cast<int>(ids.size()) < length) {
    switch (pick(8)) {
      case 0:
      case 1: {  // one character as byte pieces
        static constexpr uint32_t kRanges[][2] = {
            {0x20, 0x7F}, {0x80, 0x7FF}, {0x800, 0xD7FF}, {0xE000, 0xFFFF}, {0x10000, 0x10FFFF}};
        const auto& r = kRanges[pick(5)];
        const uint32_t cp = r[0] + pick(r[1] - r[0] + 1);
        std::string utf8;
        if (cp < 0x80) {
          utf8 = {static_cast<char>(cp)};
        } else if (cp < 0x800) {
          utf8 = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
        } else if (cp < 0x10000) {
          utf8 = {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
                  static_cast<char>(0x80 | (cp & 0x3F))};
        } else {
          utf8 = {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
                  static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
        }
        for (char c : utf8) ids.push_back(byte_ids[static_cast<uint8_t>(c)]);
        break;
      }
      case 2:  // any byte: stray continuation bytes, truncated characters, invalid leads
        ids.push_back(byte_ids[pick(256)]);
        break;
      case 3:  // <unk>, <s>, </s>, or an id outside the vocabulary
        ids.push_back(std::vector<int32_t>{tok.unk_id(), tok.bos_id(), tok.eos_id(), -1, tok.vocab_size()}[pick(5)]);
        break;
      default:  // any piece at all
        ids.push_back(static_cast<int32_t>(pick(static_cast<uint32_t>(tok.vocab_size()))));
        break;
    }
  }
  return ids;
}

std::vector<int32_t> ByteIds(const SentencePieceTokenizer& tok) {
  std::vector<int32_t> ids(256, -1);
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    if (!tok.IsByte(id)) continue;
    const std::string_view p = tok.IdToPiece(id);
    ids[std::stoi(std::string(p.substr(3, 2)), nullptr, 16)] = id;
  }
  return ids;
}

StreamStats FuzzStreaming(const SentencePieceTokenizer& tok, uint32_t seed, int iterations) {
  std::mt19937 rng(seed);
  const std::vector<int32_t> byte_ids = ByteIds(tok);
  StreamStats stats;
  for (int i = 0; i < iterations && !::testing::Test::HasFailure(); ++i) {
    const std::vector<int32_t> ids = RandomStream(tok, byte_ids, rng);
    ExpectStreamMatchesDecode(tok, ids, rng() % (ids.size() + 1), &stats);
  }
  return stats;
}

// ---------------------------------------------------------------------------------------------------------------
// The shared model and its reference cases.
// ---------------------------------------------------------------------------------------------------------------

struct ReferenceCase {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<std::string> pieces;
  std::string decoded;
};

void ReadReferenceCases(const std::string& path, std::vector<ReferenceCase>* cases) {
  auto text = ReadFileToString(path);
  ASSERT_TRUE(text.ok()) << text.status();
  auto json = ParseJson(*text, path);
  ASSERT_TRUE(json.ok()) << json.status();
  ASSERT_TRUE(json->is_object() && json->contains("cases") && (*json)["cases"].is_array()) << path;
  for (const Json& c : (*json)["cases"]) {
    ASSERT_TRUE(c.is_object() && c["text"].is_string() && c["ids"].is_array() && c["pieces"].is_array() &&
                c["decoded"].is_string())
        << path << ": unexpected case " << c.dump();
    ReferenceCase rc;
    rc.text = c["text"].get<std::string>();
    rc.ids = c["ids"].get<std::vector<int32_t>>();
    rc.pieces = c["pieces"].get<std::vector<std::string>>();
    rc.decoded = c["decoded"].get<std::string>();
    ASSERT_EQ(rc.ids.size(), rc.pieces.size()) << path << ": case '" << rc.text << "'";
    cases->push_back(std::move(rc));
  }
  ASSERT_FALSE(cases->empty()) << path << " has no cases";
}

class SharedModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = SharedModel(kModelName);
    if (!HaveSharedModel(kModelName)) GTEST_SKIP() << "needs the shared model at " << dir_ << " (missing)";
    auto tok = SentencePieceTokenizer::Load(dir_);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = std::move(*tok);
    ReadReferenceCases(dir_ + "/tokenizer_cases.json", &cases_);
  }

  std::string dir_;
  std::unique_ptr<SentencePieceTokenizer> tok_;
  std::vector<ReferenceCase> cases_;
};

TEST_F(SharedModelTest, ModelProperties) {
  EXPECT_EQ(tok_->vocab_size(), 4096);
  EXPECT_EQ(tok_->unk_id(), 0);
  EXPECT_EQ(tok_->bos_id(), 1);  // the cases' note: "prepend id 1 when add_bos_token is true"
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_TRUE(tok_->add_bos());  // tokenizer_config.json: add_bos_token true
  EXPECT_EQ(tok_->IdToPiece(1), "<s>");
  EXPECT_EQ(tok_->IdToPiece(3), "<0x00>");
  EXPECT_EQ(tok_->IdToPiece(-1), "");
  EXPECT_EQ(tok_->IdToPiece(4096), "");
  EXPECT_TRUE(tok_->IsControl(1));
  EXPECT_TRUE(tok_->IsControl(2));
  EXPECT_FALSE(tok_->IsControl(0));
  EXPECT_TRUE(tok_->IsByte(3));
  EXPECT_TRUE(tok_->IsByte(258));
  EXPECT_FALSE(tok_->IsByte(259));
  EXPECT_FALSE(tok_->IsByte(4096));
}

TEST_F(SharedModelTest, EncodesEveryReferenceCaseExactly) {
  int matched = 0;
  size_t ids = 0;
  for (const ReferenceCase& c : cases_) {
    const std::vector<int32_t> got = tok_->Encode(c.text);
    EXPECT_EQ(got, c.ids) << "text '" << c.text << "': got " << IdsToString(got) << ", want " << IdsToString(c.ids);
    EXPECT_EQ(Pieces(*tok_, got), c.pieces) << "text '" << c.text << "'";
    // EncodeForModel adds BOS only (add_bos_token true, add_eos_token false).
    std::vector<int32_t> with_bos = {tok_->bos_id()};
    with_bos.insert(with_bos.end(), c.ids.begin(), c.ids.end());
    EXPECT_EQ(tok_->EncodeForModel(c.text), with_bos) << "text '" << c.text << "'";
    if (got == c.ids) ++matched;
    ids += c.ids.size();
  }
  std::cout << "[ cases    ] encode: " << matched << "/" << cases_.size() << " reference cases (" << ids
            << " ids) exact\n";
  RecordProperty("encode_cases_checked", static_cast<int>(cases_.size()));
  RecordProperty("encode_cases_exact", matched);
}

TEST_F(SharedModelTest, DecodesEveryReferenceCaseExactly) {
  int matched = 0;
  for (const ReferenceCase& c : cases_) {
    const std::string got = tok_->Decode(c.ids);
    EXPECT_EQ(got, c.decoded) << "ids " << IdsToString(c.ids);
    // Control pieces vanish and do not move the leading-space rule.
    std::vector<int32_t> framed = {tok_->bos_id()};
    framed.insert(framed.end(), c.ids.begin(), c.ids.end());
    framed.push_back(tok_->eos_id());
    EXPECT_EQ(tok_->Decode(framed), c.decoded) << "ids " << IdsToString(framed);
    if (got == c.decoded) ++matched;
  }
  std::cout << "[ cases    ] decode: " << matched << "/" << cases_.size() << " reference cases exact\n";
  RecordProperty("decode_cases_checked", static_cast<int>(cases_.size()));
  RecordProperty("decode_cases_exact", matched);
}

TEST_F(SharedModelTest, IncrementalDecodingMatchesDecodeForEveryCaseAndSplit) {
  StreamStats stats;
  for (const ReferenceCase& c : cases_) {
    std::vector<int32_t> with_bos = {tok_->bos_id()};
    with_bos.insert(with_bos.end(), c.ids.begin(), c.ids.end());
    for (size_t k = 0; k <= c.ids.size(); ++k) {
      ExpectStreamMatchesDecode(*tok_, c.ids, k, &stats);
      ExpectStreamMatchesDecode(*tok_, with_bos, k + 1, &stats);
    }
    ExpectStreamMatchesDecode(*tok_, with_bos, 0, &stats);  // the BOS streamed too
    // From the start, the stream is the whole text.
    EXPECT_EQ(Stream(*tok_, {}, c.ids).all, c.decoded);
    EXPECT_EQ(Stream(*tok_, std::vector<int32_t>{tok_->bos_id()}, c.ids).all, c.decoded);
  }
  std::cout << "[ cases    ] incremental: " << cases_.size() << " reference cases, " << stats.streams
            << " context splits: " << stats.exact << " equal to Decode(all) - Decode(context), " << stats.exceptions
            << " splitting a character's bytes (the header's exception)\n";
  RecordProperty("incremental_streams_checked", stats.streams);
}

TEST_F(SharedModelTest, IncrementalDecodingHoldsSplitCharacters) {
  // CJK and emoji are not in this vocabulary: they fall back to one byte piece per UTF-8 byte.
  const std::string text = "日本語🚀";
  const std::vector<int32_t> ids = tok_->Encode(text);
  ASSERT_EQ(ids.size(), 1u + 3 * 3 + 4) << IdsToString(ids);
  EXPECT_EQ(tok_->IdToPiece(ids[0]), "▁");
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_TRUE(tok_->IsByte(ids[i])) << i;
  const Streamed s = Stream(*tok_, {}, ids);
  EXPECT_THAT(s.pushes, ElementsAre("", "", "", "日", "", "", "本", "", "", "語", "", "", "", "🚀"));
  EXPECT_EQ(s.finish, "");
  EXPECT_EQ(tok_->Decode(ids), text);

  // Two-byte characters after a word, as in the reference case "café".
  const std::vector<int32_t> cafe = tok_->Encode("café");
  const Streamed sc = Stream(*tok_, {}, cafe);
  EXPECT_EQ(sc.all, "café");
  ASSERT_GE(sc.pushes.size(), 2u);
  EXPECT_EQ(sc.pushes[sc.pushes.size() - 2], "");  // <0xC3> alone is held
  EXPECT_EQ(sc.pushes.back(), "é");
}

TEST_F(SharedModelTest, RandomIdStreamsDecodeIncrementallyLikeDecode) {
  const StreamStats stats = FuzzStreaming(*tok_, 20240611, 4000);
  std::cout << "[ fuzz     ] " << stats.streams << " random id streams: " << stats.exact
            << " checked against Decode exactly, " << stats.exceptions << " with a context ending inside a character\n";
  EXPECT_GT(stats.exact, 3000);
}

TEST_F(SharedModelTest, ControlTokensInTextAreText) {
  for (const char* text : {"<s>", "</s>", "<unk>", "a</s>b<s>"}) {
    const std::vector<int32_t> ids = tok_->Encode(text);
    for (int32_t id : ids) {
      EXPECT_FALSE(tok_->IsControl(id)) << text;
      EXPECT_NE(id, tok_->unk_id()) << text;
    }
    EXPECT_EQ(tok_->Decode(ids), text);
  }
}

TEST_F(SharedModelTest, MalformedUtf8InputBecomesReplacementCharacter) {
  // Each malformed byte is one U+FFFD (as SentencePiece's normalizer does), here encoded as byte pieces.
  const std::vector<int32_t> ids = tok_->Encode("\xff");
  ASSERT_EQ(ids.size(), 4u) << IdsToString(ids);
  EXPECT_EQ(Pieces(*tok_, ids), (std::vector<std::string>{"▁", "<0xEF>", "<0xBF>", "<0xBD>"}));
  EXPECT_EQ(tok_->Decode(tok_->Encode("a\xe6\x97")), "a" + kFffd + kFffd);
}

TEST_F(SharedModelTest, LoadCopiesWithDifferentConfigs) {
  TempDir tmp;
  const std::string model = testing::ReadFile(dir_ + "/tokenizer.model");
  WriteFile(tmp.File("tokenizer.model"), model);
  const std::string text = cases_[0].text;

  {  // no tokenizer_config.json: BOS yes, EOS no
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.status();
    EXPECT_TRUE((*tok)->add_bos());
    EXPECT_EQ((*tok)->EncodeForModel(text).front(), 1);
    EXPECT_EQ((*tok)->EncodeForModel(text).size(), cases_[0].ids.size() + 1);
  }
  {
    WriteFile(tmp.File("tokenizer_config.json"), R"({"add_bos_token": false, "add_eos_token": false})");
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.status();
    EXPECT_FALSE((*tok)->add_bos());
    EXPECT_EQ((*tok)->EncodeForModel(text), cases_[0].ids);
  }
  {
    WriteFile(tmp.File("tokenizer_config.json"), R"({"add_eos_token": true})");
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.status();
    std::vector<int32_t> want = {1};
    want.insert(want.end(), cases_[0].ids.begin(), cases_[0].ids.end());
    want.push_back(2);
    EXPECT_EQ((*tok)->EncodeForModel(text), want);
  }
}

TEST_F(SharedModelTest, TruncatedModelIsDataLoss) {
  TempDir tmp;
  const std::string model = testing::ReadFile(dir_ + "/tokenizer.model");
  WriteFile(tmp.File("tokenizer.model"), model.substr(0, model.size() / 2));
  auto tok = SentencePieceTokenizer::Load(tmp.path());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr(tmp.File("tokenizer.model")));

  // Any cut in the pieces is refused: as corrupt, or (at a piece boundary, where the trainer spec is lost) as
  // the default UNIGRAM model type. Never accepted.
  int cuts = 0;
  for (size_t cut = 1; cut < model.size() / 2; cut += 211, ++cuts) {
    auto t =
        SentencePieceTokenizer::FromSerializedModel(std::string_view(model).substr(0, cut), true, false, "cut.model");
    ASSERT_FALSE(t.ok()) << "cut at " << cut;
    EXPECT_TRUE(t.status().code() == absl::StatusCode::kDataLoss ||
                t.status().code() == absl::StatusCode::kUnimplemented)
        << t.status();
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("cut.model"));
  }
  EXPECT_GT(cuts, 100);
}

// ---------------------------------------------------------------------------------------------------------------
// BPE merging.
// ---------------------------------------------------------------------------------------------------------------

ModelBuilder AbcModel() {
  ModelBuilder b;
  b.normalizer().set_add_dummy_prefix(false);
  b.Chars({"a", "b", "c"});
  return b;
}

TEST(TokenizerBpeTest, HighestScoringPairMergesFirstWherever) {
  ModelBuilder b = AbcModel();
  b.Add("ab", -2).Add("bb", -1);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("abb")), ElementsAre("a", "bb"));  // not left to right
  EXPECT_THAT(Pieces(*tok, tok->Encode("abab")), ElementsAre("ab", "ab"));
}

TEST(TokenizerBpeTest, EqualScoresMergeLeftmostFirst) {
  {
    ModelBuilder b = AbcModel();
    b.Add("ab", -1).Add("bc", -1);
    auto tok = BuildOrFail(b);
    ASSERT_NE(tok, nullptr);
    EXPECT_THAT(Pieces(*tok, tok->Encode("abc")), ElementsAre("ab", "c"));
  }
  {
    ModelBuilder b = AbcModel();
    b.Add("ab", -1).Add("bc", -0.5);
    auto tok = BuildOrFail(b);
    ASSERT_NE(tok, nullptr);
    EXPECT_THAT(Pieces(*tok, tok->Encode("abc")), ElementsAre("a", "bc"));
  }
}

TEST(TokenizerBpeTest, MergedSymbolsKeepMerging) {
  ModelBuilder b = AbcModel();
  b.Add("ab", -1).Add("abc", -3).Add("bc", -5);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("abc")), ElementsAre("abc"));
  EXPECT_THAT(Pieces(*tok, tok->Encode("abcbc")), ElementsAre("abc", "bc"));
}

TEST(TokenizerBpeTest, OverlappingPairsGoStale) {
  ModelBuilder b = AbcModel();
  b.Add("aa", -1).Add("aaaa", -3);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("aaa")), ElementsAre("aa", "a"));
  EXPECT_THAT(Pieces(*tok, tok->Encode("aaaaa")), ElementsAre("aaaa", "a"));
  EXPECT_THAT(Pieces(*tok, tok->Encode("aaaaaa")), ElementsAre("aaaa", "aa"));
}

TEST(TokenizerBpeTest, UnusedPiecesMergeButAreSplitBack) {
  ModelBuilder b = AbcModel();
  b.Add("ab", -1, SentencePiece::UNUSED).Add("abc", -2);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("abc")), ElementsAre("abc"));  // reached through the unused "ab"
  EXPECT_THAT(Pieces(*tok, tok->Encode("ab")), ElementsAre("a", "b"));
  EXPECT_EQ(tok->Decode(tok->Encode("abcab")), "abcab");
}

TEST(TokenizerBpeTest, UserDefinedPiecesMatchLongestAndNeverMerge) {
  ModelBuilder b = AbcModel();
  b.Chars({"<", ">", "x", "y"});
  b.Add("<x>", 0, SentencePiece::USER_DEFINED).Add("<xy>", 0, SentencePiece::USER_DEFINED);
  b.Add("<x", -1).Add("<x>a", 5).Add("a<", 5);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("<xy>")), ElementsAre("<xy>"));
  EXPECT_THAT(Pieces(*tok, tok->Encode("a<x>a")), ElementsAre("a", "<x>", "a"));  // no "a<" nor "<x>a"
  EXPECT_THAT(Pieces(*tok, tok->Encode("<xa")), ElementsAre("<x", "a"));
  EXPECT_EQ(tok->Decode(tok->Encode("b<xy><x>c")), "b<xy><x>c");
}

TEST(TokenizerBpeTest, ControlPiecesAreNeverProducedFromText) {
  ModelBuilder b = AbcModel();
  b.Chars({"<", "/", "s", ">"}).Add("<s", -1).Add("</", -1).Add("s>", -2);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("<s>")), ElementsAre("<s", ">"));
  EXPECT_THAT(Pieces(*tok, tok->Encode("</s>")), ElementsAre("</", "s>"));
}

// ---------------------------------------------------------------------------------------------------------------
// Normalizer options, unknown characters, byte fallback.
// ---------------------------------------------------------------------------------------------------------------

ModelBuilder SpaceModel() {
  ModelBuilder b;
  b.Chars({"▁", "a", "b"});
  return b;
}

TEST(TokenizerNormalizerTest, DummyPrefixAndSpacesKeptByDefault) {
  auto tok = BuildOrFail(SpaceModel());
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("a  b")), ElementsAre("▁", "a", "▁", "▁", "b"));
  EXPECT_THAT(Pieces(*tok, tok->Encode(" a ")), ElementsAre("▁", "▁", "a", "▁"));
  EXPECT_THAT(tok->Encode(""), ElementsAre());
}

TEST(TokenizerNormalizerTest, RemoveExtraWhitespaces) {
  ModelBuilder b = SpaceModel();
  b.normalizer().set_remove_extra_whitespaces(true);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("  a   b  ")), ElementsAre("▁", "a", "▁", "b"));
  EXPECT_THAT(tok->Encode("   "), ElementsAre());
}

TEST(TokenizerNormalizerTest, NoDummyPrefix) {
  ModelBuilder b = SpaceModel();
  b.normalizer().set_add_dummy_prefix(false);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("a b")), ElementsAre("a", "▁", "b"));
}

TEST(TokenizerNormalizerTest, UnescapedWhitespace) {
  ModelBuilder b = SpaceModel();
  b.normalizer().set_escape_whitespaces(false);
  b.Add(" ", -100);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("a b")), ElementsAre(" ", "a", " ", "b"));
}

TEST(TokenizerNormalizerTest, WhitespaceAsSuffix) {
  ModelBuilder b = SpaceModel();
  b.trainer().set_treat_whitespace_as_suffix(true);
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("a b")), ElementsAre("a", "▁", "b", "▁"));
}

TEST(TokenizerNormalizerTest, EmptyCharsmapWithAnotherNameIsIdentity) {
  ModelBuilder b = SpaceModel();
  b.normalizer().set_name("nmt_nfkc");
  b.normalizer().set_precompiled_charsmap("");
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Pieces(*tok, tok->Encode("ab")), ElementsAre("▁", "a", "b"));
}

TEST(TokenizerUnknownTest, WithoutByteFallbackARunOfUnknownsIsOneUnk) {
  ModelBuilder b = AbcModel();
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> ids = tok->Encode("a日本b語");
  EXPECT_THAT(Pieces(*tok, ids), ElementsAre("a", "<unk>", "b", "<unk>"));
  EXPECT_EQ(tok->Decode(ids), "a \xE2\x81\x87 b \xE2\x81\x87 ");  // the default unk surface " ⁇ "

  b.trainer().set_unk_surface("?");
  auto custom = BuildOrFail(b);
  ASSERT_NE(custom, nullptr);
  EXPECT_EQ(custom->Decode(ids), "a?b?");
}

TEST(TokenizerUnknownTest, ByteFallbackSpellsUnknownCharactersInBytes) {
  ModelBuilder b = AbcModel();
  b.Bytes();
  auto tok = BuildOrFail(b);
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> ids = tok->Encode("a日b");
  EXPECT_THAT(Pieces(*tok, ids), ElementsAre("a", "<0xE6>", "<0x97>", "<0xA5>", "b"));
  EXPECT_EQ(tok->Decode(ids), "a日b");
  // Malformed input bytes: one U+FFFD each.
  EXPECT_THAT(Pieces(*tok, tok->Encode("a\xff")), ElementsAre("a", "<0xEF>", "<0xBF>", "<0xBD>"));
}

// ---------------------------------------------------------------------------------------------------------------
// Decoding rules, full and incremental.
// ---------------------------------------------------------------------------------------------------------------

class TokenizerDecodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelBuilder b;
    b.Chars({"▁", "a", "b"}).Add("▁a", -1).Add("▁▁", -2).Bytes();
    tok_ = BuildOrFail(b);
    ASSERT_NE(tok_, nullptr);
    sp_ = IdOf(*tok_, "▁");
    sp_a_ = IdOf(*tok_, "▁a");
    sp_sp_ = IdOf(*tok_, "▁▁");
    a_ = IdOf(*tok_, "a");
  }
  int32_t B(int byte) const { return IdOf(*tok_, BytePiece(byte)); }
  std::string D(const std::vector<int32_t>& ids) const { return tok_->Decode(ids); }

  std::unique_ptr<SentencePieceTokenizer> tok_;
  int32_t sp_ = -1, sp_a_ = -1, sp_sp_ = -1, a_ = -1;
};

TEST_F(TokenizerDecodeTest, LeadingSpaceOfTheFirstVisiblePieceIsDropped) {
  EXPECT_EQ(D({sp_a_}), "a");
  EXPECT_EQ(D({sp_a_, sp_a_}), "a a");
  EXPECT_EQ(D({1, sp_a_}), "a");                 // control pieces are invisible
  EXPECT_EQ(D({sp_sp_, a_}), " a");              // only one "▁" goes
  EXPECT_EQ(D({sp_, sp_a_}), " a");              // ... and only once
  EXPECT_EQ(D({B('A'), sp_a_}), "A a");          // text from bytes counts as text
  EXPECT_EQ(D({0, sp_a_}), " \xE2\x81\x87  a");  // so does <unk>
  EXPECT_EQ(D({a_, sp_a_}), "a a");
  EXPECT_EQ(D({}), "");
  EXPECT_EQ(D({1, 2}), "");
  EXPECT_EQ(D({-1, sp_a_, tok_->vocab_size()}), "a");  // ids outside the vocabulary decode to nothing
}

TEST_F(TokenizerDecodeTest, TokenTextIsOnePieceWhereverItStands) {
  EXPECT_EQ(tok_->TokenText(sp_a_), " a");  // the leading space stays
  EXPECT_EQ(tok_->TokenText(sp_sp_), "  ");
  EXPECT_EQ(tok_->TokenText(a_), "a");
  EXPECT_EQ(tok_->TokenText(B(0xE2)), "\xE2");        // a byte piece: its byte
  EXPECT_EQ(tok_->TokenText(1), tok_->IdToPiece(1));  // a control piece as written
  EXPECT_EQ(tok_->TokenText(0), " \xE2\x81\x87 ");    // <unk>: its surface
  EXPECT_EQ(tok_->TokenText(-1), "");
  EXPECT_EQ(tok_->TokenText(tok_->vocab_size()), "");
}

TEST(TokenizerDecodeOptionsTest, LeadingSpaceRulesFollowTheNormalizer) {
  {
    ModelBuilder b = SpaceModel();
    b.Add("▁a", -1).normalizer().set_add_dummy_prefix(false);
    auto tok = BuildOrFail(b);
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->Decode(tok->Encode(" a")), " a");
    EXPECT_EQ(tok->Decode(std::vector<int32_t>{IdOf(*tok, "▁a")}), " a");  // nothing to drop
  }
  {
    ModelBuilder b = SpaceModel();
    b.Add("▁a", -1).normalizer().set_remove_extra_whitespaces(true);
    auto tok = BuildOrFail(b);
    ASSERT_NE(tok, nullptr);
    // Every leading "▁" goes while the text is empty.
    EXPECT_EQ(tok->Decode(std::vector<int32_t>{IdOf(*tok, "▁"), IdOf(*tok, "▁a")}), "a");
  }
}

TEST_F(TokenizerDecodeTest, BytePiecesAreReassembledWithReplacementCharacters) {
  EXPECT_EQ(D({B(0xF0), B(0x9F), B(0x9A), B(0x80)}), "🚀");
  EXPECT_EQ(D({B(0xE2), B(0x82)}), kFffd + kFffd);                                    // truncated
  EXPECT_EQ(D({B(0xE2), B('A')}), kFffd + "A");                                       // interrupted
  EXPECT_EQ(D({B(0xC0), B(0x80)}), kFffd + kFffd);                                    // overlong
  EXPECT_EQ(D({B(0xED), B(0xA0), B(0x80)}), kFffd + kFffd + kFffd);                   // surrogate
  EXPECT_EQ(D({B(0xF4), B(0x90), B(0x80), B(0x80)}), kFffd + kFffd + kFffd + kFffd);  // above U+10FFFF
  EXPECT_EQ(D({B(0xEF), B(0xBF), B(0xBD)}), kFffd);                                   // a real U+FFFD
  EXPECT_EQ(D({B(0xFF)}), kFffd);
  EXPECT_EQ(D({B(0xE2), 2, B(0x80), B(0x94)}), kFffd + kFffd + kFffd);  // a control piece ends the run
  EXPECT_EQ(D({B(0xE2), B(0x80), B(0x94), sp_a_}), "— a");
}

TEST_F(TokenizerDecodeTest, IncrementalHoldsBytesOnlyWhileTheyCanFormACharacter) {
  EXPECT_THAT(Stream(*tok_, {}, {B(0xF0), B(0x9F), B(0x9A), B(0x80)}).pushes, ElementsAre("", "", "", "🚀"));
  EXPECT_THAT(Stream(*tok_, {}, {B(0xE2), B('A')}).pushes, ElementsAre("", kFffd + "A"));
  EXPECT_THAT(Stream(*tok_, {}, {B(0xE0), B(0x80)}).pushes, ElementsAre("", kFffd + kFffd));  // overlong: known
  EXPECT_THAT(Stream(*tok_, {}, {B(0xC0)}).pushes, ElementsAre(kFffd));                       // never a lead byte
  EXPECT_THAT(Stream(*tok_, {}, {B(0xED), B(0xA0)}).pushes, ElementsAre("", kFffd + kFffd));  // surrogate
  const Streamed truncated = Stream(*tok_, {}, {B(0xE2), B(0x82)});
  EXPECT_THAT(truncated.pushes, ElementsAre("", ""));
  EXPECT_EQ(truncated.finish, kFffd + kFffd);  // Finish gives what Decode gives
  const Streamed interrupted = Stream(*tok_, {}, {B(0xE2), 2, sp_a_});
  EXPECT_THAT(interrupted.pushes, ElementsAre("", kFffd, " a"));
}

TEST_F(TokenizerDecodeTest, IncrementalPlacesTheLeadingSpaceLikeDecode) {
  EXPECT_THAT(Stream(*tok_, {}, {sp_a_, sp_a_}).pushes, ElementsAre("a", " a"));
  EXPECT_THAT(Stream(*tok_, {}, {1, sp_a_}).pushes, ElementsAre("", "a"));
  EXPECT_THAT(Stream(*tok_, {}, {sp_, sp_a_}).pushes, ElementsAre("", " a"));
  EXPECT_THAT(Stream(*tok_, {}, {B('A'), sp_a_}).pushes, ElementsAre("A", " a"));
  EXPECT_THAT(Stream(*tok_, std::vector<int32_t>{1}, {sp_a_}).pushes, ElementsAre("a"));
  EXPECT_THAT(Stream(*tok_, std::vector<int32_t>{sp_a_}, {sp_a_}).pushes, ElementsAre(" a"));
  EXPECT_THAT(Stream(*tok_, std::vector<int32_t>{sp_}, {sp_a_}).pushes, ElementsAre(" a"));
}

// DecodeAfter: the continuation's text as it reads after its context, the leading space kept where Decode alone
// drops it.
TEST_F(TokenizerDecodeTest, DecodeAfterReadsTheIdsAsTheyFollowTheContext) {
  const std::vector<int32_t> context = {1, sp_a_};
  const std::vector<int32_t> ids = {sp_a_, a_};
  EXPECT_EQ(D(ids), "aa");
  EXPECT_EQ(tok_->DecodeAfter(context, ids), " aa");
  EXPECT_EQ(tok_->DecodeAfter(context, ids), Stream(*tok_, context, ids).all);
  EXPECT_EQ(tok_->DecodeAfter({}, ids), "aa");
  EXPECT_EQ(tok_->DecodeAfter(context, {}), "");
  EXPECT_EQ(tok_->DecodeAfter(context, std::vector<int32_t>{B(0xE2)}), kFffd);  // a held byte comes out at the end
}

TEST_F(TokenizerDecodeTest, IncrementalAfterAContextEndingInBytes) {
  // Decode(context) showed the held byte as U+FFFD; what follows keeps the contract (a string suffix).
  EXPECT_EQ(Stream(*tok_, std::vector<int32_t>{B(0xE2)}, {B('A')}).all, "A");
  EXPECT_EQ(Stream(*tok_, std::vector<int32_t>{B(0xE2)}, {sp_a_}).all, " a");
  EXPECT_EQ(Stream(*tok_, std::vector<int32_t>{B(0xE2), B(0x82)}, {}).all, "");
  EXPECT_EQ(Stream(*tok_, std::vector<int32_t>{B(0xEF)}, {B(0xBF), B(0xBD), B('A')}).all, "A");  // "\uFFFD" + "A"
  // The documented exception: the pushed bytes complete the character; it is emitted whole.
  EXPECT_EQ(Stream(*tok_, std::vector<int32_t>{B(0xE2), B(0x80)}, {B(0x94)}).all, "—");
}

TEST_F(TokenizerDecodeTest, RandomIdStreamsDecodeIncrementallyLikeDecode) {
  const StreamStats stats = FuzzStreaming(*tok_, 7, 20000);
  std::cout << "[ fuzz     ] " << stats.streams << " random id streams (small model): " << stats.exact << " exact, "
            << stats.exceptions << " with a context ending inside a character\n";
  EXPECT_GT(stats.exact, 15000);
}

TEST(TokenizerDecodeOptionsTest, RandomIdStreamsWithOtherNormalizerOptions) {
  for (const bool remove_extra : {false, true}) {
    for (const bool dummy_prefix : {false, true}) {
      ModelBuilder b = SpaceModel();
      b.Add("▁a", -1).Add("▁▁", -2).Bytes();
      b.normalizer().set_remove_extra_whitespaces(remove_extra);
      b.normalizer().set_add_dummy_prefix(dummy_prefix);
      auto tok = BuildOrFail(b);
      ASSERT_NE(tok, nullptr);
      SCOPED_TRACE(::testing::Message() << "remove_extra_whitespaces " << remove_extra << ", add_dummy_prefix "
                                        << dummy_prefix);
      const StreamStats stats = FuzzStreaming(*tok, 11, 5000);
      EXPECT_GT(stats.exact, 3000);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------------------------------

TEST(TokenizerLoadTest, MissingModelIsNotFoundNamingThePath) {
  TempDir tmp;
  auto tok = SentencePieceTokenizer::Load(tmp.path());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr(tmp.File("tokenizer.model")));

  // Tokenizer::Load: NotFound only when the folder has no tokenizer of either kind.
  auto none = Tokenizer::Load(tmp.path());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("neither tokenizer.model nor tokenizer.json"));
  auto missing_dir = Tokenizer::Load(tmp.File("no-such-dir"));
  ASSERT_FALSE(missing_dir.ok());
  EXPECT_EQ(missing_dir.status().code(), absl::StatusCode::kNotFound);

  WriteFile(tmp.File("tokenizer.json"), "{}");  // a broken tokenizer.json is an error, not a missing tokenizer
  auto broken_json = Tokenizer::Load(tmp.path());
  ASSERT_FALSE(broken_json.ok());
  EXPECT_EQ(broken_json.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(broken_json.status().message()), HasSubstr("tokenizer.json: field 'model': missing"));
}

TEST(TokenizerLoadTest, GarbageModelIsDataLossNamingTheFile) {
  for (const std::string& garbage : {std::string("this is not a protobuf\xff\xff"), std::string(""),
                                     std::string("\x0a\xff\xff\xff\x0f", 5), std::string("\xc8\x06\x01", 3)}) {
    TempDir tmp;
    WriteFile(tmp.File("tokenizer.model"), garbage);
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_FALSE(tok.ok()) << "garbage of " << garbage.size() << " bytes accepted";
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr(tmp.File("tokenizer.model")));
  }
}

TEST(TokenizerLoadTest, ConfigIsReadAndCheckedFromTheDirectory) {
  TempDir tmp;
  ModelBuilder b = SpaceModel();
  WriteFile(tmp.File("tokenizer.model"), b.Serialize());
  const std::vector<int32_t> body = {IdOf(*BuildOrFail(b), "▁"), IdOf(*BuildOrFail(b), "a")};

  {  // defaults: BOS, no EOS
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.status();
    EXPECT_THAT((*tok)->EncodeForModel("a"), ElementsAre(1, body[0], body[1]));
  }
  {
    WriteFile(tmp.File("tokenizer_config.json"), R"({"add_bos_token": false})");
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.status();
    EXPECT_FALSE((*tok)->add_bos());
    EXPECT_THAT((*tok)->EncodeForModel("a"), ElementsAre(body[0], body[1]));
  }
  {
    WriteFile(tmp.File("tokenizer_config.json"), R"({"add_bos_token": true, "add_eos_token": true, "x": [1]})");
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.status();
    EXPECT_THAT((*tok)->EncodeForModel("a"), ElementsAre(1, body[0], body[1], 2));
  }
  {
    WriteFile(tmp.File("tokenizer_config.json"), R"({"add_bos_token": fals)");
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr(tmp.File("tokenizer_config.json")));
  }
  {
    WriteFile(tmp.File("tokenizer_config.json"), R"([true])");
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("tokenizer_config.json"));
  }
  {
    WriteFile(tmp.File("tokenizer_config.json"), R"({"add_bos_token": "no"})");
    auto tok = SentencePieceTokenizer::Load(tmp.path());
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kFailedPrecondition) << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("add_bos_token"));
  }
}

TEST(TokenizerModelErrorsTest, UnigramIsUnimplementedNamingModelType) {
  ModelBuilder b = SpaceModel();
  b.trainer().set_model_type(spm::TrainerSpec::UNIGRAM);
  auto tok = b.Build();
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("model_type"));
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("UNIGRAM"));
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("test.model"));

  b.trainer().clear_model_type();  // SentencePiece's default is UNIGRAM
  EXPECT_EQ(b.Build().status().code(), absl::StatusCode::kUnimplemented);
}

TEST(TokenizerModelErrorsTest, PrecompiledCharsmapIsUnimplemented) {
  ModelBuilder b = SpaceModel();
  b.normalizer().set_name("nmt_nfkc");
  b.normalizer().set_precompiled_charsmap(std::string("\x04\x00\x00\x00\x00\x00\x00\x00xyz", 11));
  auto tok = b.Build();
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("precompiled_charsmap"));
}

TEST(TokenizerModelErrorsTest, InconsistentModelsAreDataLoss) {
  const auto expect_data_loss = [](const ModelBuilder& b, std::string_view what) {
    auto tok = b.Build();
    ASSERT_FALSE(tok.ok()) << what;
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kDataLoss) << what << ": " << tok.status();
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr("test.model")) << what;
  };
  {
    ModelBuilder b = SpaceModel();
    b.proto().mutable_pieces(0)->set_type(SentencePiece::NORMAL);
    expect_data_loss(b, "no unk");
  }
  {
    ModelBuilder b = SpaceModel();
    b.Add("<unk2>", 0, SentencePiece::UNKNOWN);
    expect_data_loss(b, "two unks");
  }
  {
    ModelBuilder b = SpaceModel();
    b.Add("a");
    expect_data_loss(b, "duplicate piece");
  }
  {
    ModelBuilder b = SpaceModel();
    b.Add("");
    expect_data_loss(b, "empty piece");
  }
  {
    ModelBuilder b = SpaceModel();
    b.Add("<0x41>", 0, SentencePiece::BYTE);
    expect_data_loss(b, "byte piece without byte_fallback");
  }
  {
    ModelBuilder b = SpaceModel();
    b.Bytes();
    b.proto().mutable_pieces()->RemoveLast();  // <0xFF>
    expect_data_loss(b, "255 byte pieces");
  }
  {
    ModelBuilder b = SpaceModel();
    b.trainer().set_byte_fallback(true);
    b.Add("<0xzz>", 0, SentencePiece::BYTE);
    expect_data_loss(b, "malformed byte piece");
  }
}

}  // namespace
}  // namespace odmoe
