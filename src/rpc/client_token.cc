#include "src/rpc/client_token.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe::rpc {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string why = StrCat("token file ", path, ": ", std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(why) : absl::NotFoundError(why);
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string token = text.str();
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) token.pop_back();
  if (token.empty()) return absl::InvalidArgumentError(StrCat("token file ", path, ": empty"));
  for (unsigned char c : token) {
    if (c <= ' ' || c == 0x7f) {
      return absl::InvalidArgumentError(
          StrCat("token file ", path, ": the token holds whitespace or a control character (one line expected)"));
    }
  }
  return token;
}

TokenGuard::TokenGuard(std::string token) : token_(std::move(token)) { ODMOE_CHECK(!token_.empty()); }

absl::StatusOr<TokenGuard> TokenGuard::FromFile(const std::string& path) {
  absl::StatusOr<std::string> token = ReadTokenFile(path);
  if (!token.ok()) return token.status();
  return TokenGuard(*std::move(token));
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Every byte of `b` is visited whatever `a` holds; differences are OR-ed together, never branched on.
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < b.size(); ++i) {
    const unsigned char given = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    diff = static_cast<unsigned char>(diff | (given ^ static_cast<unsigned char>(b[i])));
  }
  return diff == 0;
}

absl::Status TokenGuard::Check(const std::string_view* authorization) const {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization == nullptr || authorization->empty()) {
    return absl::UnauthenticatedError("missing bearer token (send the header 'authorization: Bearer TOKEN')");
  }
  std::string_view value = *authorization;
  bool scheme = value.size() >= kScheme.size();
  for (size_t i = 0; scheme && i < kScheme.size(); ++i) {
    scheme = (value[i] | 0x20) == kScheme[i];  // ' ' | 0x20 == ' '
  }
  if (!scheme) return absl::UnauthenticatedError("the authorization header is not 'Bearer TOKEN'");
  value.remove_prefix(kScheme.size());
  while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  if (!ConstantTimeEquals(value, token_)) return absl::UnauthenticatedError("wrong bearer token");
  return absl::OkStatus();
}

std::string TokenGuard::HeaderValue() const { return StrCat("Bearer ", token_); }

}  // namespace odmoe::rpc
