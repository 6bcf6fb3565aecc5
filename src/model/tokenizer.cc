#include "src/model/tokenizer.h"

#include "absl/status/status.h"
#include "src/common/mapped_file.h"
#include "src/common/strings.h"
#include "src/model/hf_tokenizer.h"
#include "src/model/sentencepiece_tokenizer.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer;
  if (FileExists(dir + "/tokenizer.model")) {
    tokenizer = SentencePieceTokenizer::Load(dir);
  } else if (FileExists(dir + "/tokenizer.json")) {
    tokenizer = HfTokenizer::Load(dir);
  } else {
    return absl::NotFoundError(StrCat(dir, ": no tokenizer (neither tokenizer.model nor tokenizer.json)"));
  }
  if (absl::IsUnimplemented(tokenizer.status())) {  // a way on for the operator: odmoe runs ids without one
    return absl::UnimplementedError(StrCat(tokenizer.status().message(),
                                           " (odmoe serves token-id prompts without a tokenizer: move the tokenizer "
                                           "file out of the checkpoint folder for that)"));
  }
  return tokenizer;
}

std::string Tokenizer::DecodeAfter(std::span<const int32_t> context, std::span<const int32_t> ids) const {
  std::unique_ptr<IncrementalDecoder> decoder = NewDecoder(context);
  std::string text;
  for (const int32_t id : ids) text += decoder->Push(id);
  return text + decoder->Finish();
}

}  // namespace odmoe
