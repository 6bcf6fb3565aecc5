// odmoe tokenize: a checkpoint's tokenizer from the command line (text to ids, ids to text), so that prompts
// can be counted and checked against other tools without loading any weights.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_join.h"
#include "src/cli/commands.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"
#include "src/model/tokenizer.h"

namespace odmoe::cli {
namespace {

constexpr char kUsage[] =
    "usage: odmoe tokenize --model DIR (--text TEXT | --ids 1,2,3) [--for-model] [--json]\n"
    "  Runs the checkpoint's tokenizer (tokenizer.model or tokenizer.json) and nothing else.\n"
    "  --text TEXT   prints its ids, comma-separated: the ids a prompt gets with --for-model (the BOS or\n"
    "                template tokens the checkpoint adds), without them otherwise\n"
    "  --ids 1,2,3   prints the text they decode to (special tokens left out)\n"
    "  --json        one JSON object instead: {\"ids\": [...], \"count\": N} or {\"text\": \"...\"}\n"
    "  exit codes: 0 ok, 2 usage, 3 no tokenizer in DIR, 4 tokenizer file unreadable, 5 a malformed field,\n"
    "              6 an unsupported tokenizer, 7 an id outside the vocabulary\n";

absl::Status Run(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Flags f, Flags::Parse(args, {"model", "text", "ids"}, {"for-model", "json"}));
  ODMOE_ASSIGN_OR_RETURN(const std::string model, f.Required("model"));
  if (f.Has("text") == f.Has("ids")) return absl::InvalidArgumentError("give exactly one of --text and --ids");
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::Load(model));
  const bool json = f.Has("json");
  std::string out;
  if (f.Has("text")) {
    const std::string text = *f.Get("text");
    ODMOE_RETURN_IF_ERROR(CheckUtf8(text, "--text"));
    const std::vector<int32_t> ids = f.Has("for-model") ? tokenizer->EncodeForModel(text) : tokenizer->Encode(text);
    out = json ? DumpJson({{"ids", ids}, {"count", ids.size()}}) : absl::StrJoin(ids, ",");
  } else {
    if (f.Has("for-model")) return absl::InvalidArgumentError("--for-model goes with --text");
    ODMOE_ASSIGN_OR_RETURN(const std::vector<int64_t> list, f.IntList("ids"));
    std::vector<int32_t> ids;
    for (const int64_t id : list) {
      if (id < 0 || id >= tokenizer->vocab_size()) {
        return absl::OutOfRangeError(
            StrCat("--ids: token id ", id, " is outside the tokenizer's [0, ", tokenizer->vocab_size(), ")"));
      }
      ids.push_back(static_cast<int32_t>(id));
    }
    const std::string text = tokenizer->Decode(ids);
    out = json ? DumpJson({{"text", text}}) : text;
  }
  out += "\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

int RunTokenize(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
  }
  const absl::Status status = Run(args);
  if (status.ok()) return kExitOk;
  std::fprintf(stderr, "odmoe tokenize: %s%s\n", std::string(status.message()).c_str(),
               absl::IsInvalidArgument(status) ? " (see odmoe tokenize --help)" : "");
  return ExitCodeFor(status);
}

}  // namespace odmoe::cli
