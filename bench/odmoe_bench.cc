// odmoe-bench: benchmarks that print JSON lines (one per measurement) and then a human table.
//
//   odmoe-bench decode --model DIR [--backend cpu] [--prompt-len 16,128] [--new-tokens 64,256] [--repeat 3]
//     Single-process TTFT and decode tokens/s, batch 1, EOS ignored, after one warm-up request; the figure of
//     each (prompt, output) pair is the median over --repeat runs.
//
//   odmoe-bench engine (--synthetic CONFIG [--layers N] [--seed S] | --model DIR) [--backend cpu]
//       [--pairs 16x64,16x256,128x64,128x256] [--repeat 3] [--copy-mb 1024]
//     The whole model resident on one device, batch 1: TTFT, decode tokens/s, bytes read per token and the
//     memory-bandwidth bound (engine_bench.cc).
//
//   odmoe-bench kernels [--backend cpu] [--hidden 4096] [--inter 14336] [--contexts 1024,4096,16384]
//       [--heads 32] [--kv-heads 8] [--head-dim 128] [--rotate-mb 256] [--iters N] [--copy-mb 1024]
//     Achieved GB/s of the expert GEMVs and decode attention against the copy bandwidth (kernels_bench.cc).
//
//   odmoe-bench prediction --config FILE --prompts FILE [--model DIR] [--prompt-count N] [--max-new-tokens 256]
//       [--cases 1,2,3,4,5,6|none] [--grid 1,2,4,8,16] [--shadow-quant int8] [--run-dir DIR]
//     A real cluster (`odmoe cluster up`) per OD-MoE ablation case and alignment-period pair: decode tokens/s,
//     recall, timely recall, on-demand loads and stall per token (prediction_bench.cc).
//
//   odmoe-bench cluster --config FILE [--model DIR] [--prompt-len 64] [--new-tokens 128] [--requests 1]
//       [--copy-mb 512] [--run-dir DIR]
//     A real cluster: each worker's peak GPU memory (context apart), TTFT, decode tokens/s, bytes loaded per
//     token and that rate against the pinned host-to-device bandwidth measured first (cluster_bench.cc).
//
//   odmoe-bench workload (--endpoint HOST:PORT | --resident) (--model DIR | --synthetic CONFIG [--layers N])
//       [--seed S] [--backend cpu | --config FILE] [--pairs 16x64,16x256,128x64,128x256] [--prompts 3]
//       [--prompt-text FILE]
//     Every (input, output) pair over a set of prompts, batch 1, EOS ignored, on a running cluster or on the
//     fully-resident engine (on --backend, or with --config on the device of FILE's main node, e.g. a timed
//     GPU): the arrival time of every token and the cluster's request stats, one JSON line per request
//     (workload_bench.cc; bench/run.sh aggregates them).
//
//   odmoe-bench load (--config FILE [--model DIR] [--run-dir DIR] | --endpoint HOST:PORT [--config FILE])
//       (--prompts FILE | --prompt-text FILE) [--clients 1,2,4,8] [--requests-per-client 1]
//       [--max-new-tokens 64] [--ignore-eos true] [--per-request] [--api grpc|http]
//     A bounded load test of main's streaming API (gRPC, or the OpenAI API's streamed /v1/completions): N
//     concurrent clients (N <= 256, one N after another), each sending R streaming requests (R <= 1000); total and
//     per-client tokens/s, client-side TTFT p50 / p99, failures and busy refusals, expert loads per generated
//     token, one JSON line per N (load_bench.cc).
//
//   odmoe-bench grammar (--model DIR | --synthetic-vocab N [--seed S]) [--repeat 20]
//     Structured output's cost per pick: the vocabulary sorted once, then the walk that finds the tokens a grammar
//     state allows, at states along a JSON object and a choice list (grammar_bench.cc).
//
// Every benchmark takes --json FILE: its JSON lines also go to FILE (the table stays on stdout).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "src/backend/device_factory.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"

namespace odmoe {
namespace {

using bench::Median;

absl::Status RunDecode(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Flags f, Flags::Parse(args, {"model", "backend", "prompt-len", "new-tokens", "repeat"}, {}));
  ODMOE_ASSIGN_OR_RETURN(std::string model_dir, f.Required("model"));
  const std::string backend = f.Get("backend").value_or("cpu");
  ODMOE_ASSIGN_OR_RETURN(std::vector<int64_t> prompt_lens, f.IntList("prompt-len"));
  ODMOE_ASSIGN_OR_RETURN(std::vector<int64_t> new_tokens, f.IntList("new-tokens"));
  ODMOE_ASSIGN_OR_RETURN(int64_t repeat, f.Int("repeat", 3));
  if (prompt_lens.empty()) prompt_lens = {16, 128};
  if (new_tokens.empty()) new_tokens = {64, 256};
  if (repeat < 1) return absl::InvalidArgumentError("--repeat must be >= 1");

  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(backend));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<LocalModel> model, LocalModel::Open(model_dir, std::move(device)));
  const ModelConfig& c = model->config();

  struct Row {
    int64_t prompt, output;
    double ttft_ms, tps;
  };
  std::vector<Row> rows;
  for (int64_t p : prompt_lens) {
    for (int64_t n : new_tokens) {
      const std::vector<int32_t> prompt = bench::SyntheticPrompt(c, p);
      GenerateOptions opt;
      opt.max_new_tokens = n;
      opt.ignore_eos = true;
      ODMOE_RETURN_IF_ERROR(Generate(model->engine(), prompt, opt).status());  // warm-up
      std::vector<double> ttft, tps;
      for (int64_t r = 0; r < repeat; ++r) {
        ODMOE_ASSIGN_OR_RETURN(GenerateResult res, Generate(model->engine(), prompt, opt));
        ttft.push_back(res.ttft_ms);
        tps.push_back(res.decode_tokens_per_s);
      }
      Row row{p, n, Median(ttft), Median(tps)};
      rows.push_back(row);
      Json j = {{"bench", "decode"},  {"model", model_dir}, {"backend", backend},     {"prompt_tokens", p},
                {"output_tokens", n}, {"repeat", repeat},   {"ttft_ms", row.ttft_ms}, {"decode_tokens_per_s", row.tps}};
      bench::PrintJsonLine(j);
    }
  }
  std::printf("\n%-8s %-8s %12s %16s\n", "prompt", "output", "ttft_ms", "decode_tok/s");
  for (const Row& r : rows) {
    std::printf("%-8lld %-8lld %12.2f %16.1f\n", static_cast<long long>(r.prompt), static_cast<long long>(r.output),
                r.ttft_ms, r.tps);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace odmoe

int main(int argc, char** argv) {
  const std::string usage =
      "usage: odmoe-bench decode --model DIR [--backend cpu] [--prompt-len 16,128] [--new-tokens 64,256] "
      "[--repeat 3]\n"
      "       odmoe-bench engine (--synthetic CONFIG [--layers N] [--seed S] | --model DIR) [--backend cpu]\n"
      "           [--pairs 16x64,16x256,128x64,128x256] [--repeat 3] [--copy-mb 1024]\n"
      "       odmoe-bench kernels [--backend cpu] [--hidden 4096] [--inter 14336] [--contexts 1024,4096,16384]\n"
      "           [--heads 32] [--kv-heads 8] [--head-dim 128] [--rotate-mb 256] [--iters N] [--copy-mb 1024]\n"
      "       odmoe-bench prediction --config FILE --prompts FILE [--model DIR] [--prompt-count N]\n"
      "           [--max-new-tokens 256] [--cases 1,2,3,4,5,6] [--grid 1,2,4,8,16] [--shadow-quant Q] [--run-dir DIR]\n"
      "       odmoe-bench cluster --config FILE [--model DIR] [--prompt-len 64] [--new-tokens 128] [--requests 1]\n"
      "           [--copy-mb 512] [--run-dir DIR]\n"
      "       odmoe-bench workload (--endpoint HOST:PORT | --resident) (--model DIR | --synthetic CONFIG [--layers "
      "N])\n"
      "           [--seed S] [--backend cpu | --config FILE] [--pairs 16x64,...] [--prompts 3] [--prompt-text FILE]\n"
      "           [--write-prompts FILE]\n"
      "       odmoe-bench load (--config FILE [--model DIR] [--run-dir DIR] | --endpoint HOST:PORT [--config FILE])\n"
      "           (--prompts FILE | --prompt-text FILE) [--clients 1,2,4,8] [--requests-per-client 1]\n"
      "           [--max-new-tokens 64] [--ignore-eos true] [--per-request] [--api grpc|http]\n"
      "       odmoe-bench grammar (--model DIR | --synthetic-vocab N [--seed S]) [--repeat 20]\n"
      "       every benchmark: [--json FILE] (its JSON lines also go to FILE)\n";
  if (argc < 2) {
    std::fputs(usage.c_str(), stderr);
    return odmoe::kExitUsage;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> args;
  absl::Status status;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" || a.rfind("--json=", 0) == 0) {
      std::string path;
      if (a == "--json") {
        if (i + 1 >= argc) {
          std::fprintf(stderr, "odmoe-bench: --json needs a FILE\n%s", usage.c_str());
          return odmoe::kExitUsage;
        }
        path = argv[++i];
      } else {
        path = a.substr(7);
      }
      status = odmoe::bench::SetJsonFile(path);
      if (!status.ok()) {
        std::fprintf(stderr, "odmoe-bench: %s\n", std::string(status.message()).c_str());
        return odmoe::kExitUsage;
      }
      continue;
    }
    args.push_back(a);
  }
  if (cmd == "decode") {
    status = odmoe::RunDecode(args);
  } else if (cmd == "engine") {
    status = odmoe::bench::RunEngine(args);
  } else if (cmd == "kernels") {
    status = odmoe::bench::RunKernels(args);
  } else if (cmd == "prediction") {
    status = odmoe::bench::RunPrediction(args);
  } else if (cmd == "cluster") {
    status = odmoe::bench::RunCluster(args);
  } else if (cmd == "workload") {
    status = odmoe::bench::RunWorkload(args);
  } else if (cmd == "load") {
    status = odmoe::bench::RunLoad(args);
  } else if (cmd == "grammar") {
    status = odmoe::bench::RunGrammar(args);
  } else {
    std::fprintf(stderr, "odmoe-bench: unknown benchmark '%s'\n%s", cmd.c_str(), usage.c_str());
    return odmoe::kExitUsage;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "odmoe-bench %s: %s\n", cmd.c_str(), std::string(status.message()).c_str());
    return odmoe::ExitCodeFor(status);
  }
  return 0;
}
