#include "src/rpc/metrics_server.h"

#include <filesystem>

#include "httplib.h"
#include "src/common/host_port.h"
#include "src/common/strings.h"
#include "src/common/version.h"
#include "src/rpc/http_serving.h"

namespace odmoe::rpc {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";
// Connections served at once: scrapers (Prometheus keeps its connection alive between scrapes, an HA pair keeps
// two), `odmoe cluster status`, curl. More wait in the listen backlog.
constexpr size_t kMaxConnections = 64;

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& node, const std::string& address,
                                                                    metrics::Registry* registry) {
  const absl::StatusOr<HostPort> where = ParseHostPort(address);
  if (!where.ok()) {
    return absl::InvalidArgumentError(StrCat("node '", node, "': metrics_address: ", where.status().message()));
  }

  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->http_ = std::make_unique<httplib::Server>();
  httplib::Server& http = *server->http_;
  http.set_keep_alive_timeout(10);
  http.Get("/metrics", [registry](const httplib::Request&, httplib::Response& response) {
    response.set_content(registry->Render(), kContentType);
  });
  const absl::StatusOr<int> port =
      StartHttpServer(http, where->host, where->port, kMaxConnections,
                      HttpConnectionMetrics::In(*registry, "metrics", kMaxConnections), &server->thread_);
  if (!port.ok()) {
    return absl::UnavailableError(StrCat("node '", node, "': cannot serve metrics at metrics_address '", address,
                                         "': ", port.status().message()));
  }
  server->port_ = *port;
  server->url_ = StrCat("http://", JoinHostPort(where->host, *port), "/metrics");
  return server;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::StartFor(const NodeConfig& node,
                                                                       metrics::Registry* registry) {
  if (node.metrics_address.empty()) return std::unique_ptr<MetricsServer>();
  return Start(node.name, node.metrics_address, registry);
}

MetricsServer::~MetricsServer() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

void AddBuildInfo(metrics::Registry& registry) {
  registry.AddGauge("odmoe_build_info", "1, labelled with the build this daemon runs.", {"version"})
      .With({std::string(BuildVersion())})
      .Set(1);
}

metrics::Labels DaemonMetricLabels(const ClusterConfig& cluster, const NodeConfig& self, const std::string& model_dir) {
  namespace fs = std::filesystem;
  auto folder_name = [](fs::path p) {
    p = p.lexically_normal();
    if (!p.has_filename()) p = p.parent_path();  // a trailing slash
    return p.filename().string();
  };
  std::string model;
  if (!cluster.model.served_names.empty()) {
    model = cluster.model.served_names.front();
  } else if (!model_dir.empty()) {
    model = folder_name(model_dir);
  } else if (cluster.model.is_synthetic()) {
    fs::path config(cluster.model.synthetic);
    model = folder_name(config.extension() == ".json" ? config.parent_path() : config) + "-synthetic";
  }
  return {{"model", model.empty() ? "unknown" : model}, {"node", self.name}};
}

void AppendDeviceMemoryFamilies(const MemoryInfo& memory, uint64_t budget_bytes,
                                std::vector<metrics::MetricFamily>* out) {
  using metrics::MetricType;
  out->push_back(metrics::SingleSample("odmoe_gpu_memory_used_bytes", "Device memory the node has allocated now.",
                                       MetricType::kGauge, static_cast<double>(memory.in_use)));
  out->push_back(metrics::SingleSample("odmoe_gpu_memory_peak_bytes",
                                       "Most device memory the node had allocated at once (since start or the last "
                                       "stats reset).",
                                       MetricType::kGauge, static_cast<double>(memory.peak)));
  out->push_back(metrics::SingleSample("odmoe_gpu_memory_budget_bytes",
                                       "The node's device memory budget (a worker's gpu_budget_mb, else the "
                                       "device's capacity; 0: no limit known).",
                                       MetricType::kGauge, static_cast<double>(budget_bytes)));
}

}  // namespace odmoe::rpc
