#include "src/rpc/library_logs.h"

#include <string>

#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "spdlog/spdlog.h"

namespace odmoe::rpc {
namespace {

// Only the file's base name: the build paths of the libraries say nothing to an operator.
const char* BaseName(const char* path) {
  if (path == nullptr) return "?";
  const char* base = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  return base;
}

void FromProtobuf(google::protobuf::LogLevel level, const char* filename, int line, const std::string& message) {
  spdlog::level::level_enum to = spdlog::level::info;
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO:
      to = spdlog::level::info;
      break;
    case google::protobuf::LOGLEVEL_WARNING:
      to = spdlog::level::warn;
      break;
    case google::protobuf::LOGLEVEL_ERROR:
      to = spdlog::level::err;
      break;
    case google::protobuf::LOGLEVEL_FATAL:
      to = spdlog::level::critical;
      break;
  }
  spdlog::log(to, "libprotobuf: {} ({}:{})", message, BaseName(filename), line);
  if (level == google::protobuf::LOGLEVEL_FATAL) spdlog::default_logger()->flush();  // protobuf aborts next
}

void FromGrpc(gpr_log_func_args* args) {
  spdlog::level::level_enum to = spdlog::level::info;
  switch (args->severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      to = spdlog::level::debug;
      break;
    case GPR_LOG_SEVERITY_INFO:
      to = spdlog::level::info;
      break;
    case GPR_LOG_SEVERITY_ERROR:
      to = spdlog::level::err;
      break;
  }
  spdlog::log(to, "grpc: {} ({}:{})", args->message != nullptr ? args->message : "", BaseName(args->file), args->line);
  if (to == spdlog::level::err) spdlog::default_logger()->flush();  // an assertion failure aborts next
}

}  // namespace

void RouteLibraryLogsToSpdlog() {
  google::protobuf::SetLogHandler(&FromProtobuf);
  gpr_set_log_function(&FromGrpc);
}

}  // namespace odmoe::rpc
