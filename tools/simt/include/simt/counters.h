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
// read and written by those launches, and their read-only and evict-first loads (__ldg, __ldcs) as warp requests
// (LoadRequests). Per device allocation (by base address): bytes written into it by cudaMemcpy(Async) and
// cudaMemset(Async) and, checked mode, by kernels.
//
// Thread safety: any host thread may read or reset; counts of a launch are added when it ends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace simt {

// How scattered a kernel's loads are, as a GPU's L1 sees them (checked mode; the figures Nsight Compute gives as
// sectors and requests). A request is one load instruction of a warp: here the n-th execution of one __ldg (or
// __ldcs) call site by each lane of the warp (lanes of a warp run a site's loads in the same order; a lane that skips
// a load, e.g. past the end of a row, leaves its later loads paired with the next ones of the others, so a kernel that
// skips loads other than its last ones is counted approximately). Each request touches some 32-byte sectors and
// 128-byte lines: a coalesced request of 16 bytes per lane touches 16 sectors in 4 lines; lanes 128 bytes apart,
// 32 sectors in 32 lines. Lines per 128 bytes requested is 1 for a coalesced kernel.
struct LoadRequests {
  uint64_t requests = 0;
  uint64_t bytes = 0;    // requested: each lane's load counted whole
  uint64_t sectors = 0;  // distinct 32-byte sectors, summed over requests
  uint64_t lines = 0;    // distinct 128-byte lines, summed over requests
  double LinesPer128Bytes() const { return bytes == 0 ? 0.0 : static_cast<double>(lines) * 128.0 / bytes; }
  void Add(const LoadRequests& o) {
    requests += o.requests;
    bytes += o.bytes;
    sectors += o.sectors;
    lines += o.lines;
  }
};

struct SiteCounts {
  uint64_t launches = 0;
  uint64_t bytes_read = 0;     // checked mode
  uint64_t bytes_written = 0;  // checked mode
  LoadRequests ldg;            // checked mode
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
