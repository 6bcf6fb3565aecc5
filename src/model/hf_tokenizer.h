// Hugging Face `tokenizers` BPE over the byte-level alphabet, read from tokenizer.json: the tokenizer of the
// Qwen2-MoE, Qwen3-MoE and OLMoE checkpoints (and of GPT-2, GPT-NeoX, Llama 3 ...). Written from the file format
// and the `tokenizers` pipeline, with ICU for Unicode normalization and the pre-tokenizer's regular expressions:
//
//   text -> split at added tokens (matched in the raw text, leftmost, longest first; lstrip / rstrip /
//           single_word honoured) -> each other piece: normalizer (NFC, NFKC, NFD, NFKD, Lowercase, or a
//           Sequence) -> pre-tokenizer (Split by regex or string, Isolated or Removed; ByteLevel with or without
//           its GPT-2 regex; or a Sequence) -> bytes to the byte-level alphabet -> BPE merges by rank (lowest
//           first, leftmost on ties) -> vocab ids; post-processor (ByteLevel, TemplateProcessing, or a Sequence)
//           for EncodeForModel.
//   ids -> tokens (added tokens by content, special ones left out) -> byte-level decoding -> UTF-8 with
//          replacement (maximal subparts, as Rust's from_utf8_lossy).
//
// Regular expressions follow Oniguruma (which `tokenizers` uses) where ICU differs: \s and \S mean Unicode
// White_Space. Added tokens marked `normalized` are matched in the raw text too: the same for the normalizers
// above unless the token's own text changes under them. Anything else the file asks for (another model type,
// byte_fallback, a Metaspace pre-tokenizer or decoder ...) is refused at load with Unimplemented naming the
// field, never approximated.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "src/model/tokenizer.h"

namespace odmoe {

// The character that stands for `byte` in the byte-level alphabet (GPT-2's bytes_to_unicode), in UTF-8:
// printable Latin-1 bytes stand for themselves, the other 68 for U+0100 and up, in byte order.
std::string ByteLevelChar(uint8_t byte);

class HfTokenizer final : public Tokenizer {
 public:
  // Reads DIR/tokenizer.json and, if present, DIR/tokenizer_config.json (bos_token, eos_token). NotFound names a
  // missing tokenizer.json; invalid JSON is DataLoss, a malformed field FailedPrecondition and an unsupported one
  // Unimplemented, each naming the file and field.
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> Load(const std::string& dir);
  // From the two files' contents (`tokenizer_config`: "" when there is none); `where` names tokenizer.json.
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> FromJson(std::string_view tokenizer_json,
                                                               std::string_view tokenizer_config,
                                                               const std::string& where);
  ~HfTokenizer() override;

  // Added tokens written in the text are recognized, as `tokenizers` does by default.
  std::vector<int32_t> Encode(std::string_view text) const override;
  // Encode, then the post-processor's tokens around it (TemplateProcessing's `single`; none for ByteLevel).
  std::vector<int32_t> EncodeForModel(std::string_view text) const override;
  // As `tokenizers` decode(ids, skip_special_tokens=True). No clean_up_tokenization_spaces.
  std::string Decode(std::span<const int32_t> ids) const override;
  // Exception to the IncrementalDecoder contract: a context ending in the start of a character that the pushed
  // bytes complete. Decode(context) showed U+FFFD there; the decoder emits the whole character.
  std::unique_ptr<IncrementalDecoder> NewDecoder(std::span<const int32_t> context) const override;
  std::string TokenText(int32_t id) const override;

  std::string_view file_name() const override { return "tokenizer.json"; }
  // One past the highest id of the vocabulary and the added tokens.
  int32_t vocab_size() const override;
  int32_t bos_id() const override;  // tokenizer_config.json's bos_token, if it names a token
  int32_t eos_id() const override;  // tokenizer_config.json's eos_token, if it names a token

  // The bytes `id` stands for ("" for a special token or an id out of range), and whether it is special.
  std::string_view TokenBytes(int32_t id) const;
  bool IsSpecial(int32_t id) const override;

  struct Impl;

 private:
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace odmoe
