// The resident engine's KV cache on the (emulated) CUDA backend: bf16 for a bf16 model, and the rows the shadow's
// KV alignment moves (ReadKv, ReadKvRange, WriteKv: fp32 on the host) go through it exactly. Built only against
// the SIMT emulator (tools/simt/tests/CMakeLists.txt), label cuda-emulated; needs ../shared/models.
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/common/dtype.h"
#include "src/engine/generator.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

TEST(KvCacheCudaTest, RowsGoThroughTheBf16CacheExactly) {
  const std::string name = "tiny-mixtral-kjv";  // a bf16 checkpoint
  ASSERT_TRUE(testing::HaveSharedModel(name)) << "needs " << testing::SharedModel(name);
  auto device = CreateDevice("cuda");
  ASSERT_TRUE(device.ok()) << "the emulated CUDA device: " << device.status();
  auto model = LocalModel::Open(testing::SharedModel(name), std::move(device).value());
  ASSERT_TRUE(model.ok()) << model.status();
  Engine& engine = (*model)->engine();
  const ModelConfig& c = (*model)->config();
  ASSERT_EQ(engine.device().KvCacheDType(DType::kBF16), DType::kBF16);

  constexpr int64_t kCapacity = 16;
  const uint64_t before = engine.device().memory_info().in_use;
  ASSERT_TRUE(engine.StartSequence(kCapacity).ok());
  EXPECT_EQ(engine.device().memory_info().in_use - before,
            static_cast<uint64_t>(2 * c.num_layers * kCapacity * c.kv_size() * 2))
      << "K and V of every layer, 2 bytes a value";
  const std::vector<int32_t> prompt = {1, 415, 2936, 302, 7};
  ASSERT_TRUE(engine.Forward(prompt, nullptr, ForwardKind::kPrefill).ok());

  const size_t row = static_cast<size_t>(c.num_layers * c.kv_size());
  std::vector<float> k(row), v(row);
  ASSERT_TRUE(engine.ReadKv(2, k.data(), v.data()).ok());
  int nonzero = 0;
  for (size_t i = 0; i < row; ++i) {
    ASSERT_EQ(Bf16ToF32(F32ToBf16(k[i])), k[i]) << "K value " << i << " is not a bf16 value";
    ASSERT_EQ(Bf16ToF32(F32ToBf16(v[i])), v[i]) << "V value " << i << " is not a bf16 value";
    nonzero += k[i] != 0.0f;
  }
  EXPECT_GT(nonzero, static_cast<int>(row / 2));

  // ReadKvRange's layout: [count, layers, kv_size]; position 2 is the third row.
  std::vector<float> ks(3 * row), vs(3 * row);
  ASSERT_TRUE(engine.ReadKvRange(0, 3, ks.data(), vs.data()).ok());
  EXPECT_EQ(std::vector<float>(ks.begin() + 2 * row, ks.end()), k);
  EXPECT_EQ(std::vector<float>(vs.begin() + 2 * row, vs.end()), v);

  // The shadow's alignment: position 2's rows written at position 4 read back bit for bit.
  ASSERT_TRUE(engine.WriteKv(4, k.data(), v.data()).ok());
  std::vector<float> k4(row), v4(row);
  ASSERT_TRUE(engine.ReadKv(4, k4.data(), v4.data()).ok());
  EXPECT_EQ(k4, k);
  EXPECT_EQ(v4, v);
}

}  // namespace
}  // namespace odmoe
