// Between the emulator's parts: the scheduler (emulator.cc), the runtime (runtime.cc) and the checker
// (checker.cc). Not for kernel code or tests.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "simt/counters.h"
#include "simt/simt.h"

namespace simt::detail {

// Sends a report to the handler (the default aborts).
void Raise(ErrorKind kind, const std::string& message);

// runtime.cc: the launch-limit checks (block and grid sizes, dynamic shared memory against the limit raised with
// cudaFuncSetAttribute). A refused launch is an ordinary CUDA error (cudaGetLastError), as on the hardware.
cudaError_t CheckLaunch(const LaunchSite& site, const void* func, dim3 grid, dim3 block, size_t dynamic_smem,
                        cudaStream_t stream);
// The calling host thread's last error; a sticky error stays for every later call.
void SetLastError(cudaError_t err, bool sticky = false);

// The scheduler tells the checker what orders the threads.
void OnKernelStart(const LaunchSite& site);
void OnKernelEnd();
void OnBlockStart(void* dynamic_shared, size_t bytes, size_t redzone);
void OnSharedBlockStart(void* p, size_t bytes, const char* name);  // a static __shared__ variable, per block
void OnBlockBarrier();                                             // every thread passed __syncthreads
void OnWarpSync(unsigned warp, unsigned lanes);                    // these lanes of the warp met in a collective

// Whether instrumented (checked) kernel code is linked in: its module constructor calls __tsan_init. Then device
// allocations stay accessible around and after their use, so the checker's report comes instead of a fault.
extern bool checked_mode;

bool InKernel();
std::string CurrentThreadName();
unsigned CurrentLinearThread();  // ~0u outside a kernel

// The fiber running now, kept current by the scheduler at every switch: the checker's per-access fast path reads
// it instead of calling into the scheduler.
struct RunningFiber {
  unsigned linear = ~0u;   // linear thread index in the block; ~0u while no fiber runs (host code, the scheduler)
  uintptr_t stack_lo = 0;  // the fiber's stack: [stack_lo, stack_lo + stack_bytes)
  size_t stack_bytes = 0;
};
extern RunningFiber running_fiber;

// Holds off kernel launches (they run under this lock) for as long as the returned lock lives. cudaMalloc and
// cudaFree (and their pool variants) take it, as the hardware's cudaFree waits for the device, so the checker's shadow
// of an allocation is never dropped under a running kernel.
std::unique_lock<std::recursive_mutex> HoldLaunches();

// runtime.cc: the device allocation holding [p, p + bytes), for the checker.
struct AllocationView {
  enum class Status { kNone, kInside, kOutOfBounds, kFreed } status = Status::kNone;
  const void* base = nullptr;
  size_t size = 0;
  // kNone: the gap between device mappings (guard pages included) that holds [p, p + bytes); every access inside
  // it is kNone too, until the next cudaMalloc or cudaFree.
  uintptr_t gap_lo = 0;
  uintptr_t gap_hi = 0;
};
AllocationView FindAllocation(const void* p, size_t bytes);

// checker.cc: device memory changed (called by every allocation and free, under HoldLaunches()). `freed` is the base
// of a freed allocation, or null after an allocation: the checker drops what it remembered about that memory.
void OnDeviceMemoryChanged(const void* freed);

// counters.cc: the runtime's counts (simt/counters.h).
void CountHostSync();
void CountAllocation();
void CountFree();
// A copy of n bytes from src to dst: bytes read from a device allocation, bytes written into one, and from device
// memory a host sync when `synchronous` (cudaMemcpy), else a pageable copy when dst is pageable host memory.
void CountCopy(void* dst, const void* src, size_t n, bool synchronous);
void CountMemset(void* dst, size_t n);
// checker.cc -> counters.cc, at the end of a checked launch: what its kernel code read and wrote.
struct LaunchAccesses {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  LoadRequests ldg;  // read-only loads (__ldg) as warp requests
  std::vector<std::pair<const void*, uint64_t>> writes;  // per allocation base
};
void CountKernelAccesses(const LaunchAccesses& accesses);
// emulator.cc: a launch that ran (after OnKernelEnd, so the checked accesses of it are known); `in_graph`: as a node
// of a graph (cudaGraphLaunch).
void CountLaunch(const LaunchSite& site, bool in_graph);
// runtime.cc: a cudaGraphLaunch that ran.
void CountGraphLaunch();
// runtime.cc: whether [p, p + bytes) is pinned host memory (cudaHostRegister or cudaMallocHost).
bool IsPinnedHost(const void* p, size_t bytes);

// runtime.cc: stream capture (cudaStreamBeginCapture ... cudaStreamEndCapture) and graphs.
//
// Where work issued on `stream` (a launch, an asynchronous copy or memset, a GEMM) goes. Returns
//  - cudaSuccess with *capture false: run it now;
//  - cudaSuccess with *capture true: the stream is capturing; record the work with RecordNode and run nothing;
//  - an error, already set as the calling thread's last error: refuse the work. cudaErrorStreamCaptureInvalidated
//    on a stream whose capture an earlier error invalidated; cudaErrorStreamCaptureImplicit for the legacy default
//    stream while a capture it would depend on is going on (that capture is invalidated).
cudaError_t IssueWork(cudaStream_t stream, bool* capture);
// Invalidates `stream`'s capture, if it is capturing (work the capture cannot record, or a refused launch).
void InvalidateCapture(cudaStream_t stream);
// Appends a node to `stream`'s capture after IssueWork said to record. `run` does the work at every cudaGraphLaunch,
// on the launch's stream; it must own whatever it needs (values, not pointers to the caller's variables).
void RecordNode(cudaStream_t stream, cudaGraphNodeType type, std::function<cudaError_t(cudaStream_t)> run);

// A kernel launch recorded by stream capture: what RunKernel received, the body owning the launch's parameters.
struct KernelLaunch {
  LaunchSite site;
  const void* func;
  dim3 grid;
  dim3 block;
  size_t dynamic_smem;
  std::function<void()> body;
};
// emulator.cc: runs a recorded launch as a node of a graph: the launch checks, then the kernel (checked in checked
// mode), counted as a launch of its site and as a graph kernel launch.
cudaError_t RunGraphKernel(const KernelLaunch& launch, cudaStream_t stream);

// runtime.cc: raises a report when the runtime itself (a copy, a memset, cuBLAS) would touch [p, p + bytes) of a
// freed device allocation. Returns whether it did (the caller then leaves the memory alone).
bool ReportFreedAccess(const void* p, size_t bytes, const char* what);

}  // namespace simt::detail
