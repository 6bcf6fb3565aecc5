// Timed devices: the mock GPU's math (CPU reference kernels, so results equal the CPU device's bit for bit) with
// each op and copy completing, in wall-clock time, when a hardware profile (src/common/device_profile.h) says it
// would, optionally charged at a larger model's shapes (src/backend/shape_map.h). With the LAN harness this
// emulates a GPU testbed on one machine (issue 28). A node asks for one with device = "timed:PROFILE".
//
// Cost of each op on its stream (ProfileCostModel): time_scale * (launch_latency + max(bytes / memory bandwidth,
// flops / rate)), with bytes and flops those of src/backend/op_cost.h at the charged shape, and the rate the
// profile's for the dtype of the op's weights (MatMul; every other op runs at the fp32 rate). A copy: time_scale *
// (copy_latency + charged bytes / link rate), the link the pinned or the pageable host-to-device rate by whether
// the host memory is registered (Device::RegisterHostMemory), or the device-to-host rate; a copy on the device
// time_scale * (launch_latency + 2 * charged bytes / memory bandwidth). The clock, links and streams are the
// mock GPU's (mock_gpu_device.h): ops of a stream serialise, host-to-device copies share one link, events order
// streams, and with a wall clock every wait returns no earlier than the modelled end.
#pragma once

#include <cstdint>
#include <memory>

#include "src/backend/mock_gpu_device.h"
#include "src/backend/op_cost.h"
#include "src/backend/shape_map.h"
#include "src/common/device_profile.h"

namespace odmoe {

class ProfileCostModel final : public CostModel {
 public:
  // REQUIRES: time_scale > 0 and the profile's figures > 0 (as ParseClusterConfig checks them).
  ProfileCostModel(DeviceProfile profile, ShapeMap shapes, double time_scale);
  double OpSeconds(const OpShape& shape, OpWork* work) const override;
  double CopySeconds(CopyKind kind, uint64_t bytes, bool pinned, uint64_t* charged_bytes) const override;

 private:
  const DeviceProfile profile_;
  const ShapeMap shapes_;
  const double time_scale_;
};

struct TimedDeviceOptions {
  DeviceProfile profile;
  ShapeMap shapes;  // identity: charge the running model's own shapes
  double time_scale = 1.0;
  // Device memory for the running model's allocations: the profile's memory, or less where non-zero.
  uint64_t capacity_bytes = 0;
  // The clock its waits pace to: NewSteadyWallClock() for real time; nullptr: virtual time only (tests that read
  // the modelled clock through MockGpuDevice's hooks without waiting).
  std::shared_ptr<WallClock> wall_clock;
  bool record_timeline = false;  // MockGpuOptions::record_timeline (a daemon runs for long)
};

// A MockGpuDevice named "timed:PROFILE (...)" whose work costs what ProfileCostModel says.
std::unique_ptr<MockGpuDevice> CreateTimedDevice(const TimedDeviceOptions& options);

}  // namespace odmoe
