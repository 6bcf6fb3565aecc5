// The request id that follows one client request across the cluster's logs. Main takes the client's
// `x-request-id` gRPC metadata or makes one, answers with it (response metadata `x-request-id`), and sends it as
// `x-request-id` metadata on every RPC it makes for the request (workers, shadow); the shadow passes it on to
// the workers with its predictions. Every daemon puts it on its log lines about the request
// (logging::ScopedRequestId).
//
// Distinct from RequestHeader.request_id, main's internal counter that workers use for residency.
#pragma once

#include <deque>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace odmoe::rpc {

inline constexpr char kRequestIdKey[] = "x-request-id";
// The longest id main accepts from a client.
inline constexpr size_t kMaxRequestIdLength = 128;

// A fresh id: 16 lowercase hex characters (64 random bits).
std::string NewRequestId();

// OK when `id` may serve as a request id: 1 to kMaxRequestIdLength characters of [A-Za-z0-9._:-] (UUIDs and
// the ids proxies make pass; nothing that could break a log line). InvalidArgument naming the metadata key and
// the problem otherwise.
absl::Status ValidateRequestId(std::string_view id);

// The `x-request-id` metadata the client sent; "" when it sent none or (for a peer's id) an invalid one.
std::string RequestIdOf(const grpc::ServerContext& context);

// Main's id for a client call: the client's valid `x-request-id`, a new one when it sent none, InvalidArgument
// for an invalid one.
absl::StatusOr<std::string> TakeOrMakeRequestId(const grpc::ServerContext& context);

// Sends `id` as `x-request-id` metadata with the call of `context` (nothing when `id` is empty). Every client
// context made for a request's RPC goes through this, before the call starts.
void AttachRequestId(grpc::ClientContext& context, std::string_view id);

// The last `capacity` request ids seen, so that a node logs one info line for the first call of each request
// it serves and debug lines for the rest. Thread-safe.
class RecentRequestIds {
 public:
  explicit RecentRequestIds(size_t capacity = 64) : capacity_(capacity) {}
  // True when `id` is not among the recent ids (it is then added, evicting the oldest); false for "".
  bool Insert(const std::string& id);

 private:
  const size_t capacity_;
  absl::Mutex mu_;
  std::deque<std::string> ids_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace odmoe::rpc
