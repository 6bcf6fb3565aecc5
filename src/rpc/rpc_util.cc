#include "src/rpc/rpc_util.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "src/common/host_port.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/peer_version.h"

namespace odmoe::rpc {

namespace {
// The status details (grpc-status-details-bin) of a busy refusal (ServerBusyError).
constexpr char kBusyDetails[] = "odmoe:server-busy";

// Takes a reference on gRPC's library that is never given back, so that it stays up from the first server or
// channel to the process's exit (MakeChannel and Server::Start call it). Otherwise the last gRPC object to go
// runs grpc_shutdown, which joins gRPC's executor threads, and one of them may be blocked polling until its next
// timer (seen in tests: a channel's destructor waited 9.5 s there).
void KeepGrpcInitialized() {
  static const bool initialized = [] {
    grpc_init();  // never undone
    return true;
  }();
  (void)initialized;
}
}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()),
                      IsServerBusy(status) ? kBusyDetails : "");
}

absl::Status FromGrpc(const grpc::Status& status, std::string_view what) {
  if (status.ok()) return absl::OkStatus();
  const std::string message = StrCat(what, ": ", status.error_message());
  if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED && status.error_details() == kBusyDetails) {
    return ServerBusyError(message);
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), message);
}

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Reconnect quickly after a peer restarts (the default backoff grows to minutes).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Keep pinging an idle connection (the default stops after two pings without data).
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return args;
}

void ApplyServerArgs(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kMinPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // The server pings its clients too (a client host that vanished frees its calls), as rarely as the clients.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  return MakeChannel(address, *ProcessSecurity());
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const Security& security) {
  KeepGrpcInitialized();
  grpc::ChannelArguments args = ChannelArgs();
  security.ConfigureChannel(address, &args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeVersionClientInterceptorFactory(address));
  security.AddClientInterceptors(&interceptors);
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, security.ChannelCredentials(), args,
                                                                 std::move(interceptors));
}

void SetDeadline(grpc::ClientContext& ctx, int64_t timeout_ms) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
}

bool SetDeadline(grpc::ClientContext& ctx, int64_t timeout_ms, absl::Time request_deadline) {
  const absl::Time own = absl::Now() + absl::Milliseconds(timeout_ms);
  ctx.set_deadline(absl::ToChronoTime(std::min(own, request_deadline)));
  return request_deadline < own;
}

absl::Time RequestDeadline(const grpc::ServerContext& ctx) {
  const std::chrono::system_clock::time_point d = ctx.deadline();
  // gRPC reports "no deadline" as the largest time point.
  if (d >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

namespace {

// Why `where` cannot be listened on, as a plain exclusive bind(2) of it tells (e.g. "Address already in use"),
// or "" when at least one of the addresses it resolves to can be bound (as gRPC needs).
std::string BindError(const HostPort& where) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(where.port);
  if (const int rc = getaddrinfo(where.host.empty() ? nullptr : where.host.c_str(), port.c_str(), &hints, &found);
      rc != 0) {
    return gai_strerror(rc);
  }
  std::string error;
  bool bound = false;
  for (addrinfo* a = found; a != nullptr && !bound; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC does: TIME_WAIT is not "in use"
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1) == 0) {
      bound = true;
    } else if (error.empty()) {
      error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  return bound ? "" : (error.empty() ? "no usable address" : error);
}

std::string CannotListen(const ServerOptions& options, const std::string& reason) {
  return StrCat(options.node.empty() ? std::string("this node") : StrCat("node '", options.node, "'"),
                " cannot listen on ", options.address, ": ", reason);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options,
                                                      const std::vector<grpc::Service*>& services) {
  KeepGrpcInitialized();
  // A taken port is refused here, with one line, before gRPC (which would also refuse it, SO_REUSEPORT being
  // off below, but after logging its own error).
  // An address that is not host:port (e.g. "unix:path") is gRPC's to read.
  const absl::StatusOr<HostPort> where = ParseHostPort(options.address);
  const int wanted = where.ok() ? where->port : -1;
  if (wanted > 0) {
    if (std::string reason = BindError(*where); !reason.empty()) {
      return absl::UnavailableError(CannotListen(options, reason));
    }
  }
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<Server> s(new Server());
  s->address_ = options.address;
  s->node_ = options.node;
  grpc::ServerBuilder builder;
  const std::shared_ptr<const Security> security = options.security != nullptr ? options.security : ProcessSecurity();
  builder.AddListeningPort(options.address, security->ServerCredentials(), &s->port_);
  // gRPC sets SO_REUSEPORT by default, so a second daemon on a taken port would bind it silently and share its
  // calls at random. Listen exclusively.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  ApplyServerArgs(builder);
  // The sync server takes a thread per call in flight plus its pollers, and refuses a call with
  // RESOURCE_EXHAUSTED when the quota has no thread left, even at low load if the quota is tight. One poller
  // and a quota of a few threads per requested handler keeps the pool bounded (ten daemons share two cores in
  // CI) without refusing ordinary overlapping calls (main's compute, the shadow's prefetch, a stats call).
  grpc::ResourceQuota quota("odmoe");
  quota.SetMaxThreads(4 * std::max(1, options.threads) + 2 + std::max(0, options.blocking_calls));
  builder.SetResourceQuota(quota);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 1);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(MakeVersionServerInterceptorFactory(options.cluster));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  for (grpc::Service* service : services) builder.RegisterService(service);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0 || (wanted > 0 && s->port_ != wanted)) {
    std::string reason = where.ok() ? BindError(*where) : "";
    if (reason.empty()) reason = "in use, or not a local address?";
    if (s->server_ != nullptr) s->server_->Shutdown();
    s->server_.reset();
    return absl::UnavailableError(CannotListen(options, reason));
  }
  {
    absl::MutexLock lock(&s->health_mu_);
    s->health_ = s->server_->GetHealthCheckService();
  }
  s->MarkServing(false);
  return s;
}

Server::~Server() { Shutdown(); }

void Server::SetStatus(const char* service, bool serving) {
  absl::MutexLock lock(&health_mu_);
  if (health_ != nullptr) health_->SetServingStatus(service, serving);
}

void Server::MarkLive(bool serving) { SetStatus(kLivenessService, serving); }
void Server::MarkReady(bool serving) { SetStatus(kReadinessService, serving); }
void Server::MarkServing(bool serving) {
  MarkLive(serving);
  MarkReady(serving);
}

void Server::Shutdown(int64_t grace_ms) {
  if (server_ == nullptr) return;
  {
    absl::MutexLock lock(&health_mu_);
    if (health_ != nullptr) health_->Shutdown();  // every service NOT_SERVING, and no later change
    health_ = nullptr;
  }
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  server_->Wait();
  server_.reset();
}

void Server::Wait() {
  if (server_ != nullptr) server_->Wait();
}

namespace {

// One health check on `stub`; the answer's build version and cluster go to `health` when given.
absl::StatusOr<bool> CheckOne(grpc::health::v1::Health::Stub& stub, const std::string& address,
                              const std::string& service, int64_t timeout_ms, NodeHealth* health) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout_ms);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = stub.Check(&ctx, req, &resp);
  if (health != nullptr) {
    health->version = ReceivedMetadata(ctx.GetServerInitialMetadata(), kVersionMetadataKey);
    health->cluster = ReceivedMetadata(ctx.GetServerInitialMetadata(), kClusterMetadataKey);
  }
  if (st.error_code() == grpc::StatusCode::NOT_FOUND) return false;
  if (!st.ok()) return FromGrpc(st, StrCat("health check of ", address));
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace

absl::StatusOr<bool> CheckServing(const std::string& address, int64_t timeout_ms, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(MakeChannel(address));
  return CheckOne(*stub, address, service, timeout_ms, nullptr);
}

absl::StatusOr<NodeHealth> CheckHealth(const std::string& address, int64_t timeout_ms) {
  auto stub = grpc::health::v1::Health::NewStub(MakeChannel(address));
  NodeHealth h;
  ODMOE_ASSIGN_OR_RETURN(h.live, CheckOne(*stub, address, kLivenessService, timeout_ms, &h));
  ODMOE_ASSIGN_OR_RETURN(h.ready, CheckOne(*stub, address, kReadinessService, timeout_ms, nullptr));
  return h;
}

absl::Status CheckHeader(const v1::RequestHeader& header, uint64_t epoch, const std::string& fingerprint) {
  if (header.epoch() != epoch) {
    return absl::FailedPreconditionError(StrCat("membership epoch ", header.epoch(), " of ",
                                                header.sender().empty() ? "the sender" : header.sender(),
                                                " does not match this node's epoch ", epoch));
  }
  if (header.model_fingerprint() != fingerprint) {
    return absl::FailedPreconditionError(StrCat("model fingerprint '", header.model_fingerprint(), "' of ",
                                                header.sender().empty() ? "the sender" : header.sender(),
                                                " does not match this node's model '", fingerprint, "'"));
  }
  return absl::OkStatus();
}

void FillHeader(v1::RequestHeader* header, uint64_t epoch, const std::string& fingerprint, const std::string& sender,
                uint64_t request_id, const MembershipView* membership) {
  header->set_epoch(epoch);
  header->set_model_fingerprint(fingerprint);
  header->set_sender(sender);
  header->set_request_id(request_id);
  if (membership != nullptr) {
    ToProto(*membership, header->mutable_membership());
  } else {
    header->clear_membership();
  }
}

void ToProto(const MembershipView& view, v1::MembershipView* out) {
  out->set_epoch(view.epoch);
  out->clear_absent_workers();
  for (int32_t w : view.absent) out->add_absent_workers(w);
}

MembershipView FromProto(const v1::MembershipView& view) {
  return MembershipView{view.epoch(), std::vector<int32_t>(view.absent_workers().begin(), view.absent_workers().end())};
}

absl::Status EpochGate::Admit(const v1::RequestHeader& header) {
  const uint64_t epoch = header.membership().epoch();
  if (epoch == 0) return absl::OkStatus();
  uint64_t newest = newest_.load(std::memory_order_relaxed);
  while (epoch > newest && !newest_.compare_exchange_weak(newest, epoch, std::memory_order_relaxed)) {
  }
  if (epoch < newest) {
    return absl::FailedPreconditionError(
        StrCat("membership epoch ", epoch, " of ", header.sender().empty() ? "the sender" : header.sender(),
               " is older than epoch ", newest, " this node has seen: main has changed the placement since"));
  }
  return absl::OkStatus();
}

void EncodeF32(std::span<const float> values, std::span<const int64_t> shape, v1::Tensor* out) {
  out->set_dtype(v1::DTYPE_F32);
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  out->set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

absl::StatusOr<std::vector<float>> DecodeF32(const v1::Tensor& tensor, std::span<const int64_t> shape,
                                             std::string_view what, std::vector<int64_t>* dims) {
  if (tensor.dtype() != v1::DTYPE_F32) {
    return absl::InvalidArgumentError(StrCat(what, ": expected dtype F32, got ", v1::DType_Name(tensor.dtype())));
  }
  if (tensor.shape_size() != static_cast<int>(shape.size())) {
    return absl::InvalidArgumentError(
        StrCat(what, ": expected ", shape.size(), " dimensions, got ", tensor.shape_size()));
  }
  int64_t count = 1;
  for (int i = 0; i < tensor.shape_size(); ++i) {
    const int64_t d = tensor.shape(i);
    if (d <= 0) return absl::InvalidArgumentError(StrCat(what, ": dimension ", i, " is ", d, " (empty tensor)"));
    if (shape[static_cast<size_t>(i)] >= 0 && d != shape[static_cast<size_t>(i)]) {
      return absl::InvalidArgumentError(
          StrCat(what, ": dimension ", i, " is ", d, ", expected ", shape[static_cast<size_t>(i)]));
    }
    if (count > (int64_t{1} << 40) / d) return absl::InvalidArgumentError(StrCat(what, ": shape too large"));
    count *= d;
  }
  if (static_cast<int64_t>(tensor.data().size()) != count * static_cast<int64_t>(sizeof(float))) {
    return absl::InvalidArgumentError(StrCat(what, ": ", tensor.data().size(), " data bytes for ", count,
                                             " F32 values (", count * 4, " bytes expected)"));
  }
  std::vector<float> values(static_cast<size_t>(count));
  std::memcpy(values.data(), tensor.data().data(), tensor.data().size());
  if (dims != nullptr) dims->assign(tensor.shape().begin(), tensor.shape().end());
  return values;
}

void FillDeviceMemory(const Device& device, uint64_t capacity, v1::DeviceMemory* out) {
  const MemoryInfo m = device.memory_info();
  out->set_device(device.name());
  out->set_capacity_bytes(capacity);
  out->set_in_use_bytes(m.in_use);
  out->set_peak_bytes(m.peak);
  const std::optional<uint64_t> process = device.process_device_bytes();
  out->set_context_bytes(process.has_value() && *process > m.in_use ? *process - m.in_use : 0);
}

}  // namespace odmoe::rpc
