#include "src/common/cluster_config.h"

#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

constexpr char kGood[] = R"(
[cluster]
name = "lab"
epoch = 3
group_size = 2
rpc_timeout_ms = 5000

[model]
path = "../models/demo"

[[node]]
name = "main"
role = "main"
address = "10.0.0.1:7100"

[[node]]
name = "shadow"
role = "shadow"
address = "10.0.0.2:7100"
device = "cuda"

[[node]]
name = "w0"
role = "worker"
address = "10.0.0.3:7100"
device = "mock-gpu"
gpu_budget_mb = 1024

[[node]]
name = "w1"
role = "worker"
address = "10.0.0.4:7100"
)";

TEST(ClusterConfigTest, ParsesEveryField) {
  auto c = ParseClusterConfig(kGood, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "lab");
  EXPECT_EQ(c->epoch, 3u);
  EXPECT_EQ(c->group_size, 2);
  EXPECT_EQ(c->rpc_timeout_ms, 5000);
  EXPECT_EQ(c->model.path, "/etc/models/demo");
  ASSERT_EQ(c->nodes.size(), 4u);
  EXPECT_EQ(c->main()->name, "main");
  EXPECT_EQ(c->shadow()->device, "cuda");
  auto workers = c->workers();
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0]->worker_index, 0);
  EXPECT_EQ(workers[1]->worker_index, 1);
  EXPECT_EQ(workers[0]->gpu_budget_bytes, 1024ull << 20);
  EXPECT_EQ(workers[1]->device, "cpu");
}

TEST(ClusterConfigTest, TheShippedLocalConfigLoads) {
  auto c = LoadClusterConfig(odmoe::testing::SourceDir() + "/configs/local.toml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(c->main(), nullptr);
  EXPECT_NE(c->shadow(), nullptr);
  EXPECT_EQ(c->workers().size(), 8u);
}

TEST(ClusterConfigTest, TheShippedTestbedConfigLoads) {
  auto c = LoadClusterConfig(odmoe::testing::SourceDir() + "/configs/testbed.toml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->nodes.size(), 10u);
  EXPECT_EQ(c->workers().size(), 8u);
  EXPECT_EQ(c->workers()[7]->gpu_budget_bytes, 1024ull << 20);
}

struct Bad {
  std::string from, to;  // replace `from` in kGood by `to`
  std::string needle;    // the message must name this
};

TEST(ClusterConfigTest, BadFilesNameTheFieldAtFault) {
  const std::vector<Bad> cases = {
      {"epoch = 3", "epoch = 0", "'epoch'"},
      {"group_size = 2", "group_size = 3", "'group_size'"},
      {"rpc_timeout_ms = 5000", "rpc_timeout_ms = \"soon\"", "'rpc_timeout_ms'"},
      {"address = \"10.0.0.4:7100\"", "address = \"10.0.0.4\"", "node 'w1': field 'address'"},
      {"address = \"10.0.0.4:7100\"", "address = \"10.0.0.3:7100\"", "used by two nodes"},
      {"address = \"10.0.0.4:7100\"", "address = \"10.0.0.4:99999\"", "'address'"},
      {"role = \"shadow\"", "role = \"oracle\"", "'oracle'"},
      {"role = \"shadow\"", "role = \"main\"", "exactly one main"},
      {"name = \"w1\"", "name = \"w0\"", "used by two nodes"},
      {"gpu_budget_mb = 1024", "gpu_budget_mb = 0", "'gpu_budget_mb'"},
      {"gpu_budget_mb = 1024", "gpu_budgte_mb = 1024", "'gpu_budgte_mb': unknown field"},
      {"[model]", "[modle]", "'modle'"},
      {"name = \"lab\"", "name = \"lab", "invalid TOML"},
  };
  for (const Bad& b : cases) {
    std::string text = kGood;
    const size_t at = text.find(b.from);
    ASSERT_NE(at, std::string::npos) << b.from;
    text.replace(at, b.from.size(), b.to);
    auto c = ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
    EXPECT_FALSE(c.ok()) << b.to;
    EXPECT_NE(c.status().message().find(b.needle), absl::string_view::npos) << c.status();
    EXPECT_NE(c.status().message().find("lab.toml"), absl::string_view::npos) << c.status();
  }
}

TEST(ClusterConfigTest, NeedsAMainAndAWorker) {
  auto c = ParseClusterConfig("[[node]]\nname = \"m\"\nrole = \"main\"\naddress = \"h:1\"\n", "x.toml", ".");
  EXPECT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("worker"), absl::string_view::npos);
  c = ParseClusterConfig("[cluster]\nname = \"x\"\n", "x.toml", ".");
  EXPECT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("[[node]]"), absl::string_view::npos);
}

TEST(ClusterConfigTest, MissingFileIsNotFound) {
  auto c = LoadClusterConfig("/nonexistent/cluster.toml");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace odmoe
