// The one reading of a node's listening address ("host:port") that every server, the cluster file's check and the
// worker's host comparison share, so that they never disagree on what an address means.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace odmoe {

struct HostPort {
  std::string host;  // without the brackets of an IPv6 literal; empty for ":port" (every interface)
  int port = 0;      // 0..65535; 0 asks the system for a free port
};

// Splits "host:port", "[v6 literal]:port" or ":port" at its last ':'. InvalidArgument, naming `address`, when there
// is no ':' or the port is not a decimal number in 0..65535 ("host:", "host:http", "host:70000", "host:-1").
absl::StatusOr<HostPort> ParseHostPort(std::string_view address);

// "host:port", with an IPv6 literal in brackets: what ParseHostPort reads back.
std::string JoinHostPort(std::string_view host, int port);

}  // namespace odmoe
