// GpuBudget: what fits, the allocation within the budget and the "budget too small" errors, on a CpuDevice
// (no model, no gRPC).
#include "src/worker_node/gpu_budget.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "src/backend/cpu_device.h"

namespace odmoe {
namespace {

constexpr uint64_t kExpert = 4096;

TEST(GpuBudgetTest, TheLimitIsTheSmallerOfTheNodeBudgetAndTheCapacity) {
  CpuDevice unlimited;
  EXPECT_EQ(GpuBudget(unlimited, 0, kExpert, "w0", "c.toml").limit(), 0u);
  EXPECT_EQ(GpuBudget(unlimited, 1000, kExpert, "w0", "c.toml").limit(), 1000u);
  CpuDevice small(500);
  EXPECT_EQ(GpuBudget(small, 0, kExpert, "w0", "c.toml").limit(), 500u);
  EXPECT_EQ(GpuBudget(small, 1000, kExpert, "w0", "c.toml").limit(), 500u);
  EXPECT_EQ(GpuBudget(small, 300, kExpert, "w0", "c.toml").limit(), 300u);
}

TEST(GpuBudgetTest, FitsAndExcessCountWhatIsInUse) {
  CpuDevice device;
  GpuBudget budget(device, 10000, kExpert, "w0", "c.toml");
  EXPECT_TRUE(budget.Fits(10000));
  EXPECT_FALSE(budget.Fits(10001));
  auto held = budget.Allocate(6000, "held");
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE(budget.Fits(4000));
  EXPECT_FALSE(budget.Fits(4001));
  EXPECT_EQ(budget.Excess(4000), 0u);
  EXPECT_EQ(budget.Excess(5000), 1000u);
  // No limit: everything fits.
  GpuBudget unlimited(device, 0, kExpert, "w0", "c.toml");
  EXPECT_TRUE(unlimited.Fits(uint64_t{1} << 40));
  EXPECT_EQ(unlimited.Excess(uint64_t{1} << 40), 0u);
}

TEST(GpuBudgetTest, AnAllocationPastTheBudgetIsRefusedNamingWhatAndTheBudget) {
  CpuDevice device;
  GpuBudget budget(device, 3 * kExpert, kExpert, "w3", "c.toml");
  auto a = budget.Allocate(2 * kExpert, "expert 1 of layer 0");
  ASSERT_TRUE(a.ok());
  auto b = budget.Allocate(2 * kExpert, "expert 2 of layer 0");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(b.status().message());
  EXPECT_NE(message.find("worker 'w3'"), std::string::npos) << message;
  EXPECT_NE(message.find("expert 2 of layer 0"), std::string::npos) << message;
  EXPECT_NE(message.find("budget"), std::string::npos) << message;
  EXPECT_EQ(device.memory_info().in_use, 2 * kExpert);  // nothing was allocated
}

TEST(GpuBudgetTest, ConcurrentAllocationsNeverExceedTheBudget) {
  CpuDevice device;
  GpuBudget budget(device, 10 * kExpert, kExpert, "w0", "c.toml");
  std::vector<std::unique_ptr<Buffer>> got[4];
  std::vector<std::thread> threads;
  for (auto& mine : got) {
    threads.emplace_back([&budget, &mine] {
      for (int i = 0; i < 10; ++i) {
        auto b = budget.Allocate(kExpert, "expert");
        if (b.ok()) mine.push_back(std::move(b).value());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  size_t total = 0;
  for (const auto& mine : got) total += mine.size();
  EXPECT_EQ(total, 10u);
  EXPECT_EQ(device.memory_info().peak, 10 * kExpert);
}

TEST(GpuBudgetTest, StartUpNeedsTheWorkspaceTheLibraryWorkspaceAndOneExpert) {
  CpuDevice device;
  GpuBudget budget(device, 10000, kExpert, "w0", "cluster.toml");
  EXPECT_TRUE(budget.CheckWorkspace(10000 - kExpert, 64, absl::OkStatus()).ok());
  EXPECT_EQ(budget.workspace_bytes(), 10000 - kExpert);

  // The library workspace already on the device (a prepared stream) counts too.
  auto library = device.Allocate(100, "cuBLAS workspace");
  ASSERT_TRUE(library.ok());
  GpuBudget tight(device, 10000, kExpert, "w0", "cluster.toml");
  const absl::Status refused = tight.CheckWorkspace(10000 - kExpert, 64, absl::OkStatus());
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  const std::string message(refused.message());
  EXPECT_NE(message.find("gpu_budget_mb in cluster.toml"), std::string::npos) << message;
  EXPECT_NE(message.find("library workspace"), std::string::npos) << message;
  EXPECT_NE(message.find("64 rows per call"), std::string::npos) << message;

  // A stream that could not be prepared is refused the same way, with its reason.
  GpuBudget roomy(device, 0, kExpert, "w0", "cluster.toml");
  const absl::Status unprepared = roomy.CheckWorkspace(1, 64, absl::ResourceExhaustedError("cuBLAS: out of memory"));
  EXPECT_EQ(unprepared.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(unprepared.message().find("cuBLAS: out of memory"), std::string::npos) << unprepared;
}

}  // namespace
}  // namespace odmoe
