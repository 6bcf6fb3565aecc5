// The mock GPU. See mock_gpu_device.h for the memory and clock model, op_cost.h for the work of each op.
#include "src/backend/mock_gpu_device.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "src/backend/cpu_kernels.h"
#include "src/backend/quantize.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

constexpr size_t kAlignment = 256;  // as cudaMalloc

std::string FormatBytes(uint64_t bytes) {
  return absl::StrFormat("%d bytes (%.1f MiB)", bytes, static_cast<double>(bytes) / (1024.0 * 1024.0));
}

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

// Bytes of `count` 4-byte elements (fp32 activations, int32 ids).
uint64_t Bytes4(int64_t count) { return static_cast<uint64_t>(count) * 4; }
uint64_t WeightBytes(WeightRef w, int64_t count) {
  ODMOE_CHECK(w.dtype == DType::kF32 || w.dtype == DType::kF16 || w.dtype == DType::kBF16);
  return static_cast<uint64_t>(count) * DTypeSize(w.dtype);
}
// Bytes of w's data for a [rows, cols] weight, dense or quantized (quantize.h layouts).
uint64_t MatrixBytes(WeightRef w, int64_t rows, int64_t cols) {
  if (w.dtype == DType::kI8) return static_cast<uint64_t>(rows * cols);
  if (w.dtype == DType::kU8) return static_cast<uint64_t>(rows * Nf4RowBytes(cols));
  return WeightBytes(w, rows * cols);
}
// Bytes of w's scales for a [rows, cols] weight (0 when dense).
uint64_t ScaleBytes(WeightRef w, int64_t rows, int64_t cols) {
  if (w.dtype == DType::kI8) return Bytes4(rows);
  if (w.dtype == DType::kU8) return Bytes4(rows * Nf4BlocksPerRow(cols));
  return 0;
}

// The default cost model: a roofline over the options' figures (mock_gpu_device.h).
class RooflineCostModel final : public CostModel {
 public:
  explicit RooflineCostModel(const MockGpuOptions& o) : o_(o) {}
  double OpSeconds(const OpShape& shape, OpWork* work) const override {
    *work = WorkOf(shape);
    return std::max(work->flops / o_.flops_per_s, static_cast<double>(work->bytes) / o_.mem_bytes_per_s);
  }
  double CopySeconds(CopyKind kind, uint64_t bytes, bool pinned, uint64_t* charged_bytes) const override {
    *charged_bytes = bytes;
    const double b = static_cast<double>(bytes);
    switch (kind) {
      case CopyKind::kHostToDevice:
        return o_.h2d_latency_s +
               b / (pinned || o_.h2d_pageable_bytes_per_s <= 0 ? o_.h2d_bytes_per_s : o_.h2d_pageable_bytes_per_s);
      case CopyKind::kDeviceToHost:
        return o_.d2h_latency_s + b / o_.d2h_bytes_per_s;
      case CopyKind::kOnDevice:
        return 2.0 * b / o_.mem_bytes_per_s;
    }
    return 0;
  }

 private:
  const MockGpuOptions o_;  // figures only (its cost_model and wall_clock are not used)
};

class SteadyWallClock final : public WallClock {
 public:
  double NowSeconds() override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count();
  }
  void SleepUntil(double seconds) override {
    const double now = NowSeconds();
    if (seconds > now) std::this_thread::sleep_for(std::chrono::duration<double>(seconds - now));
  }

 private:
  const std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
};

}  // namespace

std::shared_ptr<WallClock> NewSteadyWallClock() { return std::make_shared<SteadyWallClock>(); }

std::string_view MockGpuWorkName(MockGpuWork kind) {
  switch (kind) {
    case MockGpuWork::kH2D:
      return "h2d";
    case MockGpuWork::kD2H:
      return "d2h";
    case MockGpuWork::kD2D:
      return "d2d";
    case MockGpuWork::kCompute:
      return "compute";
  }
  return "?";
}

uint64_t Fnv1a64(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= p[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

struct MockGpuDevice::State {
  explicit State(const MockGpuOptions& o)
      : options(o),
        cost(o.cost_model != nullptr ? o.cost_model : std::make_shared<RooflineCostModel>(o)),
        wall(o.wall_clock) {}

  struct Block {
    size_t size;
    std::string tag;
  };

  const MockGpuOptions options;
  const std::shared_ptr<const CostModel> cost;  // never null
  const std::shared_ptr<WallClock> wall;        // null: virtual time only
  mutable absl::Mutex mu;
  std::map<uintptr_t, Block> live ABSL_GUARDED_BY(mu);  // start address -> block
  uint64_t in_use ABSL_GUARDED_BY(mu) = 0;
  uint64_t peak ABSL_GUARDED_BY(mu) = 0;
  std::map<int, double> stream_time ABSL_GUARDED_BY(mu) = {{0, 0.0}};  // stream id -> its time
  int next_stream_id ABSL_GUARDED_BY(mu) = 1;
  std::map<int, double> event_time ABSL_GUARDED_BY(mu);  // recorded events only
  int next_event_id ABSL_GUARDED_BY(mu) = 1;
  double host_time ABSL_GUARDED_BY(mu) = 0;
  double latest_end ABSL_GUARDED_BY(mu) = 0;
  double h2d_free ABSL_GUARDED_BY(mu) = 0;  // when the H2D link is next free
  double d2h_free ABSL_GUARDED_BY(mu) = 0;
  std::vector<MockGpuInterval> timeline ABSL_GUARDED_BY(mu);
  MockGpuStats stats ABSL_GUARDED_BY(mu);
  std::map<std::string, int64_t> op_counts ABSL_GUARDED_BY(mu);

  bool ContainsLocked(const void* ptr, size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    auto it = live.upper_bound(p);
    if (it == live.begin()) return false;
    --it;
    return p - it->first <= it->second.size && bytes <= it->second.size - (p - it->first);
  }

  // Aborts unless [ptr, ptr + bytes) is device memory of this device (nothing to check for 0 bytes).
  void CheckArgLocked(std::string_view op, std::string_view arg, const void* ptr, uint64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (bytes == 0) return;
    if (ptr == nullptr) Die(StrCat("mock-gpu ", op, ": argument '", arg, "' is null (", bytes, " bytes expected)"));
    if (!ContainsLocked(ptr, bytes)) {
      Die(StrCat("mock-gpu ", op, ": argument '", arg, "' [", absl::StrFormat("%p", ptr), ", +", bytes,
                 " bytes) is not inside a live allocation of this device; device ops take device memory (host data "
                 "reaches the device only through CopyToDevice)"));
    }
  }

  void CheckNotDeviceLocked(std::string_view op, std::string_view arg, const void* ptr, uint64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (bytes == 0) return;
    if (ptr == nullptr) Die(StrCat("mock-gpu ", op, ": argument '", arg, "' is null (", bytes, " bytes expected)"));
    if (ContainsLocked(ptr, 1)) {
      Die(StrCat("mock-gpu ", op, ": argument '", arg, "' is device memory but must be host memory"));
    }
  }

  // Largest index of idx[0..n) (device memory, already checked); aborts on a negative one. -1 when n == 0.
  int64_t MaxIndexLocked(std::string_view op, std::string_view arg, const int32_t* idx, int64_t n) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    int64_t max_index = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (idx[i] < 0) Die(StrCat("mock-gpu ", op, ": ", arg, "[", i, "] = ", idx[i], " is negative"));
      max_index = std::max<int64_t>(max_index, idx[i]);
    }
    return max_index;
  }

  int StreamIdLocked(Stream* stream) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  int EventIdLocked(Event& event) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Places work of `duration` on the clock of stream `stream_id` (and on the link of an H2D/D2H copy) and
  // records it. Returns its end.
  double ScheduleLocked(MockGpuWork kind, std::string_view op, int stream_id, uint64_t bytes, double flops,
                        double duration) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    double& stream_clock = stream_time.at(stream_id);
    if (wall != nullptr) host_time = std::max(host_time, wall->NowSeconds());  // the host issues it now
    double start = std::max(stream_clock, host_time);
    double* link = kind == MockGpuWork::kH2D ? &h2d_free : kind == MockGpuWork::kD2H ? &d2h_free : nullptr;
    if (link != nullptr) start = std::max(start, *link);
    const double end = start + duration;
    stream_clock = end;
    if (link != nullptr) *link = end;
    latest_end = std::max(latest_end, end);
    switch (kind) {
      case MockGpuWork::kH2D:
        stats.h2d_busy_s += duration;
        break;
      case MockGpuWork::kD2H:
        stats.d2h_busy_s += duration;
        break;
      case MockGpuWork::kD2D:
        break;
      case MockGpuWork::kCompute:
        stats.compute_busy_s += duration;
        break;
    }
    if (options.record_timeline) {
      timeline.push_back(MockGpuInterval{kind, std::string(op), stream_id, start, end, bytes, flops});
    }
    return end;
  }

  void ScheduleOpLocked(const OpShape& shape, int stream_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    OpWork work;
    const double duration = cost->OpSeconds(shape, &work);
    const std::string_view op = OpKindName(shape.kind);
    ScheduleLocked(MockGpuWork::kCompute, op, stream_id, work.bytes, work.flops, duration);
    ++op_counts[std::string(op)];
    ++stats.ops;
  }

  // Schedules a copy of `bytes` on the clock (its link's, for H2D and D2H) at the cost model's duration. Returns
  // its end.
  double ScheduleCopyLocked(CopyKind kind, int stream_id, uint64_t bytes, bool pinned)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    uint64_t charged = bytes;
    const double duration = cost->CopySeconds(kind, bytes, pinned, &charged);
    switch (kind) {
      case CopyKind::kHostToDevice:
        return ScheduleLocked(MockGpuWork::kH2D, "CopyToDevice", stream_id, charged, 0, duration);
      case CopyKind::kDeviceToHost:
        return ScheduleLocked(MockGpuWork::kD2H, "CopyToHost", stream_id, charged, 0, duration);
      case CopyKind::kOnDevice:
        return ScheduleLocked(MockGpuWork::kD2D, "CopyOnDevice", stream_id, charged, 0, duration);
    }
    return 0;
  }

  // With a wall clock: returns when that clock reaches `end` (call without holding mu).
  void WaitUntil(double end) const ABSL_LOCKS_EXCLUDED(mu) {
    if (wall != nullptr) wall->SleepUntil(end);
  }
};

namespace {

class MockGpuBuffer final : public Buffer {
 public:
  MockGpuBuffer(void* data, size_t size, std::shared_ptr<MockGpuDevice::State> state)
      : Buffer(data, size), state_(std::move(state)) {}
  ~MockGpuBuffer() override {
    {
      absl::MutexLock lock(&state_->mu);
      state_->live.erase(reinterpret_cast<uintptr_t>(data()));
      state_->in_use -= size();
    }
    std::free(data());
  }

 private:
  std::shared_ptr<MockGpuDevice::State> state_;
};

class MockGpuStream final : public Stream {
 public:
  MockGpuStream(std::shared_ptr<MockGpuDevice::State> state, int id) : state(std::move(state)), id(id) {}
  ~MockGpuStream() override {
    absl::MutexLock lock(&state->mu);
    state->stream_time.erase(id);
  }
  const std::shared_ptr<MockGpuDevice::State> state;
  const int id;
};

class MockGpuEvent final : public Event {
 public:
  MockGpuEvent(std::shared_ptr<MockGpuDevice::State> state, int id) : state(std::move(state)), id(id) {}
  ~MockGpuEvent() override {
    absl::MutexLock lock(&state->mu);
    state->event_time.erase(id);
  }
  const std::shared_ptr<MockGpuDevice::State> state;
  const int id;
};

}  // namespace

int MockGpuDevice::State::StreamIdLocked(Stream* stream) const {
  if (stream == nullptr) return 0;
  auto* s = dynamic_cast<MockGpuStream*>(stream);
  if (s == nullptr || s->state.get() != this) Die("mock-gpu: a Stream of another device was passed to this device");
  return s->id;
}

int MockGpuDevice::State::EventIdLocked(Event& event) const {
  auto* e = dynamic_cast<MockGpuEvent*>(&event);
  if (e == nullptr || e->state.get() != this) Die("mock-gpu: an Event of another device was passed to this device");
  return e->id;
}

MockGpuDevice::MockGpuDevice(MockGpuOptions options) : options_(options), state_(std::make_shared<State>(options)) {
  ODMOE_CHECK(options.h2d_bytes_per_s > 0 && options.d2h_bytes_per_s > 0);
  ODMOE_CHECK(options.flops_per_s > 0 && options.mem_bytes_per_s > 0);
  ODMOE_CHECK(options.h2d_latency_s >= 0 && options.d2h_latency_s >= 0);
  ODMOE_CHECK(options.h2d_pageable_bytes_per_s >= 0);
}

MockGpuDevice::~MockGpuDevice() = default;

std::string MockGpuDevice::name() const {
  if (!options_.name.empty()) return options_.name;
  return absl::StrFormat("mock-gpu (%.1f GiB, H2D %.1f GB/s)",
                         static_cast<double>(options_.capacity_bytes) / (1024.0 * 1024.0 * 1024.0),
                         options_.h2d_bytes_per_s / 1e9);
}

// ---- memory ------------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Buffer>> MockGpuDevice::Allocate(size_t bytes, std::string_view tag) {
  {
    absl::MutexLock lock(&state_->mu);
    const uint64_t capacity = options_.capacity_bytes;
    if (bytes > capacity - std::min(capacity, state_->in_use)) {
      ++state_->stats.failed_allocations;
      return absl::ResourceExhaustedError(StrCat("mock-gpu: out of device memory allocating ", FormatBytes(bytes),
                                                 " for '", tag, "': ", FormatBytes(state_->in_use),
                                                 " of its capacity of ", FormatBytes(capacity), " are in use"));
    }
    state_->in_use += bytes;
    state_->peak = std::max(state_->peak, state_->in_use);
  }
  const size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  void* data = std::aligned_alloc(kAlignment, rounded);
  if (data == nullptr) {
    absl::MutexLock lock(&state_->mu);
    state_->in_use -= bytes;
    return absl::ResourceExhaustedError(
        StrCat("mock-gpu: the host is out of memory allocating ", FormatBytes(bytes), " for '", tag, "'"));
  }
  if (options_.poison_allocations) std::memset(data, 0xFF, rounded);
  {
    absl::MutexLock lock(&state_->mu);
    state_->live.emplace(reinterpret_cast<uintptr_t>(data), State::Block{bytes, std::string(tag)});
    ++state_->stats.allocations;
  }
  NoteAllocation();
  return std::unique_ptr<Buffer>(new MockGpuBuffer(data, bytes, state_));
}

MemoryInfo MockGpuDevice::memory_info() const {
  absl::MutexLock lock(&state_->mu);
  return MemoryInfo{options_.capacity_bytes, state_->in_use, state_->peak};
}

void MockGpuDevice::ResetPeak() {
  absl::MutexLock lock(&state_->mu);
  state_->peak = state_->in_use;
}

// ---- streams -----------------------------------------------------------------------------------------------

std::unique_ptr<Stream> MockGpuDevice::CreateStream() {
  absl::MutexLock lock(&state_->mu);
  const int id = state_->next_stream_id++;
  state_->stream_time[id] = 0.0;
  return std::make_unique<MockGpuStream>(state_, id);
}

std::unique_ptr<Event> MockGpuDevice::CreateEvent() {
  absl::MutexLock lock(&state_->mu);
  return std::make_unique<MockGpuEvent>(state_, state_->next_event_id++);
}

void MockGpuDevice::RecordEvent(Event& event, Stream* stream) {
  absl::MutexLock lock(&state_->mu);
  const int event_id = state_->EventIdLocked(event);
  state_->event_time[event_id] = state_->stream_time.at(state_->StreamIdLocked(stream));
}

void MockGpuDevice::WaitEvent(Stream* stream, Event& event) {
  absl::MutexLock lock(&state_->mu);
  const int event_id = state_->EventIdLocked(event);
  double& t = state_->stream_time.at(state_->StreamIdLocked(stream));
  auto it = state_->event_time.find(event_id);
  if (it != state_->event_time.end()) t = std::max(t, it->second);
}

void MockGpuDevice::SynchronizeEvent(Event& event) {
  NoteHostSync();
  double end = 0;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->event_time.find(state_->EventIdLocked(event));
    if (it != state_->event_time.end()) end = it->second;
    state_->host_time = std::max(state_->host_time, end);
  }
  state_->WaitUntil(end);
}

void MockGpuDevice::Synchronize(Stream* stream) {
  NoteHostSync();
  double end = 0;
  {
    absl::MutexLock lock(&state_->mu);
    end = state_->stream_time.at(state_->StreamIdLocked(stream));
    state_->host_time = std::max(state_->host_time, end);
  }
  state_->WaitUntil(end);
}

void MockGpuDevice::SynchronizeAll() {
  NoteHostSync();
  double end = 0;
  {
    absl::MutexLock lock(&state_->mu);
    end = state_->latest_end;
    state_->host_time = std::max(state_->host_time, end);
  }
  state_->WaitUntil(end);
}

// ---- copies ------------------------------------------------------------------------------------------------

void MockGpuDevice::CopyToDevice(void* dst, const void* src, size_t bytes, Stream* stream) {
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    state_->CheckArgLocked("CopyToDevice", "dst", dst, bytes);
    state_->CheckNotDeviceLocked("CopyToDevice", "src", src, bytes);
    state_->ScheduleCopyLocked(CopyKind::kHostToDevice, sid, bytes, IsRegisteredHostMemory(src, bytes));
    state_->stats.transfers.h2d_bytes += bytes;
    ++state_->stats.transfers.h2d_copies;
  }
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void MockGpuDevice::CopyToHost(void* dst, const void* src, size_t bytes, Stream* stream) {
  NoteHostSync();
  NoteBytesRead(bytes);
  double end = 0;
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    state_->CheckArgLocked("CopyToHost", "src", src, bytes);
    state_->CheckNotDeviceLocked("CopyToHost", "dst", dst, bytes);
    end = state_->ScheduleCopyLocked(CopyKind::kDeviceToHost, sid, bytes, /*pinned=*/true);
    state_->host_time = std::max(state_->host_time, end);  // returns when the bytes are on the host
    state_->stats.transfers.d2h_bytes += bytes;
    ++state_->stats.transfers.d2h_copies;
    // Under the lock: the caller waits for the copy anyway, and this keeps the source alive while it is read.
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  state_->WaitUntil(end);
}

void MockGpuDevice::CopyOnDevice(void* dst, const void* src, size_t bytes, Stream* stream) {
  NoteBytesRead(bytes);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    state_->CheckArgLocked("CopyOnDevice", "dst", dst, bytes);
    state_->CheckArgLocked("CopyOnDevice", "src", src, bytes);
    state_->ScheduleCopyLocked(CopyKind::kOnDevice, sid, bytes, /*pinned=*/true);
    state_->stats.transfers.d2d_bytes += bytes;
    ++state_->stats.transfers.d2d_copies;
  }
  if (bytes > 0) std::memmove(dst, src, bytes);
}

TransferStats MockGpuDevice::transfer_stats() const {
  absl::MutexLock lock(&state_->mu);
  return state_->stats.transfers;
}

// ---- ops: check every argument against the registry, schedule, then compute outside the lock -----------------

void MockGpuDevice::Embedding(const int32_t* ids, int64_t n, WeightRef table, int64_t dim, float* out, Stream* stream) {
  ODMOE_CHECK(n >= 0 && dim >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    if (n > 0 && dim > 0) {
      state_->CheckArgLocked("Embedding", "ids", ids, Bytes4(n));
      const int64_t max_id = state_->MaxIndexLocked("Embedding", "ids", ids, n);
      state_->CheckArgLocked("Embedding", "table", table.data, WeightBytes(table, (max_id + 1) * dim));
      state_->CheckArgLocked("Embedding", "out", out, Bytes4(n * dim));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kEmbedding, .n = n, .dim = dim, .weight = table.dtype}, sid);
  }
  cpu::Embedding(ids, n, table, dim, out);
}

void MockGpuDevice::RmsNorm(const float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out,
                            Stream* stream) {
  ODMOE_CHECK(rows >= 0 && dim > 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    const uint64_t weight_bytes = WeightBytes(weight, dim);
    if (rows > 0) {
      state_->CheckArgLocked("RmsNorm", "x", x, Bytes4(rows * dim));
      state_->CheckArgLocked("RmsNorm", "weight", weight.data, weight_bytes);
      state_->CheckArgLocked("RmsNorm", "out", out, Bytes4(rows * dim));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kRmsNorm, .n = rows, .dim = dim, .weight = weight.dtype}, sid);
  }
  cpu::RmsNorm(x, weight, rows, dim, eps, out);
}

void MockGpuDevice::MatMul(const float* x, WeightRef w, WeightRef bias, int64_t n, int64_t in_dim, int64_t out_dim,
                           float* y, Stream* stream) {
  ODMOE_CHECK(n >= 0 && in_dim >= 0 && out_dim >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    const uint64_t w_bytes = MatrixBytes(w, out_dim, in_dim);
    const uint64_t scale_bytes = ScaleBytes(w, out_dim, in_dim);
    const uint64_t bias_bytes = bias.empty() ? 0 : WeightBytes(bias, out_dim);
    if (n > 0 && out_dim > 0) {
      state_->CheckArgLocked("MatMul", "x", x, Bytes4(n * in_dim));
      state_->CheckArgLocked("MatMul", "w", w.data, w_bytes);
      if (w.quantized()) state_->CheckArgLocked("MatMul", "w.scales", w.scales, scale_bytes);
      if (!bias.empty()) state_->CheckArgLocked("MatMul", "bias", bias.data, bias_bytes);
      state_->CheckArgLocked("MatMul", "y", y, Bytes4(n * out_dim));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kMatMul,
                                     .n = n,
                                     .in_dim = in_dim,
                                     .out_dim = out_dim,
                                     .weight = w.dtype,
                                     .has_bias = !bias.empty(),
                                     .bias = bias.empty() ? DType::kF32 : bias.dtype},
                             sid);
  }
  cpu::MatMul(x, w, bias, n, in_dim, out_dim, y);
}

void MockGpuDevice::Rope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                         Stream* stream) {
  ODMOE_CHECK(n >= 0 && heads >= 0 && head_dim > 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    const int64_t count = n * heads * head_dim;
    if (n > 0 && heads > 0) {
      state_->CheckArgLocked("Rope", "x", x, Bytes4(count));
      state_->CheckArgLocked("Rope", "positions", positions, Bytes4(n));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kRope, .n = n, .heads = heads, .head_dim = head_dim}, sid);
  }
  cpu::Rope(x, positions, n, heads, head_dim, theta);
}

void MockGpuDevice::Convert(const void* src, DType src_dtype, int64_t count, void* dst, DType dst_dtype,
                            Stream* stream) {
  ODMOE_CHECK(count >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    const uint64_t src_bytes = static_cast<uint64_t>(count) * DTypeSize(src_dtype);
    const uint64_t dst_bytes = static_cast<uint64_t>(count) * DTypeSize(dst_dtype);
    if (count > 0) {
      state_->CheckArgLocked("Convert", "src", src, src_bytes);
      state_->CheckArgLocked("Convert", "dst", dst, dst_bytes);
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kConvert, .count = count, .weight = src_dtype, .dst = dst_dtype},
                             sid);
  }
  cpu::Convert(src, src_dtype, count, dst, dst_dtype);
}

void MockGpuDevice::Attention(const float* q, KvCacheRef k_cache_ref, KvCacheRef v_cache_ref, int64_t n, int64_t past,
                              int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out,
                              Stream* stream) {
  ODMOE_CHECK(n >= 0 && past >= 0 && heads > 0 && kv_heads > 0 && head_dim > 0);
  // KvCacheDType's only answer here.
  ODMOE_CHECK(k_cache_ref.dtype == DType::kF32 && v_cache_ref.dtype == DType::kF32);
  const float* k_cache = static_cast<const float*>(k_cache_ref.data);
  const float* v_cache = static_cast<const float*>(v_cache_ref.data);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    const uint64_t q_bytes = Bytes4(n * heads * head_dim);
    const uint64_t kv_bytes = Bytes4((past + n) * kv_heads * head_dim);
    if (n > 0) {
      state_->CheckArgLocked("Attention", "q", q, q_bytes);
      state_->CheckArgLocked("Attention", "k_cache", k_cache, kv_bytes);
      state_->CheckArgLocked("Attention", "v_cache", v_cache, kv_bytes);
      state_->CheckArgLocked("Attention", "out", out, q_bytes);
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kAttention,
                                     .n = n,
                                     .heads = heads,
                                     .kv_heads = kv_heads,
                                     .head_dim = head_dim,
                                     .past = past},
                             sid);
  }
  cpu::Attention(q, k_cache, v_cache, n, past, heads, kv_heads, head_dim, scale, out);
}

void MockGpuDevice::RouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize,
                               int32_t* ids, float* weights, Stream* stream) {
  ODMOE_CHECK(n >= 0 && num_experts > 0 && k >= 1 && k <= num_experts);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    if (n > 0) {
      state_->CheckArgLocked("RouterTopK", "logits", logits, Bytes4(n * num_experts));
      state_->CheckArgLocked("RouterTopK", "ids", ids, Bytes4(n * k));
      state_->CheckArgLocked("RouterTopK", "weights", weights, Bytes4(n * k));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kRouterTopK, .n = n, .experts = num_experts, .k = k}, sid);
  }
  cpu::RouterTopK(logits, n, num_experts, k, renormalize, ids, weights);
}

void MockGpuDevice::SwiGlu(const float* gate, const float* up, int64_t count, float* out, Stream* stream) {
  ODMOE_CHECK(count >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    state_->CheckArgLocked("SwiGlu", "gate", gate, Bytes4(count));
    state_->CheckArgLocked("SwiGlu", "up", up, Bytes4(count));
    state_->CheckArgLocked("SwiGlu", "out", out, Bytes4(count));
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kSwiGlu, .count = count}, sid);
  }
  cpu::SwiGlu(gate, up, count, out);
}

void MockGpuDevice::Add(const float* x, int64_t count, float* y, Stream* stream) {
  ODMOE_CHECK(count >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    state_->CheckArgLocked("Add", "x", x, Bytes4(count));
    state_->CheckArgLocked("Add", "y", y, Bytes4(count));
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kAdd, .count = count}, sid);
  }
  cpu::Add(x, count, y);
}

void MockGpuDevice::GatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst,
                               Stream* stream) {
  ODMOE_CHECK(n >= 0 && dim >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    if (n > 0 && dim > 0) {
      state_->CheckArgLocked("GatherRows", "rows", rows, Bytes4(n));
      const int64_t max_row = state_->MaxIndexLocked("GatherRows", "rows", rows, n);
      state_->CheckArgLocked("GatherRows", "src", src, Bytes4((max_row + 1) * dim));
      state_->CheckArgLocked("GatherRows", "dst", dst, Bytes4(n * dim));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kGatherRows, .n = n, .dim = dim}, sid);
  }
  cpu::GatherRows(src, rows, n, dim, dst);
}

void MockGpuDevice::ScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                                     bool sigmoid_scale, float* dst, Stream* stream) {
  ODMOE_CHECK(n >= 0 && dim >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    if (n > 0 && dim > 0) {
      state_->CheckArgLocked("ScatterAddScaled", "src", src, Bytes4(n * dim));
      state_->CheckArgLocked("ScatterAddScaled", "rows", rows, Bytes4(n));
      state_->CheckArgLocked("ScatterAddScaled", "scale", scale, Bytes4(n));
      const int64_t max_row = state_->MaxIndexLocked("ScatterAddScaled", "rows", rows, n);
      state_->CheckArgLocked("ScatterAddScaled", "dst", dst, Bytes4((max_row + 1) * dim));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kScatterAddScaled, .n = n, .dim = dim}, sid);
  }
  cpu::ScatterAddScaled(src, rows, scale, n, dim, sigmoid_scale, dst);
}

void MockGpuDevice::ChangeLogits(float* logits, const LogitChange* changes, int64_t n, Stream* stream) {
  ODMOE_CHECK(n >= 0);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    if (n > 0) {
      state_->CheckArgLocked("ChangeLogits", "changes", changes, static_cast<uint64_t>(n) * sizeof(LogitChange));
      int64_t max_index = -1;
      for (int64_t i = 0; i < n; ++i) {
        if (changes[i].index < 0) {
          Die(StrCat("mock-gpu ChangeLogits: changes[", i, "].index = ", changes[i].index, " is negative"));
        }
        max_index = std::max<int64_t>(max_index, changes[i].index);
      }
      state_->CheckArgLocked("ChangeLogits", "logits", logits, Bytes4(max_index + 1));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kChangeLogits, .n = n}, sid);
  }
  cpu::ChangeLogits(logits, changes, n);
}

void MockGpuDevice::SelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices,
                                 int32_t* ids, Stream* stream) {
  ODMOE_CHECK(rows >= 0 && vocab >= 1);
  {
    absl::MutexLock lock(&state_->mu);
    const int sid = state_->StreamIdLocked(stream);
    if (rows > 0) {
      state_->CheckArgLocked("SelectTokens", "logits", logits, Bytes4(rows * vocab));
      state_->CheckArgLocked("SelectTokens", "choices", choices, static_cast<uint64_t>(rows) * sizeof(TokenChoice));
      state_->CheckArgLocked("SelectTokens", "ids", ids, Bytes4(rows));
    }
    NoteLaunches(1);
    state_->ScheduleOpLocked(OpShape{.kind = OpKind::kSelectTokens, .n = rows, .dim = vocab}, sid);
  }
  cpu::SelectTokens(logits, rows, vocab, choices, ids);
}

// ---- accounting and test hooks -----------------------------------------------------------------------------

std::map<std::string, int64_t> MockGpuDevice::op_counts() const {
  absl::MutexLock lock(&state_->mu);
  return state_->op_counts;
}

uint64_t MockGpuDevice::Checksum(const void* device_ptr, size_t bytes) const {
  absl::MutexLock lock(&state_->mu);
  state_->CheckArgLocked("Checksum", "device_ptr", device_ptr, bytes);
  return Fnv1a64(device_ptr, bytes);
}

bool MockGpuDevice::Contains(const void* ptr, size_t bytes) const {
  absl::MutexLock lock(&state_->mu);
  return state_->ContainsLocked(ptr, bytes);
}

double MockGpuDevice::virtual_time_s() const {
  absl::MutexLock lock(&state_->mu);
  return state_->host_time;
}

double MockGpuDevice::completion_time_s() const {
  absl::MutexLock lock(&state_->mu);
  return state_->latest_end;
}

double MockGpuDevice::StreamTime(Stream* stream) const {
  absl::MutexLock lock(&state_->mu);
  return state_->stream_time.at(state_->StreamIdLocked(stream));
}

int MockGpuDevice::StreamId(Stream* stream) const {
  absl::MutexLock lock(&state_->mu);
  return state_->StreamIdLocked(stream);
}

std::vector<MockGpuInterval> MockGpuDevice::timeline() const {
  absl::MutexLock lock(&state_->mu);
  return state_->timeline;
}

void MockGpuDevice::ClearTimeline() {
  absl::MutexLock lock(&state_->mu);
  state_->timeline.clear();
}

MockGpuStats MockGpuDevice::stats() const {
  absl::MutexLock lock(&state_->mu);
  return state_->stats;
}

double MockGpuDevice::ModeledBusyMs() const {
  const MockGpuStats s = stats();
  return 1000.0 * (s.compute_busy_s + s.h2d_busy_s + s.d2h_busy_s);
}

std::optional<double> ModeledBusyMs(const Device& device) {
  const auto* mock = dynamic_cast<const MockGpuDevice*>(&device);
  if (mock == nullptr) return std::nullopt;
  return mock->ModeledBusyMs();
}

}  // namespace odmoe
