// odmoe inspect: opens a checkpoint folder the way every node does (config.json, generation_config.json, the
// safetensors shards), validates every tensor the config needs (presence, dtype, shape, bounds, overlaps) and
// prints what the model is. Nothing is copied or computed: the shards are memory-mapped and only headers read.
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_join.h"
#include "src/cli/commands.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/checkpoint.h"
#include "src/model/model_config.h"
#include "src/model/model_layout.h"
#include "src/model/tokenizer.h"

namespace odmoe::cli {
namespace {

constexpr std::string_view kUsageLine = "usage: odmoe inspect --model DIR [--json]";
constexpr std::string_view kHelp =
    "usage: odmoe inspect --model DIR [--json]\n"
    "\n"
    "Opens a Hugging Face MoE checkpoint folder (config.json, generation_config.json, model.safetensors or the\n"
    "shards listed in model.safetensors.index.json), validates every tensor the config needs (present, of a\n"
    "supported dtype, of the right shape, inside its file, not overlapping another) and prints a summary.\n"
    "\n"
    "flags:\n"
    "  --model DIR   the checkpoint folder\n"
    "  --json        print the summary as one JSON object on one line\n"
    "  --help        print this help\n"
    "\n"
    "exit codes: 0 ok, 2 usage, 3 file or tensor missing, 4 corrupt input, 5 inconsistent model,\n"
    "            6 unsupported feature, 1 internal error\n";

struct Options {
  std::string model;
  bool json = false;
  bool help = false;
};

absl::StatusOr<Options> ParseOptions(const std::vector<std::string>& args) {
  Options options;
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") options.help = true;
  }
  if (options.help) return options;
  absl::StatusOr<Flags> flags = Flags::Parse(args, /*with_value=*/{"model"}, /*booleans=*/{"json", "help"});
  if (!flags.ok()) return absl::InvalidArgumentError(StrCat(flags.status().message(), " (", kUsageLine, ")"));
  const std::optional<std::string> model = flags->Get("model");
  if (!model) return absl::InvalidArgumentError(StrCat("missing --model DIR (", kUsageLine, ")"));
  if (model->empty()) return absl::InvalidArgumentError(StrCat("--model needs a non-empty value (", kUsageLine, ")"));
  options.model = *model;
  options.json = flags->Has("json");
  return options;
}

// Messages can quote bytes from a corrupt file (a tensor name with a newline in it): keep them to one line.
std::string OneLine(std::string_view msg) {
  std::string out;
  out.reserve(msg.size());
  for (const char ch : msg) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

struct Summary {
  std::string dir;
  ModelConfig config;
  std::vector<int64_t> sparse_layers;
  size_t shards = 0;
  size_t tensors_in_checkpoint = 0;
  size_t tensors_needed = 0;
  int64_t params = 0;                              // every tensor the config needs
  int64_t expert_params = 0;                       // the routed experts' share of `params`
  uint64_t file_bytes = 0;                         // all shards, headers included
  uint64_t tensor_bytes = 0;                       // the tensors the config needs
  uint64_t expert_bytes = 0;                       // the routed experts' share of `tensor_bytes`
  std::map<std::string, int64_t> params_by_dtype;  // safetensors dtype name -> parameters stored in it
  std::string tokenizer;                           // the file the tokenizer was loaded from, "" when there is none
  int32_t tokenizer_vocab = 0;
};

// Checks `specs` against the checkpoint (presence, dtype, shape) and adds them up into `s`.
absl::Status Tally(const Checkpoint& ck, const std::vector<TensorSpec>& specs, bool experts, Summary& s) {
  ODMOE_RETURN_IF_ERROR(ck.Validate(specs));
  for (const TensorSpec& spec : specs) {
    const TensorInfo* info = ck.Find(spec.name);
    ODMOE_CHECK(info != nullptr);  // Validate succeeded
    s.params += info->numel();
    s.tensor_bytes += info->nbytes;
    s.params_by_dtype[info->dtype_name] += info->numel();
    if (experts) {
      s.expert_params += info->numel();
      s.expert_bytes += info->nbytes;
    }
  }
  s.tensors_needed += specs.size();
  return absl::OkStatus();
}

absl::StatusOr<Summary> Inspect(const std::string& dir) {
  Summary s;
  s.dir = dir;
  ODMOE_ASSIGN_OR_RETURN(s.config, LoadModelConfig(dir));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ck, Checkpoint::Open(dir));
  ODMOE_RETURN_IF_ERROR(Tally(*ck, NonExpertTensors(s.config), /*experts=*/false, s));
  ODMOE_RETURN_IF_ERROR(Tally(*ck, AllExpertTensors(s.config), /*experts=*/true, s));
  s.sparse_layers = s.config.SparseLayers();
  s.shards = ck->shards().size();
  s.tensors_in_checkpoint = ck->TensorNames().size();
  s.file_bytes = ck->TotalBytes();
  // Loaded, not only looked for: a tokenizer that would fail main at startup fails inspect too.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Load(dir);
  if (tokenizer.ok()) {
    s.tokenizer = (*tokenizer)->file_name();
    s.tokenizer_vocab = (*tokenizer)->vocab_size();
  } else if (!absl::IsNotFound(tokenizer.status())) {
    return tokenizer.status();
  }
  return s;
}

std::string_view QkNormName(QkNorm n) {
  switch (n) {
    case QkNorm::kNone:
      return "none";
    case QkNorm::kPerHead:
      return "per_head";
    case QkNorm::kFull:
      return "full";
  }
  return "?";
}

std::string ToJson(const Summary& s) {
  const ModelConfig& c = s.config;
  Json j = Json::object();
  j["model"] = s.dir;
  j["architecture"] = std::string(ArchitectureName(c.arch));
  j["layers"] = c.num_layers;
  j["sparse_layers"] = s.sparse_layers;
  j["experts"] = c.num_experts;
  j["top_k"] = c.top_k;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["expert_intermediate_size"] = c.expert_intermediate_size;
  j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  j["dense_intermediate_size"] = c.dense_intermediate_size;
  j["hidden_size"] = c.hidden_size;
  j["vocab_size"] = c.vocab_size;
  j["heads"] = c.num_heads;
  j["kv_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["qkv_bias"] = c.qkv_bias;
  j["o_bias"] = c.o_bias;
  j["qk_norm"] = std::string(QkNormName(c.qk_norm));
  j["rope_theta"] = c.rope_theta;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["sliding_window"] = c.sliding_window ? Json(*c.sliding_window) : Json(nullptr);
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["bos_token_id"] = c.bos_token_id ? Json(*c.bos_token_id) : Json(nullptr);
  j["eos_token_ids"] = c.eos_token_ids;
  j["config_dtype"] = c.torch_dtype;
  Json dtypes = Json::object();
  for (const auto& [name, n] : s.params_by_dtype) dtypes[name] = n;
  j["dtypes"] = dtypes;
  j["params"] = s.params;
  j["expert_params"] = s.expert_params;
  j["tensors_needed"] = s.tensors_needed;
  j["tensors_in_checkpoint"] = s.tensors_in_checkpoint;
  j["shards"] = s.shards;
  j["file_bytes"] = s.file_bytes;
  j["tensor_bytes"] = s.tensor_bytes;
  j["expert_bytes"] = s.expert_bytes;
  const int64_t experts_total = static_cast<int64_t>(s.sparse_layers.size()) * c.num_experts;
  j["bytes_per_expert"] = experts_total > 0 ? s.expert_bytes / static_cast<uint64_t>(experts_total) : 0;
  j["tokenizer_model"] = s.tokenizer == "tokenizer.model";
  j["tokenizer"] = s.tokenizer.empty() ? Json(nullptr) : Json(s.tokenizer);
  return DumpJson(j);
}

std::string ToText(const Summary& s) {
  const ModelConfig& c = s.config;
  std::string dtypes;
  for (const auto& [name, n] : s.params_by_dtype) {
    if (!dtypes.empty()) dtypes += ", ";
    dtypes += s.params_by_dtype.size() == 1 ? name : StrCat(name, " (", n, " params)");
  }
  std::string attention = StrCat(c.num_heads, " heads, ", c.num_kv_heads, " kv heads, head_dim ", c.head_dim,
                                 ", rope_theta ", c.rope_theta);
  if (c.qkv_bias) attention += ", q/k/v bias";
  if (c.o_bias) attention += ", o bias";
  if (c.qk_norm == QkNorm::kPerHead) attention += ", q/k RMSNorm per head";
  if (c.qk_norm == QkNorm::kFull) attention += ", q/k RMSNorm over the projection";
  if (c.sliding_window) attention += StrCat(", sliding window ", *c.sliding_window);
  std::string experts =
      StrCat(c.num_experts, ", top-", c.top_k, c.norm_topk_prob ? " (renormalised)" : " (not renormalised)",
             ", intermediate ", c.expert_intermediate_size);
  if (c.shared_expert_intermediate_size > 0) {
    experts += StrCat("; shared expert ", c.shared_expert_intermediate_size, " with sigmoid gate");
  }
  const int64_t experts_total = static_cast<int64_t>(s.sparse_layers.size()) * c.num_experts;
  const int64_t dense_layers = c.num_layers - static_cast<int64_t>(s.sparse_layers.size());
  std::string out;
  auto line = [&out](std::string_view key, std::string_view value) {
    out += StrCat(key, std::string(key.size() < 14 ? 14 - key.size() : 1, ' '), value, "\n");
  };
  line("model", s.dir);
  line("architecture", ArchitectureName(c.arch));
  line("layers",
       StrCat(c.num_layers, " (", s.sparse_layers.size(),
              " sparse: ", s.sparse_layers.empty() ? "none" : absl::StrJoin(s.sparse_layers, ","),
              dense_layers > 0 ? StrCat("; ", dense_layers, " dense, intermediate ", c.dense_intermediate_size)
                               : std::string(),
              ")"));
  line("experts", experts);
  line("hidden", StrCat(c.hidden_size, ", vocab ", c.vocab_size, ", max positions ", c.max_position_embeddings,
                        c.tie_word_embeddings ? ", tied embeddings" : ""));
  line("attention", attention);
  line("params",
       StrCat(s.params, " (", s.expert_params, " in routed experts, ", s.params - s.expert_params, " elsewhere)"));
  line("dtype", StrCat(dtypes, " (config.json: ", c.torch_dtype, ")"));
  line("bytes", StrCat(s.file_bytes, " in ", s.shards, s.shards == 1 ? " file" : " files", "; ", s.tensor_bytes,
                       " of needed tensors, ",
                       experts_total > 0 ? s.expert_bytes / static_cast<uint64_t>(experts_total) : 0, " per expert"));
  line("tokens", StrCat("bos ", c.bos_token_id ? StrCat(*c.bos_token_id) : std::string("none"), ", eos ",
                        c.eos_token_ids.empty() ? "none" : absl::StrJoin(c.eos_token_ids, ",")));
  line("tokenizer", s.tokenizer.empty() ? std::string("none (no tokenizer.model or tokenizer.json): use --prompt-ids")
                                        : StrCat(s.tokenizer, ", ", s.tokenizer_vocab, " tokens"));
  line("checkpoint",
       StrCat("ok: ", s.tensors_needed, " tensors validated (", s.tensors_in_checkpoint, " in the checkpoint)"));
  return out;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "odmoe inspect: %s\n", OneLine(ToStdView(status.message())).c_str());
  return ExitCodeFor(status);
}

}  // namespace

int RunInspect(const std::vector<std::string>& args) {
  absl::StatusOr<Options> options = ParseOptions(args);
  if (!options.ok()) return Fail(options.status());
  if (options->help) {
    std::fputs(kHelp.data(), stdout);
    return kExitOk;
  }
  absl::StatusOr<Summary> summary = Inspect(options->model);
  if (!summary.ok()) return Fail(summary.status());
  const std::string out = options->json ? ToJson(*summary) + "\n" : ToText(*summary);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace odmoe::cli
