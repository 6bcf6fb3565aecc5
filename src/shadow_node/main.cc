// odmoe-shadow: the shadow node daemon. `odmoe-shadow --config FILE --node NAME [--model DIR]`.
#include <string>
#include <vector>

#include "spdlog/spdlog.h"
#include "src/common/status.h"
#include "src/rpc/daemon.h"
#include "src/rpc/metrics_server.h"
#include "src/rpc/peer_version.h"
#include "src/shadow_node/shadow_node.h"

namespace {

absl::Status Serve(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(odmoe::rpc::DaemonArgs d, odmoe::rpc::ParseDaemonArgs(args, odmoe::NodeRole::kShadow));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<odmoe::ShadowNode> node, odmoe::ShadowNode::Create(d));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<odmoe::rpc::MetricsServer> metrics,
                         odmoe::rpc::MetricsServer::StartFor(d.self, &node->mutable_metrics()));
  if (metrics != nullptr) spdlog::info("odmoe-shadow {}: metrics at {}", d.self.name, metrics->url());
  // Each request main runs holds a Follow stream, and its handler's thread, for the request's whole life.
  ODMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<odmoe::rpc::Server> server,
      odmoe::rpc::Server::Start({.address = d.self.address,
                                 .threads = d.self.threads,
                                 .node = d.self.name,
                                 .blocking_calls = d.cluster.max_running,
                                 .cluster = odmoe::rpc::ClusterIdentity(d.cluster.epoch, node->fingerprint())},
                                {node.get()}));
  const odmoe::ShadowSettings& s = node->settings();
  spdlog::info(
      "odmoe-shadow {} serving {} on port {}: model {} (fingerprint {}, epoch {}); prediction {}, replica {} "
      "({} bytes), token alignment every {} steps, KV every {} (0: never), lead <= {} positions",
      d.self.name, d.self.address, server->port(), d.model_dir, node->fingerprint(), d.cluster.epoch,
      std::string(odmoe::PredictionModeName(s.mode)),
      node->has_replica() ? std::string(odmoe::ShadowQuantName(s.quant)) : std::string("not loaded"),
      node->replica_bytes(), s.align_token, s.align_kv, s.max_lead_tokens);
  odmoe::rpc::ServeUntilSignal(*server, odmoe::rpc::Readiness::kWhenListening, d.cluster.shutdown_timeout_ms);
  spdlog::info("odmoe-shadow {}: shut down", d.self.name);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  odmoe::rpc::BlockShutdownSignals();
  return odmoe::rpc::RunDaemon("odmoe-shadow", std::vector<std::string>(argv + 1, argv + argc), Serve);
}
