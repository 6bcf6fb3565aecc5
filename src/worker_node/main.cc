// odmoe-worker --config FILE --node NAME [--model DIR]: serves routed-expert computation for the cluster file's
// node NAME until SIGINT or SIGTERM. All logic lives in src/worker_node/worker_node.h.
#include <malloc.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "spdlog/spdlog.h"
#include "src/backend/device_factory.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/daemon.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/peer_version.h"
#include "src/worker_node/worker_node.h"

namespace {

absl::Status Run(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(odmoe::rpc::DaemonArgs daemon, odmoe::rpc::ParseDaemonArgs(args, odmoe::NodeRole::kWorker));
  ODMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<odmoe::Device> device,
      odmoe::CreateNodeDevice(daemon.cluster, daemon.self, daemon.model_dir, daemon.self.gpu_budget_bytes));
  if (device->kind() == odmoe::DeviceKind::kMockGpu) {
    // A mock (or timed) GPU's memory is host memory, and the worker allocates an expert's worth with every load
    // and frees it with every eviction. glibc would hand each freed block back to the kernel (trim, unmap) and
    // the next load would fault every page in again: keep up to the GPU budget of freed memory in the process.
    const uint64_t keep = std::max<uint64_t>(daemon.self.gpu_budget_bytes, uint64_t{64} << 20);
    mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: blocks below it come from the heap, reused
    mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<uint64_t>(keep, uint64_t{1} << 30)));
  }
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<odmoe::WorkerNode> node,
                         odmoe::WorkerNode::Create(daemon.cluster, daemon.self, daemon.model_dir, std::move(device)));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<odmoe::rpc::MetricsServer> metrics,
                         odmoe::rpc::MetricsServer::StartFor(daemon.self, &node->mutable_metrics()));
  if (metrics != nullptr) spdlog::info("odmoe-worker {}: metrics at {}", daemon.self.name, metrics->url());
  ODMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<odmoe::rpc::Server> server,
      odmoe::rpc::Server::Start({.address = daemon.self.address,
                                 .threads = daemon.self.threads,
                                 .node = daemon.self.name,
                                 .cluster = odmoe::rpc::ClusterIdentity(node->epoch(), node->fingerprint())},
                                {node.get()}));
  std::string layers;
  for (int64_t l : node->decode_layers()) layers += odmoe::StrCat(layers.empty() ? "" : ",", l);
  spdlog::info(
      "odmoe-worker {} (worker {} of {}) serving {} on port {}: model {} (fingerprint {}, epoch {}), device {}, "
      "GPU budget {} bytes, decode layers [{}], up to {} rows per call",
      daemon.self.name, daemon.self.worker_index, daemon.cluster.workers().size(), daemon.self.address, server->port(),
      daemon.model_dir, node->fingerprint(), node->epoch(), node->device().name(), node->budget_bytes(), layers,
      node->max_rows_per_call());
  odmoe::rpc::ServeUntilSignal(*server, odmoe::rpc::Readiness::kWhenListening, daemon.cluster.shutdown_timeout_ms);
  spdlog::info("odmoe-worker {}: shut down", daemon.self.name);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread exists, so SIGINT/SIGTERM reach ServeUntilSignal only.
  odmoe::rpc::BlockShutdownSignals();
  return odmoe::rpc::RunDaemon("odmoe-worker", std::vector<std::string>(argv + 1, argv + argc), Run);
}
