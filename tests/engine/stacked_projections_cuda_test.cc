// q, k and v stored as one stack (AttentionWeights::qkv) on the (emulated) CUDA backend: one token's projection
// through the stack is bitwise the three projections through their own views, for the checkpoint's bf16 and for
// each precision of the shadow's replica. The GEMVs sum a row the same way whichever rows share a launch; this
// checks that the views keep what lets them (16-byte aligned rows). Built only against the SIMT emulator
// (tools/simt/tests/CMakeLists.txt), label cuda-emulated; needs ../shared/models.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/engine/model_weights.h"
#include "src/model/checkpoint.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

TEST(StackedQkvCudaTest, OneTokensRowsAreTheProjectionsBitwise) {
  const std::string name = "tiny-mixtral-kjv";  // a bf16 checkpoint
  ASSERT_TRUE(testing::HaveSharedModel(name)) << "needs " << testing::SharedModel(name);
  auto checkpoint = Checkpoint::Open(testing::SharedModel(name));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto config = LoadModelConfig(testing::SharedModel(name));
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t h = config->hidden_size, qs = config->q_size(), kvs = config->kv_size(), rows = qs + 2 * kvs;
  std::vector<float> x(static_cast<size_t>(h));
  for (int64_t i = 0; i < h; ++i) x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i + 1));
  for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kFp16, WeightQuant::kInt8, WeightQuant::kNf4}) {
    auto device = CreateDevice("cuda");
    ASSERT_TRUE(device.ok()) << "the emulated CUDA device: " << device.status();
    Device& d = **device;
    auto weights = ModelWeights::Load(*config, **checkpoint, d, WeightSelection::Quantized(q));
    ASSERT_TRUE(weights.ok()) << weights.status();
    auto dx = d.Allocate(x.size() * sizeof(float), "x");
    auto dy = d.Allocate(2 * static_cast<size_t>(rows) * sizeof(float), "y");
    ASSERT_TRUE(dx.ok() && dy.ok());
    d.CopyToDevice((*dx)->data(), x.data(), x.size() * sizeof(float), nullptr);
    const float* xp = (*dx)->as<float>();
    float* stacked = (*dy)->as<float>();
    float* apart = stacked + rows;
    for (int64_t l = 0; l < config->num_layers; ++l) {
      const AttentionWeights& a = (*weights)->layer(l).attn;
      ASSERT_FALSE(a.qkv.empty()) << "layer " << l;
      d.MatMul(xp, a.qkv, a.qkv_bias, 1, h, rows, stacked, nullptr);
      d.MatMul(xp, a.q, a.q_bias, 1, h, qs, apart, nullptr);
      d.MatMul(xp, a.k, a.k_bias, 1, h, kvs, apart + qs, nullptr);
      d.MatMul(xp, a.v, a.v_bias, 1, h, kvs, apart + qs + kvs, nullptr);
      std::vector<float> y(2 * static_cast<size_t>(rows));
      d.CopyToHost(y.data(), (*dy)->data(), y.size() * sizeof(float), nullptr);
      EXPECT_EQ(std::memcmp(y.data(), y.data() + rows, static_cast<size_t>(rows) * sizeof(float)), 0)
          << "layer " << l << ", quant " << static_cast<int>(q);
    }
  }
}

}  // namespace
}  // namespace odmoe
