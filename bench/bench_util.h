// Helpers shared by the odmoe-bench benchmarks.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "odmoe/v1/worker.pb.h"
#include "src/backend/device.h"
#include "src/common/cluster_config.h"
#include "src/common/json.h"
#include "src/model/model_config.h"

namespace odmoe::bench {

using Clock = std::chrono::steady_clock;
inline double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double Median(std::vector<double> v);
// The nearest-rank p-th percentile (0 < p <= 100) of `v`: the smallest value with at least p% of `v` at or
// below it; 0 when `v` is empty.
double Percentile(std::vector<double> v, double p);

// Device-to-device copy bandwidth in bytes/s, counting the bytes read and the bytes written (2 x size per
// copy): CopyOnDevice of a `bytes` buffer, timed over `iters` copies after one warm-up, SynchronizeAll at both
// ends (host steady clock). This is the memory bandwidth the kernels are compared with.
absl::StatusOr<double> MeasureCopyBandwidth(Device& device, size_t bytes, int iters);

// A deterministic prompt of `length` ordinary token ids for `config`'s vocabulary, BOS first when the model has
// one: the same prompt for every run and backend, so that timings compare.
std::vector<int32_t> SyntheticPrompt(const ModelConfig& config, int64_t length);

// "16x64,128x256" -> {{16, 64}, {128, 256}}.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ParsePairs(const std::string& text);

// Prints `j` as one line on stdout and, after SetJsonFile, appends the same line to that file too.
void PrintJsonLine(const Json& j);
// Every later PrintJsonLine also goes to `path` (created or truncated now); InvalidArgument naming the path
// when it cannot be opened. `odmoe-bench ... --json FILE` calls it.
absl::Status SetJsonFile(const std::string& path);
// Runs `argv` (a program path first) with its stdout sent to our stderr, so that our stdout carries only JSON
// lines and the table; Unavailable when it does not exit 0.
absl::Status RunQuiet(const std::vector<std::string>& argv);

// `bench` runs beside the `odmoe` program (both in build/bin): its path, and the default run directory of
// benchmark `bench` (a folder of this process under the temporary directory).
std::string OdmoeProgram();
std::string DefaultRunDir(const std::string& bench);
// `odmoe cluster up --config CONFIG --run-dir RUN_DIR [--model MODEL] EXTRA...` and `odmoe cluster down
// --config CONFIG --run-dir RUN_DIR`, quiet (RunQuiet); `model` empty: the cluster file's.
absl::Status ClusterUp(const std::string& config, const std::string& run_dir, const std::string& model,
                       const std::vector<std::string>& extra = {});
absl::Status ClusterDown(const std::string& config, const std::string& run_dir);

// The lines of a --prompt-text FILE, empty lines and lines starting with '#' left out; InvalidArgument when
// none is left.
absl::StatusOr<std::vector<std::string>> ReadPromptLines(const std::string& path);

// One prompt of a prompts file: text (main tokenizes it) or token ids; exactly one is set.
struct Prompt {
  std::string text;
  std::vector<int32_t> ids;
};
// A --prompts FILE: {"prompts": [...]} (recall_prompts.json of the shared models) or a bare [...], each prompt
// a non-empty string or a non-empty array of token ids. InvalidArgument naming the file and the prompt's index
// otherwise, or when there is none.
absl::StatusOr<std::vector<Prompt>> ReadPromptsJson(const std::string& path);

// Every worker's counters (GetStats), in worker_index order; with `reset` they are zeroed after the read.
// Unavailable (or the worker's code) naming the worker when one does not answer.
absl::StatusOr<std::vector<v1::WorkerStats>> ReadWorkerStats(const ClusterConfig& cluster, bool reset);

}  // namespace odmoe::bench
