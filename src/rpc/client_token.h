// The bearer token of a cluster's clients ([auth] token_file in the cluster file): a client sends the header
// `authorization: Bearer TOKEN` (gRPC metadata, or the HTTP header of the same name) and a node admits the call
// when TOKEN equals the file's. The comparison takes the same time whatever the given value, and neither the
// token nor the given value ever appears in a message or a log line.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace odmoe::rpc {

// The header (gRPC metadata key, lower case) that carries the token.
inline constexpr char kAuthorizationKey[] = "authorization";

// Reads a token file: its content without the trailing newline or spaces. NotFound / PermissionDenied naming
// the file when it cannot be read; InvalidArgument naming it when the token is empty or holds whitespace or
// control characters (it must fit in one header value).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Admits a raw Authorization header value against the one expected token.
// Thread safety: immutable after construction; Check may be called from any thread.
class TokenGuard {
 public:
  // REQUIRES: `token` is non-empty (ReadTokenFile's result).
  explicit TokenGuard(std::string token);
  static absl::StatusOr<TokenGuard> FromFile(const std::string& path);

  // `authorization`: the header's value as received ("Bearer TOKEN"), or nullptr when the request has none.
  // OK when it is "Bearer " (scheme case-insensitive) followed by exactly the token; else Unauthenticated
  // ("missing bearer token" / "wrong bearer token"), whose message holds neither token.
  absl::Status Check(const std::string_view* authorization) const;
  absl::Status Check(std::string_view authorization) const { return Check(&authorization); }

  // The header value a client sends: "Bearer TOKEN".
  std::string HeaderValue() const;

 private:
  std::string token_;
};

// True when `a` equals `b`, in a time that depends only on b's length (b: the secret).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace odmoe::rpc
