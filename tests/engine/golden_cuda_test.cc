// The goldens of ../shared/models on the CUDA backend (weights in the checkpoint's dtype), with the bf16/fp16
// thresholds of ../shared/README.md (the fp32 ones for an fp32 checkpoint). Built twice: into kernels_test
// against the real CUDA runtime (skips without a GPU), and into simt_golden_test against the SIMT emulator
// (tools/simt, ODMOE_EMULATED_CUDA defined), where the real kernels and backend run on the CPU and a missing
// device is a failure, never a skip.
#include <iostream>
#include <string>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/engine/generator.h"
#include "src/model/model_config.h"
#include "tests/engine/golden_support.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using testing::GoldenThresholds;

#ifdef ODMOE_EMULATED_CUDA
constexpr bool kDeviceRequired = true;
#else
constexpr bool kDeviceRequired = false;
#endif

class GoldenCudaTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenCudaTest, MatchesHfTransformersOnCuda) {
  const std::string name = GetParam();
  const std::string dir = odmoe::testing::SharedModel(name);
  if (!odmoe::testing::HaveSharedModel(name)) {
    if (kDeviceRequired) FAIL() << "needs " << dir << " (../shared is missing)";
    GTEST_SKIP() << "needs " << dir << " (../shared is missing)";
  }
  auto device = CreateDevice("cuda");
  if (!device.ok()) {
    if (kDeviceRequired) FAIL() << "the emulated CUDA device: " << device.status();
    GTEST_SKIP() << "no CUDA device: " << device.status().message();
  }
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const bool fp32 = config->torch_dtype == "float32";
  auto model = LocalModel::Open(dir, std::move(device).value());
  ASSERT_TRUE(model.ok()) << model.status();
  auto golden = testing::LoadGolden(dir);
  ASSERT_TRUE(golden.ok()) << golden.status();
  const testing::GoldenCounts counts = testing::CheckGolden(
      **model, *golden, fp32 ? GoldenThresholds::Fp32() : GoldenThresholds::Reduced(), name + " cuda");
  std::cout << "[golden] " << name << " cuda (" << (fp32 ? "fp32" : "bf16/fp16") << " thresholds): "
            << counts.tokens << " greedy tokens, " << counts.routing << " routing decisions, " << counts.logits
            << " logits compared; max logit error ratio " << counts.max_logit_ratio << "\n";
  // The forward pass ran on the CUDA device: no op on any other device.
  EXPECT_GT((*model)->device().op_counts().at("MatMul"), 0);
  EXPECT_GT(counts.tokens, 0) << "compared no greedy token";
  EXPECT_GT(counts.routing, 0) << "compared no routing decision";
  EXPECT_GT(counts.logits, 0) << "compared no logits";
}

INSTANTIATE_TEST_SUITE_P(SharedModels, GoldenCudaTest, ::testing::ValuesIn(testing::GoldenModels()),
                         testing::GoldenParamName);

}  // namespace
}  // namespace odmoe
