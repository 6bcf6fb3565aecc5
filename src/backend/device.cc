#include "src/backend/device.h"

#include <string_view>

#include "absl/status/status.h"

namespace odmoe {

std::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kMockGpu:
      return "mock-gpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "?";
}

}  // namespace odmoe
