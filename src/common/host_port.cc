#include "src/common/host_port.h"

#include "absl/status/status.h"
#include "src/common/strings.h"

namespace odmoe {

absl::StatusOr<HostPort> ParseHostPort(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) {
    return absl::InvalidArgumentError(StrCat("expected host:port, got '", address, "'"));
  }
  const std::string_view port = address.substr(colon + 1);
  HostPort out;
  bool digits = !port.empty() && port.size() <= 5;
  for (size_t i = 0; digits && i < port.size(); ++i) {
    digits = port[i] >= '0' && port[i] <= '9';
    out.port = out.port * 10 + (port[i] - '0');
  }
  if (!digits || out.port > 65535) {
    return absl::InvalidArgumentError(StrCat("port must be a number 0..65535, got '", port, "' in '", address, "'"));
  }
  std::string_view host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  out.host = std::string(host);
  return out;
}

std::string JoinHostPort(std::string_view host, int port) {
  return host.find(':') == std::string_view::npos ? StrCat(host, ":", port) : StrCat("[", host, "]:", port);
}

}  // namespace odmoe
