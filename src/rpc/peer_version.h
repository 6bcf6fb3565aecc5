// Build versions and cluster identities between nodes: every call a node makes carries its build version
// (src/common/version.h) as gRPC metadata `odmoe-version`, and every answer carries the answering node's, so that
// a worker upgraded alone is visible. A node logs one warning per peer and version when a peer's differs from
// its own. Every answer of a daemon's server also carries `odmoe-cluster`: which cluster (file epoch and model)
// the node serves, so that main's health checks see a node started from another cluster file or with another
// model (src/main_node/peer_health.h) before any of its calls fails.
//
// Both halves are gRPC interceptors, installed in the one place channels are made (rpc::MakeChannel) and the
// one place servers are built (rpc::Server::Start), so no call site adds the metadata by hand.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpcpp/support/server_interceptor.h"
#include "grpcpp/support/string_ref.h"

namespace odmoe::rpc {

// The metadata key of the sender's build version (requests) and the answering node's (initial metadata of
// every response).
inline constexpr char kVersionMetadataKey[] = "odmoe-version";
// The metadata key of the answering node's cluster identity (initial metadata of every response of a server
// started with one, ServerOptions::cluster). Nodes of builds before it send none.
inline constexpr char kClusterMetadataKey[] = "odmoe-cluster";

// What a node serves, as its answers carry it and as messages about a mismatch show it:
// "epoch 7, model 3fa2c0...": the cluster file's epoch and the model fingerprint, which every request header
// between nodes must match (rpc::CheckHeader).
std::string ClusterIdentity(uint64_t epoch, std::string_view fingerprint);
// The value of `key` in received metadata (e.g. an answer's initial metadata: the version, the cluster identity);
// empty when absent.
std::string ReceivedMetadata(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, std::string_view key);

// Remembers which (peer, version) pairs differing from this node's version have been reported, so that each
// is warned about once. Bounded: beyond kMaxPeers pairs it stops warning (and says so once).
// Thread safety: safe to call from any thread.
class PeerVersions {
 public:
  static constexpr size_t kMaxPeers = 1024;
  explicit PeerVersions(std::string own_version) : own_(std::move(own_version)) {}

  // True the first time `peer` shows `version` when `version` differs from this node's (the caller then warns);
  // false for a matching version, an empty one (a client that sends none, e.g. a generic health prober), or
  // a pair already reported.
  bool ShouldWarn(std::string_view peer, std::string_view version);
  const std::string& own() const { return own_; }

 private:
  const std::string own_;
  absl::Mutex mu_;
  std::set<std::pair<std::string, std::string>> reported_ ABSL_GUARDED_BY(mu_);
};

// This process's registry (own version BuildVersion()), shared by every channel and server of the process.
PeerVersions& ProcessPeerVersions();

// "ipv4:10.0.0.3:53412" -> "ipv4:10.0.0.3": a server sees each connection from a new port; the host names the
// peer node.
std::string PeerHost(std::string_view grpc_peer);

// Client half, for the channel to `target`: sends this build's version with every call and checks the version
// in the answer's initial metadata.
std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> MakeVersionClientInterceptorFactory(
    std::string target);
// Server half: checks the caller's version and sends this build's version with every answer, and `cluster` (a
// ClusterIdentity; empty: none) as kClusterMetadataKey.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeVersionServerInterceptorFactory(
    std::string cluster);

}  // namespace odmoe::rpc
