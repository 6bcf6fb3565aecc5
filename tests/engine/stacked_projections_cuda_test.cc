// Stacked projections (AttentionWeights::qkv, MlpWeights::gate_up) on the (emulated) CUDA backend: one token's
// projection through a stack is bitwise the projections through its matrices' own views, for the checkpoint's
// dtype and for each precision of the shadow's replica. The GEMVs sum a row the same way whichever rows share a launch;
// this checks that the views keep what lets them (16-byte aligned rows). Built only against the SIMT emulator
// (tools/simt/tests/CMakeLists.txt), label cuda-emulated; needs ../shared/models.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/engine/model_weights.h"
#include "src/model/checkpoint.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

// y[0, rows) = x through `stacked`, then y[rows, 2 rows) = x through each of `apart` ([rows_i] each, in order);
// true when the two halves have the same bits.
bool SameBits(Device& d, const float* x, int64_t in, WeightRef stacked, WeightRef stacked_bias,
              const std::vector<std::tuple<WeightRef, WeightRef, int64_t>>& apart, float* y) {
  int64_t rows = 0;
  for (const auto& [w, b, r] : apart) rows += r;
  d.MatMul(x, stacked, stacked_bias, 1, in, rows, y, nullptr);
  int64_t at = rows;
  for (const auto& [w, b, r] : apart) {
    d.MatMul(x, w, b, 1, in, r, y + at, nullptr);
    at += r;
  }
  std::vector<float> host(2 * static_cast<size_t>(rows));
  d.CopyToHost(host.data(), y, host.size() * sizeof(float), nullptr);
  return std::memcmp(host.data(), host.data() + rows, static_cast<size_t>(rows) * sizeof(float)) == 0;
}

void CheckModel(const std::string& name) {
  ASSERT_TRUE(testing::HaveSharedModel(name)) << "needs " << testing::SharedModel(name);
  auto checkpoint = Checkpoint::Open(testing::SharedModel(name));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto config = LoadModelConfig(testing::SharedModel(name));
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t h = config->hidden_size, qs = config->q_size(), kvs = config->kv_size();
  const int64_t most_rows =
      std::max({qs + 2 * kvs, 2 * config->shared_expert_intermediate_size, 2 * config->dense_intermediate_size});
  std::vector<float> x(static_cast<size_t>(h));
  for (int64_t i = 0; i < h; ++i) x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i + 1));
  int mlps = 0;
  for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kFp16, WeightQuant::kInt8, WeightQuant::kNf4}) {
    auto device = CreateDevice("cuda");
    ASSERT_TRUE(device.ok()) << "the emulated CUDA device: " << device.status();
    Device& d = **device;
    auto weights = ModelWeights::Load(*config, **checkpoint, d, WeightSelection::Quantized(q));
    ASSERT_TRUE(weights.ok()) << weights.status();
    auto dx = d.Allocate(x.size() * sizeof(float), "x");
    auto dy = d.Allocate(2 * static_cast<size_t>(most_rows) * sizeof(float), "y");
    ASSERT_TRUE(dx.ok() && dy.ok());
    d.CopyToDevice((*dx)->data(), x.data(), x.size() * sizeof(float), nullptr);
    const float* xp = (*dx)->as<float>();
    float* y = (*dy)->as<float>();
    const std::string what = name + ", quant " + std::to_string(static_cast<int>(q));
    for (int64_t l = 0; l < config->num_layers; ++l) {
      const LayerWeights& lw = (*weights)->layer(l);
      const AttentionWeights& a = lw.attn;
      ASSERT_FALSE(a.qkv.empty()) << what << ", layer " << l;
      EXPECT_TRUE(
          SameBits(d, xp, h, a.qkv, a.qkv_bias, {{a.q, a.q_bias, qs}, {a.k, a.k_bias, kvs}, {a.v, a.v_bias, kvs}}, y))
          << what << ", layer " << l << ": q, k, v";
      for (const MlpWeights* m : {&lw.shared, &lw.dense}) {
        if (!m->present()) continue;
        ++mlps;
        ASSERT_FALSE(m->gate_up.empty()) << what << ", layer " << l;
        const int64_t inter = m->intermediate;
        EXPECT_TRUE(SameBits(d, xp, h, m->gate_up, {}, {{m->gate, {}, inter}, {m->up, {}, inter}}, y))
            << what << ", layer " << l << ": gate and up";
      }
    }
  }
  EXPECT_EQ(mlps > 0, config->shared_expert_intermediate_size > 0) << name;
}

TEST(StackedProjectionsCudaTest, OneTokensRowsAreTheirMatricesBitwise) {
  CheckModel("tiny-mixtral-kjv");  // bf16, Mixtral
  CheckModel("qwen2moe-tiny");     // q, k, v biases and a shared expert
}

}  // namespace
}  // namespace odmoe
