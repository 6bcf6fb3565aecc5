// Text to token ids and back, exactly as the checkpoint's own tokenizer does it. Two kinds, chosen by the file
// the checkpoint folder ships:
//  - tokenizer.model: SentencePiece BPE (Mixtral, Llama, Mistral): src/model/sentencepiece_tokenizer.h;
//  - tokenizer.json with a BPE model and the byte-level alphabet (Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-2 and
//    GPT-NeoX descendants), as Hugging Face `tokenizers` runs it: src/model/hf_tokenizer.h.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace odmoe {

// Turns a stream of generated ids into text as they arrive, for printing while generating. Never emits part of
// a UTF-8 character: Push(ids one by one) concatenated with Finish() equals Decode(context + ids) minus
// Decode(context) (each kind states its exceptions). Finish() ends the stream: call it once, after the last Push.
//
// Thread safety: none; one decoder per stream. REQUIRES: the tokenizer that made it outlives it.
class IncrementalDecoder {
 public:
  virtual ~IncrementalDecoder() = default;
  // Appends one id; returns the text that is now complete (possibly empty).
  virtual std::string Push(int32_t id) = 0;
  // Returns whatever is still held back (incomplete UTF-8 becomes U+FFFD, as Decode would give).
  virtual std::string Finish() = 0;
};

// Thread safety: const methods may be called concurrently.
class Tokenizer {
 public:
  // The tokenizer of checkpoint folder `dir`: DIR/tokenizer.model if present, else DIR/tokenizer.json (each with
  // DIR/tokenizer_config.json where the kind reads it). NotFound when the folder has neither; other errors name
  // the file and field that is malformed or unsupported (Unimplemented ones also say how to run without it).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& dir);

  virtual ~Tokenizer() = default;

  // Text to ids, without the tokens the model adds around a prompt. Whether special tokens written in the text
  // ("</s>", "<|im_start|>") are recognized is the kind's own rule: SentencePiece no, tokenizer.json yes.
  virtual std::vector<int32_t> Encode(std::string_view text) const = 0;
  // Text to ids as a prompt for the model: with the BOS / EOS (or template) tokens the checkpoint asks for.
  virtual std::vector<int32_t> EncodeForModel(std::string_view text) const = 0;
  // Ids to text, special tokens left out. Ids outside [0, vocab_size()) decode to nothing.
  virtual std::string Decode(std::span<const int32_t> ids) const = 0;
  // A decoder for the ids that follow `context` (ids already in the sequence, not emitted).
  virtual std::unique_ptr<IncrementalDecoder> NewDecoder(std::span<const int32_t> context) const = 0;
  // The text of `ids` as it reads after `context`: what a NewDecoder(context) streams for them, whole. Decode(ids)
  // alone may differ at the start (SentencePiece drops a leading space there).
  std::string DecodeAfter(std::span<const int32_t> context, std::span<const int32_t> ids) const;
  // One token on its own, as logprobs show it: the bytes it stands for wherever it stands (a byte-level token's
  // bytes; a SentencePiece piece with "▁" as a space and a byte piece as its byte), and a special or control
  // token's own text ("</s>", "<|im_end|>"), which Decode leaves out. May be part of a UTF-8 character; "" for an
  // id outside [0, vocab_size()).
  virtual std::string TokenText(int32_t id) const = 0;
  // Whether `id` stands for no text of its own: a special or control token (TokenText gives its name), or
  // SentencePiece's unknown piece.
  virtual bool IsSpecial(int32_t id) const = 0;

  // The file of the checkpoint folder it reads: "tokenizer.model" or "tokenizer.json".
  virtual std::string_view file_name() const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when the tokenizer has none
  virtual int32_t eos_id() const = 0;  // -1 when the tokenizer has none
};

}  // namespace odmoe
