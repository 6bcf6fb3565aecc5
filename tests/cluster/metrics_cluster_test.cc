// Metrics of a running cluster: `odmoe cluster up` on loopback (main, shadow, two workers, the demo model),
// one request, then every daemon's /metrics scraped and parsed by a real parser (Python's
// prometheus_client.parser, tests/tools/scrape_metrics.py) and checked against the request served. And a
// daemon whose metrics port is taken refuses to start, naming its node and the address.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <regex>

#include "gtest/gtest.h"
#include "src/cluster/client.h"
#include "src/common/json.h"
#include "src/common/strings.h"
#include "src/common/version.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using odmoe::testing::ProgramPath;
using odmoe::testing::RunProgram;
using odmoe::testing::RunResult;

std::string DemoModel() { return odmoe::testing::SourceDir() + "/models/demo-mixtral-kjv"; }

// A cluster file with main, shadow and `workers` workers on free loopback ports, each with a metrics address.
std::string ClusterFile(int workers, std::map<std::string, std::string>* metrics_urls) {
  const std::vector<int> ports = odmoe::testing::PickFreePorts(2 * (workers + 2));
  std::string toml = StrCat(
      "[cluster]\nname = \"metrics-test\"\ngroup_size = 2\nrpc_timeout_ms = 60000\nstartup_timeout_ms = "
      "120000\nprefill_minibatch_rows = 0\n[model]\npath = \"",
      DemoModel(), "\"\n");
  int next = 0;
  auto node = [&](const std::string& name, const std::string& role, const std::string& extra) {
    const int grpc = ports[static_cast<size_t>(next++)], metrics = ports[static_cast<size_t>(next++)];
    toml += StrCat("\n[[node]]\nname = \"", name, "\"\nrole = \"", role, "\"\naddress = \"127.0.0.1:", grpc,
                   "\"\nmetrics_address = \"127.0.0.1:", metrics, "\"\n", extra);
    (*metrics_urls)[name] = StrCat("http://127.0.0.1:", metrics, "/metrics");
  };
  node("main", "main", "device = \"cpu\"\n");
  node("shadow", "shadow", "device = \"cpu\"\n");
  for (int w = 0; w < workers; ++w) node(StrCat("w", w), "worker", "device = \"mock-gpu\"\ngpu_budget_mb = 64\n");
  return toml;
}

// The parsed scrape of one daemon: sample name -> [(labels, value)].
class Scrape {
 public:
  explicit Scrape(const Json& j) : j_(j) {}
  // The value of the sample `name` whose labels include `labels` (summed over the matches); -1 when none.
  double Value(const std::string& name, const std::map<std::string, std::string>& labels = {}) const {
    if (!j_["samples"].contains(name)) return -1;
    double sum = 0;
    bool found = false;
    for (const Json& s : j_["samples"][name]) {
      bool match = true;
      for (const auto& [k, v] : labels) match = match && s["labels"].contains(k) && s["labels"][k] == v;
      if (!match) continue;
      found = true;
      sum += s["value"].get<double>();
    }
    return found ? sum : -1;
  }
  std::string Type(const std::string& family) const {
    return j_["types"].contains(family) ? j_["types"][family].get<std::string>() : "";
  }
  // Every sample carries the constant labels model and node.
  void ExpectConstantLabels(const std::string& node) const {
    for (const auto& [name, samples] : j_["samples"].items()) {
      for (const Json& s : samples) {
        EXPECT_EQ(s["labels"].value("node", ""), node) << name;
        EXPECT_EQ(s["labels"].value("model", ""), "demo-mixtral-kjv") << name;
      }
    }
  }

 private:
  const Json& j_;
};

TEST(MetricsClusterTest, EveryDaemonServesMetricsThatCountTheRequestServed) {
  odmoe::testing::TempDir dir;
  std::map<std::string, std::string> urls;
  const std::string config = dir.File("cluster.toml");
  odmoe::testing::WriteFile(config, ClusterFile(2, &urls));
  const std::string run_dir = dir.File("run");
  const RunResult up = RunProgram({ProgramPath("odmoe"), "cluster", "up", "--config", config, "--run-dir", run_dir});
  struct Down {
    std::vector<std::string> argv;
    ~Down() { RunProgram(argv); }
  } down{{ProgramPath("odmoe"), "cluster", "down", "--config", config, "--run-dir", run_dir}};
  ASSERT_EQ(up.exit_code, 0) << up.err;
  // `cluster up` prints one metrics line per node.
  for (const auto& [node, url] : urls) {
    EXPECT_NE(up.out.find(StrCat("\nmetrics: ", node, " ", url, "\n")), std::string::npos) << up.out;
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_search(up.out, m, std::regex("grpc: ([^\\n]+)\\n"))) << up.out;

  v1::GenerateRequest request;
  const std::vector<int32_t> prompt = {1, 415, 2043, 773, 1725, 3169};
  for (int32_t id : prompt) request.add_prompt_ids(id);
  request.set_max_new_tokens(6);
  request.set_ignore_eos(true);
  auto result = GenerateRemote(m[1], request, 60000);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->tokens.size(), 6u);
  const double alignment_sent = static_cast<double>(result->stats.alignment_bytes());
  ASSERT_GT(alignment_sent, 0);

  std::vector<std::string> argv = {ODMOE_PYTHON3, odmoe::testing::SourceDir() + "/tests/tools/scrape_metrics.py"};
  for (const auto& [node, url] : urls) argv.push_back(url);
  const RunResult scraped = RunProgram(argv);
  ASSERT_EQ(scraped.exit_code, 0) << scraped.err;
  auto parsed = ParseJson(scraped.out, "scrape_metrics.py output");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  for (const auto& [node, url] : urls) {
    const Scrape daemon((*parsed)[url]);
    daemon.ExpectConstantLabels(node);
    EXPECT_EQ(daemon.Type("odmoe_build_info"), "gauge") << node;
    EXPECT_EQ(daemon.Value("odmoe_build_info", {{"version", std::string(BuildVersion())}}), 1) << node;
  }

  const Scrape main((*parsed)[urls["main"]]);
  EXPECT_EQ(main.Type("odmoe_requests_total"), "counter");
  EXPECT_EQ(main.Value("odmoe_requests_total", {{"outcome", "ok"}}), 1);
  EXPECT_EQ(main.Value("odmoe_requests_total", {{"outcome", "error"}}), 0);
  EXPECT_EQ(main.Value("odmoe_ready"), 1);  // `cluster up` waited for odmoe.ready
  EXPECT_EQ(main.Value("odmoe_prompt_tokens_total"), static_cast<double>(prompt.size()));
  EXPECT_EQ(main.Value("odmoe_generation_tokens_total"), 6);
  EXPECT_EQ(main.Type("odmoe_time_to_first_token_seconds"), "histogram");
  EXPECT_EQ(main.Value("odmoe_time_to_first_token_seconds_count"), 1);
  EXPECT_EQ(main.Value("odmoe_time_to_first_token_seconds_bucket", {{"le", "+Inf"}}), 1);
  EXPECT_EQ(main.Value("odmoe_inter_token_latency_seconds_count"), 5);  // between 6 tokens
  EXPECT_EQ(main.Value("odmoe_e2e_request_latency_seconds_count"), 1);
  EXPECT_EQ(main.Value("odmoe_request_queue_time_seconds_count"), 1);
  EXPECT_EQ(main.Value("odmoe_num_requests_running"), 0);
  EXPECT_EQ(main.Value("odmoe_num_requests_waiting"), 0);
  EXPECT_EQ(main.Value("odmoe_alignment_bytes_sent_total"), alignment_sent);
  // Recall counters: k experts per sparse layer and decode step.
  const double decode_layers = static_cast<double>(result->stats.positions() - prompt.size()) * 6;
  EXPECT_EQ(main.Value("odmoe_prediction_experts_needed_total"), 2 * decode_layers);
  EXPECT_LE(main.Value("odmoe_prediction_experts_hit_total"), main.Value("odmoe_prediction_experts_needed_total"));
  // The same counts as the request's stats (main counts them once, for both).
  EXPECT_DOUBLE_EQ(
      main.Value("odmoe_prediction_experts_hit_total") / main.Value("odmoe_prediction_experts_needed_total"),
      result->stats.recall());
  EXPECT_EQ(main.Value("odmoe_on_demand_loads_total"), static_cast<double>(result->stats.decode_loads_on_demand()));
  EXPECT_NEAR(main.Value("odmoe_on_demand_stall_seconds_total"), result->stats.stall_ms() / 1e3, 1e-9);
  EXPECT_EQ(main.Value("odmoe_shadow_lead_layers_count"), static_cast<double>(result->stats.predictions_received()));
  EXPECT_EQ(main.Value("odmoe_worker_reachable", {{"worker", "w0"}}), 1);
  EXPECT_EQ(main.Value("odmoe_worker_reachable", {{"worker", "w1"}}), 1);
  EXPECT_EQ(main.Value("odmoe_shadow_reachable"), 1);

  const Scrape shadow((*parsed)[urls["shadow"]]);
  EXPECT_EQ(shadow.Value("odmoe_shadow_requests_total"), 1);
  EXPECT_GT(shadow.Value("odmoe_shadow_alignment_bytes_received_total"), 0);
  EXPECT_LE(shadow.Value("odmoe_shadow_alignment_bytes_received_total"), alignment_sent);
  EXPECT_GT(shadow.Value("odmoe_shadow_predictions_sent_total"), 0);
  EXPECT_EQ(shadow.Value("odmoe_shadow_prediction_lead_layers_count"),
            shadow.Value("odmoe_shadow_predictions_sent_total"));

  double loads = 0, bytes = 0;
  for (const std::string w : {"w0", "w1"}) {
    const Scrape worker((*parsed)[urls[w]]);
    const double worker_loads = std::max(0.0, worker.Value("odmoe_worker_expert_loads_total"));
    loads += worker_loads;
    bytes += worker.Value("odmoe_worker_expert_bytes_loaded_total");
    EXPECT_EQ(worker.Value("odmoe_gpu_memory_budget_bytes"), 64.0 * (1 << 20)) << w;
    EXPECT_GT(worker.Value("odmoe_gpu_memory_used_bytes"), 0) << w;  // the workspace
    EXPECT_LE(worker.Value("odmoe_gpu_memory_peak_bytes"), 64.0 * (1 << 20)) << w;
    // No expert cache: experts are freed after use (a prediction never used may still be resident).
    EXPECT_GT(worker.Value("odmoe_worker_expert_evictions_total"), 0) << w;
    EXPECT_LE(worker.Value("odmoe_worker_expert_evictions_total"), worker_loads) << w;
    EXPECT_GE(worker.Value("odmoe_worker_resident_experts"), 0) << w;
    EXPECT_GT(worker.Value("odmoe_worker_experts_computed_total"), 0) << w;
    EXPECT_GT(worker.Value("odmoe_worker_expert_compute_seconds_count"), 0) << w;
  }
  EXPECT_GT(loads, 0);
  EXPECT_GT(bytes, 0);
}

// Listens on a free loopback port until destroyed.
class Listener {
 public:
  Listener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 4), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~Listener() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(MetricsClusterTest, ADaemonWhoseMetricsPortIsTakenDoesNotStart) {
  odmoe::testing::TempDir dir;
  std::map<std::string, std::string> urls;
  std::string toml = ClusterFile(2, &urls);
  Listener taken;
  // w0's metrics address becomes the port another process listens on.
  const std::string w0_metrics = urls["w0"].substr(7, urls["w0"].size() - 7 - 8);  // http://HOST:PORT/metrics
  const std::string busy = StrCat("127.0.0.1:", taken.port());
  toml.replace(toml.find(w0_metrics), w0_metrics.size(), busy);
  const std::string config = dir.File("cluster.toml");
  odmoe::testing::WriteFile(config, toml);
  const RunResult r = RunProgram({ProgramPath("odmoe-worker"), "--config", config, "--node", "w0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find(StrCat("node 'w0': cannot serve metrics at metrics_address '", busy, "'")), std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace odmoe
