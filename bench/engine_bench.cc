// odmoe-bench engine: the whole model resident on one device, batch 1; TTFT and decode tokens/s per
// (prompt, output) pair, against the memory-bandwidth bound of decode.
//
// Bytes read per decoded token = every non-expert weight of the layers (attention, norms, routers, shared
// experts, dense MLPs) + top_k routed experts per sparse layer + final norm + lm_head + one embedding row + the
// KV cache read by attention at the mean context of the decode phase (prompt + output / 2 positions, fp32 K and
// V of every layer). HBM bound (tokens/s) = measured copy bandwidth (read + write) / those bytes.
//
// Per decode token, the Device's own counts (Device::counters(): on CUDA the runtime calls the backend makes, under
// the SIMT emulator the emulated runtime's counts): host synchronizations, allocations, frees, kernel launches and
// bytes read, as (the timed runs' counts / repeat - a one-token run's) / (output - 1), so prefill drops out; and
// of the launches, those the host made (not a graph's kernels), with the graph launches. `--graphs off` runs every
// decode step op by op (EngineOptions::decode_graphs), for the comparison; graphs exist on CUDA only.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "src/backend/device_factory.h"
#include "src/common/flags.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "src/model/model_layout.h"

namespace odmoe::bench {
namespace {

// Weight bytes one decode step reads, KV excluded.
double WeightBytesPerToken(const ModelConfig& c, const ModelWeights& w) {
  double bytes = 0;
  for (const TensorSpec& s : NonExpertTensors(c)) {
    double elems = 1;
    for (int64_t d : s.shape) elems *= static_cast<double>(d);
    if (s.role == TensorRole::kEmbed) elems = static_cast<double>(c.hidden_size);  // one row
    DType dt = w.embed().dtype;  // every tensor of a model shares its dtype in practice
    bytes += elems * static_cast<double>(DTypeSize(dt));
  }
  if (c.tie_word_embeddings) {
    bytes += static_cast<double>(c.vocab_size * c.hidden_size) * static_cast<double>(DTypeSize(w.embed().dtype));
  }
  const double expert = 3.0 * static_cast<double>(c.hidden_size * c.expert_intermediate_size) *
                        static_cast<double>(DTypeSize(w.embed().dtype));
  bytes += static_cast<double>(c.SparseLayers().size()) * static_cast<double>(c.top_k) * expert;
  return bytes;
}

double KvBytesPerToken(const ModelConfig& c, double context) {
  return static_cast<double>(c.num_layers) * 2.0 * context * static_cast<double>(c.kv_size()) * sizeof(float);
}

}  // namespace

absl::Status RunEngine(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(
      Flags f,
      Flags::Parse(args, {"model", "synthetic", "layers", "seed", "backend", "pairs", "repeat", "copy-mb", "graphs"},
                   {}));
  const std::string backend = f.Get("backend").value_or("cpu");
  ODMOE_ASSIGN_OR_RETURN(auto pairs, ParsePairs(f.Get("pairs").value_or("16x64,16x256,128x64,128x256")));
  ODMOE_ASSIGN_OR_RETURN(int64_t repeat, f.Int("repeat", 3));
  ODMOE_ASSIGN_OR_RETURN(int64_t copy_mb, f.Int("copy-mb", 1024));
  if (repeat < 1) return absl::InvalidArgumentError("--repeat must be >= 1");
  if (copy_mb < 1) return absl::InvalidArgumentError("--copy-mb must be >= 1");
  const std::string graphs = f.Get("graphs").value_or("on");
  if (graphs != "on" && graphs != "off") {
    return absl::InvalidArgumentError(StrCat("--graphs must be on or off, not '", graphs, "'"));
  }
  EngineOptions engine_options;
  engine_options.decode_graphs = graphs == "on";
  if (f.Has("model") == f.Has("synthetic")) {
    return absl::InvalidArgumentError("give exactly one of --model DIR and --synthetic CONFIG");
  }

  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(backend));
  std::unique_ptr<LocalModel> model;
  std::string what;
  const Clock::time_point load_start = Clock::now();
  if (f.Has("synthetic")) {
    SyntheticSpec spec;
    spec.config_path = *f.Get("synthetic");
    ODMOE_ASSIGN_OR_RETURN(spec.layers, f.Int("layers", 0));
    ODMOE_ASSIGN_OR_RETURN(int64_t seed, f.Int("seed", 1));
    spec.seed = static_cast<uint64_t>(seed);
    what = StrCat("synthetic:", spec.config_path, " layers=", spec.layers, " seed=", spec.seed);
    ODMOE_ASSIGN_OR_RETURN(model, LocalModel::OpenSynthetic(spec, std::move(device), engine_options));
  } else {
    if (f.Has("layers") || f.Has("seed")) return absl::InvalidArgumentError("--layers and --seed need --synthetic");
    what = *f.Get("model");
    ODMOE_ASSIGN_OR_RETURN(model, LocalModel::Open(what, std::move(device), engine_options));
  }
  const double load_s = SecondsSince(load_start);
  const ModelConfig& c = model->config();
  Device& dev = model->device();

  // Copy bandwidth first, then release its buffers before the requests.
  ODMOE_ASSIGN_OR_RETURN(const double copy_bw,
                         MeasureCopyBandwidth(dev, static_cast<size_t>(copy_mb) << 20, backend == "cpu" ? 4 : 20));
  const double weight_bytes = WeightBytesPerToken(c, model->weights());
  PrintJsonLine({{"bench", "engine"},
                 {"kind", "setup"},
                 {"model", what},
                 {"backend", backend},
                 {"device", dev.name()},
                 {"decode_graphs", graphs},
                 {"layers", c.num_layers},
                 {"load_s", load_s},
                 {"weights_device_bytes", model->weights().device_bytes()},
                 {"copy_gb_per_s", copy_bw / 1e9},
                 {"weight_bytes_per_token", weight_bytes}});

  struct Row {
    int64_t prompt, output;
    double ttft_ms, tps, bytes, bound, fraction;
    double syncs, allocations, frees, launches, bytes_read;  // per decode token (Device::counters())
    double host_launches, graph_launches;                    // of `launches`, the host's; graphs launched
  };
  std::vector<Row> rows;
  for (const auto& [p_, n_] : pairs) {
    const int64_t p = p_, n = n_;  // named copies: clang 14 cannot capture structured bindings in lambdas
    const std::vector<int32_t> prompt = SyntheticPrompt(c, p);
    GenerateOptions opt;
    opt.max_new_tokens = n;
    opt.ignore_eos = true;
    ODMOE_RETURN_IF_ERROR(Generate(model->engine(), prompt, opt).status());  // warm-up
    std::vector<double> ttft, tps;
    dev.ResetCounters();
    for (int64_t r = 0; r < repeat; ++r) {
      ODMOE_ASSIGN_OR_RETURN(GenerateResult res, Generate(model->engine(), prompt, opt));
      ttft.push_back(res.ttft_ms);
      tps.push_back(res.decode_tokens_per_s);
    }
    const DeviceCounters timed = dev.counters();
    GenerateOptions one = opt;
    one.max_new_tokens = 1;
    dev.ResetCounters();
    ODMOE_RETURN_IF_ERROR(Generate(model->engine(), prompt, one).status());
    const DeviceCounters first = dev.counters();
    const auto per_decode_token = [&](uint64_t all, uint64_t one_token) {
      if (n < 2) return 0.0;
      return (static_cast<double>(all) / static_cast<double>(repeat) - static_cast<double>(one_token)) /
             static_cast<double>(n - 1);
    };
    const double context = static_cast<double>(p) + static_cast<double>(n) / 2.0;
    const double bytes = weight_bytes + KvBytesPerToken(c, context);
    const double bound = copy_bw / bytes;
    Row row{
        p,
        n,
        Median(ttft),
        Median(tps),
        bytes,
        bound,
        bound > 0 ? Median(tps) / bound : 0,
        per_decode_token(timed.host_syncs, first.host_syncs),
        per_decode_token(timed.allocations, first.allocations),
        per_decode_token(timed.frees, first.frees),
        per_decode_token(timed.launches, first.launches),
        per_decode_token(timed.bytes_read, first.bytes_read),
        per_decode_token(timed.launches - timed.graph_kernel_launches, first.launches - first.graph_kernel_launches),
        per_decode_token(timed.graph_launches, first.graph_launches)};
    rows.push_back(row);
    PrintJsonLine({{"bench", "engine"},
                   {"kind", "pair"},
                   {"model", what},
                   {"backend", backend},
                   {"prompt_tokens", p},
                   {"output_tokens", n},
                   {"repeat", repeat},
                   {"ttft_ms", row.ttft_ms},
                   {"decode_tokens_per_s", row.tps},
                   {"bytes_per_token", row.bytes},
                   {"hbm_bound_tokens_per_s", row.bound},
                   {"fraction_of_bound", row.fraction},
                   {"host_syncs_per_token", row.syncs},
                   {"allocations_per_token", row.allocations},
                   {"frees_per_token", row.frees},
                   {"launches_per_token", row.launches},
                   {"host_launches_per_token", row.host_launches},
                   {"graph_launches_per_token", row.graph_launches},
                   {"device_bytes_read_per_token", row.bytes_read}});
  }
  const MemoryInfo mem = dev.memory_info();
  PrintJsonLine({{"bench", "engine"},
                 {"kind", "memory"},
                 {"backend", backend},
                 {"peak_device_bytes", mem.peak},
                 {"capacity_bytes", mem.capacity}});

  std::printf("\n%s on %s (%s): copy %.1f GB/s, weights %.2f GB resident, peak device memory %.2f GB\n", what.c_str(),
              backend.c_str(), dev.name().c_str(), copy_bw / 1e9,
              static_cast<double>(model->weights().device_bytes()) / 1e9, static_cast<double>(mem.peak) / 1e9);
  std::printf("%-8s %-8s %12s %14s %14s %14s %10s %8s %8s %8s %10s %10s %9s\n", "prompt", "output", "ttft_ms",
              "decode_tok/s", "MB/token", "bound_tok/s", "of_bound", "syncs/t", "allocs/t", "frees/t", "launches/t",
              "by_host/t", "graphs/t");
  for (const Row& r : rows) {
    std::printf("%-8lld %-8lld %12.2f %14.2f %14.2f %14.2f %9.1f%% %8.2f %8.2f %8.2f %10.1f %10.1f %9.2f\n",
                static_cast<long long>(r.prompt), static_cast<long long>(r.output), r.ttft_ms, r.tps, r.bytes / 1e6,
                r.bound, 100 * r.fraction, r.syncs, r.allocations, r.frees, r.launches, r.host_launches,
                r.graph_launches);
  }
  return absl::OkStatus();
}

}  // namespace odmoe::bench
