// MockGpuDevice: the CPU math behind a device with its own memory, a hard capacity, and a simulated
// host<->device link on a deterministic virtual clock. Tests of the worker's budget, loading, eviction and
// stall accounting run on it in CI, without a GPU.
//
// Memory. Every Allocate is a separate host block (256-byte aligned) that only this device hands out; a
// registry of live blocks lets every op CHECK that each pointer it is given lies inside a live allocation of
// THIS device (a quantized weight's scales included), so an engine that passes host memory (or another
// device's memory) to an op aborts with a message naming the op and the argument. Data reaches the device only through CopyToDevice; ops compute
// (with the reference kernels of cpu_kernels.h, so results equal CpuDevice's bit for bit) on the bytes in
// the device's blocks. Allocations beyond `capacity_bytes` fail with ResourceExhausted naming the tag, the
// request and the bytes in use. New allocations are filled with 0xFF bytes (fp32 NaN, int32 -1) when
// `poison_allocations`, so reading device memory that was never written shows up as NaN.
//
// Virtual clock (no sleeps; the same calls give the same times). All work executes synchronously on the
// calling thread when it is enqueued; only its timing is simulated:
//  - Each Stream has a time: when the work enqueued on it so far completes. The host has a clock too, advanced
//    only by Synchronize, SynchronizeEvent, SynchronizeAll and CopyToHost; work cannot start before the host
//    clock (the host issued it then).
//  - CopyToDevice starts at max(stream time, host clock, time the H2D link is free) and ends
//    start + (h2d_latency_s + bytes / rate); all H2D copies share one link, so they serialise. The rate is
//    h2d_bytes_per_s (pinned) when the source lies in host memory registered with RegisterHostMemory, or when
//    h2d_pageable_bytes_per_s is 0 (the default: no distinction), and h2d_pageable_bytes_per_s otherwise.
//    CopyToHost likewise on its own D2H link, and then advances the host clock to its end.
//  - CopyOnDevice takes 2 * bytes / mem_bytes_per_s (read + write) on its stream, no link.
//  - An op starts at max(stream time, host clock) and takes max(flops / flops_per_s, bytes / mem_bytes_per_s)
//    with the flop and byte counts of src/backend/op_cost.h (MatMul: 2*n*in*out flops; weight bytes plus
//    activations). Ops on different streams overlap freely (no contention is modelled).
//  - RecordEvent captures the stream's time; WaitEvent advances the waiting stream to at least that time (an
//    event never recorded is complete at time 0).
// The durations above are the default cost model; MockGpuOptions::cost_model replaces them (copies keep their
// link and its serialisation, ops their stream), e.g. with a hardware profile's (src/backend/timed_device.h).
//
// Wall-clock pacing (MockGpuOptions::wall_clock, for emulating hardware in real time; off by default): the virtual
// clock then counts seconds of that clock. Work cannot start before the host issued it, now on the wall clock
// (the host clock advances to it at every enqueue), and every call that waits for work (Synchronize,
// SynchronizeEvent, SynchronizeAll, CopyToHost) returns no earlier than the work's modelled end, sleeping on the
// wall clock outside the mutex. The math itself still runs at once, when the work is enqueued.
//
// Thread safety: all methods may be called from any thread (e.g. a loader thread copying experts while a
// compute thread runs ops); one mutex guards the registry, clocks, timeline and counters, and kernels and
// memcpy run outside it. With several threads the virtual times depend on the order in which calls arrive.
// Buffers, streams and events may outlive the device (they share its state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/backend/device.h"
#include "src/backend/op_cost.h"

namespace odmoe {

// The wall clock a paced mock GPU waits on. Seconds since an origin of the clock's choosing (the device's virtual
// clock starts at 0, so a clock made with the device should start near 0). Thread-safe.
class WallClock {
 public:
  virtual ~WallClock() = default;
  virtual double NowSeconds() = 0;
  // Returns when NowSeconds() >= seconds (at once when that has passed).
  virtual void SleepUntil(double seconds) = 0;
};

// std::chrono::steady_clock, counted from when it was made.
std::shared_ptr<WallClock> NewSteadyWallClock();

// Defaults: a 16 GiB card on PCIe 4.0 x16 (about 25 GB/s achieved each way, 10 us per copy), 50 TFLOP/s and
// 900 GB/s of memory bandwidth (a consumer GPU of the RTX 30/40 class).
struct MockGpuOptions {
  // Pageable / pinned host-to-device bandwidth measured on the reference H100 (8.8 / 55 GB/s).
  static constexpr double kPageableFraction = 8.8 / 55.0;

  uint64_t capacity_bytes = uint64_t{16} << 30;
  double h2d_bytes_per_s = 25e9;  // from registered (pinned) host memory
  // From pageable host memory (not registered); 0: the same as h2d_bytes_per_s. The reference H100 measures
  // ~55 GB/s pinned and ~8.8 GB/s pageable (kPageableFraction of it).
  double h2d_pageable_bytes_per_s = 0;
  double h2d_latency_s = 10e-6;
  double d2h_bytes_per_s = 25e9;
  double d2h_latency_s = 10e-6;
  double flops_per_s = 50e12;
  double mem_bytes_per_s = 900e9;
  bool record_timeline = true;     // false: timeline() stays empty (long runs)
  bool poison_allocations = true;  // fill new allocations with 0xFF bytes
  // How long ops and copies take; nullptr: the roofline over the figures above (see the file comment).
  std::shared_ptr<const CostModel> cost_model;
  // Paces the virtual clock to this clock (see the file comment); nullptr: virtual time only, no waits.
  std::shared_ptr<WallClock> wall_clock;
  std::string name;  // what name() says; empty: "mock-gpu (CAPACITY GiB, H2D RATE GB/s)"
};

enum class MockGpuWork { kH2D, kD2H, kD2D, kCompute };
std::string_view MockGpuWorkName(MockGpuWork kind);  // "h2d", "d2h", "d2d", "compute"

// One piece of work on the virtual clock.
struct MockGpuInterval {
  MockGpuWork kind = MockGpuWork::kCompute;
  std::string op;     // "CopyToDevice", "CopyToHost", "CopyOnDevice", or the op's name ("MatMul", ...)
  int stream_id = 0;  // 0: the default stream; see MockGpuDevice::StreamId
  double start_s = 0;
  double end_s = 0;
  uint64_t bytes = 0;  // bytes copied, or bytes an op reads and writes
  double flops = 0;    // ops only

  bool operator==(const MockGpuInterval&) const = default;
};

struct MockGpuStats {
  TransferStats transfers;
  uint64_t ops = 0;                 // compute ops run
  uint64_t allocations = 0;         // successful Allocate calls
  uint64_t failed_allocations = 0;  // Allocate calls refused for capacity
  double h2d_busy_s = 0;            // total time the H2D link was busy
  double d2h_busy_s = 0;            // total time the D2H link was busy
  double compute_busy_s = 0;        // sum of op durations (over all streams)
};

// FNV-1a, 64 bit, of `bytes` bytes at `data` (host memory). MockGpuDevice::Checksum gives the same value for
// device memory holding the same bytes.
uint64_t Fnv1a64(const void* data, size_t bytes);

class MockGpuDevice final : public Device {
 public:
  explicit MockGpuDevice(MockGpuOptions options = {});
  ~MockGpuDevice() override;

  DeviceKind kind() const override { return DeviceKind::kMockGpu; }
  std::string name() const override;
  const MockGpuOptions& options() const { return options_; }

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes, std::string_view tag) override;
  MemoryInfo memory_info() const override;
  void ResetPeak() override;

  std::unique_ptr<Stream> CreateStream() override;
  std::unique_ptr<Event> CreateEvent() override;
  void RecordEvent(Event& event, Stream* stream) override;
  void WaitEvent(Stream* stream, Event& event) override;
  void SynchronizeEvent(Event& event) override;
  void Synchronize(Stream* stream) override;
  void SynchronizeAll() override;

  void CopyToDevice(void* dst, const void* src, size_t bytes, Stream* stream) override;
  void CopyToHost(void* dst, const void* src, size_t bytes, Stream* stream) override;
  void CopyOnDevice(void* dst, const void* src, size_t bytes, Stream* stream) override;
  TransferStats transfer_stats() const override;

  void Embedding(const int32_t* ids, int64_t n, WeightRef table, int64_t dim, float* out, Stream* stream) override;
  void RmsNorm(const float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out,
               Stream* stream) override;
  void MatMul(const float* x, WeightRef w, WeightRef bias, int64_t n, int64_t in_dim, int64_t out_dim, float* y,
              Stream* stream) override;
  void Rope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
            Stream* stream) override;
  void Convert(const void* src, DType src_dtype, int64_t count, void* dst, DType dst_dtype, Stream* stream) override;
  void Attention(const float* q, KvCacheRef k_cache, KvCacheRef v_cache, int64_t n, int64_t past, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, float scale, float* out, Stream* stream) override;
  void RouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize, int32_t* ids,
                  float* weights, Stream* stream) override;
  void SwiGlu(const float* gate, const float* up, int64_t count, float* out, Stream* stream) override;
  void Add(const float* x, int64_t count, float* y, Stream* stream) override;
  void GatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst, Stream* stream) override;
  void ScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                        bool sigmoid_scale, float* dst, Stream* stream) override;
  void ChangeLogits(float* logits, const LogitChange* changes, int64_t n, Stream* stream) override;
  void SelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices, int32_t* ids,
                    Stream* stream) override;

  std::map<std::string, int64_t> op_counts() const override;

  // ---- test hooks ------------------------------------------------------------------------------------------
  // Fnv1a64 of device memory. REQUIRES (CHECK): [device_ptr, device_ptr + bytes) lies in a live allocation.
  uint64_t Checksum(const void* device_ptr, size_t bytes) const;
  // True if [ptr, ptr + bytes) lies inside one live allocation of this device.
  bool Contains(const void* ptr, size_t bytes) const;
  // The host clock: the latest completion the host has waited for (Synchronize, SynchronizeAll, CopyToHost).
  double virtual_time_s() const;
  // When all work enqueued so far on any stream completes (>= virtual_time_s()).
  double completion_time_s() const;
  // When the work enqueued so far on `stream` (nullptr: the default stream) completes.
  double StreamTime(Stream* stream) const;
  // The id timeline intervals carry for `stream`: 0 for the default stream (nullptr), then 1, 2, ... in order
  // of CreateStream.
  int StreamId(Stream* stream) const;
  // Every copy and op so far, in the order they were enqueued.
  std::vector<MockGpuInterval> timeline() const;
  void ClearTimeline();
  MockGpuStats stats() const;
  // The modelled busy time so far, in ms: every op's duration plus both links' busy time, summed (work that
  // overlapped on different streams or links counts once for each).
  double ModeledBusyMs() const;

  // The state shared with this device's buffers, streams and events (defined in mock_gpu_device.cc).
  struct State;

 private:
  const MockGpuOptions options_;
  std::shared_ptr<State> state_;
};

// `device`'s modelled busy time so far (MockGpuDevice::ModeledBusyMs) where it is a mock or timed GPU; nullopt
// on every other device, whose time is not modelled.
std::optional<double> ModeledBusyMs(const Device& device);

}  // namespace odmoe
