// Device::RoutedExperts (kernels/moe_grouped.cu on CUDA) against the per-expert path it replaces on the same
// device: GroupByExpert + PackRowsAndScales on the host, then ComputeExpertRows per expert (GatherRows, MatMul
// gate, MatMul up, SwiGlu, MatMul down) and ScatterAddScaled in ascending expert id (CombineExpertOutputs) onto
// zeros, while RoutedExperts writes over an output of random values.
// Compared bit for bit on odd shapes (16-byte and scalar GEMV paths, a gate and an up of different alignment),
// k = 1, 2, 4 and n = 1..4 in bf16, fp16 and fp32. Skipped without a GPU (the emulated twin runs everywhere).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/cpu_device.h"
#include "src/backend/cuda_device.h"
#include "src/engine/moe_units.h"
#include "tests/kernels/gpu_test_util.h"

namespace odmoe {
namespace {

using gpu_test::RandomFloats;
using gpu_test::TestWeight;

std::unique_ptr<Buffer> Upload(Device& d, const void* data, size_t bytes) {
  auto b = d.Allocate(std::max<size_t>(bytes, 4), "test");
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return nullptr;
  d.CopyToDevice((*b)->data(), data, bytes, nullptr);
  d.Synchronize(nullptr);  // `data` may be a temporary
  return std::move(b).value();
}
template <typename T>
std::unique_ptr<Buffer> Upload(Device& d, const std::vector<T>& v) {
  return Upload(d, v.data(), v.size() * sizeof(T));
}
std::vector<uint32_t> Bits(Device& d, const Buffer& b, size_t floats) {
  std::vector<uint32_t> host(floats);
  d.CopyToHost(host.data(), b.data(), floats * sizeof(float), nullptr);
  return host;
}

class RoutedExpertsTest : public gpu_test::CudaDeviceFixture {
 protected:
  // Two layers of `experts` experts; layer 0 has none (a dense layer: empty table entries), layer 1 is routed.
  // With `misalign_up` the up projections sit 2 bytes past a 16-byte boundary (the GEMV's scalar path) while the
  // gates do not.
  void Check(DType dtype, int64_t hidden, int64_t inter, int64_t experts, bool misalign_up, std::mt19937& rng) {
    const size_t elt = DTypeSize(dtype);
    std::vector<std::unique_ptr<Buffer>> weights;
    std::vector<ExpertWeightRefs> table(static_cast<size_t>(2 * experts));
    std::vector<MlpWeights> mlps(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) {
      MlpWeights& m = mlps[static_cast<size_t>(e)];
      m.intermediate = inter;
      for (int which = 0; which < 3; ++which) {
        const size_t count = static_cast<size_t>(hidden * inter);
        const size_t pad = which == 1 && misalign_up ? 2 : 0;
        std::vector<uint8_t> bytes(pad + count * elt, 0);
        const std::vector<uint8_t> enc = TestWeight::Encode(dtype, RandomFloats(count, rng, -0.5f, 0.5f));
        std::copy(enc.begin(), enc.end(), bytes.begin() + static_cast<std::ptrdiff_t>(pad));
        weights.push_back(Upload(*gpu_, bytes));
        ASSERT_NE(weights.back(), nullptr);
        const WeightRef ref{weights.back()->as<uint8_t>() + pad, dtype};
        (which == 0 ? m.gate : which == 1 ? m.up : m.down) = ref;
      }
      table[static_cast<size_t>(experts + e)] = ExpertWeightRefs{m.gate, m.up, m.down};
    }
    auto made = gpu_->CreateExpertTable(table, experts, hidden, inter);
    ASSERT_TRUE(made.ok()) << made.status();
    const std::unique_ptr<ExpertTable> expert_table = std::move(made).value();

    for (int64_t k : {1, 2, 4}) {
      for (int64_t n = 1; n <= 4; ++n) {
        const std::string what = std::string(DTypeName(dtype)) + " hidden=" + std::to_string(hidden) +
                                 " inter=" + std::to_string(inter) + " k=" + std::to_string(k) +
                                 " n=" + std::to_string(n) + (misalign_up ? " (up misaligned)" : "");
        // Each row: k distinct experts in random order (best first is the router's order, not the id's).
        std::vector<int32_t> ids;
        for (int64_t i = 0; i < n; ++i) {
          std::vector<int32_t> perm(static_cast<size_t>(experts));
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), rng);
          ids.insert(ids.end(), perm.begin(), perm.begin() + k);
        }
        const std::vector<float> route_w = RandomFloats(static_cast<size_t>(n * k), rng, 0.0f, 1.0f);
        const std::vector<float> x = RandomFloats(static_cast<size_t>(n * hidden), rng);
        // The per-expert path adds onto zeros; the grouped one writes over whatever `out` held.
        const std::vector<float> start = RandomFloats(static_cast<size_t>(n * hidden), rng);
        auto dx = Upload(*gpu_, x);
        auto want = Upload(*gpu_, std::vector<float>(static_cast<size_t>(n * hidden), 0.0f));
        auto got = Upload(*gpu_, start);

        // The per-expert path, as LocalExpertExecutor::Run takes it.
        const std::vector<ExpertBatch> batches = GroupByExpert(ids, route_w, n, k);
        PackedRouting packed;
        PackRowsAndScales(batches, n, k, &packed);
        auto index = Upload(*gpu_, packed.host);
        auto ws = MlpWorkspace::Create(*gpu_, n, inter);
        ASSERT_TRUE(ws.ok()) << ws.status();
        auto gathered = Upload(*gpu_, std::vector<float>(static_cast<size_t>(n * hidden)));
        auto yb = Upload(*gpu_, std::vector<float>(static_cast<size_t>(n * hidden)));
        const int32_t* dev_index = index->as<int32_t>();
        ASSERT_TRUE(CombineExpertOutputs(
                        *gpu_, batches, packed, dev_index, hidden,
                        [&](size_t b) -> absl::StatusOr<const float*> {
                          ComputeExpertRows(*gpu_, mlps[static_cast<size_t>(batches[b].expert)], dx->as<float>(), n,
                                            packed.rows(dev_index, b), static_cast<int64_t>(batches[b].rows.size()),
                                            hidden, gathered->as<float>(), **ws, yb->as<float>(), nullptr);
                          return yb->as<float>();
                        },
                        want->as<float>(), nullptr)
                        .ok());

        // The grouped path, from the ids on the device.
        auto dids = Upload(*gpu_, ids);
        auto dw = Upload(*gpu_, route_w);
        auto act = Upload(*gpu_, std::vector<float>(static_cast<size_t>(n * k * inter)));
        auto y = Upload(*gpu_, std::vector<float>(static_cast<size_t>(n * k * hidden)));
        gpu_->RoutedExperts(*expert_table, 1, dx->as<float>(), n, k, dids->as<int32_t>(), dw->as<float>(),
                            act->as<float>(), y->as<float>(), got->as<float>(), nullptr);

        const std::vector<uint32_t> a = Bits(*gpu_, *got, x.size()), b = Bits(*gpu_, *want, x.size());
        size_t differ = 0;
        for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
        EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << a.size() << " values differ";
        std::vector<float> gf(a.size());
        std::memcpy(gf.data(), a.data(), a.size() * sizeof(float));
        for (float v : gf) ASSERT_TRUE(std::isfinite(v)) << what;
        // Something was computed: the result is neither zeros nor the starting value.
        EXPECT_NE(a, Bits(*gpu_, *Upload(*gpu_, start), start.size())) << what;
        EXPECT_NE(a, std::vector<uint32_t>(a.size(), 0u)) << what;
      }
    }
  }
};

TEST_F(RoutedExpertsTest, BitwiseThePerExpertPathOnOddShapes) {
  std::mt19937 rng(2024);
  // (hidden, intermediate): 16-byte paths on both projections but neither a multiple of 256; scalar paths (not
  // multiples of 8) on one or both; a down projection whose rows end mid-warp.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{264, 200}, {100, 77}, {72, 130}, {33, 264}};
  for (DType dtype : {DType::kBF16, DType::kF32, DType::kF16}) {
    for (const auto& [hidden, inter] : shapes) Check(dtype, hidden, inter, 6, /*misalign_up=*/false, rng);
  }
  Check(DType::kBF16, 264, 200, 5, /*misalign_up=*/true, rng);
}

TEST_F(RoutedExpertsTest, TheTableTakesDenseExpertsOfOneDtype) {
  EXPECT_EQ(gpu_->RoutedExpertsMaxTokens(), 8);
  std::vector<float> w(64, 0.25f);
  auto f32 = Upload(*gpu_, w);
  const WeightRef dense{f32->data(), DType::kF32};
  const WeightRef bf16{f32->data(), DType::kBF16};
  const WeightRef int8{f32->data(), DType::kI8, f32->as<float>()};
  EXPECT_TRUE(gpu_->CreateExpertTable(std::vector<ExpertWeightRefs>{{dense, dense, dense}, {}}, 1, 8, 8).ok());
  EXPECT_EQ(gpu_->CreateExpertTable(std::vector<ExpertWeightRefs>{{dense, dense, dense}, {bf16, bf16, bf16}}, 1, 8, 8)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->CreateExpertTable(std::vector<ExpertWeightRefs>{{int8, int8, int8}}, 1, 8, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->CreateExpertTable(std::vector<ExpertWeightRefs>{{dense, {}, dense}}, 1, 8, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RoutedExpertsCpuTest, TheCpuDeviceKeepsTheHostPath) {
  CpuDevice cpu;
  EXPECT_EQ(cpu.RoutedExpertsMaxTokens(), 0);
  EXPECT_EQ(cpu.CreateExpertTable({}, 1, 8, 8).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace odmoe
