// The CUDA runtime functions odmoe calls, over host memory. Every operation runs when it is issued, so streams
// run in order (and in issue order with each other); events and synchronisation are immediate. Device
// allocations are mappings with an inaccessible page on each side; freed ones stay inaccessible (quarantine) so a
// use after free faults in fast mode and is named in checked mode.
//
// Stream-ordered allocation (cudaMallocAsync, cudaMallocFromPoolAsync, cudaFreeAsync) goes through memory pools
// that keep the hardware's books: a pool reserves device memory in 2 MiB granules as its allocations need it, keeps
// what frees return, and gives back what it holds above its release threshold at the next host synchronization
// (stream, event or device) or cudaMemPoolTrimTo. cudaMemGetInfo counts what pools reserve, not what is allocated
// from them. Each allocation still gets its own mapping, so bounds and use-after-free checks are the same as for
// cudaMalloc; only the books are pooled.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "src/internal.h"

struct CUstream_st {
  unsigned flags;
};
struct CUevent_st {
  unsigned flags;
};
// A memory pool (cudaMemPoolCreate, or the device's default pool). Fields guarded by simt::detail::mu.
struct CUmemPoolHandle_st {
  bool is_default = false;
  bool destroyed = false;          // cudaMemPoolDestroy came while allocations were live: deleted with the last
  uint64_t release_threshold = 0;  // cudaMemPoolAttrReleaseThreshold
  uint64_t reserved = 0;           // device memory the pool holds (granules)
  uint64_t reserved_high = 0;
  uint64_t used = 0;  // bytes of its live allocations, as asked
  uint64_t used_high = 0;
  size_t live = 0;  // live allocations
  // cudaMemPoolReuseFollowEventDependencies, ...AllowOpportunistic, ...AllowInternalDependencies: kept, not used.
  int reuse[3] = {1, 1, 1};
};

namespace simt::detail {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kTotalMemory = size_t{80} << 30;             // what cudaMemGetInfo reports: an H100's 80 GB
constexpr size_t kQuarantineAddressSpace = size_t{64} << 30;  // freed mappings kept inaccessible, then unmapped
constexpr size_t kDefaultSharedLimit = 48 * 1024;
constexpr size_t kMaxSharedOptIn = 227 * 1024;  // sm_90: 232448 bytes per block with the opt-in

constexpr uint64_t kPoolGranule = uint64_t{2} << 20;  // what a pool reserves at a time

struct Allocation {
  size_t size;    // as asked
  char* mapping;  // guard page, data pages, guard page
  size_t mapping_bytes;
  bool freed;
  cudaMemPool_t pool;  // the pool it came from; null for cudaMalloc
};

std::mutex mu;
std::map<const char*, Allocation> allocations;  // by base address (guarded by mu)
size_t allocated = 0;                           // bytes of live cudaMalloc allocations
size_t pool_reserved = 0;                       // bytes all pools reserve
size_t quarantined = 0;
CUmemPoolHandle_st default_pool{.is_default = true};
std::set<cudaMemPool_t> pools = {&default_pool};  // live pools (guarded by mu)
std::map<const void*, size_t> shared_limit;       // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
std::map<const char*, size_t> pinned_host;        // cudaHostRegister and cudaMallocHost ranges: start -> bytes
std::set<const void*> malloc_host;                // the cudaMallocHost ones
int current_device = 0;

thread_local cudaError_t last_error = cudaSuccess;
cudaError_t sticky_error = cudaSuccess;

cudaError_t Fail(cudaError_t err) {
  SetLastError(err);
  return err;
}

cudaError_t Status() { return sticky_error; }

uint64_t RoundUpToGranule(uint64_t bytes) { return (bytes + kPoolGranule - 1) / kPoolGranule * kPoolGranule; }

// Gives back what `pool` reserves above max(keep, what its allocations need). REQUIRES: mu held.
void TrimLocked(cudaMemPool_t pool, uint64_t keep) {
  const uint64_t target = std::max(RoundUpToGranule(pool->used), RoundUpToGranule(keep));
  if (pool->reserved <= target) return;
  pool_reserved -= pool->reserved - target;
  pool->reserved = target;
}

// A host synchronization: counted; every pool gives back what it holds above its release threshold (as the
// hardware's pools do at a synchronization); then the sticky error.
cudaError_t HostSync() {
  CountHostSync();
  {
    std::lock_guard<std::mutex> lock(mu);
    for (cudaMemPool_t pool : pools) TrimLocked(pool, pool->release_threshold);
  }
  return Status();
}

// Maps `size` bytes of device memory with a guard page on each side and records it, counted as an allocation.
// REQUIRES: mu held (and HoldLaunches()); size > 0.
cudaError_t MapLocked(size_t size, cudaMemPool_t pool, void** ptr) {
  const size_t data_pages = (size + kPage - 1) / kPage * kPage;
  const size_t bytes = data_pages + 2 * kPage;
  // Checked mode: the guard pages stay accessible so the checker's report comes instead of a fault.
  void* m = mmap(nullptr, bytes, checked_mode ? PROT_READ | PROT_WRITE : PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return Fail(cudaErrorMemoryAllocation);
  char* mapping = static_cast<char*>(m);
  if (!checked_mode && mprotect(mapping + kPage, data_pages, PROT_READ | PROT_WRITE) != 0) {
    munmap(m, bytes);
    return Fail(cudaErrorMemoryAllocation);
  }
  char* base = mapping + kPage;
  allocations[base] = Allocation{size, mapping, bytes, false, pool};
  OnDeviceMemoryChanged(nullptr);
  *ptr = base;
  CountAllocation();
  return cudaSuccess;
}

// Marks the allocation at `it` freed (its range reserved and inaccessible, without its memory) and returns its
// bytes to cudaMalloc's books or its pool. REQUIRES: mu held (and HoldLaunches()); not freed yet.
void UnmapLocked(std::map<const char*, Allocation>::iterator it) {
  Allocation& a = it->second;
  a.freed = true;
  CountFree();
  OnDeviceMemoryChanged(it->first);
  if (a.pool == nullptr) {
    allocated -= a.size;
  } else {
    cudaMemPool_t pool = a.pool;
    pool->used -= a.size;
    if (--pool->live == 0 && pool->destroyed) {
      pool_reserved -= pool->reserved;
      pools.erase(pool);
      delete pool;
    }
    a.pool = nullptr;
  }
  madvise(a.mapping, a.mapping_bytes, MADV_DONTNEED);
  if (!checked_mode) mprotect(a.mapping, a.mapping_bytes, PROT_NONE);
  quarantined += a.mapping_bytes;
  while (quarantined > kQuarantineAddressSpace) {
    // Release the oldest-addressed freed mappings (any order is fine; this bounds address space only).
    for (auto q = allocations.begin(); q != allocations.end(); ++q) {
      if (q->second.freed && q != it) {
        munmap(q->second.mapping, q->second.mapping_bytes);
        quarantined -= q->second.mapping_bytes;
        allocations.erase(q);
        break;
      }
    }
    break;
  }
}

// An allocation from `pool` in stream order (the stream is not needed: everything runs when issued). The pool
// reserves more granules when what it holds does not cover its live allocations plus this one.
cudaError_t PoolAllocate(void** ptr, size_t size, cudaMemPool_t pool) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  const auto launches = HoldLaunches();
  std::lock_guard<std::mutex> lock(mu);
  if (pools.count(pool) == 0 || pool->destroyed) return Fail(cudaErrorInvalidValue);
  const uint64_t need = RoundUpToGranule(pool->used + size);
  const uint64_t grow = need > pool->reserved ? need - pool->reserved : 0;
  if (grow > kTotalMemory - allocated - pool_reserved) return Fail(cudaErrorMemoryAllocation);
  const cudaError_t err = MapLocked(size, pool, ptr);
  if (err != cudaSuccess) return err;
  pool->reserved += grow;
  pool_reserved += grow;
  pool->reserved_high = std::max(pool->reserved_high, pool->reserved);
  pool->used += size;
  pool->used_high = std::max(pool->used_high, pool->used);
  ++pool->live;
  return cudaSuccess;
}

}  // namespace

void SetLastError(cudaError_t err, bool sticky) {
  last_error = err;
  if (sticky) sticky_error = err;
}

cudaError_t CheckLaunch(const LaunchSite& site, const void* func, dim3 grid, dim3 block, size_t dynamic_smem,
                        cudaStream_t) {
  (void)site;
  if (sticky_error != cudaSuccess) return sticky_error;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  size_t limit = kDefaultSharedLimit;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = shared_limit.find(func);
    if (it != shared_limit.end()) limit = it->second;
  }
  if (dynamic_smem > limit) return cudaErrorInvalidValue;
  return cudaSuccess;
}

bool IsPinnedHost(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(mu);
  auto next = pinned_host.upper_bound(c);
  if (next == pinned_host.begin()) return false;
  auto it = std::prev(next);
  return c + bytes <= it->first + it->second;
}

AllocationView FindAllocation(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(mu);
  auto next = allocations.upper_bound(c);  // the first allocation starting after c
  if (next != allocations.end() && c + bytes > next->second.mapping) {
    // Reaches into the guard page before `next`.
    const Allocation& n = next->second;
    return {n.freed ? AllocationView::Status::kFreed : AllocationView::Status::kOutOfBounds, next->first, n.size};
  }
  AllocationView none;
  none.gap_hi = next != allocations.end() ? reinterpret_cast<uintptr_t>(next->second.mapping) : UINTPTR_MAX;
  if (next == allocations.begin()) return none;
  auto it = std::prev(next);
  const Allocation& a = it->second;
  if (c >= a.mapping + a.mapping_bytes) {
    none.gap_lo = reinterpret_cast<uintptr_t>(a.mapping + a.mapping_bytes);
    return none;
  }
  if (a.freed) return {AllocationView::Status::kFreed, it->first, a.size};
  if (c + bytes <= it->first + a.size) return {AllocationView::Status::kInside, it->first, a.size};
  return {AllocationView::Status::kOutOfBounds, it->first, a.size};
}

}  // namespace simt::detail

using namespace simt::detail;  // NOLINT: the definitions below are the C API's

extern "C" {

cudaError_t cudaGetLastError() {
  const cudaError_t e = last_error;
  last_error = sticky_error;
  return e;
}
cudaError_t cudaPeekAtLastError() { return last_error; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered:
      return "cudaErrorHostMemoryNotRegistered";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    default:
      return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorNotSupported:
      return "operation not supported";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    default:
      return "unknown error";
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device) {
  if (device != 0 || len <= 0) return Fail(cudaErrorInvalidValue);
  std::snprintf(bus_id, static_cast<size_t>(len), "0000:00:00.0");
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrHostRegisterReadOnlySupported:
      *value = 1;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(kMaxSharedOptIn);
      break;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      break;
    case cudaDevAttrWarpSize:
      *value = 32;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      break;
    default:
      *value = 0;
      break;
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof *prop);
  std::snprintf(prop->name, sizeof prop->name, "SIMT emulated device");
  prop->totalGlobalMem = kTotalMemory;
  prop->sharedMemPerBlock = kDefaultSharedLimit;
  prop->sharedMemPerBlockOptin = kMaxSharedOptIn;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->totalConstMem = 65536;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->maxThreadsPerMultiProcessor = 2048;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  const auto launches = HoldLaunches();
  std::lock_guard<std::mutex> lock(mu);
  if (size > kTotalMemory - allocated - pool_reserved) return Fail(cudaErrorMemoryAllocation);
  const cudaError_t err = MapLocked(size, nullptr, ptr);
  if (err == cudaSuccess) allocated += size;
  return err;
}

// Any device allocation, a pool's too; it waits for the device.
cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  const auto launches = HoldLaunches();
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(static_cast<const char*>(p));
  if (it == allocations.end() || it->second.freed) return Fail(cudaErrorInvalidValue);
  CountHostSync();  // cudaFree waits for the device
  UnmapLocked(it);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (pool == nullptr) return Fail(cudaErrorInvalidValue);
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  *pool = &default_pool;
  return cudaSuccess;
}
// The device's current pool: always the default one here (cudaDeviceSetMemPool is not emulated).
cudaError_t cudaDeviceGetMemPool(cudaMemPool_t* pool, int device) { return cudaDeviceGetDefaultMemPool(pool, device); }

cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
  if (pool == nullptr || props == nullptr) return Fail(cudaErrorInvalidValue);
  if (props->allocType != cudaMemAllocationTypePinned || props->location.type != cudaMemLocationTypeDevice) {
    return Fail(cudaErrorInvalidValue);
  }
  if (props->location.id != 0) return Fail(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> lock(mu);
  *pool = new CUmemPoolHandle_st;
  pools.insert(*pool);
  return cudaSuccess;
}

// As on the hardware, a pool destroyed with live allocations goes when the last of them is freed.
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
  std::lock_guard<std::mutex> lock(mu);
  if (pools.count(pool) == 0 || pool->is_default || pool->destroyed) return Fail(cudaErrorInvalidValue);
  if (pool->live > 0) {
    pool->destroyed = true;
    return cudaSuccess;
  }
  pool_reserved -= pool->reserved;
  pools.erase(pool);
  delete pool;
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (value == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mu);
  if (pools.count(pool) == 0) return Fail(cudaErrorInvalidValue);
  const uint64_t v64 = *static_cast<const uint64_t*>(value);
  switch (attr) {
    case cudaMemPoolReuseFollowEventDependencies:
    case cudaMemPoolReuseAllowOpportunistic:
    case cudaMemPoolReuseAllowInternalDependencies:
      pool->reuse[attr - cudaMemPoolReuseFollowEventDependencies] = *static_cast<const int*>(value) != 0 ? 1 : 0;
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      pool->release_threshold = v64;
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh:  // only a reset (to 0) may be set
      if (v64 != 0) return Fail(cudaErrorInvalidValue);
      pool->reserved_high = pool->reserved;
      return cudaSuccess;
    case cudaMemPoolAttrUsedMemHigh:
      if (v64 != 0) return Fail(cudaErrorInvalidValue);
      pool->used_high = pool->used;
      return cudaSuccess;
    default:
      return Fail(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (value == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mu);
  if (pools.count(pool) == 0) return Fail(cudaErrorInvalidValue);
  uint64_t* v64 = static_cast<uint64_t*>(value);
  switch (attr) {
    case cudaMemPoolReuseFollowEventDependencies:
    case cudaMemPoolReuseAllowOpportunistic:
    case cudaMemPoolReuseAllowInternalDependencies:
      *static_cast<int*>(value) = pool->reuse[attr - cudaMemPoolReuseFollowEventDependencies];
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      *v64 = pool->release_threshold;
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemCurrent:
      *v64 = pool->reserved;
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh:
      *v64 = pool->reserved_high;
      return cudaSuccess;
    case cudaMemPoolAttrUsedMemCurrent:
      *v64 = pool->used;
      return cudaSuccess;
    case cudaMemPoolAttrUsedMemHigh:
      *v64 = pool->used_high;
      return cudaSuccess;
    default:
      return Fail(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep) {
  std::lock_guard<std::mutex> lock(mu);
  if (pools.count(pool) == 0) return Fail(cudaErrorInvalidValue);
  TrimLocked(pool, min_bytes_to_keep);
  return cudaSuccess;
}

cudaError_t cudaMallocFromPoolAsync(void** ptr, size_t size, cudaMemPool_t pool, cudaStream_t) {
  return PoolAllocate(ptr, size, pool);
}
cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t) { return PoolAllocate(ptr, size, &default_pool); }

// Only memory from a pool; in stream order, so the host does not wait (not a host synchronization).
cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  if (p == nullptr) return cudaSuccess;
  const auto launches = HoldLaunches();
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(static_cast<const char*>(p));
  if (it == allocations.end() || it->second.freed || it->second.pool == nullptr) return Fail(cudaErrorInvalidValue);
  UnmapLocked(it);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(mu);
  *free_bytes = kTotalMemory - allocated - pool_reserved;
  *total_bytes = kTotalMemory;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  CountCopy(dst, src, n, /*synchronous=*/true);
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  CountCopy(dst, src, n, /*synchronous=*/false);
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* dst, int value, size_t n) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr) return Fail(cudaErrorInvalidValue);
  CountMemset(dst, n);
  std::memset(dst, value, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* dst, int value, size_t n, cudaStream_t) { return cudaMemset(dst, value, n); }

cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned int) {
  std::lock_guard<std::mutex> lock(mu);
  if (p == nullptr || bytes == 0) return Fail(cudaErrorInvalidValue);
  const char* c = static_cast<const char*>(p);
  auto next = pinned_host.lower_bound(c);
  const bool overlaps_next = next != pinned_host.end() && next->first < c + bytes;
  const bool overlaps_prev = next != pinned_host.begin() && std::prev(next)->first + std::prev(next)->second > c;
  if (overlaps_next || overlaps_prev) return Fail(cudaErrorHostMemoryAlreadyRegistered);
  pinned_host[c] = bytes;
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
  std::lock_guard<std::mutex> lock(mu);
  if (malloc_host.count(p) != 0 || pinned_host.erase(static_cast<const char*>(p)) == 0) {
    return Fail(cudaErrorHostMemoryNotRegistered);
  }
  return cudaSuccess;
}
// Page-locked host memory: ordinary host memory here, remembered as pinned (copies from device memory into it do
// not synchronize the host).
cudaError_t cudaMallocHost(void** ptr, size_t size) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  void* p = std::aligned_alloc(kPage, (size + kPage - 1) / kPage * kPage);
  if (p == nullptr) return Fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(mu);
  pinned_host[static_cast<const char*>(p)] = size;
  malloc_host.insert(p);
  *ptr = p;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (malloc_host.erase(p) == 0) return Fail(cudaErrorInvalidValue);
    pinned_host.erase(static_cast<const char*>(p));
  }
  CountHostSync();  // as cudaFree, it waits for the device
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st{0};
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  *s = new CUstream_st{flags};
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return HostSync(); }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return Status(); }
cudaError_t cudaDeviceSynchronize() { return HostSync(); }
// Clears a sticky error (a failed launch), so a test can go on after one. Unlike the hardware's, it keeps every
// allocation, stream and event.
cudaError_t cudaDeviceReset() {
  sticky_error = cudaSuccess;
  last_error = cudaSuccess;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st{0};
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  *e = new CUevent_st{flags};
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return Status(); }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return HostSync(); }
cudaError_t cudaEventQuery(cudaEvent_t) { return Status(); }

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || static_cast<size_t>(value) > kMaxSharedOptIn) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mu);
  shared_limit[func] = static_cast<size_t>(value);
  return cudaSuccess;
}

}  // extern "C"
