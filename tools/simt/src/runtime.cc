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
//
// Stream capture and graphs: while a stream captures (cudaStreamBeginCapture), the work issued on it (launches,
// asynchronous copies and memsets, cuBLAS GEMMs) is recorded as graph nodes in issue order instead of running;
// cudaGraphLaunch of an instantiated graph runs its nodes in that order as ordinary work, so they are checked and
// counted as if issued one by one. The rules of the real runtime are enforced: calls that are not stream-ordered
// (allocation, synchronization, synchronous copies) fail while a capture forbids them, and a failed call invalidates
// the capture it concerns, so cudaStreamEndCapture then fails. Where the real rule is unclear, the stricter one.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "src/internal.h"

namespace simt::detail {
struct StreamCapture;
}  // namespace simt::detail

// Fields marked (capture) are guarded by simt::detail::capture_mu.
struct CUstream_st {
  unsigned flags;
  simt::detail::StreamCapture* capture = nullptr;  // its capture sequence, until cudaStreamEndCapture (capture)
};
struct CUevent_st {
  unsigned flags;
  // The capture sequence that last recorded it (its id); 0 when last recorded outside any capture or never (capture).
  uint64_t capture = 0;
};
// A node of a graph: what it does at every launch of an instantiated graph, on the launch's stream.
struct CUgraphNode_st {
  cudaGraphNodeType type;
  std::function<cudaError_t(cudaStream_t)> run;
};
// Nodes in capture order, each depending on the one before (one captured stream is a chain).
struct CUgraph_st {
  std::vector<std::shared_ptr<CUgraphNode_st>> nodes;
  bool capturing = true;  // still being built by a capture sequence (capture)
};
// An instantiated graph shares its graph's nodes (they never change), so it outlives cudaGraphDestroy.
struct CUgraphExec_st {
  std::vector<std::shared_ptr<CUgraphNode_st>> nodes;
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

}  // namespace

// A capture sequence, from cudaStreamBeginCapture to cudaStreamEndCapture (guarded by capture_mu).
struct StreamCapture {
  CUstream_st* stream;
  cudaStreamCaptureMode mode;
  std::thread::id thread;  // the one that began it
  uint64_t id;             // unique over the process (cudaStreamGetCaptureInfo)
  bool invalidated = false;
  cudaGraph_t graph;               // the graph being built
  cudaGraphNode_t last = nullptr;  // the node the next one will depend on
};

namespace {

// Lock order: capture_mu is taken last (nothing else is locked while it is held), after launch_mu and never together
// with mu.
std::mutex capture_mu;
std::vector<StreamCapture*> captures;   // capture sequences going on, invalidated ones too (guarded by capture_mu)
std::atomic<size_t> capture_count{0};   // captures.size(), read without the lock on every call's fast path
uint64_t next_capture_id = 1;           // guarded by capture_mu
std::set<CUstream_st*> streams;         // live streams from cudaStreamCreate* (guarded by capture_mu)
std::set<cudaGraph_t> graphs;           // live graphs (guarded by capture_mu)
std::set<cudaGraphExec_t> graph_execs;  // live instantiated graphs (guarded by capture_mu)
// cudaThreadExchangeStreamCaptureMode: how the calling thread's potentially unsafe calls interact with captures.
thread_local cudaStreamCaptureMode thread_capture_mode = cudaStreamCaptureModeGlobal;
thread_local CUstream_st per_thread_stream{0};  // cudaStreamPerThread: blocking, one per host thread

bool IsLegacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; }

// The stream object behind a handle other than the legacy stream's, or null (and *err) for an unknown handle.
// REQUIRES: capture_mu held.
CUstream_st* ResolveLocked(cudaStream_t s, cudaError_t* err) {
  if (s == cudaStreamPerThread) return &per_thread_stream;
  if (streams.count(s) == 0) {
    *err = cudaErrorInvalidResourceHandle;
    return nullptr;
  }
  return s;
}

void Add(std::vector<StreamCapture*>* v, StreamCapture* c) {
  if (std::find(v->begin(), v->end(), c) == v->end()) v->push_back(c);
}

// The captures that forbid a potentially unsafe call (one not ordered in a stream: allocation, free, synchronization,
// a synchronous copy) from the calling thread: unless the thread's mode is Relaxed, its own captures not begun in
// Relaxed mode and, in Global mode, every other thread's capture begun in Global mode. REQUIRES: capture_mu held.
std::vector<StreamCapture*> ForbiddingLocked() {
  std::vector<StreamCapture*> out;
  if (thread_capture_mode == cudaStreamCaptureModeRelaxed) return out;
  const std::thread::id me = std::this_thread::get_id();
  for (StreamCapture* c : captures) {
    const bool mine = c->thread == me;
    if ((mine && c->mode != cudaStreamCaptureModeRelaxed) ||
        (!mine && c->mode == cudaStreamCaptureModeGlobal && thread_capture_mode == cudaStreamCaptureModeGlobal)) {
      out.push_back(c);
    }
  }
  return out;
}

// The captures that work on the legacy default stream would depend on: every capture of a blocking stream (the legacy
// stream waits for blocking streams: the real rule) and, stricter, every capture that forbids this thread's
// potentially unsafe calls (on the hardware legacy-stream work beside a capturing non-blocking stream runs at once,
// which in a captured sequence is most likely a launch that forgot its stream). REQUIRES: capture_mu held.
std::vector<StreamCapture*> LegacyConflictsLocked() {
  std::vector<StreamCapture*> out = ForbiddingLocked();
  for (StreamCapture* c : captures) {
    if ((c->stream->flags & cudaStreamNonBlocking) == 0) Add(&out, c);
  }
  return out;
}

// Invalidates `concerned` and fails with err, unless it is empty. REQUIRES: capture_mu held.
cudaError_t RefuseLocked(const std::vector<StreamCapture*>& concerned, cudaError_t err) {
  if (concerned.empty()) return cudaSuccess;
  for (StreamCapture* c : concerned) c->invalidated = true;
  return Fail(err);
}

// The stream work issued on `s` goes to, or null: for the legacy stream (after refusing the work beside the captures
// it conflicts with, which *err then says: cudaErrorStreamCaptureImplicit) and for an unknown handle (*err
// cudaErrorInvalidResourceHandle). *err is cudaSuccess when the work may go on. REQUIRES: capture_mu held.
CUstream_st* IssuedOnLocked(cudaStream_t s, cudaError_t* err) {
  *err = cudaSuccess;
  if (IsLegacy(s)) {
    *err = RefuseLocked(LegacyConflictsLocked(), cudaErrorStreamCaptureImplicit);
    return nullptr;
  }
  CUstream_st* st = ResolveLocked(s, err);
  if (st == nullptr) *err = Fail(*err);
  return st;
}

// A potentially unsafe call: refused (cudaErrorStreamCaptureUnsupported) while a capture forbids it, and the
// captures that forbid it invalidated.
cudaError_t CheckUnsafe() {
  if (capture_count.load(std::memory_order_acquire) == 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(capture_mu);
  return RefuseLocked(ForbiddingLocked(), cudaErrorStreamCaptureUnsupported);
}

// A call that waits for or queries `s` (cudaStreamSynchronize, cudaStreamQuery): potentially unsafe, and refused
// whatever the modes while `s` itself captures; on the legacy stream, refused as legacy-stream work too.
cudaError_t CheckStreamSync(cudaStream_t s) {
  if (capture_count.load(std::memory_order_acquire) == 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(capture_mu);
  std::vector<StreamCapture*> concerned = ForbiddingLocked();
  if (!concerned.empty()) return RefuseLocked(concerned, cudaErrorStreamCaptureUnsupported);
  cudaError_t err = cudaSuccess;
  CUstream_st* st = IssuedOnLocked(s, &err);
  if (st == nullptr) return err;
  if (st->capture != nullptr) return RefuseLocked({st->capture}, cudaErrorStreamCaptureUnsupported);
  return cudaSuccess;
}

// cudaDeviceSynchronize waits for every stream: refused while any stream captures, whatever the modes.
cudaError_t CheckDeviceSync() {
  if (capture_count.load(std::memory_order_acquire) == 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(capture_mu);
  return RefuseLocked(captures, cudaErrorStreamCaptureUnsupported);
}

// The live capture sequence with this id, or null. REQUIRES: capture_mu held.
StreamCapture* FindCaptureLocked(uint64_t id) {
  for (StreamCapture* c : captures) {
    if (c->id == id) return c;
  }
  return nullptr;
}

// An event last recorded inside a capture cannot be waited for or queried by the host (cudaErrorCapturedEvent; a
// capture still going on is invalidated).
cudaError_t CheckEventSync(cudaEvent_t e) {
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  const cudaError_t unsafe = CheckUnsafe();
  if (unsafe != cudaSuccess) return unsafe;
  std::lock_guard<std::mutex> lock(capture_mu);
  if (e->capture == 0) return cudaSuccess;
  if (StreamCapture* c = FindCaptureLocked(e->capture)) c->invalidated = true;
  return Fail(cudaErrorCapturedEvent);
}

// Ends a capture sequence: it leaves the registry and its stream. REQUIRES: capture_mu held.
void RemoveCaptureLocked(StreamCapture* c) {
  captures.erase(std::find(captures.begin(), captures.end(), c));
  capture_count.store(captures.size(), std::memory_order_release);
  c->stream->capture = nullptr;
}

// Whether [p, p + n) is host memory that is not page-locked (a capture cannot record a copy from or to it).
bool IsPageableHost(const void* p, size_t n) {
  return FindAllocation(p, n).status == AllocationView::Status::kNone && !IsPinnedHost(p, n);
}

// A copy or memset the runtime does now (issued directly or as a graph node): refused, with a report, when it would
// touch a freed device allocation; else counted and done.
cudaError_t DoCopy(void* dst, const void* src, size_t n, bool synchronous, const char* what) {
  if (ReportFreedAccess(src, n, what) || ReportFreedAccess(dst, n, what)) return Fail(cudaErrorInvalidValue);
  CountCopy(dst, src, n, synchronous);
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t DoMemset(void* dst, int value, size_t n, const char* what) {
  if (ReportFreedAccess(dst, n, what)) return Fail(cudaErrorInvalidValue);
  CountMemset(dst, n);
  std::memset(dst, value, n);
  return cudaSuccess;
}

// Stream-ordered allocation and free cannot be captured (memory nodes are not modelled): refused on a capturing
// stream, whose capture is invalidated.
cudaError_t CheckStreamOrderedMemory(cudaStream_t stream) {
  bool capture = false;
  const cudaError_t err = IssueWork(stream, &capture);
  if (err != cudaSuccess) return err;
  if (capture) {
    InvalidateCapture(stream);
    return Fail(cudaErrorStreamCaptureUnsupported);
  }
  return cudaSuccess;
}

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

cudaError_t IssueWork(cudaStream_t stream, bool* capture) {
  *capture = false;
  if (capture_count.load(std::memory_order_acquire) == 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(capture_mu);
  cudaError_t err = cudaSuccess;
  CUstream_st* st = IssuedOnLocked(stream, &err);
  if (st == nullptr) return err;
  if (st->capture == nullptr) return cudaSuccess;
  if (st->capture->invalidated) return Fail(cudaErrorStreamCaptureInvalidated);
  *capture = true;
  return cudaSuccess;
}

void InvalidateCapture(cudaStream_t stream) {
  if (capture_count.load(std::memory_order_acquire) == 0 || IsLegacy(stream)) return;
  std::lock_guard<std::mutex> lock(capture_mu);
  cudaError_t err = cudaSuccess;
  CUstream_st* st = ResolveLocked(stream, &err);
  if (st != nullptr && st->capture != nullptr) st->capture->invalidated = true;
}

void RecordNode(cudaStream_t stream, cudaGraphNodeType type, std::function<cudaError_t(cudaStream_t)> run) {
  auto node = std::make_shared<CUgraphNode_st>(CUgraphNode_st{type, std::move(run)});
  std::lock_guard<std::mutex> lock(capture_mu);
  if (IsLegacy(stream)) return;
  cudaError_t err = cudaSuccess;
  CUstream_st* st = ResolveLocked(stream, &err);
  // The capture ended or failed since IssueWork (another thread's call): the node is dropped.
  if (st == nullptr || st->capture == nullptr || st->capture->invalidated) return;
  st->capture->graph->nodes.push_back(node);
  st->capture->last = node.get();
}

bool ReportFreedAccess(const void* p, size_t bytes, const char* what) {
  const AllocationView view = FindAllocation(p, bytes);
  if (view.status != AllocationView::Status::kFreed) return false;
  char message[256];
  std::snprintf(message, sizeof message,
                "%s of %zu bytes at %p reaches freed device memory (the allocation at %p of %zu bytes)", what, bytes, p,
                view.base, view.size);
  Raise(ErrorKind::kUseAfterFree, message);
  return true;
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
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureIsolation:
      return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit:
      return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent:
      return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread:
      return "cudaErrorStreamCaptureWrongThread";
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
    case cudaErrorIllegalState:
      return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent:
      return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
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
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
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
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
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

// Not on a capturing stream: memory nodes are not modelled.
cudaError_t cudaMallocFromPoolAsync(void** ptr, size_t size, cudaMemPool_t pool, cudaStream_t stream) {
  if (const cudaError_t e = CheckStreamOrderedMemory(stream); e != cudaSuccess) return e;
  return PoolAllocate(ptr, size, pool);
}
cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  if (const cudaError_t e = CheckStreamOrderedMemory(stream); e != cudaSuccess) return e;
  return PoolAllocate(ptr, size, &default_pool);
}

// Only memory from a pool; in stream order, so the host does not wait (not a host synchronization). Not on a
// capturing stream.
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  if (const cudaError_t e = CheckStreamOrderedMemory(stream); e != cudaSuccess) return e;
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

// Synchronous: potentially unsafe during a capture, and work on the legacy stream.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
  bool capture = false;  // the legacy stream never captures
  if (const cudaError_t e = IssueWork(nullptr, &capture); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  return DoCopy(dst, src, n, /*synchronous=*/true, "cudaMemcpy");
}
// On a capturing stream, recorded as a memcpy node that copies between the same addresses at every launch; host
// memory must then be page-locked (cudaMallocHost, cudaHostRegister).
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  bool capture = false;
  if (const cudaError_t e = IssueWork(stream, &capture); e != cudaSuccess) return e;
  if (!capture) return DoCopy(dst, src, n, /*synchronous=*/false, "cudaMemcpyAsync");
  if (IsPageableHost(dst, n) || IsPageableHost(src, n)) {
    InvalidateCapture(stream);
    return Fail(cudaErrorStreamCaptureUnsupported);
  }
  RecordNode(stream, cudaGraphNodeTypeMemcpy, [dst, src, n](cudaStream_t) {
    return DoCopy(dst, src, n, /*synchronous=*/false, "cudaMemcpyAsync (graph node)");
  });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* dst, int value, size_t n) {
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
  bool capture = false;
  if (const cudaError_t e = IssueWork(nullptr, &capture); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  if (dst == nullptr) return Fail(cudaErrorInvalidValue);
  return DoMemset(dst, value, n, "cudaMemset");
}
cudaError_t cudaMemsetAsync(void* dst, int value, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr) return Fail(cudaErrorInvalidValue);
  bool capture = false;
  if (const cudaError_t e = IssueWork(stream, &capture); e != cudaSuccess) return e;
  if (!capture) return DoMemset(dst, value, n, "cudaMemsetAsync");
  RecordNode(stream, cudaGraphNodeTypeMemset,
             [dst, value, n](cudaStream_t) { return DoMemset(dst, value, n, "cudaMemsetAsync (graph node)"); });
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned int) {
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
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
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (malloc_host.count(p) != 0 || pinned_host.erase(static_cast<const char*>(p)) == 0) {
    return Fail(cudaErrorHostMemoryNotRegistered);
  }
  return cudaSuccess;
}
// Page-locked host memory: ordinary host memory here, remembered as pinned (copies from device memory into it do
// not synchronize the host).
cudaError_t cudaMallocHost(void** ptr, size_t size) {
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
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
  if (const cudaError_t e = CheckUnsafe(); e != cudaSuccess) return e;
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

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  if (s == nullptr) return Fail(cudaErrorInvalidValue);
  *s = new CUstream_st{flags};
  std::lock_guard<std::mutex> lock(capture_mu);
  streams.insert(*s);
  return cudaSuccess;
}
// A capturing stream is not destroyed (its capture is invalidated; end it first).
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(capture_mu);
  if (streams.count(s) == 0) return Fail(cudaErrorInvalidResourceHandle);
  if (s->capture != nullptr) return RefuseLocked({s->capture}, cudaErrorStreamCaptureUnsupported);
  streams.erase(s);
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (const cudaError_t e = CheckStreamSync(s); e != cudaSuccess) return e;
  return HostSync();
}
// Everything issued has run: always done (not a host synchronization: nothing waits).
cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (const cudaError_t e = CheckStreamSync(s); e != cudaSuccess) return e;
  return Status();
}
// On a capturing stream, only an event recorded in the same capture may be waited for (anything else would be a
// dependency on work outside the graph: cudaErrorStreamCaptureIsolation). A stream that does not capture cannot wait
// for an event recorded in a capture: on the hardware it would join that capture (not modelled), or, the capture
// over, wait for nothing.
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lock(capture_mu);
  cudaError_t err = cudaSuccess;
  const CUstream_st* st = IssuedOnLocked(s, &err);
  if (err != cudaSuccess) return err;
  if (StreamCapture* c = st != nullptr ? st->capture : nullptr) {
    if (c->invalidated) return Fail(cudaErrorStreamCaptureInvalidated);
    if (e->capture != c->id) return RefuseLocked({c}, cudaErrorStreamCaptureIsolation);
    return Status();
  }
  if (e->capture != 0) {
    if (StreamCapture* c = FindCaptureLocked(e->capture)) return RefuseLocked({c}, cudaErrorStreamCaptureUnsupported);
    return Fail(cudaErrorCapturedEvent);
  }
  return Status();
}
cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t e = CheckDeviceSync(); e != cudaSuccess) return e;
  return HostSync();
}
// Clears a sticky error (a failed launch), so a test can go on after one, and ends every capture sequence (their
// graphs discarded), so one left by a failed test does not forbid the next test's calls. Unlike the hardware's, it
// keeps every allocation, stream, event, graph and instantiated graph.
cudaError_t cudaDeviceReset() {
  sticky_error = cudaSuccess;
  last_error = cudaSuccess;
  thread_capture_mode = cudaStreamCaptureModeGlobal;
  std::lock_guard<std::mutex> lock(capture_mu);
  while (!captures.empty()) {
    StreamCapture* c = captures.back();
    RemoveCaptureLocked(c);
    graphs.erase(c->graph);
    delete c->graph;
    delete c;
  }
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  if (e == nullptr) return Fail(cudaErrorInvalidValue);
  *e = new CUevent_st{flags};
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
// On a capturing stream the event marks a point of the capture (no node: nothing is recorded at a graph launch);
// until recorded again outside a capture, the host cannot wait for or query it (cudaErrorCapturedEvent).
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lock(capture_mu);
  cudaError_t err = cudaSuccess;
  const CUstream_st* st = IssuedOnLocked(s, &err);
  if (err != cudaSuccess) return err;
  const StreamCapture* c = st != nullptr ? st->capture : nullptr;
  if (c != nullptr && c->invalidated) return Fail(cudaErrorStreamCaptureInvalidated);
  e->capture = c != nullptr ? c->id : 0;
  return Status();
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (const cudaError_t err = CheckEventSync(e); err != cudaSuccess) return err;
  return HostSync();
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (const cudaError_t err = CheckEventSync(e); err != cudaSuccess) return err;
  return Status();
}

// ------------------------------------------------------------------------------------------------------------------
// Stream capture
// ------------------------------------------------------------------------------------------------------------------

// Not on the legacy stream (cudaErrorStreamCaptureUnsupported); not on a stream that captures already
// (cudaErrorIllegalState, and that capture is invalidated).
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  if (IsLegacy(s)) return Fail(cudaErrorStreamCaptureUnsupported);
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed) {
    return Fail(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lock(capture_mu);
  cudaError_t err = cudaSuccess;
  CUstream_st* st = ResolveLocked(s, &err);
  if (st == nullptr) return Fail(err);
  if (st->capture != nullptr) return RefuseLocked({st->capture}, cudaErrorIllegalState);
  auto* graph = new CUgraph_st;
  graphs.insert(graph);
  st->capture = new StreamCapture{st, mode, std::this_thread::get_id(), next_capture_id++, false, graph, nullptr};
  captures.push_back(st->capture);
  capture_count.store(captures.size(), std::memory_order_release);
  return cudaSuccess;
}

// The captured graph; an invalidated capture ends with a null graph and cudaErrorStreamCaptureInvalidated. A capture
// not begun in Relaxed mode must be ended by the thread that began it (else cudaErrorStreamCaptureWrongThread, and the
// capture is invalidated).
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  if (graph == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(capture_mu);
  if (IsLegacy(s)) return Fail(cudaErrorIllegalState);
  cudaError_t err = cudaSuccess;
  CUstream_st* st = ResolveLocked(s, &err);
  if (st == nullptr) return Fail(err);
  StreamCapture* c = st->capture;
  if (c == nullptr) return Fail(cudaErrorIllegalState);
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id()) {
    return RefuseLocked({c}, cudaErrorStreamCaptureWrongThread);
  }
  RemoveCaptureLocked(c);
  std::unique_ptr<StreamCapture> ended(c);
  if (c->invalidated) {
    graphs.erase(c->graph);
    delete c->graph;
    *graph = nullptr;
    return Fail(cudaErrorStreamCaptureInvalidated);
  }
  c->graph->capturing = false;
  *graph = c->graph;
  return cudaSuccess;
}

// The legacy stream never captures; asked while a capture it would depend on goes on: cudaErrorStreamCaptureImplicit
// (that capture is not invalidated).
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  return cudaStreamGetCaptureInfo(s, status, nullptr, nullptr, nullptr, nullptr, nullptr);
}

// A captured stream is a chain: the next node depends on the last one recorded (none at first); no edge data.
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, cudaStreamCaptureStatus* status, unsigned long long* id,
                                     cudaGraph_t* graph, const cudaGraphNode_t** dependencies,
                                     const cudaGraphEdgeData** edge_data, size_t* num_dependencies) {
  static const cudaGraphEdgeData kNoEdgeData{};
  if (status == nullptr || (edge_data != nullptr && dependencies == nullptr)) return Fail(cudaErrorInvalidValue);
  *status = cudaStreamCaptureStatusNone;
  std::lock_guard<std::mutex> lock(capture_mu);
  if (IsLegacy(s)) {
    if (!LegacyConflictsLocked().empty()) return Fail(cudaErrorStreamCaptureImplicit);
    return cudaSuccess;
  }
  cudaError_t err = cudaSuccess;
  CUstream_st* st = ResolveLocked(s, &err);
  if (st == nullptr) return Fail(err);
  const StreamCapture* c = st->capture;
  if (c == nullptr) return cudaSuccess;
  *status = c->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  if (id != nullptr) *id = c->id;
  if (graph != nullptr) *graph = c->graph;
  if (dependencies != nullptr) *dependencies = &c->last;
  if (edge_data != nullptr) *edge_data = &kNoEdgeData;
  if (num_dependencies != nullptr) *num_dependencies = c->last != nullptr ? 1 : 0;
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (mode == nullptr || (*mode != cudaStreamCaptureModeGlobal && *mode != cudaStreamCaptureModeThreadLocal &&
                          *mode != cudaStreamCaptureModeRelaxed)) {
    return Fail(cudaErrorInvalidValue);
  }
  std::swap(*mode, thread_capture_mode);
  return cudaSuccess;
}

// ------------------------------------------------------------------------------------------------------------------
// Graphs
// ------------------------------------------------------------------------------------------------------------------

// Flags other than 0 are refused (cudaErrorInvalidValue): none changes anything without memory nodes, and a caller
// should not count on one.
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  if (exec == nullptr || flags != 0) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(capture_mu);
  if (graphs.count(graph) == 0 || graph->capturing) return Fail(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{graph->nodes};
  graph_execs.insert(*exec);
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  return cudaGraphInstantiate(exec, graph, flags);
}

// Runs the graph's nodes in order on `stream`, as that work issued there would run: kernels checked (checked mode)
// and counted, copies and memsets counted. Into a capturing stream: cudaErrorStreamCaptureUnsupported (child graph
// nodes are not modelled), and the capture is invalidated. Stops at the first node that fails.
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  std::vector<std::shared_ptr<CUgraphNode_st>> nodes;
  {
    std::lock_guard<std::mutex> lock(capture_mu);
    if (graph_execs.count(exec) == 0) return Fail(cudaErrorInvalidResourceHandle);
    nodes = exec->nodes;
  }
  bool capture = false;
  if (const cudaError_t e = IssueWork(stream, &capture); e != cudaSuccess) return e;
  if (capture) {
    InvalidateCapture(stream);
    return Fail(cudaErrorStreamCaptureUnsupported);
  }
  if (sticky_error != cudaSuccess) return Fail(sticky_error);
  const auto launches = HoldLaunches();  // one graph at a time, its nodes in order
  CountGraphLaunch();
  for (const auto& node : nodes) {
    const cudaError_t e = node->run(stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// An instantiated graph stays valid after its graph is destroyed. The graph of a capture going on is not destroyed.
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard<std::mutex> lock(capture_mu);
  if (graphs.count(graph) == 0 || graph->capturing) return Fail(cudaErrorInvalidValue);
  graphs.erase(graph);
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::lock_guard<std::mutex> lock(capture_mu);
  if (graph_execs.erase(exec) == 0) return Fail(cudaErrorInvalidValue);
  delete exec;
  return cudaSuccess;
}

// nodes null: *count = the number of nodes; else up to *count nodes in capture order, *count = how many.
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, size_t* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(capture_mu);
  if (graphs.count(graph) == 0) return Fail(cudaErrorInvalidValue);
  if (nodes == nullptr) {
    *count = graph->nodes.size();
    return cudaSuccess;
  }
  const size_t n = std::min(*count, graph->nodes.size());
  for (size_t i = 0; i < *count; ++i) nodes[i] = i < n ? graph->nodes[i].get() : nullptr;
  *count = n;
  return cudaSuccess;
}
cudaError_t cudaGraphNodeGetType(cudaGraphNode_t node, cudaGraphNodeType* type) {
  if (node == nullptr || type == nullptr) return Fail(cudaErrorInvalidValue);
  *type = node->type;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || static_cast<size_t>(value) > kMaxSharedOptIn) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mu);
  shared_limit[func] = static_cast<size_t>(value);
  return cudaSuccess;
}

}  // extern "C"
