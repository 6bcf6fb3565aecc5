#include "src/common/status.h"

#include "absl/strings/cord.h"

namespace odmoe {

int ExitCodeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kInvalidArgument:
      return kExitUsage;
    case absl::StatusCode::kNotFound:
      return kExitNotFound;
    case absl::StatusCode::kDataLoss:
      return kExitCorrupt;
    case absl::StatusCode::kFailedPrecondition:
      return kExitInvalidModel;
    case absl::StatusCode::kUnimplemented:
      return kExitUnsupported;
    case absl::StatusCode::kOutOfRange:
      return kExitOutOfRange;
    case absl::StatusCode::kResourceExhausted:
      return IsServerBusy(status) ? kExitBusy : kExitResources;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnavailable;
    default:
      return kExitInternal;
  }
}

namespace {
constexpr char kBusyPayload[] = "type.odmoe.dev/server-busy";
constexpr char kFieldPayload[] = "type.odmoe.dev/field";
}  // namespace

absl::Status ServerBusyError(std::string_view message) {
  absl::Status s = absl::ResourceExhaustedError(std::string(message));
  s.SetPayload(kBusyPayload, absl::Cord("1"));
  return s;
}

bool IsServerBusy(const absl::Status& status) {
  return absl::IsResourceExhausted(status) && status.GetPayload(kBusyPayload).has_value();
}

absl::Status WithField(absl::Status status, std::string_view field) {
  if (!status.ok()) status.SetPayload(kFieldPayload, absl::Cord(std::string(field)));
  return status;
}

std::string FieldOf(const absl::Status& status) {
  const auto field = status.GetPayload(kFieldPayload);  // absl::optional<absl::Cord>
  return field ? std::string(*field) : std::string();
}

absl::Status CorruptError(std::string_view msg) { return absl::DataLossError(std::string(msg)); }
absl::Status InvalidModelError(std::string_view msg) { return absl::FailedPreconditionError(std::string(msg)); }

}  // namespace odmoe
