// The SIMT emulator's interface: kernel launches, the per-thread built-in variables, warp collectives, barriers,
// per-block shared memory and the error reports. Kernel code never includes this directly: prelude.h (force-included
// into every rewritten .cu) does, and the rewrite (rewrite_cu.py) emits the calls below.
//
// Threading: one launch runs at a time in the whole process (a global mutex); the CUDA threads of a block are
// fibers on the launching host thread. Everything here that is not a Launch* function may be called only from
// inside a kernel (a fiber).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace simt {

// ------------------------------------------------------------------------------------------------------------------
// Reports
// ------------------------------------------------------------------------------------------------------------------
enum class ErrorKind {
  kDeadlock,           // no thread can make progress
  kBarrierDivergence,  // __syncthreads reached at different call sites
  kWarpCollective,     // a collective whose lanes disagree, exited or read a lane outside the mask
  kLaunch,             // a launch configuration the hardware refuses
  kOutOfBounds,        // checked mode: an access outside a device allocation
  kUseAfterFree,       // checked mode: an access to freed device memory
  kMisaligned,         // checked mode: an access not aligned to its size
  kRace,               // checked mode: two unordered accesses of different threads, at least one a write
  kUninitShared,       // checked mode: a read of shared memory never written in this block
  kConstWrite,         // checked mode: a store into __constant__ memory
};
const char* ErrorKindName(ErrorKind kind);

struct Report {
  ErrorKind kind;
  std::string kernel;   // the kernel's name as written at the launch
  std::string message;  // what happened, with block, thread and the file:line of the accesses or waits
};

// Called for every report. The default prints the report to stderr and aborts the process; tests install a handler
// that records reports. After a kDeadlock or kBarrierDivergence the launch is abandoned (the fibers' stacks are
// dropped without unwinding) and the launch's error is cudaErrorLaunchFailure.
using ReportHandler = std::function<void(const Report&)>;
// Returns the previous handler. Pass nullptr to restore the default.
ReportHandler SetReportHandler(ReportHandler handler);

// ------------------------------------------------------------------------------------------------------------------
// Launches
// ------------------------------------------------------------------------------------------------------------------
struct LaunchSite {
  const char* kernel;  // as written before <<< >>>
  const char* file;
  int line;
};

namespace detail {
// Runs body() once per CUDA thread of every block, block after block. Returns the launch's error. On a stream that
// captures (cudaStreamBeginCapture) nothing runs: a copy of body is recorded as a kernel node of the graph.
cudaError_t RunKernel(const LaunchSite& site, const void* func, dim3 grid, dim3 block, size_t dynamic_smem,
                      cudaStream_t stream, const std::function<void()>& body);
}  // namespace detail

// What `kernel<<<grid, block, smem, stream>>>(args...)` is rewritten into. Parameters are converted as a call would
// convert them, once per launch; every thread receives its own copy (kernel parameters are by value). The body owns
// the converted parameters, so a launch recorded by stream capture replays these values, not the caller's variables.
template <typename... P, typename... A>
void Launch(const LaunchSite& site, dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
            void (*kernel)(P...), A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
  std::tuple<std::decay_t<P>...> params(static_cast<std::decay_t<P>>(std::forward<A>(args))...);
  detail::RunKernel(site, reinterpret_cast<const void*>(kernel), grid, block, dynamic_smem, stream,
                    [kernel, params = std::move(params)] { std::apply(kernel, params); });
}

// ------------------------------------------------------------------------------------------------------------------
// Inside a kernel
// ------------------------------------------------------------------------------------------------------------------
namespace detail {
extern thread_local uint3 tls_thread_idx;
extern thread_local uint3 tls_block_idx;
extern thread_local dim3 tls_block_dim;
extern thread_local dim3 tls_grid_dim;

// The block's dynamic shared memory (`extern __shared__ T x[];`), poisoned at block start.
void* DynamicShared();

// A static __shared__ variable: its storage is a function-local static, so per block as blocks run one at a time.
// Touch() poisons it the first time a thread of a new block reaches its declaration.
class SharedVar {
 public:
  void Touch(void* p, size_t bytes, const char* name) {
    if (epoch_ != CurrentBlockEpoch()) Enter(p, bytes, name);
  }

 private:
  static uint64_t CurrentBlockEpoch();
  void Enter(void* p, size_t bytes, const char* name);
  uint64_t epoch_ = 0;
};

void SyncThreads(const char* file, int line);

enum class CollectiveOp : uint8_t { kSyncWarp, kShfl, kShflXor, kShflUp, kShflDown };
// Waits until every lane of mask has arrived at a collective, then returns the value this lane receives.
uint64_t WarpCollective(CollectiveOp op, unsigned mask, uint64_t value, int arg, int width, const char* file, int line);

// Checked mode: tells the checker that an atomic read-modify-write of `bytes` at p happens (atomics do not race
// with each other). No-op in fast mode.
void NoteAtomic(const void* p, size_t bytes, const char* file, int line);

// A vector load at an address not aligned to its size (__ldg).
void ReportMisaligned(const void* p, size_t bytes, const char* file, int line);

// Checked mode: a read-only load (__ldg) of `bytes` at p from the call site file:line, for the counts of warp load
// requests (simt/counters.h). No-op in fast mode.
void NoteReadOnlyLoad(const void* p, size_t bytes, const char* file, int line);

template <typename T>
T Shuffle(CollectiveOp op, unsigned mask, T v, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move 4- or 8-byte values");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = WarpCollective(op, mask, bits, arg, width, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
}  // namespace detail

}  // namespace simt
