// odmoe-bench workload: the paper's (input, output) workloads (OD-MoE table 2) over a set of prompts, batch 1,
// EOS ignored, either on a running cluster (--endpoint, main's client API) or on the fully-resident engine in
// this process (--resident: the whole model on one device, the "all experts cached" reference).
// --resident --config FILE runs the engine on the device of FILE's main node as a daemon would create it
// (CreateNodeDevice: e.g. a timed device of an emulated testbed, charged at [cluster] timing_model's shapes), so
// that the reference and the cluster of FILE run on the same hardware profile.
//
// It prints raw figures only, one JSON line per request (bench/report.py derives the statistics):
//  - the arrival time of every generated token, in ms from the request's start (client side: the stream's
//    messages for a cluster, Generate's token callback for the engine), and the engine's own TTFT and decode
//    tokens/s;
//  - for a cluster, main's request stats, every field of v1::RequestStats (its timings as server_ttft_ms,
//    server_decode_tokens_per_s, server_total_ms): recall (overall and per decode token), stall per sparse
//    layer, on-demand loads, bytes loaded by every worker, t_M / t_W / load time / t_maxload (eq. 1), each
//    worker's peak GPU memory, ...; and the bytes a prefill-only request of the same prompt loads, so that the
//    bytes decode moved per token are the difference;
//  - for the engine, one "memory" line at the end: its peak device memory and resident weight bytes; on a mock
//    or timed GPU, per request the device's modelled busy time from the first token to the last (its ops and
//    copies: with one stream, the critical path the profile predicts), for the calibration check of
//    bench/report.py.
//
// Prompts: with --prompt-text FILE and a model with a tokenizer, prompt i is the file's lines from line
// (seed + 3 i) on, cyclically, encoded (BOS as the tokenizer asks) and cut to the input length; otherwise
// seeded ids drawn uniformly from [3, vocab) (BOS first when the model has one). Prompt i is the same for every
// pair of an input length, and one unrecorded warm-up request runs first. --write-prompts FILE only writes the
// prompts of the first pair's input length as {"prompts": [[ids...], ...]} (the input of `odmoe-bench
// prediction`) and runs nothing.
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "src/backend/device_factory.h"
#include "src/backend/mock_gpu_device.h"
#include "src/cluster/client.h"
#include "src/common/cluster_config.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "src/model/model_config.h"
#include "src/model/synthetic.h"
#include "src/model/tokenizer.h"
#include "src/rpc/proto_json.h"

namespace odmoe::bench {
namespace {

// Builds the prompts of one run; see the file comment.
class PromptSet {
 public:
  PromptSet(const ModelConfig& config, std::unique_ptr<Tokenizer> tokenizer, std::vector<std::string> lines,
            uint64_t seed)
      : config_(config), tokenizer_(std::move(tokenizer)), lines_(std::move(lines)), seed_(seed) {}

  bool from_tokenizer() const { return tokenizer_ != nullptr && !lines_.empty(); }

  // Prompt `index` of `length` ids; InvalidArgument when the text cannot fill it.
  absl::StatusOr<std::vector<int32_t>> Make(int64_t index, int64_t length) const {
    std::vector<int32_t> ids;
    if (from_tokenizer()) {
      std::string text;
      const size_t n = lines_.size();
      for (size_t k = 0; k < 4 * n && static_cast<int64_t>(ids.size()) < length; ++k) {
        if (!text.empty()) text += " ";
        text += lines_[(seed_ + 3 * static_cast<uint64_t>(index) + k) % n];
        ids = tokenizer_->EncodeForModel(text);
      }
      if (static_cast<int64_t>(ids.size()) < length) {
        return absl::InvalidArgumentError(StrCat("--prompt-text: the whole text encodes to ", ids.size(),
                                                 " ids, fewer than the input length ", length));
      }
      ids.resize(static_cast<size_t>(length));
      return ids;
    }
    if (config_.vocab_size <= 3) return absl::InvalidArgumentError("the model's vocab_size is too small for prompts");
    std::mt19937_64 rng(seed_ * 1000003ull + static_cast<uint64_t>(index));
    std::uniform_int_distribution<int32_t> id(3, static_cast<int32_t>(config_.vocab_size - 1));
    for (int64_t i = 0; i < length; ++i) {
      ids.push_back(i == 0 && config_.bos_token_id ? static_cast<int32_t>(*config_.bos_token_id) : id(rng));
    }
    return ids;
  }

 private:
  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<std::string> lines_;
  uint64_t seed_;
};

// One request's raw figures.
struct Timed {
  std::vector<double> token_ms;  // arrival of each generated token, from the request's start
  std::vector<int32_t> tokens;   // the generated ids (the cluster's must equal the resident engine's)
  double total_ms = 0;
  std::optional<double> modeled_decode_ms;  // a mock/timed GPU's busy time from the first token to the last
};

// Main's stats for one request: every field of v1::RequestStats, with its three timings named server_* (the
// line's own token_ms and total_ms are measured here, at the client).
Json StatsJson(const v1::RequestStats& st) {
  Json out = ProtoToJson(st);
  for (const char* key : {"ttft_ms", "decode_tokens_per_s", "total_ms"}) {
    out[std::string("server_") + key] = std::move(out[key]);
    out.erase(key);
  }
  return out;
}

}  // namespace

absl::Status RunWorkload(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Flags f, Flags::Parse(args,
                                               {"endpoint", "model", "synthetic", "layers", "seed", "backend", "pairs",
                                                "prompts", "prompt-text", "write-prompts", "config"},
                                               {"resident"}));
  const bool resident = f.Has("resident");
  if (resident == f.Has("endpoint") && !f.Has("write-prompts")) {
    return absl::InvalidArgumentError("give exactly one of --endpoint and --resident");
  }
  if (f.Has("model") == f.Has("synthetic")) {
    return absl::InvalidArgumentError("give exactly one of --model DIR and --synthetic CONFIG");
  }
  ODMOE_ASSIGN_OR_RETURN(auto pairs, ParsePairs(f.Get("pairs").value_or("16x64,16x256,128x64,128x256")));
  ODMOE_ASSIGN_OR_RETURN(int64_t prompt_count, f.Int("prompts", 3));
  ODMOE_ASSIGN_OR_RETURN(int64_t seed, f.Int("seed", 1));
  ODMOE_ASSIGN_OR_RETURN(int64_t layers, f.Int("layers", 0));
  if (prompt_count < 1) return absl::InvalidArgumentError("--prompts must be >= 1");
  if (seed < 0) return absl::InvalidArgumentError("--seed must be >= 0");
  for (auto [p, n] : pairs) {
    if (p < 1 || n < 2)
      return absl::InvalidArgumentError(StrCat("--pairs: ", p, "x", n, " needs input >= 1, output >= 2"));
  }
  if (f.Has("config") && (!resident || f.Has("backend"))) {
    return absl::InvalidArgumentError(
        "--config FILE goes with --resident, without --backend (FILE's main node's device)");
  }
  std::optional<ClusterConfig> cluster;
  if (f.Has("config")) {
    ODMOE_ASSIGN_OR_RETURN(cluster, LoadClusterConfig(*f.Get("config")));
  }
  const std::string backend = cluster ? cluster->main()->device : f.Get("backend").value_or("cpu");

  ModelConfig config;
  std::string what;
  std::unique_ptr<Tokenizer> tokenizer;
  SyntheticSpec spec;
  if (f.Has("synthetic")) {
    spec = SyntheticSpec{*f.Get("synthetic"), layers, static_cast<uint64_t>(seed)};
    ODMOE_ASSIGN_OR_RETURN(config, SyntheticModelConfig(spec));
    what = StrCat("synthetic:", spec.config_path, " layers=", config.num_layers);
  } else {
    if (f.Has("layers")) return absl::InvalidArgumentError("--layers needs --synthetic");
    what = *f.Get("model");
    ODMOE_ASSIGN_OR_RETURN(config, LoadModelConfig(what));
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(what);
    if (tok.ok()) {
      tokenizer = std::move(*tok);
    } else if (!absl::IsNotFound(tok.status())) {
      return tok.status();
    }
  }
  std::vector<std::string> lines;
  if (f.Has("prompt-text")) {
    ODMOE_ASSIGN_OR_RETURN(lines, ReadPromptLines(*f.Get("prompt-text")));
  }
  const PromptSet prompts(config, std::move(tokenizer), std::move(lines), static_cast<uint64_t>(seed));
  const std::string source = prompts.from_tokenizer() ? "tokenizer" : "seeded_ids";

  if (f.Has("write-prompts")) {  // the prompts of the first pair's input length, for `odmoe-bench prediction`
    Json list = Json::array();
    for (int64_t i = 0; i < prompt_count; ++i) {
      ODMOE_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, prompts.Make(i, pairs.front().first));
      list.push_back(prompt);
    }
    const std::string path = *f.Get("write-prompts");
    std::FILE* out = std::fopen(path.c_str(), "w");
    if (out == nullptr) return absl::InvalidArgumentError(StrCat("--write-prompts: cannot open ", path));
    const std::string text = DumpJson(Json{{"prompts", list}, {"source", source}});
    const bool ok = std::fprintf(out, "%s\n", text.c_str()) > 0;
    if (std::fclose(out) != 0 || !ok) return absl::DataLossError(StrCat("--write-prompts: writing ", path, " failed"));
    return absl::OkStatus();
  }

  std::unique_ptr<LocalModel> model;
  if (resident) {
    std::unique_ptr<Device> device;
    if (cluster) {
      ODMOE_ASSIGN_OR_RETURN(device, CreateNodeDevice(*cluster, *cluster->main(), f.Has("model") ? what : ""));
    } else {
      ODMOE_ASSIGN_OR_RETURN(device, CreateDevice(backend));
    }
    if (f.Has("synthetic")) {
      ODMOE_ASSIGN_OR_RETURN(model, LocalModel::OpenSynthetic(spec, std::move(device)));
    } else {
      ODMOE_ASSIGN_OR_RETURN(model, LocalModel::Open(what, std::move(device)));
    }
  }
  const std::string endpoint = f.Get("endpoint").value_or("");

  // One request; `stats` is filled for a cluster.
  auto run = [&](const std::vector<int32_t>& prompt, int64_t max_new, v1::RequestStats* stats, double* engine_ttft_ms,
                 double* engine_tps) -> absl::StatusOr<Timed> {
    Timed t;
    const Clock::time_point start = Clock::now();
    auto now_ms = [&] { return 1000.0 * SecondsSince(start); };
    if (resident) {
      GenerateOptions opt;
      opt.max_new_tokens = max_new;
      opt.ignore_eos = true;
      std::optional<double> busy_at_first;
      ODMOE_ASSIGN_OR_RETURN(GenerateResult r, Generate(model->engine(), prompt, opt, [&](int32_t, bool) {
                               t.token_ms.push_back(now_ms());
                               if (t.token_ms.size() == 1) busy_at_first = ModeledBusyMs(model->device());
                             }));
      if (busy_at_first) t.modeled_decode_ms = *ModeledBusyMs(model->device()) - *busy_at_first;
      t.tokens = r.tokens;
      if (engine_ttft_ms != nullptr) *engine_ttft_ms = r.ttft_ms;
      if (engine_tps != nullptr) *engine_tps = r.decode_tokens_per_s;
    } else {
      v1::GenerateRequest req;
      req.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
      req.set_max_new_tokens(max_new);
      req.set_ignore_eos(true);
      ODMOE_ASSIGN_OR_RETURN(RemoteResult r,
                             GenerateRemote(endpoint, req, 3600 * 1000, [&](const v1::GenerateResponse& chunk) {
                               const double ms = now_ms();
                               if (!chunk.done()) {
                                 for (int i = 0; i < chunk.tokens_size(); ++i) t.token_ms.push_back(ms);
                               }
                             }));
      // Tokens the final message alone carried (none when main streams every token).
      const double ms = now_ms();
      while (t.token_ms.size() < r.tokens.size()) t.token_ms.push_back(ms);
      if (stats != nullptr) *stats = r.stats;
      t.tokens = r.tokens;
    }
    t.total_ms = now_ms();
    return t;
  };

  {  // warm-up, not recorded
    ODMOE_ASSIGN_OR_RETURN(std::vector<int32_t> warm, prompts.Make(0, pairs.front().first));
    ODMOE_RETURN_IF_ERROR(run(warm, 4, nullptr, nullptr, nullptr).status());
  }

  const std::string engine = resident ? "resident" : "cluster";
  std::printf("\n%-6s %-8s %-7s %-6s %10s %12s %10s\n", "engine", "pair", "prompt", "tokens", "ttft_ms", "decode_tok/s",
              "total_ms");
  for (auto [p, n] : pairs) {
    for (int64_t i = 0; i < prompt_count; ++i) {
      ODMOE_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, prompts.Make(i, p));
      v1::RequestStats stats, prefill_stats;
      double engine_ttft = 0, engine_tps = 0;
      uint64_t prefill_bytes = 0;
      if (!resident) {  // the bytes a prefill alone loads: decode moved the rest
        ODMOE_RETURN_IF_ERROR(run(prompt, 1, &prefill_stats, nullptr, nullptr).status());
        prefill_bytes = prefill_stats.bytes_loaded();
      }
      ODMOE_ASSIGN_OR_RETURN(Timed t, run(prompt, n, &stats, &engine_ttft, &engine_tps));
      Json j = {{"bench", "workload"},    {"engine", engine},
                {"model", what},          {"backend", resident ? backend : std::string("cluster")},
                {"endpoint", endpoint},   {"prompt_source", source},
                {"seed", seed},           {"pair", StrCat(p, "x", n)},
                {"input_tokens", p},      {"output_tokens", n},
                {"prompt_index", i},      {"generated_tokens", t.token_ms.size()},
                {"token_ms", t.token_ms}, {"tokens", t.tokens},
                {"total_ms", t.total_ms}};
      if (resident) {
        j["server_ttft_ms"] = engine_ttft;
        j["server_decode_tokens_per_s"] = engine_tps;
        if (t.modeled_decode_ms) j["modeled_decode_ms"] = *t.modeled_decode_ms;
      } else {
        j.update(StatsJson(stats));
        j["prefill_bytes_loaded"] = prefill_bytes;
      }
      PrintJsonLine(j);
      const double ttft = t.token_ms.empty() ? 0 : t.token_ms.front();
      const double decode_s = t.token_ms.size() > 1 ? (t.token_ms.back() - t.token_ms.front()) / 1000 : 0;
      std::printf("%-6s %-8s %-7lld %-6zu %10.2f %12.2f %10.1f\n", engine.c_str(), StrCat(p, "x", n).c_str(),
                  static_cast<long long>(i), t.token_ms.size(), ttft,
                  decode_s > 0 ? static_cast<double>(t.token_ms.size() - 1) / decode_s : 0.0, t.total_ms);
      std::fflush(stdout);
    }
  }
  if (resident) {
    const MemoryInfo mem = model->device().memory_info();
    PrintJsonLine({{"bench", "workload"},
                   {"engine", engine},
                   {"kind", "memory"},
                   {"model", what},
                   {"backend", backend},
                   {"device", model->device().name()},
                   {"peak_device_bytes", mem.peak},
                   {"capacity_bytes", mem.capacity},
                   {"weights_device_bytes", model->weights().device_bytes()}});
  }
  return absl::OkStatus();
}

}  // namespace odmoe::bench
