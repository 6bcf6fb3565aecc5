// Routes what the libraries under odmoe log (libprotobuf's GOOGLE_LOG, gRPC's gpr_log) into the default spdlog
// logger, so that every line a daemon writes has its format (src/common/logging.h) and its request id.
#pragma once

namespace odmoe::rpc {

// Installs the handlers. Call once in main(), after logging::Setup and before any gRPC or protobuf object is
// used. gRPC keeps its own threshold (GRPC_VERBOSITY, default ERROR); spdlog's level applies on top.
void RouteLibraryLogsToSpdlog();

}  // namespace odmoe::rpc
