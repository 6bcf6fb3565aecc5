#include "src/common/cluster_config.h"

#include <filesystem>

#include "gtest/gtest.h"
#include "src/common/strings.h"
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
metrics_address = "10.0.0.4:7190"
)";

TEST(ClusterConfigTest, HttpAddressOfMainMayShareItsMetricsAddress) {
  std::string text = kGood;
  const std::string main_address = "address = \"10.0.0.1:7100\"";
  text.replace(text.find(main_address), main_address.size(),
               main_address + "\nhttp_address = \"10.0.0.1:8000\"\nmetrics_address = \"10.0.0.1:8000\"");
  auto c = ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->main()->http_address, "10.0.0.1:8000");
  EXPECT_EQ(c->main()->metrics_address, "10.0.0.1:8000");
  EXPECT_TRUE(c->main()->http_allowed_origins.empty());  // no browser page may call it unless listed
  auto plain = ParseClusterConfig(kGood, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->main()->http_address, "");  // optional: no HTTP API
}

TEST(ClusterConfigTest, AllowedOriginsAreAListOrAnyOrOne) {
  const std::string main_address = "address = \"10.0.0.1:7100\"";
  auto parse = [&](const std::string& origins) {
    std::string text = kGood;
    text.replace(text.find(main_address), main_address.size(),
                 main_address + "\nhttp_address = \"10.0.0.1:8000\"\nhttp_allowed_origins = " + origins);
    return ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
  };
  auto list = parse(R"(["https://app.example.com", "http://10.0.0.9:3000"])");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->main()->http_allowed_origins,
            (std::vector<std::string>{"https://app.example.com", "http://10.0.0.9:3000"}));
  auto any = parse(R"("*")");
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(any->main()->http_allowed_origins, std::vector<std::string>{"*"});
}

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
  EXPECT_EQ(workers[1]->metrics_address, "10.0.0.4:7190");
  EXPECT_EQ(workers[0]->metrics_address, "");  // optional: no metrics server
}

TEST(ClusterConfigTest, TheShippedLocalConfigLoads) {
  auto c = LoadClusterConfig(odmoe::testing::SourceDir() + "/configs/local.toml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NE(c->main(), nullptr);
  EXPECT_NE(c->shadow(), nullptr);
  EXPECT_EQ(c->workers().size(), 8u);
  for (const NodeConfig& n : c->nodes) EXPECT_FALSE(n.metrics_address.empty()) << n.name;
}

TEST(ClusterConfigTest, TwoNodesCannotShareAMetricsAddress) {
  std::string text = kGood;  // w0 gets the metrics address w1 has
  text.insert(text.find("gpu_budget_mb = 1024"), "metrics_address = \"10.0.0.4:7190\"\n");
  auto c = ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("lab.toml: node 'w1': field 'metrics_address': '10.0.0.4:7190' is also node "
                                      "'w0' metrics_address"),
            absl::string_view::npos)
      << c.status();
}

TEST(ClusterConfigTest, TheShippedTestbedConfigLoads) {
  auto c = LoadClusterConfig(odmoe::testing::SourceDir() + "/configs/testbed.toml");
  ASSERT_TRUE(c.ok()) << c.status();
  for (const NodeConfig& n : c->nodes) EXPECT_FALSE(n.metrics_address.empty()) << n.name;
  EXPECT_EQ(c->nodes.size(), 10u);
  EXPECT_EQ(c->workers().size(), 8u);
  EXPECT_EQ(c->workers()[7]->gpu_budget_bytes, 1024ull << 20);
}

TEST(ClusterConfigTest, TheShippedOneGpuConfigLoads) {
  auto c = LoadClusterConfig(odmoe::testing::SourceDir() + "/configs/one-gpu-mixtral.toml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->model.is_synthetic());
  EXPECT_TRUE(std::filesystem::exists(c->model.synthetic)) << c->model.synthetic;
  EXPECT_EQ(c->model.layers, 16);
  ASSERT_EQ(c->workers().size(), 8u);
  for (const NodeConfig* w : c->workers()) {
    EXPECT_EQ(w->device, "cuda");
    EXPECT_EQ(w->gpu_budget_bytes, 1024ull << 20);
  }
  EXPECT_EQ(c->prefill_minibatch_rows, 32);
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
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nserved_model_name = []",
       "[model]: field 'served_model_name': expected at least one name"},
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nserved_model_name = 3",
       "field 'served_model_name': expected a string or a list of strings"},
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nserved_model_name = [\"a\", 1]",
       "field 'served_model_name': expected a string or a list of strings"},
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nserved_model_name = \"my model\"",
       "field 'served_model_name': 'my model' is not a name (empty, or with white space)"},
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nserved_model_name = [\"a\", \"b\", \"a\"]",
       "field 'served_model_name': 'a' is given twice"},
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nmax_model_len = 0",
       "[model]: field 'max_model_len': must be >= 1 (leave it out for the model's max_position_embeddings), got 0"},
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nmax_model_len = \"4k\"",
       "field 'max_model_len': expected an integer"},
      {"path = \"../models/demo\"", "path = \"../models/demo\"\nreasoning_parser = \"r1\"",
       "[model]: field 'reasoning_parser': 'r1' is not a reasoning parser (expected qwen3 or deepseek_r1)"},
      {"name = \"lab\"", "name = \"lab", "invalid TOML"},
      {"metrics_address = \"10.0.0.4:7190\"", "metrics_address = \"10.0.0.4\"",
       "node 'w1': field 'metrics_address': expected host:port with a port in 1..65535, got '10.0.0.4'"},
      {"metrics_address = \"10.0.0.4:7190\"", "metrics_address = \"10.0.0.4:0\"",
       "node 'w1': field 'metrics_address': expected host:port with a port in 1..65535, got '10.0.0.4:0'"},
      {"metrics_address = \"10.0.0.4:7190\"", "metrics_address = 7190", "'metrics_address': expected a string"},
      {"metrics_address = \"10.0.0.4:7190\"", "metrics_address = \"10.0.0.1:7100\"",
       "node 'w1': field 'metrics_address': '10.0.0.1:7100' is also node 'main' address"},
      // The HTTP API's address: main only, host:port, not another node's address.
      {"metrics_address = \"10.0.0.4:7190\"", "http_address = \"10.0.0.4:8000\"",
       "node 'w1': field 'http_address': only the main node serves the HTTP API"},
      {"address = \"10.0.0.1:7100\"", "address = \"10.0.0.1:7100\"\nhttp_address = \"10.0.0.1\"",
       "node 'main': field 'http_address': expected host:port"},
      {"address = \"10.0.0.1:7100\"", "address = \"10.0.0.1:7100\"\nhttp_address = \"10.0.0.4:7190\"",
       "node 'main': field 'http_address': '10.0.0.4:7190' is also node 'w1' metrics_address"},
      // Browser origins (CORS): with an HTTP API, as a browser sends them, "*" alone.
      {"address = \"10.0.0.1:7100\"", "address = \"10.0.0.1:7100\"\nhttp_allowed_origins = \"*\"",
       "node 'main': field 'http_allowed_origins': needs http_address"},
      {"address = \"10.0.0.1:7100\"",
       "address = \"10.0.0.1:7100\"\nhttp_address = \"10.0.0.1:8000\"\nhttp_allowed_origins = []",
       "node 'main': field 'http_allowed_origins': expected at least one origin"},
      {"address = \"10.0.0.1:7100\"",
       "address = \"10.0.0.1:7100\"\nhttp_address = \"10.0.0.1:8000\"\nhttp_allowed_origins = \"https://a.example/\"",
       "field 'http_allowed_origins': 'https://a.example/' is not an origin"},
      {"address = \"10.0.0.1:7100\"",
       "address = \"10.0.0.1:7100\"\nhttp_address = \"10.0.0.1:8000\"\nhttp_allowed_origins = \"a.example\"",
       "field 'http_allowed_origins': 'a.example' is not an origin"},
      {"address = \"10.0.0.1:7100\"",
       "address = \"10.0.0.1:7100\"\nhttp_address = \"10.0.0.1:8000\"\nhttp_allowed_origins = [\"*\", \"http://a\"]",
       "field 'http_allowed_origins': \"*\" (any origin) must be listed alone"},
      {"address = \"10.0.0.1:7100\"",
       "address = \"10.0.0.1:7100\"\nhttp_address = \"10.0.0.1:8000\"\nhttp_allowed_origins = [\"http://a\", "
       "\"http://a\"]",
       "field 'http_allowed_origins': 'http://a' is given twice"},
      {"metrics_address = \"10.0.0.4:7190\"", "http_allowed_origins = 3",
       "node 'w1': field 'http_allowed_origins': expected a string or a list of strings"},
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

// vLLM's --served-model-name: one name or a list of them; none given, none set. And its --max-model-len.
TEST(ClusterConfigTest, ServedModelNames) {
  auto plain = ParseClusterConfig(kGood, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->model.served_names.empty());
  for (const auto& [line, want] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"served_model_name = \"mixtral\"", {"mixtral"}},
           {"served_model_name = [\"mixtral\", \"Mixtral-8x7B-v0.1\"]", {"mixtral", "Mixtral-8x7B-v0.1"}}}) {
    std::string text = kGood;
    const std::string path = "path = \"../models/demo\"";
    text.replace(text.find(path), path.size(), path + "\n" + line);
    auto c = ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->model.served_names, want) << line;
  }
  EXPECT_EQ(plain->model.max_model_len, 0);  // the model's max_position_embeddings
  std::string text = kGood;
  text.replace(text.find("path = \"../models/demo\""), 23, "path = \"../models/demo\"\nmax_model_len = 4096");
  auto capped = ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(capped->model.max_model_len, 4096);
  EXPECT_EQ(plain->model.reasoning_parser, ReasoningParser::kNone);
  for (const auto& [name, parser] : std::vector<std::pair<std::string, ReasoningParser>>{
           {"qwen3", ReasoningParser::kQwen3}, {"deepseek_r1", ReasoningParser::kDeepSeekR1}}) {
    text = kGood;
    text.replace(text.find("path = \"../models/demo\""), 23,
                 "path = \"../models/demo\"\nreasoning_parser = \"" + name + "\"");
    auto parsed = ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->model.reasoning_parser, parser) << name;
  }
}

TEST(ClusterConfigTest, ShadowSectionAndOverrides) {
  // Defaults: a shadow node means shadow prediction, INT8, alignment every step.
  auto c = ParseClusterConfig(kGood, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->shadow_settings.mode, PredictionMode::kShadow);
  EXPECT_EQ(c->shadow_settings.quant, ShadowQuant::kInt8);
  EXPECT_EQ(c->shadow_settings.align_token, 1);
  EXPECT_EQ(c->shadow_settings.align_kv, 1);
  EXPECT_EQ(c->shadow_settings.catch_up_lag, 0);
  EXPECT_EQ(c->shadow_settings.finish_wait_ms, 2000);
  const std::string with = std::string(kGood) +
                           "\n[shadow]\nmode = \"shadow\"\nquant = \"nf4\"\nalign_token = 4\nalign_kv = 0\n"
                           "max_lead_tokens = 2\ncatch_up_lag = 8\nfinish_wait_ms = 0\n";
  c = ParseClusterConfig(with, "lab.toml", "/");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->shadow_settings.quant, ShadowQuant::kNf4);
  EXPECT_EQ(c->shadow_settings.align_token, 4);
  EXPECT_EQ(c->shadow_settings.align_kv, 0);
  EXPECT_EQ(c->shadow_settings.max_lead_tokens, 2);
  EXPECT_EQ(c->shadow_settings.catch_up_lag, 8);
  EXPECT_EQ(c->shadow_settings.finish_wait_ms, 0);
  for (const auto& [body, field] : std::vector<std::pair<std::string, std::string>>{
           {"quant = \"int4\"", "'quant'"},
           {"align_kv = -1", "'align_kv'"},
           {"max_lead_tokens = 0", "'max_lead_tokens'"},
           {"catch_up_lag = -1", "'catch_up_lag'"},
           {"finish_wait_ms = -5", "'finish_wait_ms'"},
           {"mode = \"oracle\"", "'mode'"},
           {"period = 2", "'period'"}}) {
    auto bad = ParseClusterConfig(std::string(kGood) + "\n[shadow]\n" + body + "\n", "lab.toml", "/");
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_NE(bad.status().message().find(field), absl::string_view::npos) << bad.status();
    EXPECT_NE(bad.status().message().find("lab.toml: [shadow]"), absl::string_view::npos) << bad.status();
  }

  // The ablation cases and the command-line overrides (`odmoe cluster up --ablation-case ...`).
  ShadowSettings s;
  ASSERT_TRUE(ApplyAblationCase(3, &s).ok());
  EXPECT_EQ(s.mode, PredictionMode::kShadow);
  EXPECT_EQ(s.align_token, 0);
  EXPECT_EQ(s.align_kv, 1);
  ASSERT_TRUE(ApplyAblationCase(4, &s).ok());
  EXPECT_EQ(s.align_token + s.align_kv, 0);
  ASSERT_TRUE(ApplyAblationCase(1, &s).ok());
  EXPECT_EQ(s.align_token, 1);
  EXPECT_EQ(s.align_kv, 1);
  ASSERT_TRUE(ApplyAblationCase(5, &s).ok());
  EXPECT_EQ(s.mode, PredictionMode::kRandom);
  ASSERT_TRUE(ApplyAblationCase(6, &s).ok());
  EXPECT_EQ(s.mode, PredictionMode::kNone);
  EXPECT_EQ(ApplyAblationCase(7, &s).code(), absl::StatusCode::kInvalidArgument);

  ShadowSettings o;
  ASSERT_TRUE(ApplyShadowOverrides({"2", std::nullopt, "fp16", "8", std::nullopt, std::nullopt}, true, &o).ok());
  EXPECT_EQ(o.mode, PredictionMode::kShadow);
  EXPECT_EQ(o.quant, ShadowQuant::kFp16);
  EXPECT_EQ(o.align_token, 8);
  EXPECT_EQ(o.align_kv, 0);
  absl::Status bad = ApplyShadowOverrides({std::nullopt, std::nullopt, std::nullopt, "x", std::nullopt, std::nullopt},
                                          true, &o);
  EXPECT_NE(bad.message().find("--align-token"), absl::string_view::npos) << bad;
  bad = ApplyShadowOverrides({"1", std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt}, false, &o);
  EXPECT_NE(bad.message().find("shadow"), absl::string_view::npos) << bad;
  EXPECT_TRUE(
      ApplyShadowOverrides({"6", std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt}, false, &o).ok());
}

TEST(ClusterConfigTest, ShadowPrecisionAndHedgeMargin) {
  auto c = ParseClusterConfig(kGood, "lab.toml", "/");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->shadow_settings.keep_router);
  EXPECT_FALSE(c->shadow_settings.keep_attention);
  EXPECT_EQ(c->shadow_settings.hedge_margin, 0.0);  // off
  EXPECT_FALSE(c->shadow_settings.early_departure);  // the paper's late departure
  c = ParseClusterConfig(std::string(kGood) + "\n[shadow]\nkeep_router = true\nkeep_attention = true\n"
                         "hedge_margin = 0.05\nearly_departure = true\n", "lab.toml", "/");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->shadow_settings.early_departure);
  EXPECT_TRUE(c->shadow_settings.keep_router);
  EXPECT_TRUE(c->shadow_settings.keep_attention);
  EXPECT_DOUBLE_EQ(c->shadow_settings.hedge_margin, 0.05);
  c = ParseClusterConfig(std::string(kGood) + "\n[shadow]\nhedge_margin = 0\n", "lab.toml", "/");  // an integer
  ASSERT_TRUE(c.ok()) << c.status();
  for (const auto& [body, field] : std::vector<std::pair<std::string, std::string>>{
           {"keep_router = 1", "'keep_router'"},
           {"keep_attention = \"yes\"", "'keep_attention'"},
           {"early_departure = 1", "'early_departure'"},
           {"hedge_margin = -0.1", "'hedge_margin'"},
           {"hedge_margin = 1.5", "'hedge_margin'"},
           {"hedge_margin = \"0.1\"", "'hedge_margin'"}}) {
    auto bad = ParseClusterConfig(std::string(kGood) + "\n[shadow]\n" + body + "\n", "lab.toml", "/");
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_NE(bad.status().message().find(field), absl::string_view::npos) << bad.status();
    EXPECT_NE(bad.status().message().find("lab.toml: [shadow]"), absl::string_view::npos) << bad.status();
  }

  // `odmoe cluster up --keep-router B --keep-attention B --hedge-margin T`; an ablation case keeps them.
  ShadowSettings o;
  ShadowOverrides flags;
  flags.keep_router = "true";
  flags.keep_attention = "false";
  flags.hedge_margin = "0.01";
  ASSERT_TRUE(ApplyShadowOverrides(flags, true, &o).ok());
  EXPECT_TRUE(o.keep_router);
  EXPECT_FALSE(o.keep_attention);
  EXPECT_DOUBLE_EQ(o.hedge_margin, 0.01);
  ASSERT_TRUE(ApplyAblationCase(2, &o).ok());
  EXPECT_TRUE(o.keep_router);
  EXPECT_DOUBLE_EQ(o.hedge_margin, 0.01);
  for (const auto& [flag, text] : std::vector<std::pair<std::string, std::string>>{
           {"--keep-router", "1"}, {"--keep-attention", "True"}, {"--hedge-margin", "-1"},
           {"--hedge-margin", "2"}, {"--hedge-margin", "0.1x"}, {"--hedge-margin", ""}}) {
    ShadowOverrides b;
    if (flag == "--keep-router") b.keep_router = text;
    if (flag == "--keep-attention") b.keep_attention = text;
    if (flag == "--hedge-margin") b.hedge_margin = text;
    const absl::Status bad = ApplyShadowOverrides(b, true, &o);
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << flag << " " << text;
    EXPECT_NE(bad.message().find(flag), absl::string_view::npos) << bad;
    EXPECT_NE(bad.message().find(StrCat("'", text, "'")), absl::string_view::npos) << bad;
  }
}

TEST(ClusterConfigTest, SyntheticModelAndHostSharing) {
  auto c = ParseClusterConfig(kGood, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->model.is_synthetic());
  EXPECT_TRUE(c->share_host_experts);  // the default
  std::string text = kGood;
  const std::string path_line = "path = \"../models/demo\"\n";
  text.replace(text.find(path_line), path_line.size(), "synthetic = \"models/tiny.json\"\nlayers = 2\nseed = 5\n");
  text.replace(text.find("rpc_timeout_ms"), 0, "share_host_experts = false\n");
  c = ParseClusterConfig(text, "lab.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->model.is_synthetic());
  EXPECT_EQ(c->model.synthetic, "/etc/odmoe/models/tiny.json");  // relative to the file
  EXPECT_EQ(c->model.path, "");
  EXPECT_EQ(c->model.layers, 2);
  EXPECT_EQ(c->model.seed, 5u);
  EXPECT_FALSE(c->share_host_experts);

  struct Bad {
    const char* model;
    const char* field;
  };
  for (const Bad& b : {Bad{"path = \"a\"\nsynthetic = \"b.json\"", "synthetic"}, Bad{"path = \"a\"\nseed = 1", "seed"},
                       Bad{"synthetic = \"b.json\"\nlayers = -1", "layers"},
                       Bad{"synthetic = \"b.json\"\nseed = \"x\"", "seed"}, Bad{"synthetic = \"\"", "synthetic"}}) {
    std::string bad = kGood;
    bad.replace(bad.find(path_line), path_line.size(), std::string(b.model) + "\n");
    auto r = ParseClusterConfig(bad, "lab.toml", "/");
    ASSERT_FALSE(r.ok()) << b.model;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(b.field), std::string::npos) << r.status();
  }
  std::string bad = kGood;
  bad.replace(bad.find("rpc_timeout_ms"), 0, "share_host_experts = 1\n");
  auto r = ParseClusterConfig(bad, "lab.toml", "/");
  EXPECT_NE(r.status().message().find("share_host_experts"), std::string::npos) << r.status();
}

TEST(ClusterConfigTest, PrefillMiniBatchRows) {
  auto c = ParseClusterConfig(kGood, "lab.toml", "/");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->prefill_minibatch_rows, 32);  // the default
  for (const int64_t rows : {0, 7}) {
    std::string text = kGood;
    text.replace(text.find("rpc_timeout_ms"), 0, StrCat("prefill_minibatch_rows = ", rows, "\n"));
    c = ParseClusterConfig(text, "lab.toml", "/");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->prefill_minibatch_rows, rows);
  }
  for (const char* bad_value : {"-1", "\"8\"", "2000000"}) {
    std::string text = kGood;
    text.replace(text.find("rpc_timeout_ms"), 0, StrCat("prefill_minibatch_rows = ", bad_value, "\n"));
    auto r = ParseClusterConfig(text, "lab.toml", "/");
    ASSERT_FALSE(r.ok()) << bad_value;
    EXPECT_NE(r.status().message().find("lab.toml"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("prefill_minibatch_rows"), std::string::npos) << r.status();
  }
}

TEST(ClusterConfigTest, MaxRunningAndMaxQueued) {
  auto c = ParseClusterConfig(kGood, "lab.toml", "/");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_running, 8);  // the defaults
  EXPECT_EQ(c->max_queued, 32);
  for (const int32_t running : {1, 16, 256}) {
    std::string text = kGood;
    text.replace(text.find("rpc_timeout_ms"), 0, StrCat("max_running = ", running, "\nmax_queued = 0\n"));
    c = ParseClusterConfig(text, "lab.toml", "/");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->max_running, running);
    EXPECT_EQ(c->max_queued, 0);
  }
  for (const char* bad_value : {"0", "-1", "257", "\"8\"", "2.5"}) {
    std::string text = kGood;
    text.replace(text.find("rpc_timeout_ms"), 0, StrCat("max_running = ", bad_value, "\n"));
    auto r = ParseClusterConfig(text, "lab.toml", "/");
    ASSERT_FALSE(r.ok()) << bad_value;
    EXPECT_NE(r.status().message().find("lab.toml: [cluster]: field 'max_running'"), std::string::npos) << r.status();
  }
  std::string text = kGood;
  text.replace(text.find("rpc_timeout_ms"), 0, "max_running = 0\n");
  EXPECT_EQ(ParseClusterConfig(text, "lab.toml", "/").status().message(),
            "lab.toml: [cluster]: field 'max_running': must be 1..256");
  text = kGood;
  text.replace(text.find("rpc_timeout_ms"), 0, "max_queued = 4097\n");
  EXPECT_EQ(ParseClusterConfig(text, "lab.toml", "/").status().message(),
            "lab.toml: [cluster]: field 'max_queued': must be 0..4096");
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
