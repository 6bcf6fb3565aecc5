#include "src/rpc/rpc_util.h"

#include <chrono>
#include <cstring>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "src/common/strings.h"

namespace odmoe::rpc {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpc(const grpc::Status& status, std::string_view what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      StrCat(what, ": ", status.error_message()));
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Reconnect quickly after a peer restarts (the default backoff grows to minutes).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

void SetDeadline(grpc::ClientContext& ctx, int64_t timeout_ms) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options,
                                                     const std::vector<grpc::Service*>& services) {
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<Server> s(new Server());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &s->port_);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // The sync server takes a thread per call in flight plus its pollers, and refuses a call with
  // RESOURCE_EXHAUSTED when the quota has no thread left, even at low load if the quota is tight. One poller
  // and a quota of a few threads per requested handler keeps the pool bounded (ten daemons share two cores in
  // CI) without refusing ordinary overlapping calls (main's compute, the shadow's prefetch, a stats call).
  grpc::ResourceQuota quota("odmoe");
  quota.SetMaxThreads(4 * std::max(1, options.threads) + 2);
  builder.SetResourceQuota(quota);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 1);
  for (grpc::Service* service : services) builder.RegisterService(service);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(StrCat("cannot listen on ", options.address, " (in use, or not a local address?)"));
  }
  s->MarkServing(false);
  return s;
}

Server::~Server() { Shutdown(); }

void Server::MarkServing(bool serving) {
  if (server_ == nullptr) return;
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(serving);
}

void Server::Shutdown(int64_t grace_ms) {
  if (server_ == nullptr) return;
  MarkServing(false);
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  server_->Wait();
  server_.reset();
}

void Server::Wait() {
  if (server_ != nullptr) server_->Wait();
}

absl::StatusOr<bool> CheckServing(const std::string& address, int64_t timeout_ms) {
  auto stub = grpc::health::v1::Health::NewStub(MakeChannel(address));
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout_ms);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = stub->Check(&ctx, req, &resp);
  if (st.error_code() == grpc::StatusCode::NOT_FOUND) return false;
  if (!st.ok()) return FromGrpc(st, StrCat("health check of ", address));
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
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
                uint64_t request_id) {
  header->set_epoch(epoch);
  header->set_model_fingerprint(fingerprint);
  header->set_sender(sender);
  header->set_request_id(request_id);
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
