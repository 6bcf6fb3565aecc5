// SentencePiece tokenizer (BPE models with byte fallback, as Mixtral/Llama ship in tokenizer.model), written
// from the model format: no dependency on the sentencepiece library. Encodes and decodes exactly like
// SentencePiece for the normalizers odmoe accepts ("identity"; a model with a precompiled NFKC charsmap is
// refused rather than approximated).
//
// Tokenizer::Load (src/model/tokenizer.h) picks it for a checkpoint that ships tokenizer.model.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "src/model/tokenizer.h"

namespace odmoe {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Reads DIR/tokenizer.model and, if present, DIR/tokenizer_config.json (add_bos_token, add_eos_token;
  // defaults: BOS yes, EOS no). NotFound names the missing file; a malformed file gives DataLoss naming it;
  // an unsupported model (unigram, non-identity normalizer) gives Unimplemented naming the field.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(const std::string& dir);
  // From the serialized model proto. `where` names the source in messages.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> FromSerializedModel(std::string_view model,
                                                                                     bool add_bos, bool add_eos,
                                                                                     const std::string& where);
  ~SentencePieceTokenizer() override;

  // Text to ids, without BOS/EOS. Control tokens written in the text ("</s>") are ordinary text.
  std::vector<int32_t> Encode(std::string_view text) const override;
  // Text to ids with BOS / EOS added as tokenizer_config.json asks.
  std::vector<int32_t> EncodeForModel(std::string_view text) const override;
  // Ids to text, as SentencePiece's DecodeIds does: control tokens vanish, byte pieces are reassembled into
  // UTF-8 (invalid bytes become U+FFFD), the leading-space marker of the first piece is dropped.
  // In detail, as current SentencePiece: while the text is empty, a piece loses one leading "▁" if the
  // normalizer adds a dummy prefix or removes extra whitespace, and after one piece has lost it no later piece
  // does (unless remove_extra_whitespaces: then every leading "▁" goes). Older SentencePiece releases dropped
  // it whatever the normalizer, from every piece while the text was empty: with add_dummy_prefix the two differ
  // only for ids that start with a bare "▁" piece (older: ["▁", "▁a"] -> "a"; here " a").
  // Ids outside [0, vocab_size()) (SentencePiece refuses them) decode like a control token: to nothing.
  std::string Decode(std::span<const int32_t> ids) const override;

  std::string_view file_name() const override { return "tokenizer.model"; }
  int32_t vocab_size() const override;
  int32_t bos_id() const override;
  int32_t eos_id() const override;
  std::unique_ptr<IncrementalDecoder> NewDecoder(std::span<const int32_t> context) const override;
  // The piece with "▁" as a space (the unknown piece as its surface, " ⁇ "), a byte piece's byte, and a control
  // piece as written ("</s>").
  std::string TokenText(int32_t id) const override;
  // A control piece ("<s>", "</s>") or the unknown piece.
  bool IsSpecial(int32_t id) const override;

  int32_t unk_id() const;
  bool add_bos() const;
  // The piece string of `id` (with the "▁" marker), or "" if out of range.
  std::string_view IdToPiece(int32_t id) const;
  bool IsControl(int32_t id) const;
  bool IsByte(int32_t id) const;

  struct Impl;

 private:
  friend class SentencePieceDecoder;  // decodes piece by piece with the same rules as Decode
  explicit SentencePieceTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of generated ids into text as they arrive, for printing while generating. Never emits part of
// a UTF-8 character (byte-fallback pieces are held until their character is complete, and only while they
// can still become one) and places the leading-space marker as full decoding would: Push(ids one by one)
// concatenated with Finish() equals Decode(context + ids) minus Decode(context).
//
// One exception, where Decode(context) is not a prefix of Decode(context + ids): `context` ends with byte
// pieces that begin a character which the pushed bytes complete. Decode(context) showed those bytes as U+FFFD,
// Decode(context + ids) has the character; the decoder then emits the whole character (and keeps going), since
// it cannot take back what the caller printed. Prompts from Encode never end that way.
// Finish() ends the byte run: call it once, after the last Push.
//
// Thread safety: none; one decoder per stream. REQUIRES: `tokenizer` outlives the decoder.
class SentencePieceDecoder final : public IncrementalDecoder {
 public:
  // `context`: ids already in the sequence (the prompt), which are not emitted.
  SentencePieceDecoder(const SentencePieceTokenizer& tokenizer, std::span<const int32_t> context);
  // Appends one id; returns the text that is now complete (possibly empty).
  std::string Push(int32_t id) override;
  // Returns whatever is still held back (incomplete UTF-8 becomes U+FFFD, as Decode would give).
  std::string Finish() override;

 private:
  // Decodes the complete characters (and definitely invalid bytes) at the front of pending_bytes_; with
  // `final`, also the rest, as SentencePiece does at the end of a run of byte pieces.
  std::string DrainBytes(bool final);
  // Drops the front of `out` while it repeats context_tail_ (text the caller already has).
  std::string SkipShown(std::string out);

  const SentencePieceTokenizer& tokenizer_;
  bool at_start_ = true;       // SentencePiece's is_bos_ws: the next piece may still lose its leading "▁"
  bool bos_ws_seen_ = false;   // the last non-byte piece had its leading "▁" dropped
  bool text_empty_ = true;     // Decode(context + ids so far) is empty (byte pieces always give text)
  std::string pending_bytes_;  // byte-fallback bytes not yet forming complete characters
  std::string context_tail_;   // what Decode(context) showed for the bytes it left held: one U+FFFD each
};

}  // namespace odmoe
