// odmoe-bench cluster: the whole cluster of --config (OD-MoE issue "Cluster 2/2" figures). It first measures the
// pinned host-to-device bandwidth of the workers' device kind in this process (a registered host buffer copied
// to the device), then starts the cluster with `odmoe cluster up`, and per request:
//  - a prefill-only request (one new token) of the prompt, then the same prompt with --new-tokens: their
//    difference is the decode steps' work (prefill loads are the same);
//  - the workers' counters (GetStats, reset before each request): bytes loaded host-to-device (prefetched and
//    on demand), peak GPU memory (the budget's, context apart) and the context's bytes;
//  - main's stats: TTFT, decode tokens/s, t_M, t_W, expert load time, t_maxload (eq. 1), io_bound.
// It prints one JSON line per worker and one for the run, then a table, and stops the cluster.
// The load rate is bytes loaded per decode token x decode tokens/s; its fraction of the pinned bandwidth says
// how close decode runs to the link's limit (with N_W workers each on its own link, the rate per worker is
// what compares).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "src/backend/device_factory.h"
#include "src/cluster/client.h"
#include "src/common/cluster_config.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/model_config.h"
#include "src/model/synthetic.h"

namespace odmoe::bench {
namespace {

// Host-to-device bytes per second from `bytes` of registered (pinned where the backend pins) host memory.
absl::StatusOr<double> MeasurePinnedH2D(Device& device, size_t bytes, int iters) {
  std::vector<uint8_t> host(bytes, 0x3c);
  const absl::Status registered = device.RegisterHostMemory(host.data(), host.size());
  if (!registered.ok()) {
    return absl::Status(registered.code(), StrCat("pinning the bench buffer: ", registered.message()));
  }
  absl::StatusOr<std::unique_ptr<Buffer>> dst = device.Allocate(bytes, "bench host-to-device destination");
  if (!dst.ok()) {
    device.UnregisterHostMemory(host.data());
    return dst.status();
  }
  device.CopyToDevice((*dst)->data(), host.data(), bytes, nullptr);  // warm-up
  device.SynchronizeAll();
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < iters; ++i) device.CopyToDevice((*dst)->data(), host.data(), bytes, nullptr);
  device.SynchronizeAll();
  const double s = SecondsSince(start);
  device.UnregisterHostMemory(host.data());
  return s > 0 ? static_cast<double>(bytes) * iters / s : 0.0;
}

uint64_t BytesLoaded(const std::vector<v1::WorkerStats>& stats) {
  uint64_t b = 0;
  for (const v1::WorkerStats& s : stats) b += s.bytes_loaded();
  return b;
}

}  // namespace

absl::Status RunCluster(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Flags f, Flags::Parse(args,
                                               {"config", "model", "prompt-len", "new-tokens", "requests",
                                                "copy-mb", "run-dir"},
                                               {}));
  ODMOE_ASSIGN_OR_RETURN(std::string config_path, f.Required("config"));
  ODMOE_ASSIGN_OR_RETURN(int64_t prompt_len, f.Int("prompt-len", 64));
  ODMOE_ASSIGN_OR_RETURN(int64_t new_tokens, f.Int("new-tokens", 128));
  ODMOE_ASSIGN_OR_RETURN(int64_t requests, f.Int("requests", 1));
  ODMOE_ASSIGN_OR_RETURN(int64_t copy_mb, f.Int("copy-mb", 512));
  if (prompt_len < 1) return absl::InvalidArgumentError("--prompt-len must be >= 1");
  if (new_tokens < 2) return absl::InvalidArgumentError("--new-tokens must be >= 2 (decode steps are measured)");
  if (requests < 1) return absl::InvalidArgumentError("--requests must be >= 1");
  if (copy_mb < 1) return absl::InvalidArgumentError("--copy-mb must be >= 1");

  ODMOE_ASSIGN_OR_RETURN(ClusterConfig cluster, LoadClusterConfig(config_path));
  const std::string model = f.Get("model").value_or("");
  ModelConfig config;
  if (!model.empty()) {
    ODMOE_ASSIGN_OR_RETURN(config, LoadModelConfig(model));
  } else if (cluster.model.is_synthetic()) {
    ODMOE_ASSIGN_OR_RETURN(config, SyntheticModelConfig(SyntheticSpec{cluster.model.synthetic,
                                                                      cluster.model.layers, cluster.model.seed}));
  } else {
    ODMOE_ASSIGN_OR_RETURN(config, LoadModelConfig(cluster.model.path));
  }
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < prompt_len; ++i) {
    prompt.push_back(static_cast<int32_t>((1 + 37 * i + 11 * i * i) % std::max<int64_t>(2, config.vocab_size)));
  }

  // The link first, with the cluster down: the device kind of the first worker.
  const NodeConfig* first = cluster.workers().front();
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> probe, CreateDevice(first->device));
  ODMOE_ASSIGN_OR_RETURN(double pinned,
                         MeasurePinnedH2D(*probe, static_cast<size_t>(copy_mb) << 20, /*iters=*/8));
  probe.reset();

  const std::string run_dir = f.Get("run-dir").value_or(DefaultRunDir("cluster"));
  ODMOE_RETURN_IF_ERROR(ClusterUp(config_path, run_dir, model));

  const std::string endpoint = cluster.main()->address;
  struct Totals {
    double decode_seconds = 0, ttft_ms = 0, t_m = 0, t_w = 0, load_ms = 0, t_maxload = 0;
    uint64_t decode_tokens = 0, decode_bytes = 0;
    bool io_bound = false;
  } t;
  std::vector<uint64_t> peak(cluster.workers().size(), 0), context(cluster.workers().size(), 0);
  auto generate = [&](int64_t max_new) -> absl::StatusOr<RemoteResult> {
    v1::GenerateRequest req;
    req.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
    req.set_max_new_tokens(max_new);
    req.set_ignore_eos(true);
    return GenerateRemote(endpoint, req, 3600 * 1000);
  };
  absl::Status status = [&]() -> absl::Status {
    for (int64_t r = 0; r < requests; ++r) {
      ODMOE_RETURN_IF_ERROR(ReadWorkerStats(cluster, /*reset=*/true).status());
      ODMOE_ASSIGN_OR_RETURN(RemoteResult prefill, generate(1));
      ODMOE_ASSIGN_OR_RETURN(std::vector<v1::WorkerStats> after_prefill, ReadWorkerStats(cluster, /*reset=*/true));
      ODMOE_ASSIGN_OR_RETURN(RemoteResult full, generate(new_tokens));
      ODMOE_ASSIGN_OR_RETURN(std::vector<v1::WorkerStats> after_full, ReadWorkerStats(cluster, /*reset=*/true));
      const uint64_t steps = full.tokens.size() > 1 ? full.tokens.size() - 1 : 0;
      const v1::RequestStats& st = full.stats;
      t.decode_tokens += steps;
      if (st.decode_tokens_per_s() > 0) t.decode_seconds += static_cast<double>(steps) / st.decode_tokens_per_s();
      const uint64_t full_bytes = BytesLoaded(after_full), prefill_bytes = BytesLoaded(after_prefill);
      t.decode_bytes += full_bytes > prefill_bytes ? full_bytes - prefill_bytes : 0;
      t.ttft_ms += prefill.stats.ttft_ms() / static_cast<double>(requests);
      t.t_m += st.t_m_ms() / static_cast<double>(requests);
      t.t_w += st.t_w_ms() / static_cast<double>(requests);
      t.load_ms += st.expert_load_ms() / static_cast<double>(requests);
      t.t_maxload += st.t_maxload_ms() / static_cast<double>(requests);
      t.io_bound = t.io_bound || st.io_bound();
      for (size_t w = 0; w < after_full.size(); ++w) {
        peak[w] = std::max({peak[w], after_full[w].memory().peak_bytes(), after_prefill[w].memory().peak_bytes()});
        context[w] = std::max(context[w], after_full[w].memory().context_bytes());
      }
    }
    return absl::OkStatus();
  }();
  const absl::Status down = ClusterDown(config_path, run_dir);
  ODMOE_RETURN_IF_ERROR(status);
  ODMOE_RETURN_IF_ERROR(down);

  const double tps = t.decode_seconds > 0 ? static_cast<double>(t.decode_tokens) / t.decode_seconds : 0;
  const double bytes_per_token =
      t.decode_tokens > 0 ? static_cast<double>(t.decode_bytes) / static_cast<double>(t.decode_tokens) : 0;
  const double rate = bytes_per_token * tps;
  const size_t workers = cluster.workers().size();
  uint64_t peak_max = 0;
  for (size_t w = 0; w < workers; ++w) {
    const NodeConfig* node = cluster.workers()[w];
    PrintJsonLine({{"bench", "cluster"},
                   {"worker", node->name},
                   {"device", node->device},
                   {"gpu_budget_bytes", node->gpu_budget_bytes},
                   {"peak_gpu_bytes", peak[w]},
                   {"context_bytes", context[w]}});
    peak_max = std::max(peak_max, peak[w]);
  }
  PrintJsonLine({{"bench", "cluster"},
                 {"config", config_path},
                 {"workers", workers},
                 {"prompt_len", prompt_len},
                 {"new_tokens", new_tokens},
                 {"requests", requests},
                 {"ttft_ms", t.ttft_ms},
                 {"decode_tokens", t.decode_tokens},
                 {"decode_tokens_per_s", tps},
                 {"bytes_loaded_per_token", bytes_per_token},
                 {"load_rate_bytes_per_s", rate},
                 {"pinned_h2d_bytes_per_s", pinned},
                 {"load_rate_fraction_of_pinned", pinned > 0 ? rate / pinned : 0},
                 {"load_rate_per_worker_fraction_of_pinned",
                  pinned > 0 ? rate / static_cast<double>(workers) / pinned : 0},
                 {"peak_gpu_bytes_max", peak_max},
                 {"t_m_ms", t.t_m},
                 {"t_w_ms", t.t_w},
                 {"expert_load_ms", t.load_ms},
                 {"t_maxload_ms", t.t_maxload},
                 {"io_bound", t.io_bound}});
  std::printf("\n%-10s %12s %12s\n", "worker", "peak MiB", "context MiB");
  for (size_t w = 0; w < workers; ++w) {
    std::printf("%-10s %12.1f %12.1f\n", cluster.workers()[w]->name.c_str(), static_cast<double>(peak[w]) / (1 << 20),
                static_cast<double>(context[w]) / (1 << 20));
  }
  std::printf("\nTTFT %.1f ms, decode %.2f tokens/s, %.1f MiB loaded per token, load rate %.2f GB/s = %.1f%% of the "
              "pinned %.2f GB/s (%.1f%% per worker), t_M %.3f ms, t_W %.3f ms, load %.3f ms, t_maxload %.3f ms%s\n",
              t.ttft_ms, tps, bytes_per_token / (1 << 20), rate / 1e9, pinned > 0 ? 100 * rate / pinned : 0,
              pinned / 1e9, pinned > 0 ? 100 * rate / static_cast<double>(workers) / pinned : 0, t.t_m, t.t_w,
              t.load_ms, t.t_maxload, t.io_bound ? ", I/O-bound" : "");
  return absl::OkStatus();
}

}  // namespace odmoe::bench
