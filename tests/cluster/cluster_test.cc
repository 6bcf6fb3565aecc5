// The whole cluster as real processes on loopback (main + shadow + 8 workers on the mock GPU), started with
// `odmoe cluster up` as users do: for every shared model, tokens, routing and logits through the cluster are
// identical to the single-process engine, the goldens pass through it, the workers' compute counters add up
// to k x sparse layers x positions, and main never opened an expert tensor.
#include <signal.h>

#include <fstream>
#include <numeric>
#include <regex>

#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/cluster/client.h"
#include "src/common/json.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "tests/engine/golden_support.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using odmoe::testing::MetricSum;
using odmoe::testing::ProgramPath;
using odmoe::testing::RunProgram;
using odmoe::testing::RunResult;

// A cluster file with free loopback ports; `cluster up` on construction, `cluster down` on destruction.
// `secure`: mutual TLS between the nodes and a client token (certificates by scripts/make-certs.sh in the
// cluster's temp folder: ca.crt, NODE.crt/.key; the token in `token`).
class LocalCluster {
 public:
  LocalCluster(const std::string& model_dir, int workers, int group_size, bool secure = false) {
    const std::vector<int> ports = odmoe::testing::PickFreePorts(workers + 3);
    http_port_ = ports[static_cast<size_t>(workers + 2)];
    std::string toml = StrCat("[cluster]\nname = \"test\"\nepoch = 7\ngroup_size = ", group_size,
                              "\nrpc_timeout_ms = 60000\nstartup_timeout_ms = 120000\n");
    if (secure) {
      std::vector<std::string> make = {"/bin/bash", odmoe::testing::SourceDir() + "/scripts/make-certs.sh", "--out",
                                       dir_.File("tls"), "main", "shadow"};
      for (int w = 0; w < workers; ++w) make.push_back(StrCat("worker", w));
      const RunResult certs = RunProgram(make);
      EXPECT_EQ(certs.exit_code, 0) << certs.err;
      odmoe::testing::WriteFile(dir_.File("token"), "cluster-test-token\n");
      toml += "[tls]\nca = \"tls/ca.crt\"\n[auth]\ntoken_file = \"token\"\n";
    }
    auto node = [&](const std::string& name, const std::string& role, int port, const std::string& extra) {
      toml += StrCat("\n[[node]]\nname = \"", name, "\"\nrole = \"", role, "\"\naddress = \"127.0.0.1:", port,
                     "\"\nthreads = 2\n", extra);
      if (secure) toml += StrCat("cert = \"tls/", name, ".crt\"\nkey = \"tls/", name, ".key\"\n");
    };
    node("main", "main", ports[0],
         StrCat("device = \"cpu\"\nhttp_address = \"127.0.0.1:", http_port_, "\"\nmetrics_address = \"127.0.0.1:",
                http_port_, "\"\n", secure ? "http_allowed_origins = [\"https://app.example.com\"]\n" : ""));
    node("shadow", "shadow", ports[1], "device = \"cpu\"\n");
    for (int w = 0; w < workers; ++w) {
      node(StrCat("worker", w), "worker", ports[static_cast<size_t>(w + 2)],
           "device = \"mock-gpu\"\ngpu_budget_mb = 256\n");
    }
    config_ = dir_.File("cluster.toml");
    odmoe::testing::WriteFile(config_, toml);
    up_ = RunProgram({ProgramPath("odmoe"), "cluster", "up", "--config", config_, "--model", model_dir,
                      "--run-dir", run_dir()});
    std::smatch m;
    static const std::regex kGrpc("(^|\\n)grpc: ([^\\n]+)\\n");
    if (up_.exit_code == 0 && std::regex_search(up_.out, m, kGrpc)) endpoint_ = m[2];
  }
  ~LocalCluster() { Down(); }
  RunResult Down() { return RunProgram({ProgramPath("odmoe"), "cluster", "down", "--config", config_, "--run-dir", run_dir()}); }

  const std::string& endpoint() const { return endpoint_; }
  const RunResult& up() const { return up_; }
  const std::string& config() const { return config_; }
  std::string run_dir() const { return dir_.File("run"); }
  std::string File(const std::string& name) const { return dir_.File(name); }
  int http_port() const { return http_port_; }

 private:
  odmoe::testing::TempDir dir_;
  int http_port_ = 0;
  std::string config_;
  RunResult up_;
  std::string endpoint_;
};

v1::GenerateRequest MakeRequest(const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  v1::GenerateRequest req;
  for (int32_t id : prompt) req.add_prompt_ids(id);
  req.set_max_new_tokens(o.max_new_tokens);
  req.set_ignore_eos(o.ignore_eos);
  req.set_dump_logits(o.keep_last_logits);
  req.set_dump_routing(o.record_routing);
  return req;
}

class ClusterModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ClusterModelTest, IdenticalToTheSingleProcessEngineAndPassesTheGoldens) {
  const std::string name = GetParam();
  const std::string dir = odmoe::testing::SharedModel(name);
  if (!odmoe::testing::HaveSharedModel(name)) GTEST_SKIP() << "needs " << dir;
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const int group = static_cast<int>(config->top_k);  // 8 workers: 4 groups for top-2, 2 for top-4

  LocalCluster cluster(dir, 8, group);
  ASSERT_EQ(cluster.up().exit_code, 0) << cluster.up().err;
  ASSERT_FALSE(cluster.endpoint().empty()) << cluster.up().out;

  auto device = CreateDevice("cpu");
  ASSERT_TRUE(device.ok());
  auto local = LocalModel::Open(dir, std::move(device).value());
  ASSERT_TRUE(local.ok()) << local.status();
  auto golden = odmoe::testing::LoadGolden(dir);
  ASSERT_TRUE(golden.ok()) << golden.status();

  const int64_t sparse = static_cast<int64_t>(config->SparseLayers().size());
  int64_t requests = 0;
  auto remote = [&](const std::vector<int32_t>& prompt,
                    const GenerateOptions& o) -> absl::StatusOr<GenerateResult> {
    auto r = GenerateRemote(cluster.endpoint(), MakeRequest(prompt, o), 120000);
    if (!r.ok()) return r.status();
    ++requests;
    // Identical to the single-process engine: tokens, routing and (bitwise) logits.
    GenerateOptions lo = o;
    lo.record_routing = true;
    lo.keep_last_logits = true;
    auto l = Generate((*local)->engine(), prompt, lo);
    EXPECT_TRUE(l.ok()) << l.status();
    if (l.ok()) {
      EXPECT_EQ(r->tokens, l->tokens);
      if (o.keep_last_logits) {
        EXPECT_EQ(r->last_logits, l->last_logits);
      }
      if (o.record_routing) {
        std::vector<PositionRouting> got(r->routing.begin(), r->routing.end());
        EXPECT_EQ(got, l->routing);
      }
    }
    // Every (position, sparse layer) sent k experts to the workers, and each was computed once.
    const int64_t positions = static_cast<int64_t>(prompt.size() + std::max<size_t>(r->tokens.size(), 1) - 1);
    uint64_t computed = 0;
    for (const auto& w : r->stats.workers()) computed += w.rows_computed();
    EXPECT_EQ(computed, static_cast<uint64_t>(config->top_k * sparse * positions));
    EXPECT_EQ(r->stats.expert_tensors_opened(), 0u) << "main opened an expert tensor";
    GenerateResult g;
    g.tokens = r->tokens;
    g.last_logits = r->last_logits;
    g.routing.assign(r->routing.begin(), r->routing.end());
    g.stop_reason = r->stop_reason;
    return g;
  };
  odmoe::testing::GoldenCounts counts;
  odmoe::testing::CheckGolden(remote, *golden, odmoe::testing::GoldenThresholds::Fp32(), name + " cluster", counts);
  std::cout << "[cluster golden] " << name << ": " << counts.tokens << " greedy tokens, " << counts.routing
            << " routing decisions compared over " << requests << " requests\n";
  EXPECT_GT(counts.tokens, 0);
  EXPECT_GT(counts.routing, 0);

  RunResult status = RunProgram({ProgramPath("odmoe"), "cluster", "status", "--config", cluster.config(),
                                 "--run-dir", cluster.run_dir(), "--json"});
  EXPECT_EQ(status.exit_code, 0) << status.out << status.err;
  // Every node's answers name one cluster: the file's epoch and the model.
  auto sj = ParseJson(status.out, "status");
  ASSERT_TRUE(sj.ok()) << status.out;
  for (const Json& n : (*sj)["nodes"]) {
    ASSERT_TRUE(n["cluster"].is_string()) << n.dump();
    EXPECT_EQ(n["cluster"].get<std::string>().rfind("epoch 7, model ", 0), 0u) << n.dump();
    EXPECT_EQ(n["same_cluster_as_main"], true) << n.dump();
  }
  RunResult down = cluster.Down();
  EXPECT_EQ(down.exit_code, 0) << down.err;
  EXPECT_NE(down.out.find("stopped 10 nodes"), std::string::npos) << down.out;
}

INSTANTIATE_TEST_SUITE_P(SharedModels, ClusterModelTest,
                         ::testing::Values("tiny-mixtral-kjv", "demo-mixtral-kjv", "mixtral-tiny", "qwen2moe-tiny",
                                           "qwen3moe-tiny", "olmoe-tiny"),
                         [](const auto& p) {
                           std::string n = p.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

class ClusterCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!odmoe::testing::HaveSharedModel("tiny-mixtral-kjv")) GTEST_SKIP() << "needs ../shared/models";
  }
};

TEST_F(ClusterCliTest, GenerateThroughTheEndpointPrintsTheSameJsonAsLocally) {
  const std::string dir = odmoe::testing::SharedModel("tiny-mixtral-kjv");
  LocalCluster cluster(dir, 8, 2);
  ASSERT_EQ(cluster.up().exit_code, 0) << cluster.up().err;
  const std::vector<std::string> common = {"--prompt", "In the beginning God created the heaven and the earth.",
                                           "--max-new-tokens", "16", "--dump-routing", "--json"};
  std::vector<std::string> remote_args = {ProgramPath("odmoe"), "generate", "--endpoint", cluster.endpoint()};
  std::vector<std::string> local_args = {ProgramPath("odmoe"), "generate", "--model", dir};
  remote_args.insert(remote_args.end(), common.begin(), common.end());
  local_args.insert(local_args.end(), common.begin(), common.end());
  RunResult rr = RunProgram(remote_args), lr = RunProgram(local_args);
  ASSERT_EQ(rr.exit_code, 0) << rr.err;
  ASSERT_EQ(lr.exit_code, 0) << lr.err;
  auto rj = ParseJson(rr.out, "remote"), lj = ParseJson(lr.out, "local");
  ASSERT_TRUE(rj.ok() && lj.ok());
  for (const char* key : {"prompt_ids", "tokens", "text", "routing", "stop_reason"}) {
    EXPECT_EQ((*rj)[key], (*lj)[key]) << key;
  }
  // The text streamed (main's `text` pieces) is the JSON's text (its `full_text`), the leading space included.
  RunResult streamed = RunProgram({ProgramPath("odmoe"), "generate", "--endpoint", cluster.endpoint(), "--prompt",
                                   common[1], "--max-new-tokens", "16"});
  ASSERT_EQ(streamed.exit_code, 0) << streamed.err;
  EXPECT_EQ(streamed.out, (*rj)["text"].get<std::string>() + "\n");
  const Json& stats = (*rj)["stats"];
  EXPECT_EQ(stats["workers"].size(), 8u);
  EXPECT_GT(stats["bytes_loaded"].get<uint64_t>(), 0u);
  EXPECT_EQ(stats["expert_tensors_opened"].get<uint64_t>(), 0u);
  EXPECT_TRUE((*rj)["timings"].contains("ttft_ms"));
}

// The cluster with mutual TLS between its nodes and a client token: the same tokens as locally; a client
// without the token is refused; `cluster status` finds the credentials in the cluster file.
TEST_F(ClusterCliTest, TlsAndTokenOnGiveTheSameTokens) {
  const std::string dir = odmoe::testing::SharedModel("tiny-mixtral-kjv");
  LocalCluster cluster(dir, 8, 2, /*secure=*/true);
  ASSERT_EQ(cluster.up().exit_code, 0) << cluster.up().err;
  const std::vector<std::string> common = {"--prompt", "And God said, Let there be light", "--max-new-tokens", "12",
                                           "--dump-routing", "--json"};
  std::vector<std::string> remote_args = {ProgramPath("odmoe"), "generate",         "--endpoint",
                                          cluster.endpoint(),   "--tls-ca",         cluster.File("tls/ca.crt"),
                                          "--tls-server-name",  "main",             "--token-file",
                                          cluster.File("token")};
  std::vector<std::string> local_args = {ProgramPath("odmoe"), "generate", "--model", dir};
  remote_args.insert(remote_args.end(), common.begin(), common.end());
  local_args.insert(local_args.end(), common.begin(), common.end());
  RunResult rr = RunProgram(remote_args), lr = RunProgram(local_args);
  ASSERT_EQ(rr.exit_code, 0) << rr.err;
  ASSERT_EQ(lr.exit_code, 0) << lr.err;
  auto rj = ParseJson(rr.out, "remote"), lj = ParseJson(lr.out, "local");
  ASSERT_TRUE(rj.ok() && lj.ok());
  for (const char* key : {"prompt_ids", "tokens", "routing", "stop_reason"}) EXPECT_EQ((*rj)[key], (*lj)[key]) << key;
  // Without the token: UNAUTHENTICATED; without TLS: no connection.
  std::vector<std::string> no_token(remote_args.begin(), remote_args.begin() + 8);
  no_token.insert(no_token.end(), common.begin(), common.end());
  RunResult refused = RunProgram(no_token);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("missing bearer token"), std::string::npos) << refused.err;
  std::vector<std::string> plain = {ProgramPath("odmoe"), "generate", "--endpoint", cluster.endpoint(), "--token-file",
                                    cluster.File("token")};
  plain.insert(plain.end(), common.begin(), common.end());
  EXPECT_NE(RunProgram(plain).exit_code, 0);
  RunResult status = RunProgram({ProgramPath("odmoe"), "cluster", "status", "--config", cluster.config(),
                                 "--run-dir", cluster.run_dir(), "--json"});
  EXPECT_EQ(status.exit_code, 0) << status.out << status.err;

  // The OpenAI HTTP API: HTTPS with main's certificate (whose name is "main"), the same token as a bearer.
  const std::string models = StrCat("https://main:", cluster.http_port(), "/v1/models");
  const std::vector<std::string> curl = {"/usr/bin/curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                                         "--resolve",     StrCat("main:", cluster.http_port(), ":127.0.0.1"),
                                         "--cacert",      cluster.File("tls/ca.crt")};
  auto http_code = [&](std::vector<std::string> extra, const std::string& url) {
    std::vector<std::string> argv = curl;
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.push_back(url);
    return RunProgram(argv).out;
  };
  EXPECT_EQ(http_code({"-H", "Authorization: Bearer cluster-test-token"}, models), "200");
  EXPECT_EQ(http_code({}, models), "401");
  EXPECT_EQ(http_code({"-H", "Authorization: Bearer wrong-token"}, models), "401");
  // A page of the allowed origin may call it from a browser: its preflight needs no token, and the answers (a 401
  // too) let it read them; another origin's preflight is refused, and its answers come without those headers.
  auto headers = [&](std::vector<std::string> extra, const std::string& url) {
    std::vector<std::string> argv = curl;
    argv.erase(argv.begin() + 4, argv.begin() + 6);  // -w %{http_code}: the status line comes with the headers
    argv.insert(argv.end(), {"-D", "-"});
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.push_back(url);
    return RunProgram(argv).out;
  };
  const std::string completions = StrCat("https://main:", cluster.http_port(), "/v1/completions");
  const std::vector<std::string> preflight = {"-X", "OPTIONS",
                                              "-H", "Access-Control-Request-Method: POST",
                                              "-H", "Access-Control-Request-Headers: authorization, content-type"};
  std::vector<std::string> from_app = preflight;
  from_app.insert(from_app.end(), {"-H", "Origin: https://app.example.com"});
  const std::string allowed = headers(from_app, completions);
  EXPECT_NE(allowed.find("HTTP/1.1 204"), std::string::npos) << allowed;
  EXPECT_NE(allowed.find("Access-Control-Allow-Origin: https://app.example.com\r\n"), std::string::npos) << allowed;
  EXPECT_NE(allowed.find("Access-Control-Allow-Methods: GET, POST, OPTIONS\r\n"), std::string::npos) << allowed;
  EXPECT_NE(allowed.find("Access-Control-Allow-Headers: authorization, content-type\r\n"), std::string::npos)
      << allowed;
  std::vector<std::string> from_other = preflight;
  from_other.insert(from_other.end(), {"-H", "Origin: https://other.example.com"});
  const std::string refused_origin = headers(from_other, completions);
  EXPECT_NE(refused_origin.find("HTTP/1.1 403"), std::string::npos) << refused_origin;
  EXPECT_EQ(refused_origin.find("Access-Control-Allow-Origin"), std::string::npos) << refused_origin;
  const std::string listed =
      headers({"-H", "Origin: https://app.example.com", "-H", "Authorization: Bearer cluster-test-token"}, models);
  EXPECT_NE(listed.find("HTTP/1.1 200"), std::string::npos) << listed;
  EXPECT_NE(listed.find("Access-Control-Allow-Origin: https://app.example.com\r\n"), std::string::npos) << listed;
  const std::string unauthorized = headers({"-H", "Origin: https://app.example.com"}, models);
  EXPECT_NE(unauthorized.find("HTTP/1.1 401"), std::string::npos) << unauthorized;
  EXPECT_NE(unauthorized.find("Access-Control-Allow-Origin: https://app.example.com\r\n"), std::string::npos)
      << unauthorized;
  const std::string other =
      headers({"-H", "Origin: https://other.example.com", "-H", "Authorization: Bearer cluster-test-token"}, models);
  EXPECT_NE(other.find("HTTP/1.1 200"), std::string::npos) << other;
  EXPECT_EQ(other.find("Access-Control-Allow-Origin"), std::string::npos) << other;
  EXPECT_EQ(http_code({"-H", "Authorization: Bearer cluster-test-token"},
                      StrCat("https://main:", cluster.http_port(), "/v1/nothing")),
            "404");
  // Each of those answers is counted (main's metrics share the HTTP API's address here): the refusals too.
  std::vector<std::string> scrape = curl;
  scrape.erase(scrape.begin() + 2, scrape.begin() + 6);  // the body, not the code
  scrape.push_back(StrCat("https://main:", cluster.http_port(), "/metrics"));
  const std::string metrics = RunProgram(scrape).out;
  auto answers = [&](const std::string& endpoint, int code) {  // -1 when there is no such sample
    return MetricSum(metrics, "odmoe_http_requests_total",
                     {StrCat("endpoint=\"", endpoint, "\""), StrCat("code=\"", code, "\"")});
  };
  EXPECT_EQ(answers("models", 200), 3) << metrics;
  EXPECT_EQ(answers("models", 401), 3);
  EXPECT_EQ(answers("preflight", 204), 1);
  EXPECT_EQ(answers("preflight", 403), 1);
  EXPECT_EQ(answers("other", 404), 1);
  // Plain HTTP gets no answer from the HTTPS port.
  EXPECT_NE(http_code({"-H", "Authorization: Bearer cluster-test-token"},
                      StrCat("http://127.0.0.1:", cluster.http_port(), "/v1/models")),
            "200");
  // A client that gives up on a whole answer cancels it over TLS too (main watches the connection under it).
  const std::string long_request = R"({"model":"tiny-mixtral-kjv","prompt":"And","max_tokens":2000,"ignore_eos":true})";
  EXPECT_EQ(http_code({"-H", "Authorization: Bearer cluster-test-token", "-H", "Content-Type: application/json",
                       "--max-time", "1", "--data-binary", long_request},
                      StrCat("https://main:", cluster.http_port(), "/v1/completions")),
            "000")
      << "curl gave up after its second";
  std::smatch logs;
  ASSERT_TRUE(std::regex_search(cluster.up().out, logs, std::regex("logs in ([^\\n]+)"))) << cluster.up().out;
  const std::string main_log = StrCat(logs[1].str(), "/main.log");
  EXPECT_TRUE(odmoe::testing::Eventually(
      [&] {
        return odmoe::testing::ReadFile(main_log).find("the client closed the connection; request cancelled") !=
               std::string::npos;
      },
      std::chrono::seconds(10)))
      << odmoe::testing::ReadFile(main_log);
}

TEST_F(ClusterCliTest, AWorkerThatCannotStartStopsTheStartUpCleanly) {
  const std::string dir = odmoe::testing::SharedModel("tiny-mixtral-kjv");
  // A worker whose device cannot be created exits at start-up; the others are stopped again.
  odmoe::testing::TempDir tmp;
  const std::vector<int> ports = odmoe::testing::PickFreePorts(3);
  std::string toml = StrCat("[cluster]\nname = \"bad\"\nstartup_timeout_ms = 60000\n[[node]]\nname = \"main\"\nrole = \"main\"\naddress = \"127.0.0.1:",
                            ports[0], "\"\n[[node]]\nname = \"w0\"\nrole = \"worker\"\naddress = \"127.0.0.1:", ports[1],
                            "\"\ndevice = \"no-such-device\"\n[[node]]\nname = \"w1\"\nrole = \"worker\"\naddress = \"127.0.0.1:",
                            ports[2], "\"\ndevice = \"mock-gpu\"\n");
  odmoe::testing::WriteFile(tmp.File("bad.toml"), toml);
  RunResult up = RunProgram({ProgramPath("odmoe"), "cluster", "up", "--config", tmp.File("bad.toml"), "--model", dir,
                             "--run-dir", tmp.File("run")});
  EXPECT_NE(up.exit_code, 0);
  EXPECT_EQ(up.signal, 0);
  EXPECT_NE(up.err.find("exited during start-up"), std::string::npos) << up.err;
  // Nothing is left running: status reports every node unreachable.
  RunResult status = RunProgram({ProgramPath("odmoe"), "cluster", "status", "--config", tmp.File("bad.toml"),
                                 "--run-dir", tmp.File("run"), "--json"});
  auto j = ParseJson(status.out, "status");
  ASSERT_TRUE(j.ok()) << status.out;
  for (const Json& n : (*j)["nodes"]) EXPECT_EQ(n["health"], "UNREACHABLE") << n.dump();
}

TEST_F(ClusterCliTest, BadClusterFileIsOneLineNamingTheField) {
  odmoe::testing::TempDir tmp;
  odmoe::testing::WriteFile(tmp.File("c.toml"), "[cluster]\nepoch = -1\n[[node]]\nname = \"m\"\nrole = \"main\"\naddress = \"127.0.0.1:1\"\n");
  RunResult up = RunProgram({ProgramPath("odmoe"), "cluster", "up", "--config", tmp.File("c.toml")});
  EXPECT_EQ(up.exit_code, 2) << up.err;
  EXPECT_NE(up.err.find("'epoch'"), std::string::npos) << up.err;
  EXPECT_EQ(std::count(up.err.begin(), up.err.end(), '\n'), 1) << up.err;
}

TEST_F(ClusterCliTest, StatusOfANodeTheFileDoesNotHaveNamesTheNodes) {
  odmoe::testing::TempDir tmp;
  odmoe::testing::WriteFile(tmp.File("c.toml"),
                            "[[node]]\nname = \"m\"\nrole = \"main\"\naddress = \"127.0.0.1:1\"\n"
                            "[[node]]\nname = \"w\"\nrole = \"worker\"\naddress = \"127.0.0.1:2\"\n");
  RunResult status =
      RunProgram({ProgramPath("odmoe"), "cluster", "status", "--config", tmp.File("c.toml"), "--node", "w9"});
  EXPECT_EQ(status.exit_code, 2) << status.err;
  EXPECT_NE(status.err.find("--node: no node 'w9' in " + tmp.File("c.toml") + " (it has m, w)"), std::string::npos)
      << status.err;
  EXPECT_TRUE(status.out.empty()) << status.out;
}

}  // namespace
}  // namespace odmoe
