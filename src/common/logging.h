// The log output every odmoe daemon shares: one spdlog logger per process writing to stderr, in one of two
// formats (`--log-format text|json`), with the request being served on every line about it.
//
//   text: [2026-11-25 11:48:45.123] [odmoe-main] [info] request_id=3f9a0c1d2b4e5f60 finished: ...
//   json: {"time":"2026-11-25T11:48:45.123456Z","level":"info","logger":"odmoe-main","node":"main",
//          "message":"finished: ...","request_id":"3f9a0c1d2b4e5f60"}     (one object per line)
//
// Times are UTC in both formats, so that the logs of several machines sort together. The request id of a line
// is the one in scope on the logging thread (ScopedRequestId), so code logs about a request with plain
// spdlog::info(...) inside that scope.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "spdlog/formatter.h"

namespace odmoe::logging {

enum class LogFormat { kText, kJson };

// "text" or "json"; InvalidArgument naming --log-format otherwise.
absl::StatusOr<LogFormat> ParseLogFormat(std::string_view name);

// The value of `--log-format VALUE` or `--log-format=VALUE` in `args` (kText when absent). Daemons read it
// before their other flags, so that even a usage error is written in the requested format.
absl::StatusOr<LogFormat> LogFormatFromArgs(const std::vector<std::string>& args);

// The formatter of `format` (a spdlog pattern_formatter with odmoe's flags), for a logger or a sink.
std::unique_ptr<spdlog::formatter> MakeFormatter(LogFormat format);

// Makes a stderr logger named `program` (e.g. "odmoe-worker") the default logger, with `format`. Call it once at
// the start of main(), before any other thread logs.
void Setup(const std::string& program, LogFormat format);

// Names the node this process serves (the "node" field of json lines) once the cluster file is read.
void SetNode(const std::string& node);

// Puts `request_id` on every line this thread logs while the object lives (restoring the previous id after:
// scopes nest). An empty id means "no request".
class ScopedRequestId {
 public:
  explicit ScopedRequestId(std::string request_id);
  ~ScopedRequestId();
  ScopedRequestId(const ScopedRequestId&) = delete;
  ScopedRequestId& operator=(const ScopedRequestId&) = delete;

 private:
  std::string previous_;
};

// The request id in scope on this thread ("" when none).
const std::string& CurrentRequestId();

// Appends `text` to `out` as the body of a JSON string (without the quotes): `"` and `\` escaped, control
// characters as \uXXXX, and every byte that is not part of well-formed UTF-8 replaced by U+FFFD, so the line
// stays valid JSON whatever a message holds.
void AppendJsonEscaped(std::string_view text, std::string* out);

}  // namespace odmoe::logging
