// ProfileCostModel and CreateTimedDevice: see timed_device.h.
#include "src/backend/timed_device.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "src/common/status.h"

namespace odmoe {

ProfileCostModel::ProfileCostModel(DeviceProfile profile, ShapeMap shapes, double time_scale)
    : profile_(std::move(profile)), shapes_(std::move(shapes)), time_scale_(time_scale) {
  ODMOE_CHECK(time_scale_ > 0);
  ODMOE_CHECK(profile_.memory_bytes_per_s > 0 && profile_.h2d_pinned_bytes_per_s > 0 &&
              profile_.h2d_pageable_bytes_per_s > 0 && profile_.d2h_bytes_per_s > 0);
  ODMOE_CHECK(profile_.fp32_flops_per_s > 0 && profile_.bf16_flops_per_s > 0 && profile_.fp16_flops_per_s > 0 &&
              profile_.int8_ops_per_s > 0);
}

double ProfileCostModel::OpSeconds(const OpShape& shape, OpWork* work) const {
  const OpShape charged = shapes_.Charge(shape);
  *work = WorkOf(charged);
  const double rate = profile_.FlopsPerS(charged.kind == OpKind::kMatMul ? charged.weight : DType::kF32);
  const double busy = std::max(static_cast<double>(work->bytes) / profile_.memory_bytes_per_s, work->flops / rate);
  return time_scale_ * (profile_.launch_latency_s + busy);
}

double ProfileCostModel::CopySeconds(CopyKind kind, uint64_t bytes, bool pinned, uint64_t* charged_bytes) const {
  *charged_bytes = shapes_.CopyBytes(bytes);
  const double b = static_cast<double>(*charged_bytes);
  switch (kind) {
    case CopyKind::kHostToDevice:
      return time_scale_ * (profile_.copy_latency_s +
                            b / (pinned ? profile_.h2d_pinned_bytes_per_s : profile_.h2d_pageable_bytes_per_s));
    case CopyKind::kDeviceToHost:
      return time_scale_ * (profile_.copy_latency_s + b / profile_.d2h_bytes_per_s);
    case CopyKind::kOnDevice:
      return time_scale_ * (profile_.launch_latency_s + 2.0 * b / profile_.memory_bytes_per_s);
  }
  return 0;
}

std::unique_ptr<MockGpuDevice> CreateTimedDevice(const TimedDeviceOptions& o) {
  const DeviceProfile& p = o.profile;
  MockGpuOptions m;
  m.capacity_bytes = o.capacity_bytes == 0 ? p.memory_bytes : std::min(o.capacity_bytes, p.memory_bytes);
  // The mock's own figures, for options() readers; the cost model below is what times the work.
  m.h2d_bytes_per_s = p.h2d_pinned_bytes_per_s;
  m.h2d_pageable_bytes_per_s = p.h2d_pageable_bytes_per_s;
  m.h2d_latency_s = p.copy_latency_s;
  m.d2h_bytes_per_s = p.d2h_bytes_per_s;
  m.d2h_latency_s = p.copy_latency_s;
  m.flops_per_s = p.fp32_flops_per_s;
  m.mem_bytes_per_s = p.memory_bytes_per_s;
  m.record_timeline = o.record_timeline;
  m.cost_model = std::make_shared<ProfileCostModel>(p, o.shapes, o.time_scale);
  m.wall_clock = o.wall_clock;
  m.name =
      absl::StrFormat("timed:%s (%.1f GiB, %.0f GB/s, H2D %.1f GB/s pinned; %s; time x %g%s)", p.name,
                      static_cast<double>(m.capacity_bytes) / (1024.0 * 1024.0 * 1024.0), p.memory_bytes_per_s / 1e9,
                      p.h2d_pinned_bytes_per_s / 1e9, o.shapes.identity() ? "own shapes" : "target shapes",
                      o.time_scale, o.wall_clock == nullptr ? ", virtual clock" : "");
  return std::make_unique<MockGpuDevice>(m);
}

}  // namespace odmoe
