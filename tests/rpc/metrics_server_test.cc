// The metrics endpoint: GET /metrics over HTTP with the Prometheus content type, a taken port refused (no
// SO_REUSEPORT sharing), and the daemons' constant labels.
#include "src/rpc/metrics_server.h"

#include <unistd.h>

#include "gtest/gtest.h"
#include "src/common/strings.h"
#include "tests/test_support.h"

namespace odmoe::rpc {
namespace {

// One HTTP/1.0 request to 127.0.0.1:`port`; the whole response (headers and body).
std::string HttpGet(int port, const std::string& path) {
  const int fd = odmoe::testing::ConnectLoopback(port);
  if (fd < 0) return "";
  const std::string request = StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return "";
  }
  std::string response;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, static_cast<size_t>(n));
  close(fd);
  return response;
}

TEST(MetricsServerTest, ServesTheRegistryAsPrometheusText) {
  metrics::Registry registry(metrics::Labels{{"node", "w0"}});
  registry.AddCounter("odmoe_things_total", "Things.").With({}).Add(3);
  auto server = MetricsServer::Start("w0", "127.0.0.1:0", &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  EXPECT_EQ((*server)->url(), StrCat("http://127.0.0.1:", (*server)->port(), "/metrics"));
  std::string response = HttpGet((*server)->port(), "/metrics");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << response;
  EXPECT_NE(response.find("\r\n\r\n# HELP odmoe_things_total Things.\n# TYPE odmoe_things_total counter\n"
                          "odmoe_things_total{node=\"w0\"} 3\n"),
            std::string::npos)
      << response;
  // Read at every scrape.
  registry.AddCounter("odmoe_more_total", "More.").With({}).Add(1);
  EXPECT_NE(HttpGet((*server)->port(), "/metrics").find("odmoe_more_total{node=\"w0\"} 1\n"), std::string::npos);
  EXPECT_NE(HttpGet((*server)->port(), "/other").find("404"), std::string::npos);
}

// Idle connections (the kept-alive connections of scrapers between scrapes, port checks) hold a thread each for
// the keep-alive timeout (10 s): a scrape is answered beside them, while every one of them is still open.
TEST(MetricsServerTest, IdleConnectionsDoNotKeepAScrapeWaiting) {
  metrics::Registry registry(metrics::Labels{{"node", "w0"}});
  registry.AddCounter("odmoe_things_total", "Things.").With({}).Add(3);
  auto server = MetricsServer::Start("w0", "127.0.0.1:0", &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  odmoe::testing::IdleConnections idle((*server)->port(), 6);
  ASSERT_EQ(idle.connected(), 6u);
  const std::string response = HttpGet((*server)->port(), "/metrics");
  EXPECT_NE(response.find("odmoe_things_total{node=\"w0\"} 3\n"), std::string::npos) << response;
  // The scrape counts the idle connections and itself, taken in the order they came.
  EXPECT_NE(response.find("odmoe_http_connections{node=\"w0\",server=\"metrics\"} 7\n"), std::string::npos) << response;
  EXPECT_NE(response.find("odmoe_http_max_connections{node=\"w0\",server=\"metrics\"} 64\n"), std::string::npos);
  EXPECT_EQ(idle.ClosedByServer(), 0);
}

TEST(MetricsServerTest, APortAlreadyServedIsRefusedNamingTheNodeAndAddress) {
  metrics::Registry registry;
  auto first = MetricsServer::Start("main", "127.0.0.1:0", &registry);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = StrCat("127.0.0.1:", (*first)->port());
  auto second = MetricsServer::Start("w3", address, &registry);
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
  EXPECT_NE(
      second.status().message().find(StrCat("node 'w3': cannot serve metrics at metrics_address '", address, "'")),
      std::string::npos)
      << second.status();
  // The first one still serves.
  EXPECT_NE(HttpGet((*first)->port(), "/metrics").find("200 OK"), std::string::npos);
}

TEST(MetricsServerTest, AnAddressWithoutAPortIsRefusedNamingIt) {
  metrics::Registry registry;
  for (const char* address : {"127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000"}) {
    auto server = MetricsServer::Start("w2", address, &registry);
    ASSERT_FALSE(server.ok()) << address << " served at port " << (*server)->port();
    EXPECT_TRUE(absl::IsInvalidArgument(server.status())) << server.status();
    EXPECT_NE(server.status().message().find("node 'w2': metrics_address: "), std::string::npos) << server.status();
    EXPECT_NE(server.status().message().find(StrCat("'", address, "'")), std::string::npos) << server.status();
  }
}

TEST(MetricsServerTest, NoMetricsAddressNoServer) {
  metrics::Registry registry;
  NodeConfig node;
  node.name = "w1";
  auto server = MetricsServer::StartFor(node, &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(*server, nullptr);
}

TEST(MetricsServerTest, DaemonLabelsNameTheModelFolderAndTheNode) {
  ClusterConfig cluster;
  NodeConfig self;
  self.name = "worker3";
  EXPECT_EQ(DaemonMetricLabels(cluster, self, "/models/Mixtral-8x7B-v0.1/"),
            (metrics::Labels{{"model", "Mixtral-8x7B-v0.1"}, {"node", "worker3"}}));
  cluster.model.synthetic = "/src/configs/models/mixtral-8x7b/config.json";
  EXPECT_EQ(DaemonMetricLabels(cluster, self, ""),
            (metrics::Labels{{"model", "mixtral-8x7b-synthetic"}, {"node", "worker3"}}));
  // The first served name, as main's HTTP API calls the model.
  cluster.model.served_names = {"mixtral", "mx"};
  EXPECT_EQ(DaemonMetricLabels(cluster, self, "/models/Mixtral-8x7B-v0.1/"),
            (metrics::Labels{{"model", "mixtral"}, {"node", "worker3"}}));
}

}  // namespace
}  // namespace odmoe::rpc
