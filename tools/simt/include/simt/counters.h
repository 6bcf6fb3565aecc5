// What the emulated CUDA runtime counts, for tests and benchmarks that check how a program drives the GPU (host
// synchronizations, allocations, launches, traffic). Counted by the runtime itself from the calls it receives, so
// a caller cannot misreport. Counts accumulate from process start (a "run") until ResetCounters().
//
// What each figure counts:
//  - host_syncs: calls that make the host wait for the device: cudaStreamSynchronize, cudaDeviceSynchronize,
//    cudaEventSynchronize, cudaFree and cudaFreeHost (which wait for the device), and a synchronous cudaMemcpy that
//    reads device memory. cudaEventQuery does not wait: not counted.
//  - pageable_copies_to_host: cudaMemcpyAsync from device memory into pageable host memory (neither registered
//    with cudaHostRegister nor from cudaMallocHost), which the hardware performs synchronously (the host waits for
//    the stream's earlier work). Counted apart from host_syncs, since callers follow them with a stream sync.
//  - allocations / frees: cudaMalloc, cudaMallocAsync and cudaMallocFromPoolAsync that returned memory / cudaFree and
//    cudaFreeAsync of it (cudaFreeAsync is stream-ordered: not a host sync; cudaFree of pool memory is one).
//  - launches: kernel launches that ran (refused launches are not counted); cuBLAS calls are not kernels here.
//    Kernels that ran as nodes of a graph count here and per site too.
//  - graph_launches: cudaGraphLaunch calls that ran their graph.
//  - graph_kernel_launches: of `launches`, the kernels that ran as nodes of a graph: launches the host issued one by
//    one are launches - graph_kernel_launches.
// Work recorded by stream capture (cudaStreamBeginCapture) runs nothing and counts nothing when it is recorded; it
// counts each time it runs, at every cudaGraphLaunch, as the same work issued directly would (launches, copies and
// their bytes, memsets). A graph launch is not a host synchronization.
//  - copy_bytes_from_device: bytes cudaMemcpy(Async) read from device allocations (to the host or on the device).
//  - copy_bytes_to_host: of those, the bytes copied into host memory (device to host: what crosses the link back).
//  - kernel_bytes_read / kernel_bytes_written: checked mode only (0 in fast mode): bytes instrumented kernel code
//    loaded from / stored to device allocations, each access once per thread that made it (shared memory, the
//    stack and host memory are not counted).
// Per launch site (the kernel's name and the file:line of its <<< >>>): launches and, checked mode, the bytes
// read and written by those launches. Per device allocation (by base address): bytes written into it by
// cudaMemcpy(Async) and cudaMemset(Async) and, checked mode, by kernels.
//
// Thread safety: any host thread may read or reset; counts of a launch are added when it ends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace simt {

struct SiteCounts {
  uint64_t launches = 0;
  uint64_t bytes_read = 0;     // checked mode
  uint64_t bytes_written = 0;  // checked mode
};

struct AllocationWrites {
  size_t size = 0;     // the allocation's size
  uint64_t bytes = 0;  // bytes written into it since the last reset
};

struct Counters {
  uint64_t host_syncs = 0;
  uint64_t pageable_copies_to_host = 0;
  uint64_t allocations = 0;
  uint64_t frees = 0;
  uint64_t launches = 0;
  uint64_t graph_launches = 0;
  uint64_t graph_kernel_launches = 0;
  uint64_t copy_bytes_from_device = 0;
  uint64_t copy_bytes_to_host = 0;
  uint64_t kernel_bytes_read = 0;
  uint64_t kernel_bytes_written = 0;
  std::map<std::string, SiteCounts> sites;          // "kernel file:line"
  std::map<const void*, AllocationWrites> written;  // allocations written into, by base address
};

// A copy of the counts since the last reset.
Counters ReadCounters();
// Sets every count to zero.
void ResetCounters();
// Whether kernel accesses are counted (the checked build is linked in).
bool CountsKernelAccesses();

}  // namespace simt
