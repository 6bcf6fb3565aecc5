#include "src/model/tokenizer.h"

#include "absl/status/status.h"
#include "src/common/mapped_file.h"
#include "src/common/strings.h"
#include "src/model/hf_tokenizer.h"
#include "src/model/sentencepiece_tokenizer.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  if (FileExists(dir + "/tokenizer.model")) return SentencePieceTokenizer::Load(dir);
  if (FileExists(dir + "/tokenizer.json")) return HfTokenizer::Load(dir);
  return absl::NotFoundError(StrCat(dir, ": no tokenizer (neither tokenizer.model nor tokenizer.json)"));
}

}  // namespace odmoe
