#include "tests/engine/stacked_projections_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/engine/model_weights.h"
#include "src/model/checkpoint.h"
#include "tests/test_support.h"

namespace odmoe::testing {
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

}  // namespace

void ExpectStackedProjectionsBitwise(const std::string& model, const std::string& device) {
  ASSERT_TRUE(HaveSharedModel(model)) << "needs " << SharedModel(model);
  auto checkpoint = Checkpoint::Open(SharedModel(model));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto config = LoadModelConfig(SharedModel(model));
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t h = config->hidden_size, qs = config->q_size(), kvs = config->kv_size();
  const int64_t most_rows =
      std::max({qs + 2 * kvs, 2 * config->shared_expert_intermediate_size, 2 * config->dense_intermediate_size});
  std::vector<float> x(static_cast<size_t>(h));
  for (int64_t i = 0; i < h; ++i) x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i + 1));
  int mlps = 0;  // shared experts and dense MLPs seen
  for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kFp16, WeightQuant::kInt8, WeightQuant::kNf4}) {
    auto made = CreateDevice(device);
    ASSERT_TRUE(made.ok()) << device << ": " << made.status();
    Device& d = **made;
    auto weights = ModelWeights::Load(*config, **checkpoint, d, WeightSelection::Quantized(q));
    ASSERT_TRUE(weights.ok()) << weights.status();
    auto dx = d.Allocate(x.size() * sizeof(float), "x");
    auto dy = d.Allocate(2 * static_cast<size_t>(most_rows) * sizeof(float), "y");
    ASSERT_TRUE(dx.ok() && dy.ok());
    d.CopyToDevice((*dx)->data(), x.data(), x.size() * sizeof(float), nullptr);
    const float* xp = (*dx)->as<float>();
    float* y = (*dy)->as<float>();
    const std::string what = model + " on " + device + ", quant " + std::to_string(static_cast<int>(q));
    for (int64_t l = 0; l < config->num_layers; ++l) {
      const LayerWeights& lw = (*weights)->layer(l);
      const AttentionWeights& a = lw.attn;
      ASSERT_FALSE(a.qkv.empty()) << what << ", layer " << l;
      EXPECT_EQ(a.q.data, a.qkv.data) << what << ", layer " << l;
      EXPECT_EQ(a.qkv_bias.empty(), !config->qkv_bias) << what << ", layer " << l;
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
  bool has_mlps = config->shared_expert_intermediate_size > 0;
  for (int64_t l = 0; l < config->num_layers; ++l) has_mlps = has_mlps || !config->IsSparseLayer(l);
  EXPECT_EQ(mlps > 0, has_mlps) << model;
}

}  // namespace odmoe::testing
