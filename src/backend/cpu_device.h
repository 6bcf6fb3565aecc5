// CpuDevice: the fp32 reference backend. Device memory is host memory (64-byte aligned), every op runs the
// reference kernel of src/backend/cpu_kernels.h synchronously on the calling thread, streams and events are
// trivial (everything is already complete when a call returns), and copies are memcpy counted in
// TransferStats (CopyToDevice as host-to-device, CopyToHost as device-to-host).
//
// Because its memory is host memory, ops accept any host pointer (a memory-mapped checkpoint included).
//
// Thread safety: all methods may be called from any thread; the accounting (memory, transfers, op counts) is
// guarded by one mutex. Ops on the same memory from several threads must be ordered by the caller.
// Buffers may outlive the device (their accounting state is shared).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "src/backend/device.h"

namespace odmoe {

class CpuDevice final : public Device {
 public:
  // `capacity_bytes`: the most bytes Allocate may hand out at once; 0 means no limit.
  explicit CpuDevice(uint64_t capacity_bytes = 0);
  ~CpuDevice() override;

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override;

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

  // The accounting shared with this device's buffers (defined in cpu_device.cc).
  struct State;

 private:
  void CountOp(const char* op);

  std::shared_ptr<State> state_;
};

}  // namespace odmoe
