// The shadow node (odmoe-shadow). Eventually it runs a quantized replica ahead of main and predicts each layer's
// experts (Scaled Emulative Prediction). For now it only serves: health (grpc.health.v1, from the server), its
// device's memory and request count (GetStats; no request is ever run, so 0) and the cluster membership. It
// opens the model's checkpoint for the fingerprint only (metadata; no tensor is read) and loads no weights.
//
// Thread safety: the handlers may be called concurrently; the object is immutable after Create apart from the
// device's own (thread-safe) memory accounting.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "odmoe/v1/shadow.grpc.pb.h"
#include "src/backend/device.h"
#include "src/common/cluster_config.h"
#include "src/rpc/daemon.h"

namespace odmoe {

class ShadowNode final : public v1::Shadow::Service {
 public:
  // Opens the checkpoint (for the fingerprint) and the device named by the node's `device` spec.
  static absl::StatusOr<std::unique_ptr<ShadowNode>> Create(const rpc::DaemonArgs& args);

  grpc::Status GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                        v1::ShadowStats* response) override;
  grpc::Status GetMembership(grpc::ServerContext* context, const v1::MembershipRequest* request,
                             v1::Membership* response) override;

  const std::string& fingerprint() const { return fingerprint_; }

 private:
  ShadowNode() = default;
  ClusterConfig cluster_;
  NodeConfig self_;
  std::string fingerprint_;
  std::unique_ptr<Device> device_;
};

}  // namespace odmoe
