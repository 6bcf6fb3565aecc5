// Fuzzes the SentencePiece model loader (SentencePieceTokenizer::FromSerializedModel: a serialized SentencePiece
// ModelProto), then uses every model it accepts the way odmoe does: encode a short text (ASCII, multi-byte UTF-8 and
// characters that need byte fallback), decode the ids back, decode every id around the vocabulary's edges,
// and stream them through an IncrementalDecoder.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "src/model/sentencepiece_tokenizer.h"

// Invalid UTF-8 in string fields makes protobuf log an error per input; the fuzzer only needs the result.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view model(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::unique_ptr<odmoe::SentencePieceTokenizer>> tok =
      odmoe::SentencePieceTokenizer::FromSerializedModel(model, /*add_bos=*/true, /*add_eos=*/true, "fuzz.model");
  if (!tok.ok()) return 0;
  const odmoe::SentencePieceTokenizer& t = **tok;
  const std::vector<int32_t> ids =
      t.EncodeForModel("In the beginning  God\tcreated \xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80 </s>.");
  (void)t.Decode(ids);
  std::vector<int32_t> edges = {-1, 0, 1, 2, 3, t.vocab_size() - 1, t.vocab_size(), t.bos_id(), t.eos_id(), t.unk_id()};
  for (int32_t id = 3; id < 3 + 256 && id < t.vocab_size(); ++id) edges.push_back(id);  // byte pieces, usually
  for (int32_t id : edges) {
    (void)t.IdToPiece(id);
    (void)t.IsControl(id);
    (void)t.IsByte(id);
  }
  (void)t.Decode(edges);
  odmoe::SentencePieceDecoder decoder(t, std::vector<int32_t>(ids.begin(), ids.begin() + (ids.size() / 2)));
  std::string streamed;
  for (int32_t id : edges) streamed += decoder.Push(id);
  streamed += decoder.Finish();
  return 0;
}
