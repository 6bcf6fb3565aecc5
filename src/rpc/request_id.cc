#include "src/rpc/request_id.h"

#include <algorithm>
#include <optional>
#include <random>

#include "src/common/strings.h"

namespace odmoe::rpc {

std::string NewRequestId() {
  thread_local std::mt19937_64 generator{[] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }()};
  const uint64_t value = generator();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(16, '0');
  for (int i = 0; i < 16; ++i) id[static_cast<size_t>(i)] = kHex[(value >> (60 - 4 * i)) & 0xf];
  return id;
}

absl::Status ValidateRequestId(std::string_view id) {
  if (id.empty()) return absl::InvalidArgumentError(StrCat(kRequestIdKey, " metadata: empty"));
  if (id.size() > kMaxRequestIdLength) {
    return absl::InvalidArgumentError(
        StrCat(kRequestIdKey, " metadata: ", id.size(), " characters, at most ", kMaxRequestIdLength));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          StrCat(kRequestIdKey, " metadata: character ", i, " is not a letter, digit, '.', '_', ':' or '-'"));
    }
  }
  return absl::OkStatus();
}

namespace {

// The client's metadata value, if it sent the key (the first value when it sent several).
std::optional<std::string> RawRequestId(const grpc::ServerContext& context) {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(kRequestIdKey);
  if (it == metadata.end()) return std::nullopt;
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

std::string RequestIdOf(const grpc::ServerContext& context) {
  std::optional<std::string> id = RawRequestId(context);
  if (!id.has_value() || !ValidateRequestId(*id).ok()) return "";
  return *id;
}

absl::StatusOr<std::string> TakeOrMakeRequestId(const grpc::ServerContext& context) {
  std::optional<std::string> id = RawRequestId(context);
  if (!id.has_value()) return NewRequestId();
  if (absl::Status s = ValidateRequestId(*id); !s.ok()) return s;
  return *id;
}

void AttachRequestId(grpc::ClientContext& context, std::string_view id) {
  if (!id.empty()) context.AddMetadata(kRequestIdKey, std::string(id));
}

bool RecentRequestIds::Insert(const std::string& id) {
  if (id.empty()) return false;
  absl::MutexLock lock(&mu_);
  if (std::find(ids_.begin(), ids_.end(), id) != ids_.end()) return false;
  ids_.push_back(id);
  if (ids_.size() > capacity_) ids_.pop_front();
  return true;
}

}  // namespace odmoe::rpc
