// What every odmoe daemon and client shares about gRPC: message size limits, deadlines, channels, servers
// with the standard health service, the one place where absl::Status and grpc::Status convert, the request
// header check (membership epoch + model fingerprint), and checked conversion of tensors to and from protos.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "odmoe/v1/common.pb.h"
#include "src/backend/device.h"

namespace odmoe::rpc {

// Largest message a node sends or accepts, both ends. Senders keep payloads well below it by chunking
// (prefill hidden states go in batches of rows; see kMaxTensorBytesPerCall).
inline constexpr int kMaxMessageBytes = 64 << 20;
// Largest tensor payload one call carries; larger transfers are split into several calls.
inline constexpr int64_t kMaxTensorBytesPerCall = 16 << 20;

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status, std::string_view what);

// A channel to `address` with odmoe's message size limits.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);
// Sets a deadline `timeout_ms` from now on `ctx`.
void SetDeadline(grpc::ClientContext& ctx, int64_t timeout_ms);

// A started server: the given services plus grpc.health.v1 (NOT_SERVING until MarkServing).
struct ServerOptions {
  std::string address;   // host:port
  int threads = 2;       // bound on the RPC threads (ten daemons share two cores in CI)
};
class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options,
                                                      const std::vector<grpc::Service*>& services);
  ~Server();
  void MarkServing(bool serving);
  void Shutdown(int64_t grace_ms = 1000);
  void Wait();
  int port() const { return port_; }

 private:
  Server() = default;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Asks `address` over grpc.health.v1 whether it is serving. OK(true) SERVING, OK(false) answering but not
// serving (yet), Unavailable / DeadlineExceeded when nothing answers within `timeout_ms`.
absl::StatusOr<bool> CheckServing(const std::string& address, int64_t timeout_ms);

// Checks a request header against this node's epoch and fingerprint: FailedPrecondition naming both values
// when they differ.
// `device`'s memory as a node reports it: `capacity` (its budget, or the device's capacity), what it has
// allocated now and at most since the last reset, and what the process holds beyond that (context_bytes).
void FillDeviceMemory(const Device& device, uint64_t capacity, v1::DeviceMemory* out);

absl::Status CheckHeader(const v1::RequestHeader& header, uint64_t epoch, const std::string& fingerprint);
void FillHeader(v1::RequestHeader* header, uint64_t epoch, const std::string& fingerprint, const std::string& sender,
                uint64_t request_id = 0);

// Encodes an F32 tensor.
void EncodeF32(std::span<const float> values, std::span<const int64_t> shape, v1::Tensor* out);
// Decodes an F32 tensor of rank `shape.size()` whose dims equal `shape` (a dim of -1 matches any positive
// size). InvalidArgument naming `what` for a wrong dtype, rank, dim or byte count, or an empty tensor.
// Returns the values and fills the actual dims into `dims` when given.
absl::StatusOr<std::vector<float>> DecodeF32(const v1::Tensor& tensor, std::span<const int64_t> shape,
                                            std::string_view what, std::vector<int64_t>* dims = nullptr);

}  // namespace odmoe::rpc
