// Status helpers shared by every odmoe module.
//
// Errors cross module boundaries as absl::Status / absl::StatusOr. A command-line program turns the final
// Status into one stderr line and a process exit code chosen by the Status code (ExitCodeFor), so scripts and
// tests can tell a missing file from a corrupt checkpoint or an unsupported model without parsing text.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "src/common/strings.h"

namespace odmoe {

// Process exit codes. Kept stable: scripts and tests depend on them (README lists them).
enum ExitCode : int {
  kExitOk = 0,
  kExitInternal = 1,        // a bug or an unexpected failure
  kExitUsage = 2,           // bad command line: unknown flag, missing or malformed value
  kExitNotFound = 3,        // a file, tensor or node that should exist does not
  kExitCorrupt = 4,         // malformed or truncated input: bad JSON, bad safetensors header, bad offsets
  kExitInvalidModel = 5,    // well-formed but inconsistent: wrong tensor shape, bad config value
  kExitUnsupported = 6,     // valid but not implemented: architecture, dtype, rope scaling, ...
  kExitOutOfRange = 7,      // request outside the model's limits: token id, prompt length
  kExitResources = 8,       // memory budget or device capacity exceeded
  kExitUnavailable = 9,     // a peer could not be reached or timed out
  kExitBusy = 10,           // the server is busy: its queue is full (retry later)
};

// Maps a Status code to the exit code above:
//   InvalidArgument -> kExitUsage, NotFound -> kExitNotFound, DataLoss -> kExitCorrupt,
//   FailedPrecondition -> kExitInvalidModel, Unimplemented -> kExitUnsupported, OutOfRange -> kExitOutOfRange,
//   ResourceExhausted -> kExitResources (kExitBusy when marked busy), Unavailable / DeadlineExceeded ->
//   kExitUnavailable, else kExitInternal.
int ExitCodeFor(const absl::Status& status);

// ResourceExhausted marked as "the server is busy" (a payload: main's admission queue is full), as opposed to a
// memory budget exceeded; the mark crosses gRPC in the status details (rpc::ToGrpc / rpc::FromGrpc).
absl::Status ServerBusyError(std::string_view message);
bool IsServerBusy(const absl::Status& status);

// The request field an error is about ("min_tokens", "sampling.logit_bias", ...: the path of the field in
// GenerateRequest), as a payload, so that an API can name the field in its own words (the HTTP API's `param`)
// without reading the message. Local to the process: it does not cross gRPC.
absl::Status WithField(absl::Status status, std::string_view field);
// The field WithField named, or "" when none.
std::string FieldOf(const absl::Status& status);
// An error of `code` whose message is `field` followed by `rest` (StrCat), naming `field` (WithField).
template <typename... Rest>
absl::Status RequestFieldError(absl::StatusCode code, std::string_view field, const Rest&... rest) {
  return WithField(absl::Status(code, StrCat(field, rest...)), field);
}

// Error constructors used across the loader so that each kind of failure maps to one exit code.
absl::Status CorruptError(std::string_view msg);       // DataLoss
absl::Status InvalidModelError(std::string_view msg);  // FailedPrecondition

}  // namespace odmoe

#define ODMOE_STATUS_CONCAT_INNER_(a, b) a##b
#define ODMOE_STATUS_CONCAT_(a, b) ODMOE_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define ODMOE_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::absl::Status odmoe_status_ = (expr);           \
    if (!odmoe_status_.ok()) return odmoe_status_;   \
  } while (0)

// `lhs = value of expr` (a StatusOr), or returns its error from the enclosing function.
#define ODMOE_ASSIGN_OR_RETURN(lhs, expr) \
  ODMOE_ASSIGN_OR_RETURN_IMPL_(ODMOE_STATUS_CONCAT_(odmoe_statusor_, __LINE__), lhs, expr)
#define ODMOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

// Programming errors (broken invariants) abort with a message; bad input never reaches a CHECK.
#define ODMOE_CHECK(cond)                                                                  \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);        \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

#define ODMOE_CHECK_OK(expr)                                                                       \
  do {                                                                                             \
    ::absl::Status odmoe_check_status_ = (expr);                                                   \
    if (!odmoe_check_status_.ok()) {                                                               \
      std::fprintf(stderr, "%s:%d: CHECK_OK failed: %s\n", __FILE__, __LINE__,                     \
                   odmoe_check_status_.ToString().c_str());                                        \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)
