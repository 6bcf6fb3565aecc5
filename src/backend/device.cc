#include "src/backend/device.h"

#include <cstddef>
#include <iterator>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {

absl::StatusOr<std::unique_ptr<ExpertTable>> Device::CreateExpertTable(std::span<const ExpertWeightRefs> experts,
                                                                       int64_t experts_per_layer, int64_t hidden,
                                                                       int64_t intermediate) {
  (void)experts;
  (void)experts_per_layer;
  (void)hidden;
  (void)intermediate;
  return absl::UnimplementedError(StrCat(name(), " computes routed experts only from ids on the host"));
}

void Device::RoutedExperts(const ExpertTable& table, int64_t layer, const float* x, int64_t n, int64_t k,
                           const int32_t* ids, const float* weights, float* act, float* y, float* out, Stream* stream) {
  (void)table, (void)layer, (void)x, (void)n, (void)k, (void)ids, (void)weights, (void)act, (void)y, (void)out;
  (void)stream;
  ODMOE_CHECK(false && "RoutedExperts on a device whose RoutedExpertsMaxTokens() is 0");
}

void Device::AddRmsNorm(const float* delta, float* x, WeightRef weight, int64_t rows, int64_t dim, float eps,
                        float* out, Stream* stream) {
  Add(delta, rows * dim, x, stream);
  RmsNorm(x, weight, rows, dim, eps, out, stream);
}

void Device::AddRmsNormRoute(const float* delta, float* x, WeightRef norm, WeightRef router, int64_t rows, int64_t dim,
                             float eps, int64_t num_experts, int64_t k, bool renormalize, float* h, float* logits,
                             int32_t* ids, float* weights, Stream* stream) {
  AddRmsNorm(delta, x, norm, rows, dim, eps, h, stream);
  MatMul(h, router, {}, rows, dim, num_experts, logits, stream);
  RouterTopK(logits, rows, num_experts, k, renormalize, ids, weights, stream);
}

void Device::HeadNormRope(float* q, float* k, WeightRef q_norm, WeightRef k_norm, const int32_t* positions, int64_t n,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, double theta, Stream* stream) {
  RmsNorm(q, q_norm, n * heads, head_dim, eps, q, stream);
  RmsNorm(k, k_norm, n * kv_heads, head_dim, eps, k, stream);
  Rope(q, positions, n, heads, head_dim, theta, stream);
  Rope(k, positions, n, kv_heads, head_dim, theta, stream);
}

absl::StatusOr<std::unique_ptr<Graph>> Device::CaptureGraph(Stream* stream,
                                                            const std::function<absl::Status()>& enqueue) {
  (void)stream, (void)enqueue;
  return absl::UnimplementedError(StrCat(name(), " runs every op when it is called: it has no graphs"));
}

void Device::LaunchGraph(const Graph& graph, Stream* stream) {
  (void)graph, (void)stream;
  ODMOE_CHECK(false && "LaunchGraph on a device without graphs");
}

void Device::WriteKvRows(const float* k_rows, const float* v_rows, const int32_t* positions, int64_t n, int64_t kv_size,
                         KvCacheRef k_cache, KvCacheRef v_cache, int64_t capacity, Stream* stream) {
  (void)k_rows, (void)v_rows, (void)positions, (void)n, (void)kv_size, (void)k_cache, (void)v_cache, (void)capacity,
      (void)stream;
  ODMOE_CHECK(false && "WriteKvRows on a device without graphs");
}

void Device::RopeWriteKv(float* q, float* k, const float* v, WeightRef q_norm, WeightRef k_norm, float eps,
                         const int32_t* positions, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         double theta, KvCacheRef k_cache, KvCacheRef v_cache, int64_t capacity, Stream* stream) {
  ODMOE_CHECK(q_norm.empty() == k_norm.empty());
  if (!q_norm.empty()) {
    HeadNormRope(q, k, q_norm, k_norm, positions, n, heads, kv_heads, head_dim, eps, theta, stream);
  } else {
    Rope(q, positions, n, heads, head_dim, theta, stream);
    Rope(k, positions, n, kv_heads, head_dim, theta, stream);
  }
  WriteKvRows(k, v, positions, n, kv_heads * head_dim, k_cache, v_cache, capacity, stream);
}

size_t Device::AttentionAtWorkspaceBytes(int64_t n, int64_t max_past, int64_t heads, int64_t head_dim) const {
  (void)n, (void)max_past, (void)heads, (void)head_dim;
  return 0;
}

void Device::AttentionAt(const float* q, KvCacheRef k_cache, KvCacheRef v_cache, int64_t n, const int32_t* past,
                         int64_t max_past, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                         void* workspace, float* out, Stream* stream) {
  (void)q, (void)k_cache, (void)v_cache, (void)n, (void)past, (void)max_past, (void)heads, (void)kv_heads;
  (void)head_dim, (void)scale, (void)workspace, (void)out, (void)stream;
  ODMOE_CHECK(false && "AttentionAt on a device without graphs");
}

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

absl::Status Device::RecordHostRange(const void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return absl::InvalidArgumentError("RegisterHostMemory: empty host range");
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  absl::MutexLock lock(&host_mu_);
  auto next = host_ranges_.lower_bound(start);
  const bool overlaps_next = next != host_ranges_.end() && next->first < start + bytes;
  const bool overlaps_prev = next != host_ranges_.begin() && std::prev(next)->first + std::prev(next)->second > start;
  if (overlaps_next || overlaps_prev) {
    return absl::InvalidArgumentError(
        StrCat("RegisterHostMemory: [", start, ", +", bytes, ") overlaps a registered host range"));
  }
  host_ranges_.emplace(start, bytes);
  return absl::OkStatus();
}

bool Device::ForgetHostRange(const void* p) {
  absl::MutexLock lock(&host_mu_);
  return host_ranges_.erase(reinterpret_cast<uintptr_t>(p)) > 0;
}

DeviceCounters Device::counters() const {
  DeviceCounters c;
  c.host_syncs = host_syncs_.load(std::memory_order_relaxed);
  c.allocations = allocations_.load(std::memory_order_relaxed);
  c.frees = frees_.load(std::memory_order_relaxed);
  c.launches = launches_.load(std::memory_order_relaxed);
  c.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  return c;
}

void Device::ResetCounters() {
  host_syncs_.store(0, std::memory_order_relaxed);
  allocations_.store(0, std::memory_order_relaxed);
  frees_.store(0, std::memory_order_relaxed);
  launches_.store(0, std::memory_order_relaxed);
  bytes_read_.store(0, std::memory_order_relaxed);
}

namespace {

// Plain heap memory (new[] aligns for any scalar the copies carry).
class HeapHostBuffer final : public HostBuffer {
 public:
  HeapHostBuffer(std::unique_ptr<std::byte[]> bytes, size_t size)
      : HostBuffer(bytes.get(), size), bytes_(std::move(bytes)) {}

 private:
  std::unique_ptr<std::byte[]> bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HostBuffer>> Device::AllocateHost(size_t bytes, std::string_view tag) {
  (void)tag;
  return std::make_unique<HeapHostBuffer>(std::make_unique<std::byte[]>(bytes), bytes);
}

absl::Status Device::RegisterHostMemory(const void* p, size_t bytes) { return RecordHostRange(p, bytes); }

void Device::UnregisterHostMemory(const void* p) { ForgetHostRange(p); }

bool Device::IsRegisteredHostMemory(const void* p, size_t bytes) const {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  absl::MutexLock lock(&host_mu_);
  auto it = host_ranges_.upper_bound(start);
  if (it == host_ranges_.begin()) return false;
  --it;
  return start >= it->first && start + bytes <= it->first + it->second;
}

uint64_t Device::registered_host_bytes() const {
  absl::MutexLock lock(&host_mu_);
  uint64_t total = 0;
  for (const auto& [start, bytes] : host_ranges_) total += bytes;
  return total;
}

absl::Status Device::PrepareStream(Stream* /*stream*/, int64_t /*max_rows*/, int64_t /*max_in_dim*/) {
  return absl::OkStatus();
}

}  // namespace odmoe
