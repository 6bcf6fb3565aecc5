// The HTTP endpoint every daemon serves its metrics on: GET /metrics at the node's `metrics_address` (the
// cluster file), answering with the node's metrics::Registry in the Prometheus text format (Content-Type
// "text/plain; version=0.0.4"). Built on cpp-httplib (Debian's libcpp-httplib-dev), with a thread per
// connection (rpc::StartHttpServer: up to 64 at once).
//
// The listening socket is bound without SO_REUSEPORT, so a port another process listens on is an error at
// start, not a silently shared port.
//
// Thread safety: the registry is read from the server's threads; it (and whatever its collectors read) must
// outlive the MetricsServer, whose destructor stops the server and joins its threads.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/common/cluster_config.h"
#include "src/common/metrics.h"

namespace httplib {
class Server;
}

namespace odmoe::rpc {

class MetricsServer {
 public:
  // Serves `registry` at `address` (host:port; port 0 picks a free one), counting its connections there
  // (HttpConnectionMetrics, server="metrics"). InvalidArgument when `address` is not host:port; Unavailable,
  // naming `node` and the address, when it cannot be bound (the port is taken, or the host is not this machine's).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& node, const std::string& address,
                                                              metrics::Registry* registry);
  // The node's server when it has a metrics_address, else nullptr (no metrics server).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> StartFor(const NodeConfig& node, metrics::Registry* registry);
  ~MetricsServer();

  int port() const { return port_; }
  // http://HOST:PORT/metrics with the port actually bound.
  const std::string& url() const { return url_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
  std::string url_;
};

// The constant labels of a daemon's metrics: model (the first [model] served_model_name; else the checkpoint
// folder's name, or the synthetic config's folder name followed by "-synthetic") and node (its name in the cluster
// file). Main's HTTP API names the model the same way.
metrics::Labels DaemonMetricLabels(const ClusterConfig& cluster, const NodeConfig& self, const std::string& model_dir);

// odmoe_build_info{version} 1, with the daemon's BuildVersion: every daemon's, so that a dashboard shows a cluster
// running mixed builds (Prometheus' *_build_info convention).
void AddBuildInfo(metrics::Registry& registry);

// The device-memory families every daemon exposes: odmoe_gpu_memory_used_bytes and _peak_bytes (the device's
// allocations now and at most since start or the last reset) and _budget_bytes (`budget_bytes`: a worker's
// GPU budget, else the device's capacity; 0: no limit known).
void AppendDeviceMemoryFamilies(const MemoryInfo& memory, uint64_t budget_bytes,
                                std::vector<metrics::MetricFamily>* out);

}  // namespace odmoe::rpc
