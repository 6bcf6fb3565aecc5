// What every odmoe daemon and client shares about gRPC: message size limits, deadlines, channels, servers
// with the standard health service, the one place where absl::Status and grpc::Status convert, the request
// header check (membership epoch + model fingerprint), and checked conversion of tensors to and from protos.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "odmoe/v1/common.pb.h"
#include "src/backend/device.h"
#include "src/common/placement.h"
#include "src/rpc/security.h"

namespace odmoe::rpc {

// Largest message a node sends or accepts, both ends. Senders keep payloads well below it by chunking
// (prefill hidden states go in batches of rows; see kMaxTensorBytesPerCall).
inline constexpr int kMaxMessageBytes = 64 << 20;
// Largest tensor payload one call carries; larger transfers are split into several calls.
inline constexpr int64_t kMaxTensorBytesPerCall = 16 << 20;

// The one conversion between absl and gRPC statuses (same code numbering); a busy refusal (ServerBusyError)
// keeps its mark through the status details.
grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status, std::string_view what);

static_assert(kMaxTensorBytesPerCall + (1 << 20) <= kMaxMessageBytes,
              "a call's largest tensor payload, plus its header and framing, must fit one message");
// What a message whose payload takes `payload_bytes` can still carry (emulation's padding, PayloadScale), with
// 1 MiB kept for its other fields and framing.
inline size_t RoomAfter(size_t payload_bytes) {
  constexpr size_t kUsable = kMaxMessageBytes - (1 << 20);
  return payload_bytes < kUsable ? kUsable - payload_bytes : 0;
}

// Keepalive between nodes. Clients ping every connection every kKeepaliveTimeMs, with or without calls, and drop
// it when a ping is not answered within kKeepaliveTimeoutMs (its calls fail UNAVAILABLE at once instead of
// waiting out their deadlines). Servers accept pings down to kMinPingIntervalMs apart: gRPC's default (5 minutes
// without calls) would answer the clients' pings with GOAWAY "too_many_pings" and close the connection.
inline constexpr int kKeepaliveTimeMs = 5000;
inline constexpr int kKeepaliveTimeoutMs = 2000;
inline constexpr int kMinPingIntervalMs = 1000;
static_assert(kMinPingIntervalMs < kKeepaliveTimeMs, "servers must accept the clients' ping rate");

// The one place where the arguments of a channel between nodes are decided: message size limits, quick
// reconnects, keepalive (above).
grpc::ChannelArguments ChannelArgs();
// The server side of the same agreement: message size limits, the pings servers accept, and keepalive pings from
// the server to detect vanished clients.
void ApplyServerArgs(grpc::ServerBuilder& builder);

// A channel to `address` with ChannelArgs(). Every call on it carries this build's version
// (src/rpc/peer_version.h). Channels to one address with the same arguments share one connection (gRPC's global
// subchannel pool), so a second channel costs no second TCP connection. Its credentials come from `security`
// (src/rpc/security.h), by default the process's.
//
// Callback calls (stub->async()): a gRPC callback must never drop the last reference to a channel (a stub holds
// one, and a ClientContext holds its call's). gRPC 1.51 runs every callback on one shared completion queue, used
// by each channel that made callback calls and each server with callback services (the health service). When
// its last user goes from one of the queue's own threads, gRPC frees the queue twice (AddressSanitizer:
// double-free in grpc_cq_internal_unref). So a callback only borrows its call's state, and whoever owns the
// channel frees that state on its own thread, or while it still holds the channel.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const Security& security);
// Sets a deadline `timeout_ms` from now on `ctx`.
void SetDeadline(grpc::ClientContext& ctx, int64_t timeout_ms);
// Sets the earlier of `timeout_ms` from now and `request_deadline` (the client's deadline for the whole
// request that this call serves; absl::InfiniteFuture() for none). Returns whether `request_deadline` is the
// earlier: the call's DEADLINE_EXCEEDED then says that the client's time ran out, not that the peer is slow.
bool SetDeadline(grpc::ClientContext& ctx, int64_t timeout_ms, absl::Time request_deadline);
// The deadline a server's client gave its call (absl::InfiniteFuture() when it gave none).
absl::Time RequestDeadline(const grpc::ServerContext& ctx);

// The grpc.health.v1 services of every daemon: liveness (the empty name: the process serves) and readiness
// ("odmoe.ready": a shadow or worker has loaded its weights and listens; main also reaches an owner of every
// sparse layer, src/main_node/readiness.h).
inline constexpr char kLivenessService[] = "";
inline constexpr char kReadinessService[] = "odmoe.ready";

struct ServerOptions {
  std::string address;  // host:port
  int threads = 2;      // bound on the RPC threads (ten daemons share two cores in CI)
  std::string node;     // the node's name, for errors ("node 'w0' cannot listen on ...")
  std::shared_ptr<const Security> security;  // its credentials (src/rpc/security.h); null: the process's
  // Calls that may block a thread each besides those (main: the running requests and the queue, so that the
  // admission queue, not gRPC's thread quota, turns requests away).
  int blocking_calls = 0;
  // What the node serves (rpc::ClusterIdentity: the cluster file's epoch and the model fingerprint), sent with
  // every answer (src/rpc/peer_version.h) so that main's health checks tell a node of another cluster from a
  // member. Empty: none sent (tools, tests of one node).
  std::string cluster;
};
// A started server: the given services plus grpc.health.v1, both services NOT_SERVING until marked. It listens
// exclusively (SO_REUSEPORT off): a second daemon on a taken address fails to start instead of sharing it.
// Every call it answers carries this build's version (and options.cluster), and a caller's differing version is
// logged once.
// Thread safety: MarkLive/MarkReady/MarkServing may be called from any thread, also during or after Shutdown
// (then they do nothing); Shutdown and Wait from the owner's thread.
class Server {
 public:
  // Unavailable naming options.node and options.address, with the reason (e.g. "Address already in use"),
  // when the address cannot be listened on.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options,
                                                       const std::vector<grpc::Service*>& services);
  ~Server();
  void MarkLive(bool serving);
  void MarkReady(bool serving);
  // Both liveness and readiness.
  void MarkServing(bool serving);
  // Marks both NOT_SERVING for good, then stops: in-flight calls get `grace_ms` to finish.
  void Shutdown(int64_t grace_ms = 1000);
  void Wait();
  int port() const { return port_; }
  const std::string& address() const { return address_; }
  const std::string& node() const { return node_; }

 private:
  Server() = default;
  void SetStatus(const char* service, bool serving);
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::string node_;
  absl::Mutex health_mu_;
  grpc::HealthCheckServiceInterface* health_ ABSL_GUARDED_BY(health_mu_) = nullptr;  // server_'s; null once stopped
};

// Asks `address` over grpc.health.v1 whether `service` is serving. OK(true) SERVING, OK(false) answering but
// not serving (yet) or not knowing the service, Unavailable / DeadlineExceeded when nothing answers within
// `timeout_ms`.
absl::StatusOr<bool> CheckServing(const std::string& address, int64_t timeout_ms,
                                  const std::string& service = kLivenessService);

// A node's health as `odmoe cluster status` shows it.
struct NodeHealth {
  bool live = false;
  bool ready = false;
  std::string version;  // the node's build version from its answer; empty when it sent none
  std::string cluster;  // the cluster it serves (rpc::ClusterIdentity) from its answer; empty when it sent none
};
// Liveness, readiness and build version of the node at `address`. Unavailable / DeadlineExceeded when nothing
// answers within `timeout_ms`.
absl::StatusOr<NodeHealth> CheckHealth(const std::string& address, int64_t timeout_ms);

// `device`'s memory as a node reports it: `capacity` (its budget, or the device's capacity), what it has
// allocated now and at most since the last reset, and what the process holds beyond that (context_bytes).
void FillDeviceMemory(const Device& device, uint64_t capacity, v1::DeviceMemory* out);

// Checks a request header against this node's cluster-file epoch and fingerprint: FailedPrecondition naming
// both values when they differ.
absl::Status CheckHeader(const v1::RequestHeader& header, uint64_t epoch, const std::string& fingerprint);
// `membership` (optional): main's view of which workers take work, for the receiver's EpochGate and placement.
void FillHeader(v1::RequestHeader* header, uint64_t epoch, const std::string& fingerprint, const std::string& sender,
                uint64_t request_id = 0, const MembershipView* membership = nullptr);

// The one conversion of a membership view to and from the wire.
void ToProto(const MembershipView& view, v1::MembershipView* out);
MembershipView FromProto(const v1::MembershipView& view);

// The newest membership epoch a node has seen in the headers it got. A message of an older epoch is refused
// (FailedPrecondition), so that nothing placed under a membership main has replaced (a shadow's prefetch sent
// before it heard of the change) takes effect; epochs only go forward. A header without a view (epoch 0: a tool
// outside the live membership) passes and changes nothing.
//
// Thread safety: Admit and newest may be called concurrently.
class EpochGate {
 public:
  absl::Status Admit(const v1::RequestHeader& header);
  uint64_t newest() const { return newest_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> newest_{0};
};

// Encodes an F32 tensor.
void EncodeF32(std::span<const float> values, std::span<const int64_t> shape, v1::Tensor* out);
// Decodes an F32 tensor of rank `shape.size()` whose dims equal `shape` (a dim of -1 matches any positive
// size). InvalidArgument naming `what` for a wrong dtype, rank, dim or byte count, or an empty tensor.
// Returns the values and fills the actual dims into `dims` when given.
absl::StatusOr<std::vector<float>> DecodeF32(const v1::Tensor& tensor, std::span<const int64_t> shape,
                                             std::string_view what, std::vector<int64_t>* dims = nullptr);

}  // namespace odmoe::rpc
