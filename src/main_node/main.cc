// odmoe-main: the main node daemon. `odmoe-main --config FILE --node NAME [--model DIR]`.
// Comes up without waiting for the workers (channels dial on first use); a request that needs a worker that
// is down (src/main_node/peer_health.h) fails at once with UNAVAILABLE naming it. Live as soon as it serves; ready
// ("odmoe.ready") while every sparse layer has a reachable owner.
#include <string>
#include <vector>

#include "spdlog/spdlog.h"
#include "src/common/status.h"
#include "src/main_node/http_server.h"
#include "src/main_node/main_node.h"
#include "src/main_node/readiness.h"
#include "src/rpc/daemon.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/peer_version.h"
#include "src/rpc/systemd_notify.h"

namespace {

absl::Status Serve(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(odmoe::rpc::DaemonArgs d, odmoe::rpc::ParseDaemonArgs(args, odmoe::NodeRole::kMain));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<odmoe::MainNode> node, odmoe::MainNode::Create(d));
  // The OpenAI-compatible HTTP API (http_address); it also answers /metrics when metrics_address is the same.
  const bool shared_http = !d.self.http_address.empty() && d.self.http_address == d.self.metrics_address;
  std::unique_ptr<odmoe::rpc::MetricsServer> metrics;
  if (!shared_http) {
    ODMOE_ASSIGN_OR_RETURN(metrics, odmoe::rpc::MetricsServer::StartFor(d.self, &node->mutable_metrics()));
    if (metrics != nullptr) spdlog::info("odmoe-main {}: metrics at {}", d.self.name, metrics->url());
  }
  std::unique_ptr<odmoe::HttpServer> http;
  if (!d.self.http_address.empty()) {
    ODMOE_ASSIGN_OR_RETURN(http,
                           odmoe::HttpServer::Start(node.get(), odmoe::HttpServer::OptionsFor(d, &node->metrics()),
                                                    &node->mutable_metrics()));
    spdlog::info("odmoe-main {}: OpenAI API at {}/v1{}", d.self.name, http->url(),
                 shared_http ? " (and /metrics)" : "");
  }
  ODMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<odmoe::rpc::Server> server,
      odmoe::rpc::Server::Start({.address = d.self.address,
                                 .threads = d.self.threads,
                                 .node = d.self.name,
                                 .blocking_calls = d.cluster.max_running + d.cluster.max_queued,
                                 .cluster = odmoe::rpc::ClusterIdentity(d.cluster.epoch, node->fingerprint())},
                                {node.get()}));
  spdlog::info(
      "odmoe-main {} serving {} on port {}: model {} (fingerprint {}, epoch {}), device {}, {} workers, "
      "tokenizer {}",
      d.self.name, d.self.address, server->port(), d.model_dir, node->fingerprint(), d.cluster.epoch, d.self.device,
      d.cluster.workers().size(), node->has_tokenizer() ? "yes" : "no");
  // Readiness follows main's verdict on the workers (src/main_node/readiness.h, peer_health.h); it stops
  // before the server goes.
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<odmoe::ReadinessWatch> readiness,
                         odmoe::ReadinessWatch::ForCluster(
                             d.cluster, node->config(), node->peer_health(), [&server, &node, &http](const auto& v) {
                               node->SetReady(v.ready);  // first: a client that sees SERVING reads odmoe_ready 1
                               if (http != nullptr) http->SetReady(v.ready, v.reason);
                               server->MarkReady(v.ready);
                               odmoe::rpc::systemd::NotifyStatus((v.ready ? "ready: " : "not ready: ") + v.reason);
                             }));
  // The HTTP API stops with the gRPC server: its port closes at the signal and its requests in flight get the
  // same time to finish.
  absl::Time drain_deadline = absl::InfinitePast();
  odmoe::rpc::ServeUntilSignal(*server, odmoe::rpc::Readiness::kReportedByDaemon, d.cluster.shutdown_timeout_ms,
                               [&http, &node, &drain_deadline](absl::Time deadline) {
                                 drain_deadline = deadline;
                                 node->StopAccepting();
                                 if (http != nullptr) http->StopAccepting();
                               });
  if (http != nullptr) http->Shutdown(drain_deadline);
  readiness.reset();
  spdlog::info("odmoe-main {}: shut down", d.self.name);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  odmoe::rpc::BlockShutdownSignals();
  return odmoe::rpc::RunDaemon("odmoe-main", std::vector<std::string>(argv + 1, argv + argc), Serve);
}
