#include "src/shadow_node/shadow_node.h"

#include "src/backend/device_factory.h"
#include "src/common/status.h"
#include "src/model/checkpoint.h"
#include "src/model/fingerprint.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<ShadowNode>> ShadowNode::Create(const rpc::DaemonArgs& args) {
  std::unique_ptr<ShadowNode> node(new ShadowNode());
  node->cluster_ = args.cluster;
  node->self_ = args.self;
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(args.model_dir));
  ODMOE_ASSIGN_OR_RETURN(node->fingerprint_, ModelFingerprint(args.model_dir, *checkpoint));
  ODMOE_ASSIGN_OR_RETURN(node->device_, CreateDevice(args.self.device));
  return node;
}

grpc::Status ShadowNode::GetStats(grpc::ServerContext*, const v1::StatsRequest*, v1::ShadowStats* response) {
  response->set_node(self_.name);
  const MemoryInfo m = device_->memory_info();
  v1::DeviceMemory* mem = response->mutable_memory();
  mem->set_device(device_->name());
  mem->set_capacity_bytes(m.capacity);
  mem->set_in_use_bytes(m.in_use);
  mem->set_peak_bytes(m.peak);
  response->set_requests(0);  // the shadow runs no request yet
  return grpc::Status::OK;
}

grpc::Status ShadowNode::GetMembership(grpc::ServerContext*, const v1::MembershipRequest*, v1::Membership* response) {
  response->set_epoch(cluster_.epoch);
  response->set_model_fingerprint(fingerprint_);
  response->set_self(self_.name);
  for (const NodeConfig& n : cluster_.nodes) {
    v1::NodeInfo* info = response->add_nodes();
    info->set_name(n.name);
    info->set_role(std::string(NodeRoleName(n.role)));
    info->set_address(n.address);
    info->set_device(n.device);
    info->set_gpu_budget_bytes(n.gpu_budget_bytes);
  }
  return grpc::Status::OK;
}

}  // namespace odmoe
