#include "src/rpc/peer_version.h"

#include <cctype>
#include <map>
#include <utility>

#include "grpcpp/server_context.h"
#include "spdlog/spdlog.h"
#include "src/common/strings.h"
#include "src/common/version.h"

namespace odmoe::rpc {

bool PeerVersions::ShouldWarn(std::string_view peer, std::string_view version) {
  if (version.empty() || version == own_) return false;
  absl::MutexLock lock(&mu_);
  if (reported_.size() >= kMaxPeers) return false;
  const bool inserted = reported_.emplace(std::string(peer), std::string(version)).second;
  if (inserted && reported_.size() == kMaxPeers) {
    spdlog::warn("{} peers with another build version reported; no more such warnings", kMaxPeers);
  }
  return inserted;
}

PeerVersions& ProcessPeerVersions() {
  static PeerVersions* const versions = new PeerVersions(std::string(BuildVersion()));
  return *versions;
}

std::string ClusterIdentity(uint64_t epoch, std::string_view fingerprint) {
  return StrCat("epoch ", epoch, ", model ", fingerprint);
}

std::string ReceivedMetadata(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, std::string_view key) {
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  return it == metadata.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

std::string PeerHost(std::string_view grpc_peer) {
  const size_t colon = grpc_peer.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == grpc_peer.size()) return std::string(grpc_peer);
  for (size_t i = colon + 1; i < grpc_peer.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(grpc_peer[i]))) return std::string(grpc_peer);
  }
  // "ipv4:1.2.3.4:port", "ipv6:[::1]:port": the part before the port.
  std::string_view host = grpc_peer.substr(0, colon);
  return host.find(':') == std::string_view::npos ? std::string(grpc_peer) : std::string(host);
}

namespace {

using grpc::experimental::InterceptionHookPoints;

// Reads the version in received metadata (nullptr: none received) and warns once per peer and version.
void CheckPeerVersion(const std::multimap<grpc::string_ref, grpc::string_ref>* metadata, const std::string& peer) {
  if (metadata == nullptr) return;
  auto it = metadata->find(kVersionMetadataKey);
  if (it == metadata->end()) return;
  const std::string_view version(it->second.data(), it->second.size());
  PeerVersions& versions = ProcessPeerVersions();
  if (versions.ShouldWarn(peer, version)) {
    spdlog::warn("peer {} runs odmoe {}, this node runs {}: run the same build on every node", peer, version,
                 versions.own());
  }
}

class ClientVersionInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ClientVersionInterceptor(std::string target) : target_(std::move(target)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kVersionMetadataKey, std::string(BuildVersion()));
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      CheckPeerVersion(methods->GetRecvInitialMetadata(), target_);
    }
    methods->Proceed();
  }

 private:
  const std::string target_;
};

class ClientVersionFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit ClientVersionFactory(std::string target) : target_(std::move(target)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new ClientVersionInterceptor(target_);
  }

 private:
  const std::string target_;
};

class ServerVersionInterceptor final : public grpc::experimental::Interceptor {
 public:
  ServerVersionInterceptor(grpc::experimental::ServerRpcInfo* info, std::string cluster)
      : info_(info), cluster_(std::move(cluster)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      CheckPeerVersion(methods->GetRecvInitialMetadata(), PeerHost(info_->server_context()->peer()));
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kVersionMetadataKey, std::string(BuildVersion()));
      if (!cluster_.empty()) methods->GetSendInitialMetadata()->emplace(kClusterMetadataKey, cluster_);
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const std::string cluster_;
};

class ServerVersionFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ServerVersionFactory(std::string cluster) : cluster_(std::move(cluster)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new ServerVersionInterceptor(info, cluster_);
  }

 private:
  const std::string cluster_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> MakeVersionClientInterceptorFactory(
    std::string target) {
  return std::make_unique<ClientVersionFactory>(std::move(target));
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeVersionServerInterceptorFactory(
    std::string cluster) {
  return std::make_unique<ServerVersionFactory>(std::move(cluster));
}

}  // namespace odmoe::rpc
