// The security flags of the client commands (`odmoe generate --endpoint`, `odmoe cluster up|down|status`):
// --tls-ca FILE, --tls-cert FILE, --tls-key FILE (mutual TLS, src/rpc/security.h), --token-file FILE (the
// client token, src/rpc/client_token.h) and --tls-server-name NAME (the name main's certificate carries, when
// it is not the endpoint's host; `generate` only).
#pragma once

#include "absl/status/status.h"
#include "src/common/cluster_config.h"
#include "src/common/flags.h"

namespace odmoe::cli {

inline constexpr const char* kSecurityFlags[] = {"tls-ca", "tls-cert", "tls-key", "token-file", "tls-server-name"};

// Installs the process's credentials (rpc::InstallProcessSecurity) from the flags. With a `cluster` file, what
// the flags leave out comes from the file: [tls] ca with its main node's cert and key (the commands run where
// the cluster runs, or give --tls-cert/--tls-key of a certificate the cluster's CA signed), [auth] token_file;
// its nodes' names are checked at their addresses. `endpoint` (optional) is the address --tls-server-name
// applies to. Errors name the flag or file.
absl::Status InstallClientSecurity(const Flags& f, const ClusterConfig* cluster, const std::string& endpoint = "");

}  // namespace odmoe::cli
