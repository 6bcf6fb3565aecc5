// Fuzzes the tokenizer.json tokenizer's text path (HfTokenizer::Encode: added-token matching, the Qwen
// pre-tokenizer regex, byte-level mapping, BPE merges) and its decoders with arbitrary bytes, on a fixed small
// tokenizer. Byte-level BPE loses nothing, so for valid UTF-8 input Decode(Encode(text)) must give the text back
// (the tokenizer has no normalizer, and its added tokens are not special and strip nothing), and streaming the ids
// through an IncrementalDecoder must give the same text.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nlohmann/json.hpp"
#include "src/common/utf8.h"
#include "src/model/hf_tokenizer.h"

namespace {

std::string ByteChar(int byte) { return odmoe::ByteLevelChar(static_cast<uint8_t>(byte)); }

const odmoe::HfTokenizer* Tokenizer() {
  static const odmoe::HfTokenizer* tokenizer = [] {
    nlohmann::json vocab = nlohmann::json::object(), merges = nlohmann::json::array();
    for (int b = 0; b < 256; ++b) vocab[ByteChar(b)] = b;
    const std::string space = ByteChar(' ');
    for (const auto& [l, r] : std::vector<std::pair<std::string, std::string>>{{space, "t"},
                                                                               {"h", "e"},
                                                                               {space + "t", "he"},
                                                                               {"i", "n"},
                                                                               {space, space},
                                                                               {"1", "2"},
                                                                               {"\xc3\xa4", "\xc2\xb8"}}) {
      if (!vocab.contains(l + r)) vocab[l + r] = static_cast<int>(vocab.size());
      merges.push_back(l + " " + r);
    }
    const nlohmann::json qwen_split = {
        {"type", "Split"},
        {"pattern",
         {{"Regex",
           "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
           "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
        {"behavior", "Isolated"}};
    const nlohmann::json json = {
        {"added_tokens",
         {{{"id", 300}, {"content", "<|im_start|>"}, {"special", false}},
          {{"id", 301}, {"content", "<|im_end|>"}, {"special", false}},
          {{"id", 302}, {"content", "<w>"}, {"special", false}, {"single_word", true}}}},
        {"normalizer", nullptr},
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers", {qwen_split, {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
        {"post_processor", {{"type", "ByteLevel"}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
    auto t = odmoe::HfTokenizer::FromJson(json.dump(), "", "fuzz/tokenizer.json");
    if (!t.ok()) {
      std::fprintf(stderr, "the fuzzer's tokenizer does not load: %s\n", t.status().ToString().c_str());
      std::abort();
    }
    return t->release();
  }();
  return tokenizer;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const odmoe::HfTokenizer& t = *Tokenizer();
  const std::vector<int32_t> ids = t.Encode(text);
  const std::string decoded = t.Decode(ids);
  std::unique_ptr<odmoe::IncrementalDecoder> stream = t.NewDecoder({});
  std::string streamed;
  for (const int32_t id : ids) streamed += stream->Push(id);
  streamed += stream->Finish();
  if (streamed != decoded) {
    std::fprintf(stderr, "streamed text differs from Decode\n");
    std::abort();
  }
  if (!odmoe::FirstInvalidUtf8(text).has_value() && decoded != text) {
    std::fprintf(stderr, "Decode(Encode(text)) != text for valid UTF-8 (%zu bytes in, %zu out)\n", text.size(),
                 decoded.size());
    std::abort();
  }
  return 0;
}
