#include "src/cli/client_security.h"

#include <map>
#include <memory>
#include <string>

#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/security.h"

namespace odmoe::cli {

absl::Status InstallClientSecurity(const Flags& f, const ClusterConfig* cluster, const std::string& endpoint) {
  rpc::SecurityFiles files;
  if (cluster != nullptr) {
    files.ca = cluster->tls_ca;
    if (const NodeConfig* main = cluster->main(); main != nullptr && !files.ca.empty()) {
      files.cert = main->tls_cert;
      files.key = main->tls_key;
    }
    files.token_file = cluster->token_file;
  }
  if (auto v = f.Get("tls-ca")) files.ca = *v;
  if (f.Has("tls-cert") || f.Has("tls-key")) {
    files.cert = f.Get("tls-cert").value_or("");
    files.key = f.Get("tls-key").value_or("");
    if (files.cert.empty() || files.key.empty()) {
      return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
    }
  }
  if (auto v = f.Get("token-file")) files.token_file = *v;
  if (files.ca.empty() && (f.Has("tls-cert") || f.Has("tls-server-name"))) {
    return absl::InvalidArgumentError("--tls-cert, --tls-key and --tls-server-name need --tls-ca FILE");
  }
  std::map<std::string, NodeRole> members;
  std::map<std::string, std::string> at;
  if (cluster != nullptr) {
    for (const NodeConfig& n : cluster->nodes) {
      members[n.name] = n.role;
      at[n.address] = n.name;
    }
  }
  if (auto name = f.Get("tls-server-name"); name && !endpoint.empty()) at[endpoint] = *name;
  absl::StatusOr<std::shared_ptr<const rpc::Security>> security =
      rpc::Security::Load(files, std::move(members), std::move(at), true);
  if (!security.ok()) return security.status();
  rpc::InstallProcessSecurity(*std::move(security));
  return absl::OkStatus();
}

}  // namespace odmoe::cli
