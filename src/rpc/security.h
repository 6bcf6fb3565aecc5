// How a node talks securely: the credentials of every channel and server (mutual TLS between the nodes of a
// cluster file with [tls]) and the admission of each call (the client token of [auth], cluster membership).
//
// With [tls], every node presents its certificate (signed by the cluster's CA, its SAN naming the node) and
// checks its peer's: a channel to a node's address accepts only the certificate of the node the cluster file
// puts at that address (gRPC's target name override = the node's name), and a server accepts only callers
// whose certificate the CA signed. Plaintext, another CA, an expired certificate or the certificate of another
// node fail the TLS handshake (UNAVAILABLE at the caller). main also takes clients that present no certificate
// (the client API; they are admitted by the token); shadow and worker ports take only CA-signed callers.
// The internal RPCs (ComputeExperts, Prefetch, Follow, GetMembership) additionally require a caller whose
// certificate names a cluster member of a role allowed to make that call (PERMISSION_DENIED otherwise).
//
// With [auth] token_file, every call but grpc.health must carry `authorization: Bearer TOKEN`
// (UNAUTHENTICATED otherwise): clients send it, and nodes send it on their own calls too. Without [tls] the
// token is then the only thing that tells a member from a stranger, so internal RPCs also require it; it
// crosses the network in clear: use [tls] wherever the network is not trusted.
//
// One Security per process, installed at start-up (daemons: ParseDaemonArgs; the CLI: from its flags) before
// any channel or server exists; rpc::MakeChannel and rpc::Server::Start read it. Tests may pass one explicitly.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/client_interceptor.h"
#include "src/common/cluster_config.h"
#include "src/rpc/client_token.h"

namespace odmoe::rpc {

// Who may make a call (the argument of Security::Admit).
enum class Access {
  kClient,  // the client API and stats: the token when one is configured
  kMember,  // node-to-node calls: with TLS a member certificate of an allowed role; without, the token
};

// File names, as the cluster file or the command line gives them (absolute or relative to the working folder).
struct SecurityFiles {
  std::string ca;          // PEM CA certificate; empty: plaintext
  std::string cert;        // PEM certificate this process presents (with `ca`; optional for a client of main)
  std::string key;         // its PEM private key
  std::string token_file;  // empty: no token
};

// Thread safety: immutable after Load; every method may be called from any thread.
class Security {
 public:
  // Plaintext, no token: what a process without [tls] and [auth] uses.
  static std::shared_ptr<const Security> Insecure();

  // Reads the files. `members`: the cluster's nodes (name -> role); `node_at_address`: the node each address
  // belongs to, whose name a peer's certificate at that address must carry. `require_client_cert`: a server
  // refuses callers without a certificate (shadow, worker) or only verifies one when given (main).
  // NotFound / InvalidArgument naming the file or flag: unreadable or malformed PEM, a cert without a key.
  static absl::StatusOr<std::shared_ptr<const Security>> Load(const SecurityFiles& files,
                                                              std::map<std::string, NodeRole> members,
                                                              std::map<std::string, std::string> node_at_address,
                                                              bool require_client_cert);
  // A daemon's: the cluster file's [tls] ca, `self`'s cert and key, [auth] token_file.
  static absl::StatusOr<std::shared_ptr<const Security>> ForNode(const ClusterConfig& cluster, const NodeConfig& self);
  // A client's (the CLI): `files` as the flags give them; `cluster` (optional) names the nodes and addresses.
  static absl::StatusOr<std::shared_ptr<const Security>> ForClient(const SecurityFiles& files,
                                                                   const ClusterConfig* cluster);

  bool tls() const { return !ca_pem_.empty(); }
  bool has_token() const { return token_ != nullptr; }

  // --- channels ---
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;
  // Sets the name the server's certificate must carry when dialled at `address`: the cluster's node at that
  // address, else the host of `address` (standard host name verification).
  void ConfigureChannel(const std::string& address, grpc::ChannelArguments* args) const;
  // Adds the client interceptors: the token on every call when one is configured.
  void AddClientInterceptors(
      std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>* interceptors) const;

  // --- servers ---
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // OK when the call may proceed; UNAUTHENTICATED without the right token; PERMISSION_DENIED for a kMember
  // call over TLS whose caller's certificate names no member of a role in `roles` (empty: any member).
  // Never names the token.
  grpc::Status Admit(const grpc::ServerContext& context, Access access, std::set<NodeRole> roles = {}) const;
  // The client token's check for other transports (main's HTTP API): OK when no token is configured, else
  // TokenGuard::Check of the raw Authorization value (nullptr: none sent).
  absl::Status CheckToken(const std::string_view* authorization) const;
  // The cluster members the caller's certificate names (empty: plaintext, no certificate, or none a member).
  std::vector<std::string> CallerMembers(const grpc::ServerContext& context) const;

 private:
  Security() = default;
  std::string ca_pem_, cert_pem_, key_pem_;
  std::shared_ptr<const TokenGuard> token_;
  std::map<std::string, NodeRole> members_;
  std::map<std::string, std::string> node_at_address_;
  bool require_client_cert_ = true;
};

// The process's Security (Insecure() until installed). Install once, before any channel or server is made;
// calls made later keep the one they started with.
void InstallProcessSecurity(std::shared_ptr<const Security> security);
std::shared_ptr<const Security> ProcessSecurity();

// The checks every handler opens with: ProcessSecurity()->Admit(...).
grpc::Status AdmitClient(const grpc::ServerContext* context);
grpc::Status AdmitMember(const grpc::ServerContext* context, std::set<NodeRole> roles = {});

}  // namespace odmoe::rpc
