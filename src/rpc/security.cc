#include "src/rpc/security.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe::rpc {
namespace {

// The content of a PEM file that must hold a block of `kind` ("CERTIFICATE", "PRIVATE KEY").
absl::StatusOr<std::string> ReadPem(const std::string& path, std::string_view what, std::string_view kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(StrCat(what, " ", path, ": cannot be read"));
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  const size_t begin = pem.find("-----BEGIN ");
  if (begin == std::string::npos || pem.find(StrCat(kind, "-----"), begin) == std::string::npos) {
    return absl::InvalidArgumentError(StrCat(what, " ", path, ": not a PEM file with a ", kind));
  }
  return pem;
}

class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kAuthorizationKey, *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const header_;  // the factory's
};

class TokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string header) : header_(std::move(header)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&header_);
  }

 private:
  const std::string header_;  // "Bearer TOKEN"; outlives the channel's interceptors (the channel owns both)
};

ABSL_CONST_INIT absl::Mutex process_mu(absl::kConstInit);
std::shared_ptr<const Security>& ProcessSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(process_mu) {
  static auto* slot = new std::shared_ptr<const Security>(Security::Insecure());
  return *slot;
}

}  // namespace

std::shared_ptr<const Security> Security::Insecure() {
  static const auto* insecure = new std::shared_ptr<const Security>(new Security());
  return *insecure;
}

absl::StatusOr<std::shared_ptr<const Security>> Security::Load(const SecurityFiles& files,
                                                               std::map<std::string, NodeRole> members,
                                                               std::map<std::string, std::string> node_at_address,
                                                               bool require_client_cert) {
  std::shared_ptr<Security> s(new Security());
  if (files.ca.empty() && (!files.cert.empty() || !files.key.empty())) {
    return absl::InvalidArgumentError("a TLS certificate or key needs the CA file too (--tls-ca / [tls] ca)");
  }
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(
        StrCat("TLS certificate '", files.cert, "' and key '", files.key, "': give both or neither"));
  }
  if (!files.ca.empty()) {
    ODMOE_ASSIGN_OR_RETURN(s->ca_pem_, ReadPem(files.ca, "TLS CA file", "CERTIFICATE"));
  }
  if (!files.cert.empty()) {
    ODMOE_ASSIGN_OR_RETURN(s->cert_pem_, ReadPem(files.cert, "TLS certificate", "CERTIFICATE"));
    ODMOE_ASSIGN_OR_RETURN(s->key_pem_, ReadPem(files.key, "TLS key", "PRIVATE KEY"));
  }
  if (!files.token_file.empty()) {
    ODMOE_ASSIGN_OR_RETURN(TokenGuard guard, TokenGuard::FromFile(files.token_file));
    s->token_ = std::make_shared<const TokenGuard>(std::move(guard));
  }
  s->members_ = std::move(members);
  s->node_at_address_ = std::move(node_at_address);
  s->require_client_cert_ = require_client_cert;
  return std::shared_ptr<const Security>(std::move(s));
}

namespace {
std::map<std::string, NodeRole> MembersOf(const ClusterConfig& cluster) {
  std::map<std::string, NodeRole> members;
  for (const NodeConfig& n : cluster.nodes) members[n.name] = n.role;
  return members;
}
std::map<std::string, std::string> NodesByAddress(const ClusterConfig& cluster) {
  std::map<std::string, std::string> at;
  for (const NodeConfig& n : cluster.nodes) at[n.address] = n.name;
  return at;
}
}  // namespace

absl::StatusOr<std::shared_ptr<const Security>> Security::ForNode(const ClusterConfig& cluster,
                                                                  const NodeConfig& self) {
  const SecurityFiles files{cluster.tls_ca, self.tls_cert, self.tls_key, cluster.token_file};
  absl::StatusOr<std::shared_ptr<const Security>> s =
      Load(files, MembersOf(cluster), NodesByAddress(cluster), self.role != NodeRole::kMain);
  if (!s.ok()) return absl::Status(s.status().code(), StrCat(cluster.file, ": ", s.status().message()));
  return s;
}

absl::StatusOr<std::shared_ptr<const Security>> Security::ForClient(const SecurityFiles& files,
                                                                    const ClusterConfig* cluster) {
  return Load(files, cluster == nullptr ? std::map<std::string, NodeRole>{} : MembersOf(*cluster),
              cluster == nullptr ? std::map<std::string, std::string>{} : NodesByAddress(*cluster), true);
}

std::shared_ptr<grpc::ChannelCredentials> Security::ChannelCredentials() const {
  if (!tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ca_pem_;
  options.pem_private_key = key_pem_;
  options.pem_cert_chain = cert_pem_;
  return grpc::SslCredentials(options);
}

void Security::ConfigureChannel(const std::string& address, grpc::ChannelArguments* args) const {
  if (!tls()) return;
  if (auto it = node_at_address_.find(address); it != node_at_address_.end()) {
    args->SetSslTargetNameOverride(it->second);
  }
}

void Security::AddClientInterceptors(
    std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>* interceptors) const {
  if (token_ != nullptr) interceptors->push_back(std::make_unique<TokenInterceptorFactory>(token_->HeaderValue()));
}

std::shared_ptr<grpc::ServerCredentials> Security::ServerCredentials() const {
  if (!tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(require_client_cert_
                                                ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = ca_pem_;
  options.pem_key_cert_pairs.push_back({key_pem_, cert_pem_});
  return grpc::SslServerCredentials(options);
}

std::vector<std::string> Security::CallerMembers(const grpc::ServerContext& context) const {
  std::vector<std::string> names;
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return names;
  for (const char* property : {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
      std::string name(value.data(), value.size());
      if (members_.count(name) > 0) names.push_back(std::move(name));
    }
  }
  return names;
}

grpc::Status Security::Admit(const grpc::ServerContext& context, Access access, std::set<NodeRole> roles) const {
  if (access == Access::kMember && tls()) {
    for (const std::string& name : CallerMembers(context)) {
      if (roles.empty() || roles.count(members_.at(name)) > 0) return grpc::Status::OK;
    }
    std::string allowed;
    for (NodeRole r : roles) allowed += StrCat(allowed.empty() ? "" : " or ", NodeRoleName(r));
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        StrCat("only a cluster member", allowed.empty() ? "" : StrCat(" (", allowed, ")"),
                               " may make this call; the caller's certificate names none"));
  }
  if (token_ == nullptr) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  std::string_view value;
  const std::string_view* given = nullptr;
  if (auto it = metadata.find(kAuthorizationKey); it != metadata.end()) {
    value = std::string_view(it->second.data(), it->second.size());
    given = &value;
  }
  const absl::Status st = token_->Check(given);
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(st.message()));
}

absl::Status Security::CheckToken(const std::string_view* authorization) const {
  return token_ == nullptr ? absl::OkStatus() : token_->Check(authorization);
}

void InstallProcessSecurity(std::shared_ptr<const Security> security) {
  absl::MutexLock lock(&process_mu);
  ProcessSlot() = std::move(security);
}

std::shared_ptr<const Security> ProcessSecurity() {
  absl::MutexLock lock(&process_mu);
  return ProcessSlot();
}

grpc::Status AdmitClient(const grpc::ServerContext* context) {
  return ProcessSecurity()->Admit(*context, Access::kClient);
}

grpc::Status AdmitMember(const grpc::ServerContext* context, std::set<NodeRole> roles) {
  return ProcessSecurity()->Admit(*context, Access::kMember, std::move(roles));
}

}  // namespace odmoe::rpc
