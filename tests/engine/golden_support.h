// Reading ../shared/models/*/golden.json and checking an engine against it with the thresholds of
// ../shared/README.md. Shared by the CPU golden test and the backends' and cluster's golden tests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "src/engine/generator.h"

namespace odmoe::testing {

struct GoldenStep {
  int32_t id = 0;
  double margin = 0;  // golden top-1 minus top-2 logit
};
struct GoldenRouting {
  std::vector<int32_t> experts;  // best first
  double margin = 0;
};
struct GoldenCase {
  std::vector<int32_t> prompt_ids;
  std::vector<float> last_logits;
  std::vector<GoldenStep> greedy;
  std::vector<int32_t> routing_sequence;
  std::vector<std::vector<GoldenRouting>> routing;  // [position][sparse layer]
  std::string text;
};
struct Golden {
  std::vector<GoldenCase> cases;
};

absl::StatusOr<Golden> LoadGolden(const std::string& model_dir);

struct GoldenThresholds {
  double logit_ratio;    // max abs error / max abs golden logit
  double greedy_margin;  // stop before the first step whose golden margin is below this
  double routing_margin; // compare expert sets only where the golden margin exceeds this
  static GoldenThresholds Fp32() { return {1e-3, 1e-3, 1e-4}; }
  static GoldenThresholds Reduced() { return {3e-2, 0.1, 1e-2}; }
};

struct GoldenCounts {
  int64_t cases = 0, logits = 0, tokens = 0, routing = 0, routing_skipped = 0;
  double max_logit_ratio = 0;
};

// A function that runs one request: greedy, `max_new_tokens`, recording routing and last logits.
using GenerateFn = std::function<absl::StatusOr<GenerateResult>(const std::vector<int32_t>& prompt,
                                                                const GenerateOptions& options)>;

// Checks every case with gtest EXPECTs (failures name `label`, the case and the position). Runs two requests
// per case: the prompt with greedy decoding (logits and tokens), and routing_sequence in one prefill (routing).
// Adds what it compared to `counts`.
void CheckGolden(const GenerateFn& generate, const Golden& golden, const GoldenThresholds& t,
                 const std::string& label, GoldenCounts& counts);
GoldenCounts CheckGolden(LocalModel& model, const Golden& golden, const GoldenThresholds& t,
                         const std::string& label);

// The models of ../shared/models the golden tests cover (GoldenCoverage checks that none is missing).
inline const std::vector<std::string>& GoldenModels() {
  static const std::vector<std::string> kModels = {"tiny-mixtral-kjv", "demo-mixtral-kjv", "mixtral-tiny",
                                                   "qwen2moe-tiny",    "qwen3moe-tiny",    "olmoe-tiny"};
  return kModels;
}
// A model's name as a gtest parameter name ('-' is not allowed): "mixtral-tiny" -> "mixtral_tiny".
inline std::string GoldenParamName(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (char& c : n) {
    if (c == '-') c = '_';
  }
  return n;
}

}  // namespace odmoe::testing
