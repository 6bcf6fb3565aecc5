#include "src/backend/cpu_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "src/backend/cpu_kernels.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {

struct CpuDevice::State {
  explicit State(uint64_t capacity_bytes) : capacity(capacity_bytes) {}

  const uint64_t capacity;  // 0: no limit
  mutable absl::Mutex mu;
  uint64_t in_use ABSL_GUARDED_BY(mu) = 0;
  uint64_t peak ABSL_GUARDED_BY(mu) = 0;
  TransferStats transfers ABSL_GUARDED_BY(mu);
  std::map<std::string, int64_t> op_counts ABSL_GUARDED_BY(mu);
};

namespace {

constexpr size_t kAlignment = 64;

std::string FormatBytes(uint64_t bytes) {
  return absl::StrFormat("%d bytes (%.1f MiB)", bytes, static_cast<double>(bytes) / (1024.0 * 1024.0));
}

class CpuBuffer final : public Buffer {
 public:
  CpuBuffer(void* data, size_t size, std::shared_ptr<CpuDevice::State> state)
      : Buffer(data, size), state_(std::move(state)) {}
  ~CpuBuffer() override {
    {
      absl::MutexLock lock(&state_->mu);
      state_->in_use -= size();
    }
    std::free(data());
  }

 private:
  std::shared_ptr<CpuDevice::State> state_;
};

class CpuStream final : public Stream {};
class CpuEvent final : public Event {};

}  // namespace

CpuDevice::CpuDevice(uint64_t capacity_bytes) : state_(std::make_shared<State>(capacity_bytes)) {}
CpuDevice::~CpuDevice() = default;

std::string CpuDevice::name() const {
  if (state_->capacity == 0) return "cpu";
  return StrCat("cpu (capacity ", FormatBytes(state_->capacity), ")");
}

absl::StatusOr<std::unique_ptr<Buffer>> CpuDevice::Allocate(size_t bytes, std::string_view tag) {
  {
    absl::MutexLock lock(&state_->mu);
    if (state_->capacity != 0 && bytes > state_->capacity - std::min(state_->capacity, state_->in_use)) {
      return absl::ResourceExhaustedError(StrCat("cpu device: cannot allocate ", FormatBytes(bytes), " for '", tag,
                                                 "': ", FormatBytes(state_->in_use), " of its capacity of ",
                                                 FormatBytes(state_->capacity), " are in use"));
    }
    state_->in_use += bytes;
    state_->peak = std::max(state_->peak, state_->in_use);
  }
  // aligned_alloc wants a size that is a multiple of the alignment (and we never hand out nullptr).
  const size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  void* data = std::aligned_alloc(kAlignment, rounded);
  if (data == nullptr) {
    absl::MutexLock lock(&state_->mu);
    state_->in_use -= bytes;
    return absl::ResourceExhaustedError(
        StrCat("cpu device: the host is out of memory allocating ", FormatBytes(bytes), " for '", tag, "'"));
  }
  NoteAllocation();
  return std::unique_ptr<Buffer>(new CpuBuffer(data, bytes, state_));
}

MemoryInfo CpuDevice::memory_info() const {
  absl::MutexLock lock(&state_->mu);
  return MemoryInfo{state_->capacity, state_->in_use, state_->peak};
}

void CpuDevice::ResetPeak() {
  absl::MutexLock lock(&state_->mu);
  state_->peak = state_->in_use;
}

std::unique_ptr<Stream> CpuDevice::CreateStream() { return std::make_unique<CpuStream>(); }
std::unique_ptr<Event> CpuDevice::CreateEvent() { return std::make_unique<CpuEvent>(); }
// Work is complete when enqueued, so ordering needs nothing.
void CpuDevice::RecordEvent(Event&, Stream*) {}
void CpuDevice::WaitEvent(Stream*, Event&) {}
void CpuDevice::SynchronizeEvent(Event&) { NoteHostSync(); }
void CpuDevice::Synchronize(Stream*) { NoteHostSync(); }
void CpuDevice::SynchronizeAll() { NoteHostSync(); }

void CpuDevice::CopyToDevice(void* dst, const void* src, size_t bytes, Stream*) {
  if (bytes > 0) {
    ODMOE_CHECK(dst != nullptr && src != nullptr);
    std::memcpy(dst, src, bytes);
  }
  absl::MutexLock lock(&state_->mu);
  state_->transfers.h2d_bytes += bytes;
  ++state_->transfers.h2d_copies;
}

void CpuDevice::CopyToHost(void* dst, const void* src, size_t bytes, Stream*) {
  if (bytes > 0) {
    ODMOE_CHECK(dst != nullptr && src != nullptr);
    std::memcpy(dst, src, bytes);
  }
  NoteHostSync();
  NoteBytesRead(bytes);
  absl::MutexLock lock(&state_->mu);
  state_->transfers.d2h_bytes += bytes;
  ++state_->transfers.d2h_copies;
}

void CpuDevice::CopyOnDevice(void* dst, const void* src, size_t bytes, Stream*) {
  NoteBytesRead(bytes);
  if (bytes > 0) {
    ODMOE_CHECK(dst != nullptr && src != nullptr);
    std::memmove(dst, src, bytes);
  }
  absl::MutexLock lock(&state_->mu);
  state_->transfers.d2d_bytes += bytes;
  ++state_->transfers.d2d_copies;
}

TransferStats CpuDevice::transfer_stats() const {
  absl::MutexLock lock(&state_->mu);
  return state_->transfers;
}

void CpuDevice::CountOp(const char* op) {
  NoteLaunches(1);
  absl::MutexLock lock(&state_->mu);
  ++state_->op_counts[op];
}

std::map<std::string, int64_t> CpuDevice::op_counts() const {
  absl::MutexLock lock(&state_->mu);
  return state_->op_counts;
}

void CpuDevice::Embedding(const int32_t* ids, int64_t n, WeightRef table, int64_t dim, float* out, Stream*) {
  CountOp("Embedding");
  cpu::Embedding(ids, n, table, dim, out);
}

void CpuDevice::RmsNorm(const float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out, Stream*) {
  CountOp("RmsNorm");
  cpu::RmsNorm(x, weight, rows, dim, eps, out);
}

void CpuDevice::MatMul(const float* x, WeightRef w, WeightRef bias, int64_t n, int64_t in_dim, int64_t out_dim,
                       float* y, Stream*) {
  CountOp("MatMul");
  cpu::MatMul(x, w, bias, n, in_dim, out_dim, y);
}

void CpuDevice::Rope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                     Stream*) {
  CountOp("Rope");
  cpu::Rope(x, positions, n, heads, head_dim, theta);
}

void CpuDevice::Convert(const void* src, DType src_dtype, int64_t count, void* dst, DType dst_dtype, Stream*) {
  CountOp("Convert");
  cpu::Convert(src, src_dtype, count, dst, dst_dtype);
}

void CpuDevice::Attention(const float* q, KvCacheRef k_cache, KvCacheRef v_cache, int64_t n, int64_t past,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, float* out, Stream*) {
  CountOp("Attention");
  ODMOE_CHECK(k_cache.dtype == DType::kF32 && v_cache.dtype == DType::kF32);  // KvCacheDType's only answer here
  cpu::Attention(q, static_cast<const float*>(k_cache.data), static_cast<const float*>(v_cache.data), n, past, heads,
                 kv_heads, head_dim, scale, out);
}

void CpuDevice::RouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize,
                           int32_t* ids, float* weights, Stream*) {
  CountOp("RouterTopK");
  cpu::RouterTopK(logits, n, num_experts, k, renormalize, ids, weights);
}

void CpuDevice::SwiGlu(const float* gate, const float* up, int64_t count, float* out, Stream*) {
  CountOp("SwiGlu");
  cpu::SwiGlu(gate, up, count, out);
}

void CpuDevice::Add(const float* x, int64_t count, float* y, Stream*) {
  CountOp("Add");
  cpu::Add(x, count, y);
}

void CpuDevice::GatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst, Stream*) {
  CountOp("GatherRows");
  cpu::GatherRows(src, rows, n, dim, dst);
}

void CpuDevice::ScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                                 bool sigmoid_scale, float* dst, Stream*) {
  CountOp("ScatterAddScaled");
  cpu::ScatterAddScaled(src, rows, scale, n, dim, sigmoid_scale, dst);
}

void CpuDevice::ChangeLogits(float* logits, const LogitChange* changes, int64_t n, Stream*) {
  CountOp("ChangeLogits");
  cpu::ChangeLogits(logits, changes, n);
}

void CpuDevice::SelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices, int32_t* ids,
                             Stream*) {
  CountOp("SelectTokens");
  cpu::SelectTokens(logits, rows, vocab, choices, ids);
}

}  // namespace odmoe
