// odmoe-bench prediction: expert prediction in a real cluster (OD-MoE section 4.2). For each setting it starts
// the cluster of --config with `odmoe cluster up` and that setting's overrides, sends every prompt of --prompts
// (greedy, EOS ignored) to main, stops the cluster, and prints one JSON line: decode tokens/s, recall, timely
// recall, on-demand loads and stall time per token, the shadow's lead and the alignment traffic.
//
// The JSON line also carries recall per decode token (mean over the prompts, OD-MoE fig. 3) and the stall of
// each sparse layer per decode token.
//
// Settings: each ablation case of --cases (1 token+KV alignment, 2 token only, 3 KV only, 4 none, 5 random
// prefetch, 6 load after routing), then, with --grid P1,P2,..., case 1 at every (align_token, align_kv) pair of
// those periods. With --hedge T1,T2,... every setting runs at each hedge margin (`--hedge-margin`, [shadow]
// hedge_margin; 0 = off), and each line adds the hedged loads, the extra loads they cost
// (hedge_loads / (k x sparse layers x decode steps)), the hedges used, and the workers' peak device memory
// against their budgets. --keep-router / --keep-attention true|false pass on to every setting. With
// --check-tokens every request's tokens are compared with the single-process engine's (CPU).
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "src/backend/device_factory.h"
#include "src/cluster/client.h"
#include "src/common/cluster_config.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "src/model/open_model.h"

namespace odmoe::bench {
namespace {

struct Setting {
  std::string name;
  std::vector<std::string> flags;  // passed to `odmoe cluster up`
  int64_t ablation_case = 0;
  int64_t align_token = -1, align_kv = -1;  // -1: the case's own
  double hedge_margin = 0;
};

struct Figures {
  double decode_tps = 0, recall = 0, timely = 0, stall_ms_per_token = 0, loads_per_token = 0, lead = 0;
  double ttft_ms = 0, t_m_ms = 0, t_w_ms = 0, load_ms = 0, t_maxload_ms = 0;
  uint64_t tokens_aligned = 0, kv_aligned = 0, alignment_bytes = 0, decode_tokens = 0;
  std::vector<double> recall_per_token;    // mean over the prompts of each decode step's recall (fig. 3)
  std::vector<double> stall_ms_per_layer;  // decode stall of each sparse layer per decode token
  uint64_t hedge_loads = 0, hedges_used = 0;
  double extra_loads = 0;          // hedge_loads / (k x sparse layers x decode steps)
  uint64_t worker_peak_bytes = 0;  // the largest peak of any worker
  bool within_budget = true;       // every worker's peak within its gpu_budget (where one is set)
  int64_t token_mismatches = -1;   // requests whose tokens differ from the engine's (-1: not checked)
};

// The single-process engine's tokens of each prompt, computed once (--check-tokens).
class EngineTokens {
 public:
  EngineTokens(std::string model_dir, int64_t max_new_tokens)
      : model_dir_(std::move(model_dir)), max_new_tokens_(max_new_tokens) {}
  absl::StatusOr<std::vector<int32_t>> Of(size_t i, const std::vector<int32_t>& prompt) {
    if (i < cache_.size() && !cache_[i].empty()) return cache_[i];
    if (local_ == nullptr) {
      ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice("cpu"));
      ODMOE_ASSIGN_OR_RETURN(local_, LocalModel::Open(model_dir_, std::move(device)));
    }
    GenerateOptions o;
    o.max_new_tokens = max_new_tokens_;
    o.ignore_eos = true;
    ODMOE_ASSIGN_OR_RETURN(GenerateResult r, Generate(local_->engine(), prompt, o));
    if (cache_.size() <= i) cache_.resize(i + 1);
    cache_[i] = r.tokens;
    return r.tokens;
  }

 private:
  std::string model_dir_;
  int64_t max_new_tokens_;
  std::unique_ptr<LocalModel> local_;
  std::vector<std::vector<int32_t>> cache_;
};

// a[i] += b[i], growing a to b's size.
void AddInto(std::vector<double>& a, const google::protobuf::RepeatedField<double>& b) {
  if (a.size() < static_cast<size_t>(b.size())) a.resize(static_cast<size_t>(b.size()), 0.0);
  for (int i = 0; i < b.size(); ++i) a[static_cast<size_t>(i)] += b[i];
}

absl::StatusOr<Figures> RunSetting(const std::string& config, const std::string& model, const std::string& run_dir,
                                   const Setting& s, const std::vector<std::vector<int32_t>>& prompts,
                                   int64_t max_new_tokens, const std::string& endpoint, const ClusterConfig& cluster,
                                   int64_t layer_experts, EngineTokens* engine_tokens) {
  ODMOE_RETURN_IF_ERROR(ClusterUp(config, run_dir, model, s.flags));
  Figures f;
  absl::Status status;
  double decode_seconds = 0, stall_ms = 0, recall_sum = 0, timely_sum = 0, lead_sum = 0, ttft_sum = 0;
  uint64_t loads = 0;
  std::map<std::string, uint64_t> peaks;  // per worker, over the requests
  if (engine_tokens != nullptr) f.token_mismatches = 0;
  for (size_t i = 0; i < prompts.size() && status.ok(); ++i) {
    v1::GenerateRequest req;
    req.mutable_prompt_ids()->Add(prompts[i].begin(), prompts[i].end());
    req.set_max_new_tokens(max_new_tokens);
    req.set_ignore_eos(true);
    absl::StatusOr<RemoteResult> r = GenerateRemote(endpoint, req, 3600 * 1000);
    if (!r.ok()) {
      status = r.status();
      break;
    }
    const v1::RequestStats& st = r->stats;
    const uint64_t steps = r->tokens.size() > 1 ? r->tokens.size() - 1 : 0;
    f.decode_tokens += steps;
    if (st.decode_tokens_per_s() > 0) decode_seconds += static_cast<double>(steps) / st.decode_tokens_per_s();
    stall_ms += st.stall_ms();
    loads += st.decode_loads_on_demand();
    recall_sum += st.recall();
    timely_sum += st.timely_recall();
    lead_sum += st.shadow_lead_layers();
    ttft_sum += st.ttft_ms();
    f.t_m_ms += st.t_m_ms() / static_cast<double>(prompts.size());
    f.t_w_ms += st.t_w_ms() / static_cast<double>(prompts.size());
    f.load_ms += st.expert_load_ms() / static_cast<double>(prompts.size());
    f.t_maxload_ms += st.t_maxload_ms() / static_cast<double>(prompts.size());
    f.tokens_aligned += st.tokens_aligned();
    f.kv_aligned += st.kv_aligned();
    f.alignment_bytes += st.alignment_bytes();
    AddInto(f.recall_per_token, st.recall_per_token());
    AddInto(f.stall_ms_per_layer, st.stall_ms_per_layer());
    f.hedge_loads += st.hedge_loads();
    f.hedges_used += st.hedges_used();
    for (const v1::WorkerRequestStats& w : st.workers())
      peaks[w.node()] = std::max(peaks[w.node()], w.gpu_peak_bytes());
    if (engine_tokens != nullptr) {
      absl::StatusOr<std::vector<int32_t>> want = engine_tokens->Of(i, prompts[i]);
      if (!want.ok()) {
        status = want.status();
        break;
      }
      if (*want != r->tokens) ++f.token_mismatches;
    }
  }
  for (const auto& [node, peak] : peaks) {
    f.worker_peak_bytes = std::max(f.worker_peak_bytes, peak);
    const NodeConfig* n = cluster.Find(node);
    if (n != nullptr && n->gpu_budget_bytes > 0 && peak > n->gpu_budget_bytes) f.within_budget = false;
  }
  const absl::Status down = ClusterDown(config, run_dir);
  ODMOE_RETURN_IF_ERROR(status);
  ODMOE_RETURN_IF_ERROR(down);
  const double n = static_cast<double>(prompts.size());
  const double tokens = static_cast<double>(std::max<uint64_t>(1, f.decode_tokens));
  f.decode_tps = decode_seconds > 0 ? static_cast<double>(f.decode_tokens) / decode_seconds : 0;
  f.recall = recall_sum / n;  // every request decodes the same number of steps (EOS ignored)
  f.timely = timely_sum / n;
  f.lead = lead_sum / n;
  f.ttft_ms = ttft_sum / n;
  f.stall_ms_per_token = stall_ms / tokens;
  f.loads_per_token = static_cast<double>(loads) / tokens;
  for (double& r : f.recall_per_token) r /= n;  // every request decodes the same number of steps
  for (double& v : f.stall_ms_per_layer) v /= tokens;
  f.extra_loads = static_cast<double>(f.hedge_loads) / (static_cast<double>(layer_experts) * tokens);
  return f;
}

}  // namespace

absl::Status RunPrediction(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Flags f,
                         Flags::Parse(args,
                                      {"config", "model", "prompts", "prompt-count", "max-new-tokens", "cases", "grid",
                                       "shadow-quant", "run-dir", "hedge", "keep-router", "keep-attention"},
                                      {"check-tokens"}));
  ODMOE_ASSIGN_OR_RETURN(std::string config_path, f.Required("config"));
  ODMOE_ASSIGN_OR_RETURN(std::string prompts_path, f.Required("prompts"));
  ODMOE_ASSIGN_OR_RETURN(int64_t prompt_count, f.Int("prompt-count", 0));
  ODMOE_ASSIGN_OR_RETURN(int64_t max_new, f.Int("max-new-tokens", 256));
  std::vector<int64_t> cases = {1, 2, 3, 4, 5, 6};
  if (f.Get("cases") == "none") {  // the grid alone
    cases.clear();
  } else if (f.Has("cases")) {
    ODMOE_ASSIGN_OR_RETURN(cases, f.IntList("cases"));
  }
  ODMOE_ASSIGN_OR_RETURN(std::vector<int64_t> grid, f.IntList("grid"));
  if (cases.empty() && grid.empty()) return absl::InvalidArgumentError("--cases none needs --grid");
  if (max_new < 2) return absl::InvalidArgumentError("--max-new-tokens must be >= 2 (decode steps are measured)");
  for (int64_t c : cases) {
    if (c < 1 || c > 6) return absl::InvalidArgumentError(StrCat("--cases: ", c, " is not an ablation case (1..6)"));
  }
  for (int64_t p : grid) {
    if (p < 1) return absl::InvalidArgumentError(StrCat("--grid: periods must be >= 1, got ", p));
  }
  std::vector<double> margins = {0};
  if (auto list = f.Get("hedge")) {
    margins.clear();
    for (absl::string_view item : absl::StrSplit(*list, ',')) {
      absl::StatusOr<double> t = ParseHedgeMargin(ToStdView(item));
      if (!t.ok()) return absl::InvalidArgumentError(StrCat("--hedge: ", t.status().message()));
      margins.push_back(*t);
    }
  }
  std::vector<std::string> precision;  // --keep-router / --keep-attention, passed on
  for (const char* flag : {"keep-router", "keep-attention"}) {
    if (auto v = f.Get(flag)) {
      ODMOE_RETURN_IF_ERROR(ParseBool(*v).status());
      precision.insert(precision.end(), {StrCat("--", flag), *v});
    }
  }

  // The prompts: token ids, {"prompts": [[ids...], ...]} (recall_prompts.json of the shared models).
  ODMOE_ASSIGN_OR_RETURN(std::vector<Prompt> listed, ReadPromptsJson(prompts_path));
  std::vector<std::vector<int32_t>> prompts;
  for (Prompt& p : listed) {
    if (p.ids.empty()) {
      return absl::InvalidArgumentError(
          StrCat(prompts_path, ": prompt ", prompts.size(), " is text; prediction needs arrays of token ids"));
    }
    prompts.push_back(std::move(p.ids));
    if (prompt_count > 0 && static_cast<int64_t>(prompts.size()) == prompt_count) break;
  }

  ODMOE_ASSIGN_OR_RETURN(ClusterConfig cluster, LoadClusterConfig(config_path));
  const std::string endpoint = cluster.main()->address;
  const std::string run_dir = f.Get("run-dir").value_or(DefaultRunDir("prediction"));
  const std::string model = f.Get("model").value_or("");
  const std::string quant = f.Get("shadow-quant").value_or("");
  const std::string model_dir = model.empty() ? cluster.model.path : model;
  ODMOE_ASSIGN_OR_RETURN(OpenedModel opened, OpenModel(cluster.model, model_dir));
  const int64_t layer_experts =
      std::max<int64_t>(1, opened.config.top_k * static_cast<int64_t>(opened.config.SparseLayers().size()));
  std::unique_ptr<EngineTokens> engine_tokens;
  if (f.Has("check-tokens")) engine_tokens = std::make_unique<EngineTokens>(model_dir, max_new);

  std::vector<Setting> base;
  auto with_quant = [&](std::vector<std::string> flags) {
    if (!quant.empty()) {
      flags.push_back("--shadow-quant");
      flags.push_back(quant);
    }
    flags.insert(flags.end(), precision.begin(), precision.end());
    return flags;
  };
  std::vector<Setting>& settings = base;
  for (int64_t c : cases) {
    Setting s{StrCat("case ", c), with_quant({"--ablation-case", StrCat(c)}), c};
    if (c <= 4) {  // the periods of the case, every step
      s.flags.insert(s.flags.end(),
                     {"--align-token", c == 1 || c == 2 ? "1" : "0", "--align-kv", c == 1 || c == 3 ? "1" : "0"});
      s.align_token = c == 1 || c == 2 ? 1 : 0;
      s.align_kv = c == 1 || c == 3 ? 1 : 0;
    }
    settings.push_back(s);
  }
  for (int64_t t : grid) {
    for (int64_t kv : grid) {
      settings.push_back({StrCat("T", t, "_KV", kv),
                          with_quant({"--ablation-case", "1", "--align-token", StrCat(t), "--align-kv", StrCat(kv)}), 1,
                          t, kv});
    }
  }

  // Every setting at every hedge margin.
  std::vector<Setting> hedged;
  for (const Setting& s : base) {
    for (double t : margins) {
      Setting h = s;
      h.hedge_margin = t;
      h.flags.insert(h.flags.end(), {"--hedge-margin", StrCat(t)});
      if (margins.size() > 1 || t > 0) h.name = StrCat(s.name, " t=", t);
      hedged.push_back(std::move(h));
    }
  }
  settings = std::move(hedged);

  struct Row {
    Setting s;
    Figures f;
  };
  std::vector<Row> rows;
  for (const Setting& s : settings) {
    ODMOE_ASSIGN_OR_RETURN(Figures fig, RunSetting(config_path, model, run_dir, s, prompts, max_new, endpoint, cluster,
                                                   layer_experts, engine_tokens.get()));
    PrintJsonLine({{"bench", "prediction"},
                   {"setting", s.name},
                   {"ablation_case", s.ablation_case},
                   {"align_token", s.align_token},
                   {"align_kv", s.align_kv},
                   {"shadow_quant", quant.empty() ? "(cluster file)" : quant},
                   {"config", config_path},
                   {"prompts", prompts.size()},
                   {"max_new_tokens", max_new},
                   {"decode_tokens", fig.decode_tokens},
                   {"decode_tokens_per_s", fig.decode_tps},
                   {"ttft_ms", fig.ttft_ms},
                   {"recall", fig.recall},
                   {"timely_recall", fig.timely},
                   {"loads_on_demand_per_token", fig.loads_per_token},
                   {"stall_ms_per_token", fig.stall_ms_per_token},
                   {"shadow_lead_layers", fig.lead},
                   {"t_m_ms", fig.t_m_ms},
                   {"t_w_ms", fig.t_w_ms},
                   {"expert_load_ms", fig.load_ms},
                   {"t_maxload_ms", fig.t_maxload_ms},
                   {"io_bound", fig.load_ms > fig.t_maxload_ms},
                   {"tokens_aligned", fig.tokens_aligned},
                   {"kv_aligned", fig.kv_aligned},
                   {"alignment_bytes", fig.alignment_bytes},
                   {"recall_per_token", fig.recall_per_token},
                   {"stall_ms_per_layer_per_token", fig.stall_ms_per_layer},
                   {"hedge_margin", s.hedge_margin},
                   {"keep_router", f.Get("keep-router").value_or("(cluster file)")},
                   {"keep_attention", f.Get("keep-attention").value_or("(cluster file)")},
                   {"hedge_loads", fig.hedge_loads},
                   {"hedges_used", fig.hedges_used},
                   {"extra_loads", fig.extra_loads},
                   {"worker_peak_bytes", fig.worker_peak_bytes},
                   {"within_budget", fig.within_budget},
                   {"token_mismatches", fig.token_mismatches}});
    rows.push_back({s, fig});
  }
  std::printf("\n%-18s %10s %9s %9s %10s %13s %6s %7s %7s %8s %10s %8s %11s\n", "setting", "decode/s", "recall%",
              "timely%", "loads/tok", "stall_ms/tok", "lead", "t_M_ms", "t_W_ms", "load_ms", "t_maxload", "extra%",
              "peak_MiB");
  for (const Row& r : rows) {
    std::printf("%-18s %10.1f %9.2f %9.2f %10.2f %13.3f %6.1f %7.3f %7.3f %8.3f %10.3f %8.2f %11.1f\n",
                r.s.name.c_str(), r.f.decode_tps, 100 * r.f.recall, 100 * r.f.timely, r.f.loads_per_token,
                r.f.stall_ms_per_token, r.f.lead, r.f.t_m_ms, r.f.t_w_ms, r.f.load_ms, r.f.t_maxload_ms,
                100 * r.f.extra_loads, static_cast<double>(r.f.worker_peak_bytes) / (1 << 20));
  }
  return absl::OkStatus();
}

}  // namespace odmoe::bench
