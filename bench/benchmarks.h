// The odmoe-bench subcommands; each parses its flags and prints JSON lines and a table.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace odmoe::bench {

absl::Status RunEngine(const std::vector<std::string>& args);      // engine_bench.cc
absl::Status RunKernels(const std::vector<std::string>& args);     // kernels_bench.cc
absl::Status RunPrediction(const std::vector<std::string>& args);  // prediction_bench.cc
absl::Status RunCluster(const std::vector<std::string>& args);     // cluster_bench.cc
absl::Status RunWorkload(const std::vector<std::string>& args);    // workload_bench.cc
absl::Status RunLoad(const std::vector<std::string>& args);        // load_bench.cc
absl::Status RunGrammar(const std::vector<std::string>& args);     // grammar_bench.cc

}  // namespace odmoe::bench
