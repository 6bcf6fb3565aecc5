#include "src/backend/cuda_device.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
#include "kernels/gemv.h"
#include "kernels/moe_grouped.h"
#include "kernels/norm.h"
#include "kernels/quant.h"
#include "kernels/rope.h"
#include "kernels/router.h"
#include "kernels/sampling.h"
#include "src/backend/cpu_kernels.h"
#include "src/common/status.h"
#include "src/common/strings.h"

#ifdef ODMOE_SIMT
#include "simt/counters.h"
#endif

// Aborts with the CUDA error's text: a failed launch or an asynchronous fault is a bug, like a failed CHECK.
#define ODMOE_CUDA_CHECK(expr)                                                              \
  do {                                                                                      \
    const cudaError_t odmoe_cuda_err_ = (expr);                                             \
    if (odmoe_cuda_err_ != cudaSuccess) {                                                   \
      std::fprintf(stderr, "%s:%d: CUDA error in %s: %s (%s)\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorName(odmoe_cuda_err_), cudaGetErrorString(odmoe_cuda_err_)); \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

#define ODMOE_CUBLAS_CHECK(expr)                                                         \
  do {                                                                                   \
    const cublasStatus_t odmoe_cublas_st_ = (expr);                                      \
    if (odmoe_cublas_st_ != CUBLAS_STATUS_SUCCESS) {                                     \
      std::fprintf(stderr, "%s:%d: cuBLAS error in %s: %s\n", __FILE__, __LINE__, #expr, \
                   cublasGetStatusString(odmoe_cublas_st_));                             \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

// A kernel launch (a Launch* call of kernels/, or a cuBLAS GEMM): checked, then counted. Inside CudaDevice.
#define ODMOE_CUDA_LAUNCH(expr) \
  do {                          \
    ODMOE_CUDA_CHECK(expr);     \
    accounting_->NoteLaunch();  \
  } while (0)
#define ODMOE_CUBLAS_LAUNCH(expr) \
  do {                            \
    ODMOE_CUBLAS_CHECK(expr);     \
    accounting_->NoteLaunch();    \
  } while (0)

namespace odmoe {
namespace {

// Above this many tokens MatMul uses cuBLAS instead of the GEMV kernel.
constexpr int64_t kGemvMaxTokens = kernels::kGemvMaxTokens;
// Up to this many new tokens Attention uses the split-sequence decode kernel.
constexpr int64_t kDecodeMaxTokens = 4;
// The most scratch bytes MatMul uses for 16-bit copies of activations (larger n is processed in row chunks).
constexpr size_t kGemmScratchBytes = size_t{32} << 20;

// The scratch of one activation row in a GEMM over 16-bit weights: its hi and lo 16-bit copies and its scale
// (kernels::LaunchSplitToPair).
size_t GemmRowBytes(int64_t in_dim) { return static_cast<size_t>(in_dim) * 2 * sizeof(uint16_t) + sizeof(float); }
// The rows of such a GEMM processed at once: as many as fit kGemmScratchBytes, at least one, at most n.
int64_t GemmChunkRows(int64_t n, int64_t in_dim) {
  return std::clamp<int64_t>(static_cast<int64_t>(kGemmScratchBytes / GemmRowBytes(in_dim)), 1, n);
}

// What the calling thread enqueues while it captures a graph (CudaDevice::CaptureGraph): recorded, not run, so its
// launches and ops are counted into the graph and counted as run at each LaunchGraph. Null when not capturing.
struct CaptureTally {
  uint64_t launches = 0;
  std::map<std::string, int64_t> ops;
  TransferStats transfers;  // the copies
  uint64_t bytes_read = 0;  // what the copies read from device memory
};
thread_local CaptureTally* tls_capture = nullptr;

std::string FormatBytes(uint64_t bytes) {
  return absl::StrFormat("%d bytes (%.1f MiB)", bytes, static_cast<double>(bytes) / (1024.0 * 1024.0));
}

// Makes `ordinal` the calling thread's current device (cheap when it already is).
void UseDevice(int ordinal) {
  int current = -1;
  ODMOE_CUDA_CHECK(cudaGetDevice(&current));
  if (current != ordinal) ODMOE_CUDA_CHECK(cudaSetDevice(ordinal));
}

// Memory accounting shared by the device, its buffers and its streams (which may outlive the device): every
// byte this backend allocates on the device (buffers, the streams' cuBLAS workspaces and scratch) is counted.
struct Accounting {
  explicit Accounting(uint64_t capacity_in) : capacity(capacity_in) {}
  const uint64_t capacity;
  mutable absl::Mutex mu;
  uint64_t in_use ABSL_GUARDED_BY(mu) = 0;
  uint64_t peak ABSL_GUARDED_BY(mu) = 0;
  // DeviceCounters of the runtime calls this backend makes (on a GPU; under the emulator the runtime counts).
  std::atomic<uint64_t> host_syncs{0};
  std::atomic<uint64_t> allocations{0};
  std::atomic<uint64_t> frees{0};
  std::atomic<uint64_t> launches{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> graph_launches{0};
  std::atomic<uint64_t> graph_kernel_launches{0};
  void Note(std::atomic<uint64_t>& counter, uint64_t n = 1) { counter.fetch_add(n, std::memory_order_relaxed); }
  // A kernel launch call: a launch, or a node of the graph this thread is capturing.
  void NoteLaunch() {
    if (tls_capture != nullptr) {
      ++tls_capture->launches;
    } else {
      Note(launches);
    }
  }

  // Counts `bytes`. `within_capacity`: not when they would exceed the capacity (then false); otherwise even
  // past it (an op's scratch, which cannot fail; in_use then shows the excess).
  bool Charge(uint64_t bytes, bool within_capacity) {
    absl::MutexLock lock(&mu);
    if (within_capacity && bytes > capacity - std::min(capacity, in_use)) return false;
    in_use += bytes;
    peak = std::max(peak, in_use);
    return true;
  }
  void Release(uint64_t bytes) {
    absl::MutexLock lock(&mu);
    in_use -= std::min(in_use, bytes);
  }
};

// Stream-ordered device memory for the buffers of one CudaDevice, so that loading and evicting (Allocate and a
// Buffer's destruction) never make the host wait for the device, as cudaFree does.
//  - A CUDA memory pool of its own whose release threshold is the device's capacity: what evictions free stays
//    reserved for the next load instead of going back to the driver at every synchronization.
//  - Allocations are ordered on `alloc_stream_`, which carries nothing else, so an allocation never waits for
//    earlier work; the pool does not reuse memory through internal dependencies (that would make the allocating
//    stream wait for a pending free), only memory whose free has completed. Every registered stream then waits
//    (on the device) for the allocation, so the memory may be used on any of them once Allocate returns.
//  - A free is ordered on `free_stream_` after all work enqueued so far on every registered stream (an event
//    recorded on each, waited on by free_stream_), so work already enqueued that uses the memory ends first.
// The pool may therefore hold more than the capacity for a moment (frees still pending on the device while new
// allocations come in); it gives back what it holds above the capacity at the next synchronization. Only when
// the GPU itself has no room left does an allocation wait (on the host, counted) for the pending frees and try
// once more. The budget itself is Accounting's, in bytes asked, exactly as before.
// Thread safety: all methods may be called from any thread; the event and the stream list are guarded by mu_.
// Shared by the device, its streams and its buffers, so it outlives the last of them.
class DeviceMemoryPool {
 public:
  DeviceMemoryPool(int ordinal, uint64_t release_threshold, std::shared_ptr<Accounting> accounting)
      : ordinal_(ordinal), accounting_(std::move(accounting)) {
    UseDevice(ordinal_);
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal_;
    ODMOE_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
    ODMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &release_threshold));
    int no = 0;
    ODMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &no));
    ODMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&alloc_stream_, cudaStreamNonBlocking));
    ODMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&free_stream_, cudaStreamNonBlocking));
    absl::MutexLock lock(&mu_);
    ODMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~DeviceMemoryPool() {
    UseDevice(ordinal_);
    // Errors are ignored: at process exit the context may be gone, and nothing is left to release then.
    (void)cudaStreamSynchronize(free_stream_);
    absl::MutexLock lock(&mu_);
    (void)cudaEventDestroy(event_);
    (void)cudaStreamDestroy(alloc_stream_);
    (void)cudaStreamDestroy(free_stream_);
    (void)cudaMemPoolDestroy(pool_);
  }
  DeviceMemoryPool(const DeviceMemoryPool&) = delete;
  DeviceMemoryPool& operator=(const DeviceMemoryPool&) = delete;

  // `bytes` (> 0) of device memory in *out, usable on every registered stream. The CUDA error when the pool
  // cannot grow even after the pending frees (cleared: an allocation failure is not sticky).
  cudaError_t Allocate(size_t bytes, void** out) {
    UseDevice(ordinal_);
    absl::MutexLock lock(&mu_);
    cudaError_t err = cudaMallocFromPoolAsync(out, bytes, pool_, alloc_stream_);
    if (err == cudaErrorMemoryAllocation) {
      // The GPU is full: what frees still pending would return may make room.
      (void)cudaGetLastError();
      ODMOE_CUDA_CHECK(cudaStreamSynchronize(free_stream_));
      accounting_->Note(accounting_->host_syncs);
      err = cudaMallocFromPoolAsync(out, bytes, pool_, alloc_stream_);
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return err;
    }
    ODMOE_CUDA_CHECK(cudaEventRecord(event_, alloc_stream_));
    for (cudaStream_t s : streams_) ODMOE_CUDA_CHECK(cudaStreamWaitEvent(s, event_, 0));
    return cudaSuccess;
  }

  // Returns `p` (from Allocate) to the pool once the work enqueued so far on every registered stream has ended.
  // Called from destructors, on any thread: the thread's current device is restored, and errors are ignored
  // (they come only when the context is gone at process exit, and nothing is left to free then).
  void Free(void* p) {
    int current = -1;
    const bool switched =
        cudaGetDevice(&current) == cudaSuccess && current != ordinal_ && cudaSetDevice(ordinal_) == cudaSuccess;
    {
      absl::MutexLock lock(&mu_);
      for (cudaStream_t s : streams_) {
        (void)cudaEventRecord(event_, s);
        (void)cudaStreamWaitEvent(free_stream_, event_, 0);
      }
      (void)cudaFreeAsync(p, free_stream_);
    }
    if (switched) (void)cudaSetDevice(current);
  }

  // A stream whose work may use this pool's memory: it waits for the allocations made so far, and later
  // allocations and frees are ordered with it. REQUIRES: not registered; RemoveStream before destroying it.
  void AddStream(cudaStream_t s) {
    UseDevice(ordinal_);
    absl::MutexLock lock(&mu_);
    ODMOE_CUDA_CHECK(cudaEventRecord(event_, alloc_stream_));
    ODMOE_CUDA_CHECK(cudaStreamWaitEvent(s, event_, 0));
    streams_.push_back(s);
  }
  void RemoveStream(cudaStream_t s) {
    absl::MutexLock lock(&mu_);
    streams_.erase(std::remove(streams_.begin(), streams_.end(), s), streams_.end());
  }

  // `s` (registered) is about to be captured into a graph: until EndCapture, allocations and frees leave it alone,
  // since a wait or an event recorded on it from here would join the capture. Frees made meanwhile come after the
  // work enqueued on it before the capture (free_stream_ waits for that now); the graph itself must not use
  // memory freed while it is captured or replayed (the caller's contract).
  void BeginCapture(cudaStream_t s) {
    UseDevice(ordinal_);
    absl::MutexLock lock(&mu_);
    ODMOE_CUDA_CHECK(cudaEventRecord(event_, s));
    ODMOE_CUDA_CHECK(cudaStreamWaitEvent(free_stream_, event_, 0));
    streams_.erase(std::remove(streams_.begin(), streams_.end(), s), streams_.end());
  }
  // The capture of `s` has ended: registered again, it waits for the allocations made in the meantime.
  void EndCapture(cudaStream_t s) { AddStream(s); }

 private:
  const int ordinal_;
  const std::shared_ptr<Accounting> accounting_;  // for the host syncs it counts
  // Constant after construction.
  cudaMemPool_t pool_ = nullptr;
  cudaStream_t alloc_stream_ = nullptr;  // allocations only
  cudaStream_t free_stream_ = nullptr;   // frees, each after the registered streams' work
  absl::Mutex mu_;
  cudaEvent_t event_ ABSL_GUARDED_BY(mu_) = nullptr;  // recorded and waited on at once, then reused
  std::vector<cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
};

// This process's device memory as NVML counts it (the driver's figure: allocations, context, module images),
// through libnvidia-ml loaded at run time (it comes with the driver; nothing links against it). nullopt when
// the library, the device or this process is not found, or the driver does not say (e.g. in some containers).
// The declarations are NVML's stable C ABI (nvml.h: nvmlProcessInfo_v2_t for the _v3 query).
namespace nvml {
struct ProcessInfo {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};
using InitFn = int (*)();
using HandleByBusIdFn = int (*)(const char*, void**);
using ProcessesFn = int (*)(void*, unsigned int*, ProcessInfo*);
constexpr unsigned long long kValueNotAvailable = ~0ULL;

struct Api {
  HandleByBusIdFn handle_by_bus_id = nullptr;
  ProcessesFn processes = nullptr;
  bool ok = false;
};

const Api& GetApi() {
  static const Api api = [] {
    Api a;
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return a;
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
    a.handle_by_bus_id = reinterpret_cast<HandleByBusIdFn>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    a.processes = reinterpret_cast<ProcessesFn>(dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
    a.ok = init != nullptr && a.handle_by_bus_id != nullptr && a.processes != nullptr && init() == 0;
    return a;  // the library stays loaded for the life of the process
  }();
  return api;
}

std::optional<uint64_t> ProcessBytes(int ordinal) {
  const Api& api = GetApi();
  if (!api.ok) return std::nullopt;
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), ordinal) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  void* device = nullptr;
  if (api.handle_by_bus_id(bus_id, &device) != 0) return std::nullopt;
  std::vector<ProcessInfo> infos(256);
  unsigned int count = static_cast<unsigned int>(infos.size());
  if (api.processes(device, &count, infos.data()) != 0) return std::nullopt;
  const unsigned int self = static_cast<unsigned int>(getpid());
  for (unsigned int i = 0; i < count && i < infos.size(); ++i) {
    if (infos[i].pid == self && infos[i].used_gpu_memory != kValueNotAvailable) return infos[i].used_gpu_memory;
  }
  return std::nullopt;
}
}  // namespace nvml

// cuBLAS's own default workspace per handle: 32 MiB on Hopper and newer, 4 MiB before. Given to each handle
// explicitly (cublasSetWorkspace), from counted memory.
size_t CublasWorkspaceBytes(int major) { return major >= 9 ? size_t{32} << 20 : size_t{4} << 20; }

// A Buffer from the device's DeviceMemoryPool: destroying it returns the memory in stream order (no host wait).
class CudaBuffer final : public Buffer {
 public:
  CudaBuffer(void* data, size_t size, std::shared_ptr<Accounting> accounting, std::shared_ptr<DeviceMemoryPool> pool)
      : Buffer(data, size), accounting_(std::move(accounting)), pool_(std::move(pool)) {}
  ~CudaBuffer() override {
    if (data() != nullptr) {
      pool_->Free(data());
      accounting_->Note(accounting_->frees);
    }
    accounting_->Release(size());
  }

 private:
  std::shared_ptr<Accounting> accounting_;
  std::shared_ptr<DeviceMemoryPool> pool_;
};

// Page-locked host memory from cudaMallocHost (Device::AllocateHost).
class CudaHostBuffer final : public HostBuffer {
 public:
  CudaHostBuffer(void* data, size_t size, std::shared_ptr<Accounting> accounting)
      : HostBuffer(data, size), accounting_(std::move(accounting)) {}
  ~CudaHostBuffer() override {
    if (data() == nullptr) return;
    if (cudaFreeHost(data()) != cudaSuccess) (void)cudaGetLastError();
    accounting_->Note(accounting_->host_syncs);  // cudaFreeHost waits for the device, as cudaFree does
  }

 private:
  std::shared_ptr<Accounting> accounting_;
};

// A CUDA stream with what the ops enqueued on it need: a cuBLAS handle bound to it and scratch memory.
// Used by one host thread at a time.
class CudaStream final : public Stream {
 public:
  CudaStream(int ordinal, int major, std::shared_ptr<Accounting> accounting, std::shared_ptr<DeviceMemoryPool> pool)
      : ordinal_(ordinal),
        cublas_workspace_bytes_(CublasWorkspaceBytes(major)),
        accounting_(std::move(accounting)),
        pool_(std::move(pool)) {
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    pool_->AddStream(stream_);
  }
  ~CudaStream() override {
    UseDevice(ordinal_);
    (void)cudaStreamSynchronize(stream_);
    pool_->RemoveStream(stream_);
    if (cublas_ != nullptr) (void)cublasDestroy(cublas_);
    if (scratch_ != nullptr) (void)cudaFree(scratch_);
    if (workspace_ != nullptr) (void)cudaFree(workspace_);
    accounting_->Release(scratch_bytes_ + (workspace_ != nullptr ? cublas_workspace_bytes_ : 0));
    (void)cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }

  // The cuBLAS workspace, counted; allocated by Prepare or the first cublas(). False when it does not fit the
  // capacity (Prepare's caller reports that; cublas() then counts it past the capacity).
  bool ReserveWorkspace(bool within_capacity) {
    if (workspace_ != nullptr) return true;
    if (!accounting_->Charge(cublas_workspace_bytes_, within_capacity)) return false;
    ODMOE_CUDA_CHECK(cudaMalloc(&workspace_, cublas_workspace_bytes_));
    accounting_->Note(accounting_->allocations);
    return true;
  }

  cublasHandle_t cublas() {
    if (cublas_ == nullptr) {
      ReserveWorkspace(/*within_capacity=*/false);
      ODMOE_CUBLAS_CHECK(cublasCreate(&cublas_));
      ODMOE_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
      ODMOE_CUBLAS_CHECK(cublasSetWorkspace(cublas_, workspace_, cublas_workspace_bytes_));
      // fp32 products ask for CUBLAS_COMPUTE_32F_PEDANTIC explicitly; here: no reduced-precision split-K
      // reductions for the 16-bit ones either.
      ODMOE_CUBLAS_CHECK(cublasSetMathMode(
          cublas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    }
    return cublas_;
  }

  // At least `bytes` of device memory, valid for work enqueued on this stream until the next call, counted.
  // Growing waits for the stream first, since earlier work may still use the old block. `within_capacity`:
  // false instead of growing past the capacity.
  void* Scratch(size_t bytes, bool within_capacity = false) {
    if (bytes > scratch_bytes_) {
      const size_t rounded = (bytes + (size_t{1} << 20) - 1) & ~((size_t{1} << 20) - 1);
      const size_t extra = rounded - scratch_bytes_;  // the old block goes first
      if (!accounting_->Charge(extra, within_capacity)) return nullptr;
      ODMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      accounting_->Note(accounting_->host_syncs);
      if (scratch_ != nullptr) {
        ODMOE_CUDA_CHECK(cudaFree(scratch_));
        accounting_->Note(accounting_->frees);
        accounting_->Note(accounting_->host_syncs);
      }
      scratch_ = nullptr;
      ODMOE_CUDA_CHECK(cudaMalloc(&scratch_, rounded));
      accounting_->Note(accounting_->allocations);
      scratch_bytes_ = rounded;
    }
    return scratch_;
  }
  size_t workspace_bytes() const { return cublas_workspace_bytes_; }

 private:
  const int ordinal_;
  cudaStream_t stream_ = nullptr;
  const size_t cublas_workspace_bytes_;
  const std::shared_ptr<Accounting> accounting_;
  const std::shared_ptr<DeviceMemoryPool> pool_;  // ordered with this stream while it lives
  cublasHandle_t cublas_ = nullptr;
  void* workspace_ = nullptr;  // the cuBLAS workspace
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int ordinal) : ordinal_(ordinal) {
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override {
    UseDevice(ordinal_);
    (void)cudaEventDestroy(event_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  const int ordinal_;
  cudaEvent_t event_ = nullptr;
};

// An instantiated graph (CudaDevice::CaptureGraph) and what one launch of it runs, for the counts. Immutable.
class CudaGraph final : public Graph {
 public:
  CudaGraph(const void* owner, int ordinal, cudaGraphExec_t exec, CaptureTally tally)
      : owner(owner), ordinal(ordinal), exec(exec), tally(std::move(tally)) {}
  ~CudaGraph() override {
    UseDevice(ordinal);
    (void)cudaGraphExecDestroy(exec);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  const void* const owner;  // the device that made it
  const int ordinal;
  const cudaGraphExec_t exec;
  const CaptureTally tally;  // its kernel launches, ops and copies
};

// The routed experts' weight pointers in device memory (kernels::ExpertPointers, [layers, experts]) and what the
// kernels need to read them: their one dtype and shapes. Immutable; `owner` identifies the device that made it.
class CudaExpertTable final : public ExpertTable {
 public:
  CudaExpertTable(const void* owner, std::unique_ptr<Buffer> pointers, DType dtype, int64_t layers, int64_t experts,
                  int64_t hidden, int64_t intermediate)
      : owner(owner),
        pointers(std::move(pointers)),
        dtype(dtype),
        layers(layers),
        experts(experts),
        hidden(hidden),
        intermediate(intermediate) {}
  const kernels::ExpertPointers* layer(int64_t l) const {
    return this->pointers->as<kernels::ExpertPointers>() + l * experts;
  }

  const void* const owner;
  const std::unique_ptr<Buffer> pointers;
  const DType dtype;
  const int64_t layers, experts, hidden, intermediate;
};

// Calls f with w.data as a typed pointer: const float*, const __half* or const __nv_bfloat16*.
template <typename F>
void WithWeightType(WeightRef w, F&& f) {
  switch (w.dtype) {
    case DType::kF32:
      f(static_cast<const float*>(w.data));
      return;
    case DType::kF16:
      f(static_cast<const __half*>(w.data));
      return;
    case DType::kBF16:
      f(static_cast<const __nv_bfloat16*>(w.data));
      return;
    default:
      break;
  }
  std::fprintf(stderr, "CudaDevice: weights must be F32, F16 or BF16, not %s\n",
               std::string(DTypeName(w.dtype)).c_str());
  std::abort();
}

bool FitsInt(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, int major, std::string gpu_name, uint64_t capacity)
      : ordinal_(ordinal),
        major_(major),
        gpu_name_(std::move(gpu_name)),
        accounting_(std::make_shared<Accounting>(capacity)),
        pool_(std::make_shared<DeviceMemoryPool>(ordinal, capacity, accounting_)),
        default_stream_(std::make_unique<CudaStream>(ordinal, major, accounting_, pool_)) {}
  ~CudaDevice() override {
    UseDevice(ordinal_);
    (void)cudaDeviceSynchronize();
    absl::MutexLock lock(&rope_mu_);
    for (auto& [key, table] : rope_tables_) {
      (void)cudaFree(table);
      accounting_->Release(static_cast<uint64_t>(key.first / 2) * sizeof(float));
    }
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return StrCat("cuda:", ordinal_, " (", gpu_name_, ")"); }

  // ---- memory ----------------------------------------------------------------------------------------------
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes, std::string_view tag) override {
    if (!accounting_->Charge(bytes, /*within_capacity=*/true)) {
      const MemoryInfo m = memory_info();
      return absl::ResourceExhaustedError(StrCat(name(), ": cannot allocate ", FormatBytes(bytes), " for '", tag,
                                                 "': ", FormatBytes(m.in_use), " of its capacity of ",
                                                 FormatBytes(m.capacity), " are in use"));
    }
    void* data = nullptr;
    if (bytes > 0) {
      const cudaError_t err = pool_->Allocate(bytes, &data);
      if (err != cudaSuccess) {
        size_t free_bytes = 0;
        size_t total_bytes = 0;
        (void)cudaMemGetInfo(&free_bytes, &total_bytes);
        accounting_->Release(bytes);
        return absl::ResourceExhaustedError(StrCat(name(), ": the memory pool could not allocate ", FormatBytes(bytes),
                                                   " for '", tag, "' (", cudaGetErrorString(err), "); the GPU has ",
                                                   FormatBytes(free_bytes), " free of ", FormatBytes(total_bytes)));
      }
      accounting_->Note(accounting_->allocations);
    }
    return std::unique_ptr<Buffer>(new CudaBuffer(data, bytes, accounting_, pool_));
  }

  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes, std::string_view tag) override {
    void* data = nullptr;
    if (bytes > 0) {
      UseDevice(ordinal_);
      const cudaError_t err = cudaMallocHost(&data, bytes);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky
        return absl::ResourceExhaustedError(StrCat(name(), ": cudaMallocHost of ", FormatBytes(bytes), " for '", tag,
                                                   "' failed: ", cudaGetErrorString(err)));
      }
      std::memset(data, 0, bytes);
    }
    return std::unique_ptr<HostBuffer>(new CudaHostBuffer(data, bytes, accounting_));
  }

  MemoryInfo memory_info() const override {
    absl::MutexLock lock(&accounting_->mu);
    return MemoryInfo{accounting_->capacity, accounting_->in_use, accounting_->peak};
  }

  void ResetPeak() override {
    absl::MutexLock lock(&accounting_->mu);
    accounting_->peak = accounting_->in_use;
  }

  std::optional<uint64_t> process_device_bytes() const override { return nvml::ProcessBytes(ordinal_); }

  // ---- streams and copies ----------------------------------------------------------------------------------
  std::unique_ptr<Stream> CreateStream() override {
    return std::make_unique<CudaStream>(ordinal_, major_, accounting_, pool_);
  }

  absl::Status PrepareStream(Stream* stream, int64_t max_rows, int64_t max_in_dim) override {
    CudaStream* s = S(stream);
    if (!s->ReserveWorkspace(/*within_capacity=*/true)) {
      return absl::ResourceExhaustedError(StrCat(name(), ": the cuBLAS workspace of ",
                                                 FormatBytes(s->workspace_bytes()), " does not fit its capacity (",
                                                 FormatBytes(memory_info().in_use), " in use)"));
    }
    // What Gemm takes for 16-bit weights.
    const uint64_t gemm = max_rows > 0 && max_in_dim > 0
                              ? static_cast<uint64_t>(GemmChunkRows(max_rows, max_in_dim)) * GemmRowBytes(max_in_dim)
                              : 0;
    if (gemm > 0 && s->Scratch(gemm, /*within_capacity=*/true) == nullptr) {
      return absl::ResourceExhaustedError(StrCat(name(), ": the GEMM scratch of ", FormatBytes(gemm),
                                                 " does not fit its capacity (", FormatBytes(memory_info().in_use),
                                                 " in use)"));
    }
    (void)s->cublas();  // the handle, bound to its workspace
    return absl::OkStatus();
  }
  std::unique_ptr<Event> CreateEvent() override { return std::make_unique<CudaEvent>(ordinal_); }

  void RecordEvent(Event& event, Stream* stream) override {
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaEventRecord(static_cast<CudaEvent&>(event).get(), S(stream)->get()));
  }
  void SynchronizeEvent(Event& event) override {
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaEventSynchronize(static_cast<CudaEvent&>(event).get()));
    accounting_->Note(accounting_->host_syncs);
  }
  void WaitEvent(Stream* stream, Event& event) override {
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaStreamWaitEvent(S(stream)->get(), static_cast<CudaEvent&>(event).get(), 0));
  }
  void Synchronize(Stream* stream) override {
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaStreamSynchronize(S(stream)->get()));
    accounting_->Note(accounting_->host_syncs);
  }
  void SynchronizeAll() override {
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaDeviceSynchronize());
    accounting_->Note(accounting_->host_syncs);
  }

  void CopyToDevice(void* dst, const void* src, size_t bytes, Stream* stream) override {
    if (bytes > 0) {
      ODMOE_CHECK(dst != nullptr && src != nullptr);
      UseDevice(ordinal_);
      ODMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, S(stream)->get()));
    }
    CountCopy(bytes, &TransferStats::h2d_bytes, &TransferStats::h2d_copies, /*reads_device=*/false);
  }
  absl::Status RegisterHostMemory(const void* p, size_t bytes) override {
    ODMOE_RETURN_IF_ERROR(RecordHostRange(p, bytes));
    UseDevice(ordinal_);
    void* host = const_cast<void*>(p);
    int read_only = 0;
    (void)cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, ordinal_);
    cudaError_t err = cudaErrorNotSupported;
    if (read_only != 0) err = cudaHostRegister(host, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      err = cudaHostRegister(host, bytes, cudaHostRegisterPortable);
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky
      ForgetHostRange(p);
      return absl::UnavailableError(
          StrCat(name(), ": cudaHostRegister of ", FormatBytes(bytes), " failed: ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
  }
  void UnregisterHostMemory(const void* p) override {
    if (!ForgetHostRange(p)) return;
    UseDevice(ordinal_);
    if (cudaHostUnregister(const_cast<void*>(p)) != cudaSuccess) (void)cudaGetLastError();
  }
  void CopyToHost(void* dst, const void* src, size_t bytes, Stream* stream) override {
    CopyToHostAsync(dst, src, bytes, stream);
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaStreamSynchronize(S(stream)->get()));
    accounting_->Note(accounting_->host_syncs);
  }
  void CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream* stream) override {
    if (bytes > 0) {
      ODMOE_CHECK(dst != nullptr && src != nullptr);
      UseDevice(ordinal_);
      ODMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, S(stream)->get()));
    }
    CountCopy(bytes, &TransferStats::d2h_bytes, &TransferStats::d2h_copies, /*reads_device=*/true);
  }
  void CopyOnDevice(void* dst, const void* src, size_t bytes, Stream* stream) override {
    if (bytes > 0) {
      ODMOE_CHECK(dst != nullptr && src != nullptr);
      UseDevice(ordinal_);
      ODMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S(stream)->get()));
    }
    CountCopy(bytes, &TransferStats::d2d_bytes, &TransferStats::d2d_copies, /*reads_device=*/true);
  }
  TransferStats transfer_stats() const override {
    absl::MutexLock lock(&mu_);
    return transfers_;
  }

  // ---- graphs -----------------------------------------------------------------------------------------------
  bool SupportsGraphs() const override { return true; }

  // Thread-local capture mode: another thread's cudaMalloc or synchronization does not break this capture, and
  // this thread's own (a bug in `enqueue`) fails it. The memory pool leaves the stream alone meanwhile.
  absl::StatusOr<std::unique_ptr<Graph>> CaptureGraph(Stream* stream,
                                                      const std::function<absl::Status()>& enqueue) override {
    UseDevice(ordinal_);
    cudaStream_t s = S(stream)->get();
    CaptureTally tally;
    pool_->BeginCapture(s);
    cudaError_t err = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    absl::Status enqueued;
    cudaGraph_t graph = nullptr;
    if (err == cudaSuccess) {
      tls_capture = &tally;
      enqueued = enqueue();
      tls_capture = nullptr;
      err = cudaStreamEndCapture(s, &graph);
    }
    pool_->EndCapture(s);
    if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky
    cudaGraphExec_t exec = nullptr;
    if (enqueued.ok() && err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);  // the instance keeps what it needs
    if (!enqueued.ok()) return enqueued;
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::InternalError(
          StrCat(name(), ": capturing a graph failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
    }
    return std::unique_ptr<Graph>(new CudaGraph(this, ordinal_, exec, std::move(tally)));
  }

  void LaunchGraph(const Graph& graph, Stream* stream) override {
    const auto& g = static_cast<const CudaGraph&>(graph);
    ODMOE_CHECK(g.owner == this);
    UseDevice(ordinal_);
    ODMOE_CUDA_CHECK(cudaGraphLaunch(g.exec, S(stream)->get()));
    accounting_->Note(accounting_->graph_launches);
    accounting_->Note(accounting_->launches, g.tally.launches);
    accounting_->Note(accounting_->graph_kernel_launches, g.tally.launches);
    accounting_->Note(accounting_->bytes_read, g.tally.bytes_read);
    absl::MutexLock lock(&mu_);
    for (const auto& [op, count] : g.tally.ops) op_counts_[op] += count;
    const TransferStats& t = g.tally.transfers;
    for (auto field : {&TransferStats::h2d_bytes, &TransferStats::h2d_copies, &TransferStats::d2h_bytes,
                       &TransferStats::d2h_copies, &TransferStats::d2d_bytes, &TransferStats::d2d_copies}) {
      transfers_.*field += t.*field;
    }
  }

  void WriteKvRows(const float* k_rows, const float* v_rows, const int32_t* positions, int64_t n, int64_t kv_size,
                   KvCacheRef k_cache, KvCacheRef v_cache, int64_t capacity, Stream* stream) override {
    CountOp("WriteKvRows");
    ODMOE_CHECK(n >= 0 && kv_size > 0 && capacity >= 0);
    if (n == 0) return;
    ODMOE_CHECK(k_rows != nullptr && v_rows != nullptr && positions != nullptr && k_cache.data != nullptr &&
                v_cache.data != nullptr && k_cache.dtype == v_cache.dtype);
    UseDevice(ordinal_);
    cudaStream_t s = S(stream)->get();
    WithWeightType(WeightRef{k_cache.data, k_cache.dtype}, [&](auto* typed) {
      using KV = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
      KV* v = const_cast<KV*>(static_cast<const KV*>(v_cache.data));
      ODMOE_CUDA_LAUNCH(
          kernels::LaunchKvStore(k_rows, v_rows, positions, n, kv_size, const_cast<KV*>(typed), v, capacity, s));
    });
  }

  void RopeWriteKv(float* q, float* k, const float* v, WeightRef q_norm, WeightRef k_norm, float eps,
                   const int32_t* positions, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim, double theta,
                   KvCacheRef k_cache, KvCacheRef v_cache, int64_t capacity, Stream* stream) override {
    ODMOE_CHECK(q_norm.empty() == k_norm.empty());
    const bool norms = !q_norm.empty();
    if (norms && !HeadNormsFitOneLaunch(q_norm, k_norm, head_dim)) {
      Device::RopeWriteKv(q, k, v, q_norm, k_norm, eps, positions, n, heads, kv_heads, head_dim, theta, k_cache,
                          v_cache, capacity, stream);
      return;
    }
    CountOp("RopeWriteKv");
    ODMOE_CHECK(n >= 0 && heads >= 0 && kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0 && capacity >= 0);
    if (n == 0) return;
    ODMOE_CHECK((heads == 0 || q != nullptr) && k != nullptr && v != nullptr && positions != nullptr &&
                k_cache.data != nullptr && v_cache.data != nullptr && k_cache.dtype == v_cache.dtype);
    UseDevice(ordinal_);
    CudaStream* s = S(stream);
    const float* inv_freq = InvFreqTable(head_dim, theta, s);
    WithWeightType(WeightRef{k_cache.data, k_cache.dtype}, [&](auto* typed) {
      using KV = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
      KV* kc = const_cast<KV*>(typed);
      KV* vc = const_cast<KV*>(static_cast<const KV*>(v_cache.data));
      if (!norms) {
        ODMOE_CUDA_LAUNCH(kernels::LaunchRopeKvStore(q, k, v, positions, n, heads, kv_heads, head_dim, theta, inv_freq,
                                                     kc, vc, capacity, s->get()));
        return;
      }
      WithWeightType(q_norm, [&](auto* qw) {
        using W = std::remove_const_t<std::remove_pointer_t<decltype(qw)>>;
        ODMOE_CUDA_LAUNCH(kernels::LaunchHeadNormRopeKvStore(q, k, v, qw, static_cast<const W*>(k_norm.data), positions,
                                                             n, heads, kv_heads, head_dim, eps, theta, inv_freq, kc, vc,
                                                             capacity, s->get()));
      });
    });
  }

  size_t AttentionAtWorkspaceBytes(int64_t n, int64_t max_past, int64_t heads, int64_t head_dim) const override {
    return kernels::AttentionDecodeAtWorkspaceFloats(n, max_past, heads, head_dim) * sizeof(float);
  }

  void AttentionAt(const float* q, KvCacheRef k_cache, KvCacheRef v_cache, int64_t n, const int32_t* past,
                   int64_t max_past, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, void* workspace,
                   float* out, Stream* stream) override {
    CountOp("Attention");
    ODMOE_CHECK(n >= 0 && n <= kDecodeMaxTokens && max_past >= 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0);
    ODMOE_CHECK(head_dim > 0 && head_dim <= kernels::kMaxHeadDim);
    ODMOE_CHECK(k_cache.dtype == v_cache.dtype);
    if (n == 0) return;
    ODMOE_CHECK(q != nullptr && past != nullptr && k_cache.data != nullptr && v_cache.data != nullptr &&
                out != nullptr);
    const size_t floats = kernels::AttentionDecodeAtWorkspaceFloats(n, max_past, heads, head_dim);
    ODMOE_CHECK(floats == 0 || workspace != nullptr);
    UseDevice(ordinal_);
    WithWeightType(WeightRef{k_cache.data, k_cache.dtype}, [&](auto* k) {
      using KV = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
      const KV* v = static_cast<const KV*>(v_cache.data);
      ODMOE_CUDA_LAUNCH(kernels::LaunchAttentionDecodeAt(q, k, v, n, past, max_past, heads, kv_heads, head_dim, scale,
                                                         out, static_cast<float*>(workspace), floats,
                                                         S(stream)->get()));
    });
  }

  // ---- ops -------------------------------------------------------------------------------------------------
  void Embedding(const int32_t* ids, int64_t n, WeightRef table, int64_t dim, float* out, Stream* stream) override {
    CountOp("Embedding");
    ODMOE_CHECK(n >= 0 && dim >= 0);
    if (n == 0 || dim == 0) return;
    ODMOE_CHECK(ids != nullptr && !table.empty() && out != nullptr);
    UseDevice(ordinal_);
    WithWeightType(
        table, [&](auto* t) { ODMOE_CUDA_LAUNCH(kernels::LaunchEmbedding(ids, n, t, dim, out, S(stream)->get())); });
  }

  void RmsNorm(const float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out,
               Stream* stream) override {
    CountOp("RmsNorm");
    ODMOE_CHECK(rows >= 0 && dim > 0);
    if (rows == 0) return;
    ODMOE_CHECK(x != nullptr && !weight.empty() && out != nullptr);
    UseDevice(ordinal_);
    WithWeightType(weight, [&](auto* w) {
      ODMOE_CUDA_LAUNCH(kernels::LaunchRmsNorm(x, w, rows, dim, eps, out, S(stream)->get()));
    });
  }

  void AddRmsNorm(const float* delta, float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out,
                  Stream* stream) override {
    CountOp("AddRmsNorm");
    ODMOE_CHECK(rows >= 0 && dim > 0);
    if (rows == 0) return;
    ODMOE_CHECK(delta != nullptr && x != nullptr && !weight.empty() && out != nullptr && out != x && out != delta);
    UseDevice(ordinal_);
    WithWeightType(weight, [&](auto* w) {
      ODMOE_CUDA_LAUNCH(kernels::LaunchAddRmsNorm(delta, x, w, rows, dim, eps, out, S(stream)->get()));
    });
  }

  void MatMul(const float* x, WeightRef w, WeightRef bias, int64_t n, int64_t in_dim, int64_t out_dim, float* y,
              Stream* stream) override {
    CountOp("MatMul");
    ODMOE_CHECK(n >= 0 && in_dim > 0 && out_dim >= 0);
    if (n == 0 || out_dim == 0) return;
    ODMOE_CHECK(x != nullptr && !w.empty() && y != nullptr);
    UseDevice(ordinal_);
    CudaStream* s = S(stream);
    if (w.quantized()) {
      QuantizedMatMul(x, w, n, in_dim, out_dim, y, s);
      if (!bias.empty()) AddBias(bias, n, out_dim, y, s);
      return;
    }
    const bool fused_bias = !bias.empty() && bias.dtype == w.dtype;
    if (n <= kGemvMaxTokens) {
      WithWeightType(w, [&](auto* wp) {
        using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
        const W* bp = fused_bias ? static_cast<const W*>(bias.data) : nullptr;
        ODMOE_CUDA_LAUNCH(kernels::LaunchGemv(x, wp, bp, n, in_dim, out_dim, y, s->get()));
      });
      if (!bias.empty() && !fused_bias) AddBias(bias, n, out_dim, y, s);
      return;
    }
    Gemm(x, w, n, in_dim, out_dim, y, s);
    if (!bias.empty()) AddBias(bias, n, out_dim, y, s);
  }

  void Rope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
            Stream* stream) override {
    CountOp("Rope");
    ODMOE_CHECK(n >= 0 && heads >= 0 && head_dim > 0 && head_dim % 2 == 0);
    if (n == 0 || heads == 0) return;
    ODMOE_CHECK(x != nullptr && positions != nullptr);
    UseDevice(ordinal_);
    CudaStream* s = S(stream);
    ODMOE_CUDA_LAUNCH(
        kernels::LaunchRope(x, positions, n, heads, head_dim, theta, InvFreqTable(head_dim, theta, s), s->get()));
  }

  // Whether the per-head norms fit HeadNormRopeKernel (HeadNormRope, RopeWriteKv): it holds a head in one block's
  // threads and takes both norms in one dtype. Otherwise those ops take their defaults.
  static bool HeadNormsFitOneLaunch(WeightRef q_norm, WeightRef k_norm, int64_t head_dim) {
    return head_dim <= kernels::kHeadNormRopeMaxHeadDim && q_norm.dtype == k_norm.dtype;
  }

  void HeadNormRope(float* q, float* k, WeightRef q_norm, WeightRef k_norm, const int32_t* positions, int64_t n,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, double theta,
                    Stream* stream) override {
    ODMOE_CHECK(n >= 0 && heads >= 0 && kv_heads >= 0 && head_dim > 0 && head_dim % 2 == 0);
    if (!HeadNormsFitOneLaunch(q_norm, k_norm, head_dim)) {
      Device::HeadNormRope(q, k, q_norm, k_norm, positions, n, heads, kv_heads, head_dim, eps, theta, stream);
      return;
    }
    CountOp("HeadNormRope");
    if (n == 0 || heads + kv_heads == 0) return;
    ODMOE_CHECK(q != nullptr && k != nullptr && !q_norm.empty() && !k_norm.empty() && positions != nullptr);
    UseDevice(ordinal_);
    CudaStream* s = S(stream);
    const float* inv_freq = InvFreqTable(head_dim, theta, s);
    WithWeightType(q_norm, [&](auto* qw) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(qw)>>;
      ODMOE_CUDA_LAUNCH(kernels::LaunchHeadNormRope(q, k, qw, static_cast<const W*>(k_norm.data), positions, n, heads,
                                                    kv_heads, head_dim, eps, theta, inv_freq, s->get()));
    });
  }

  // F16 / BF16 models keep their KV cache in their own dtype, as HF does; every other model in F32.
  DType KvCacheDType(DType compute) const override {
    return compute == DType::kF16 || compute == DType::kBF16 ? compute : DType::kF32;
  }

  void Convert(const void* src, DType src_dtype, int64_t count, void* dst, DType dst_dtype, Stream* stream) override {
    CountOp("Convert");
    ODMOE_CHECK(count >= 0);
    if (count == 0) return;
    ODMOE_CHECK(src != nullptr && dst != nullptr);
    UseDevice(ordinal_);
    cudaStream_t s = S(stream)->get();
    const auto* f32_src = static_cast<const float*>(src);
    auto* f32_dst = static_cast<float*>(dst);
    if (src_dtype == DType::kF32 && dst_dtype == DType::kBF16) {
      ODMOE_CUDA_LAUNCH(kernels::LaunchConvert(f32_src, count, static_cast<__nv_bfloat16*>(dst), s));
    } else if (src_dtype == DType::kF32 && dst_dtype == DType::kF16) {
      ODMOE_CUDA_LAUNCH(kernels::LaunchConvert(f32_src, count, static_cast<__half*>(dst), s));
    } else if (src_dtype == DType::kBF16 && dst_dtype == DType::kF32) {
      ODMOE_CUDA_LAUNCH(kernels::LaunchConvert(static_cast<const __nv_bfloat16*>(src), count, f32_dst, s));
    } else if (src_dtype == DType::kF16 && dst_dtype == DType::kF32) {
      ODMOE_CUDA_LAUNCH(kernels::LaunchConvert(static_cast<const __half*>(src), count, f32_dst, s));
    } else {
      std::fprintf(stderr, "CudaDevice::Convert: %s to %s is not a conversion it makes\n",
                   std::string(DTypeName(src_dtype)).c_str(), std::string(DTypeName(dst_dtype)).c_str());
      std::abort();
    }
  }

  void Attention(const float* q, KvCacheRef k_cache, KvCacheRef v_cache, int64_t n, int64_t past, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, float scale, float* out, Stream* stream) override {
    CountOp("Attention");
    ODMOE_CHECK(n >= 0 && past >= 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0);
    ODMOE_CHECK(head_dim > 0 && head_dim <= kernels::kMaxHeadDim);
    ODMOE_CHECK(k_cache.dtype == v_cache.dtype);
    if (n == 0) return;
    ODMOE_CHECK(q != nullptr && k_cache.data != nullptr && v_cache.data != nullptr && out != nullptr);
    UseDevice(ordinal_);
    CudaStream* s = S(stream);
    WithWeightType(WeightRef{k_cache.data, k_cache.dtype}, [&](auto* k) {
      using KV = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
      const KV* v = static_cast<const KV*>(v_cache.data);
      if (n <= kDecodeMaxTokens) {
        const size_t floats = kernels::AttentionDecodeWorkspaceFloats(n, past, heads, head_dim);
        float* workspace = floats > 0 ? static_cast<float*>(s->Scratch(floats * sizeof(float))) : nullptr;
        ODMOE_CUDA_LAUNCH(kernels::LaunchAttentionDecode(q, k, v, n, past, heads, kv_heads, head_dim, scale, out,
                                                         workspace, floats, s->get()));
      } else {
        ODMOE_CUDA_LAUNCH(
            kernels::LaunchAttentionPrefill(q, k, v, n, past, heads, kv_heads, head_dim, scale, out, s->get()));
      }
    });
  }

  void RouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize, int32_t* ids,
                  float* weights, Stream* stream) override {
    CountOp("RouterTopK");
    ODMOE_CHECK(n >= 0 && k >= 1 && k <= num_experts);
    if (n == 0) return;
    ODMOE_CHECK(logits != nullptr && ids != nullptr && weights != nullptr);
    UseDevice(ordinal_);
    ODMOE_CUDA_LAUNCH(
        kernels::LaunchRouterTopK(logits, n, num_experts, k, renormalize, ids, weights, S(stream)->get()));
  }

  // One launch where the router's GEMV would be one block (few experts) and MatMul a GEMV (few rows), with the
  // norm and router weights of one unquantized dtype; otherwise the three ops.
  void AddRmsNormRoute(const float* delta, float* x, WeightRef norm, WeightRef router, int64_t rows, int64_t dim,
                       float eps, int64_t num_experts, int64_t k, bool renormalize, float* h, float* logits,
                       int32_t* ids, float* weights, Stream* stream) override {
    if (rows > kGemvMaxTokens || num_experts > kernels::kAddRmsNormRouterMaxExperts ||
        dim > kernels::kAddRmsNormRouterMaxDim || router.quantized() || router.dtype != norm.dtype) {
      Device::AddRmsNormRoute(delta, x, norm, router, rows, dim, eps, num_experts, k, renormalize, h, logits, ids,
                              weights, stream);
      return;
    }
    CountOp("AddRmsNormRoute");
    ODMOE_CHECK(rows >= 0 && dim > 0 && k >= 1 && k <= num_experts);
    if (rows == 0) return;
    ODMOE_CHECK(delta != nullptr && x != nullptr && !norm.empty() && !router.empty() && h != nullptr && h != x &&
                h != delta && logits != nullptr && ids != nullptr && weights != nullptr);
    UseDevice(ordinal_);
    WithWeightType(norm, [&](auto* nw) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(nw)>>;
      ODMOE_CUDA_LAUNCH(kernels::LaunchAddRmsNormRouter(delta, x, nw, rows, dim, eps, h,
                                                        static_cast<const W*>(router.data), num_experts, k, renormalize,
                                                        logits, ids, weights, S(stream)->get()));
    });
  }

  void SwiGlu(const float* gate, const float* up, int64_t count, float* out, Stream* stream) override {
    CountOp("SwiGlu");
    ODMOE_CHECK(count >= 0);
    if (count == 0) return;
    UseDevice(ordinal_);
    ODMOE_CUDA_LAUNCH(kernels::LaunchSwiGlu(gate, up, count, out, S(stream)->get()));
  }

  void Add(const float* x, int64_t count, float* y, Stream* stream) override {
    CountOp("Add");
    ODMOE_CHECK(count >= 0);
    if (count == 0) return;
    UseDevice(ordinal_);
    ODMOE_CUDA_LAUNCH(kernels::LaunchAdd(x, count, y, S(stream)->get()));
  }

  void GatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst, Stream* stream) override {
    CountOp("GatherRows");
    ODMOE_CHECK(n >= 0 && dim >= 0);
    if (n == 0 || dim == 0) return;
    UseDevice(ordinal_);
    ODMOE_CUDA_LAUNCH(kernels::LaunchGatherRows(src, rows, n, dim, dst, S(stream)->get()));
  }

  void ScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                        bool sigmoid_scale, float* dst, Stream* stream) override {
    CountOp("ScatterAddScaled");
    ODMOE_CHECK(n >= 0 && dim >= 0);
    if (n == 0 || dim == 0) return;
    UseDevice(ordinal_);
    ODMOE_CUDA_LAUNCH(kernels::LaunchScatterAddScaled(src, rows, scale, n, dim, sigmoid_scale, dst, S(stream)->get()));
  }

  void ChangeLogits(float* logits, const LogitChange* changes, int64_t n, Stream* stream) override {
    CountOp("ChangeLogits");
    ODMOE_CHECK(n >= 0);
    if (n == 0) return;
    ODMOE_CHECK(logits != nullptr && changes != nullptr);
    UseDevice(ordinal_);
    ODMOE_CUDA_LAUNCH(kernels::LaunchChangeLogits(logits, changes, n, S(stream)->get()));
  }

  void SelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices, int32_t* ids,
                    Stream* stream) override {
    CountOp("SelectTokens");
    ODMOE_CHECK(rows >= 0 && vocab >= 1 && vocab <= kernels::kSampleMaxVocab);
    if (rows == 0) return;
    ODMOE_CHECK(logits != nullptr && choices != nullptr && ids != nullptr);
    UseDevice(ordinal_);
    ODMOE_CUDA_LAUNCH(kernels::LaunchSelectTokens(logits, rows, vocab, choices, ids, S(stream)->get()));
  }

  // ---- routed experts with the expert ids on the device: kernels/moe_grouped.h ---------------------------------
  // The GEMV's token range: up to there every expert of the per-expert path runs LaunchGemv, whose sums the
  // grouped kernels repeat bit for bit (above, the per-expert path takes cuBLAS).
  int64_t RoutedExpertsMaxTokens() const override { return kGemvMaxTokens; }

  absl::StatusOr<std::unique_ptr<ExpertTable>> CreateExpertTable(std::span<const ExpertWeightRefs> experts,
                                                                 int64_t experts_per_layer, int64_t hidden,
                                                                 int64_t intermediate) override {
    if (experts_per_layer <= 0 || hidden <= 0 || intermediate <= 0 ||
        experts.size() % static_cast<size_t>(experts_per_layer) != 0) {
      return absl::InvalidArgumentError(StrCat("an expert table of ", experts.size(), " entries, ", experts_per_layer,
                                               " experts per layer, shapes ", hidden, " x ", intermediate));
    }
    std::optional<DType> dtype;
    std::vector<kernels::ExpertPointers> host(experts.size());
    for (size_t i = 0; i < experts.size(); ++i) {
      const ExpertWeightRefs& e = experts[i];
      if (e.gate.empty() && e.up.empty() && e.down.empty()) continue;
      for (const WeightRef* w : {&e.gate, &e.up, &e.down}) {
        const bool dense = w->dtype == DType::kF32 || w->dtype == DType::kF16 || w->dtype == DType::kBF16;
        if (w->empty() || !dense || w->dtype != dtype.value_or(w->dtype)) {
          return absl::InvalidArgumentError(StrCat("expert table entry ", i,
                                                   ": the routed experts must be dense (F32, F16 or BF16) weights of "
                                                   "one dtype, all three present"));
        }
        dtype = w->dtype;
      }
      host[i] = kernels::ExpertPointers{e.gate.data, e.up.data, e.down.data};
    }
    if (!dtype.has_value()) return absl::InvalidArgumentError("an expert table without experts");
    const size_t bytes = host.size() * sizeof(kernels::ExpertPointers);
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> pointers, Allocate(bytes, "routed expert table"));
    CopyToDevice(pointers->data(), host.data(), bytes, nullptr);
    Synchronize(nullptr);  // `host` dies on return
    return std::unique_ptr<ExpertTable>(new CudaExpertTable(this, std::move(pointers), *dtype,
                                                            static_cast<int64_t>(experts.size()) / experts_per_layer,
                                                            experts_per_layer, hidden, intermediate));
  }

  // Three launches whatever the number of experts: gate and up fused (with SwiGLU), down, the ordered combine.
  void RoutedExperts(const ExpertTable& table, int64_t layer, const float* x, int64_t n, int64_t k, const int32_t* ids,
                     const float* weights, float* act, float* y, float* out, Stream* stream) override {
    CountOp("RoutedExperts");
    const auto& t = static_cast<const CudaExpertTable&>(table);
    ODMOE_CHECK(t.owner == this);
    ODMOE_CHECK(n > 0 && n <= RoutedExpertsMaxTokens() && k > 0 && k <= kernels::kGroupedMaxTopK);
    ODMOE_CHECK(layer >= 0 && layer < t.layers);
    ODMOE_CHECK(x != nullptr && ids != nullptr && weights != nullptr && act != nullptr && y != nullptr &&
                out != nullptr);
    UseDevice(ordinal_);
    cudaStream_t s = S(stream)->get();
    const kernels::ExpertPointers* experts = t.layer(layer);
    WithWeightType(WeightRef{nullptr, t.dtype}, [&](auto* typed) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
      ODMOE_CUDA_LAUNCH(kernels::LaunchGroupedGateUp<W>(x, experts, ids, n, k, t.hidden, t.intermediate, act, s));
      ODMOE_CUDA_LAUNCH(kernels::LaunchGroupedDown<W>(act, experts, ids, n * k, t.intermediate, t.hidden, y, s));
    });
    ODMOE_CUDA_LAUNCH(kernels::LaunchCombineExperts(y, ids, weights, n, k, t.hidden, out, s));
  }

  std::map<std::string, int64_t> op_counts() const override {
    absl::MutexLock lock(&mu_);
    return op_counts_;
  }

#ifdef ODMOE_SIMT
  // The emulated runtime's own counts (one device per process there).
  DeviceCounters counters() const override {
    const simt::Counters c = simt::ReadCounters();
    return DeviceCounters{.host_syncs = c.host_syncs,
                          .allocations = c.allocations,
                          .frees = c.frees,
                          .launches = c.launches,
                          .bytes_read = c.copy_bytes_from_device + c.kernel_bytes_read,
                          .graph_launches = c.graph_launches,
                          .graph_kernel_launches = c.graph_kernel_launches};
  }
  void ResetCounters() override { simt::ResetCounters(); }
#else
  DeviceCounters counters() const override {
    const Accounting& a = *accounting_;
    return DeviceCounters{.host_syncs = a.host_syncs.load(),
                          .allocations = a.allocations.load(),
                          .frees = a.frees.load(),
                          .launches = a.launches.load(),
                          .bytes_read = a.bytes_read.load(),
                          .graph_launches = a.graph_launches.load(),
                          .graph_kernel_launches = a.graph_kernel_launches.load()};
  }
  void ResetCounters() override {
    for (std::atomic<uint64_t>* c :
         {&accounting_->host_syncs, &accounting_->allocations, &accounting_->frees, &accounting_->launches,
          &accounting_->bytes_read, &accounting_->graph_launches, &accounting_->graph_kernel_launches}) {
      c->store(0);
    }
  }
#endif

 private:
  CudaStream* S(Stream* stream) { return stream != nullptr ? static_cast<CudaStream*>(stream) : default_stream_.get(); }

  // Counts a copy of `bytes` in transfer_stats() (and what it reads from device memory): now, or at each launch of
  // the graph this thread is capturing.
  void CountCopy(size_t bytes, uint64_t TransferStats::*total, uint64_t TransferStats::*copies, bool reads_device) {
    const uint64_t read = reads_device ? bytes : 0;
    if (tls_capture != nullptr) {
      tls_capture->transfers.*total += bytes;
      ++(tls_capture->transfers.*copies);
      tls_capture->bytes_read += read;
      return;
    }
    accounting_->Note(accounting_->bytes_read, read);
    absl::MutexLock lock(&mu_);
    transfers_.*total += bytes;
    ++(transfers_.*copies);
  }

  void CountOp(const char* op) {
    if (tls_capture != nullptr) {  // recorded: it runs, and is counted, at each LaunchGraph
      ++tls_capture->ops[op];
      return;
    }
    absl::MutexLock lock(&mu_);
    ++op_counts_[op];
  }

  // RoPE inverse frequencies computed once per (head_dim, theta) by the CPU reference (cpu::RopeInvFreq), so
  // that both backends rotate by bitwise the same angles. The first use waits for its upload.
  const float* InvFreqTable(int64_t head_dim, double theta, CudaStream* s) {
    absl::MutexLock lock(&rope_mu_);
    const auto key = std::make_pair(head_dim, theta);
    const auto it = rope_tables_.find(key);
    if (it != rope_tables_.end()) return it->second;
    std::vector<float> host(static_cast<size_t>(head_dim / 2));
    cpu::RopeInvFreq(head_dim, theta, host.data());
    float* table = nullptr;
    const size_t bytes = host.size() * sizeof(float);
    // Counted like an op's scratch (it cannot fail); released with the device.
    accounting_->Charge(bytes, /*within_capacity=*/false);
    ODMOE_CUDA_CHECK(cudaMalloc(&table, bytes));
    accounting_->Note(accounting_->allocations);
    ODMOE_CUDA_CHECK(cudaMemcpyAsync(table, host.data(), bytes, cudaMemcpyHostToDevice, s->get()));
    ODMOE_CUDA_CHECK(cudaStreamSynchronize(s->get()));
    accounting_->Note(accounting_->host_syncs);
    rope_tables_.emplace(key, table);
    return table;
  }

  void AddBias(WeightRef bias, int64_t n, int64_t out_dim, float* y, CudaStream* s) {
    WithWeightType(bias, [&](auto* b) { ODMOE_CUDA_LAUNCH(kernels::LaunchAddBias(b, n, out_dim, y, s->get())); });
  }

  // y[n, out_dim] = x[n, in_dim] * dequant(w)^T for a quantized w (kernels/quant.h): the GEMV kernels for up to
  // kGemvMaxTokens tokens, the tiled GEMM above (in chunks of tokens its grid can hold).
  void QuantizedMatMul(const float* x, WeightRef w, int64_t n, int64_t in_dim, int64_t out_dim, float* y,
                       CudaStream* s) {
    ODMOE_CHECK(w.scales != nullptr);
    const bool int8 = w.dtype == DType::kI8;
    const auto* q = static_cast<const int8_t*>(w.data);
    const auto* codes = static_cast<const uint8_t*>(w.data);
    if (n <= kGemvMaxTokens) {
      ODMOE_CUDA_LAUNCH(int8 ? kernels::LaunchGemvInt8(x, q, w.scales, n, in_dim, out_dim, y, s->get())
                             : kernels::LaunchGemvNf4(x, codes, w.scales, n, in_dim, out_dim, y, s->get()));
      return;
    }
    constexpr int64_t kGemmMaxTokens = int64_t{65535} * 64;  // the GEMM's grid.y limit times its 64-token tiles
    for (int64_t t0 = 0; t0 < n; t0 += kGemmMaxTokens) {
      const int64_t count = std::min(kGemmMaxTokens, n - t0);
      const float* xc = x + t0 * in_dim;
      float* yc = y + t0 * out_dim;
      ODMOE_CUDA_LAUNCH(int8 ? kernels::LaunchGemmInt8(xc, q, w.scales, count, in_dim, out_dim, yc, s->get())
                             : kernels::LaunchGemmNf4(xc, codes, w.scales, count, in_dim, out_dim, yc, s->get()));
    }
  }

  // y[n, out_dim] = x[n, in_dim] * w[out_dim, in_dim]^T with cuBLAS (column-major: y^T = w^T' * x^T).
  void Gemm(const float* x, WeightRef w, int64_t n, int64_t in_dim, int64_t out_dim, float* y, CudaStream* s) {
    ODMOE_CHECK(FitsInt(n) && FitsInt(in_dim) && FitsInt(out_dim));
    const int m = static_cast<int>(out_dim);
    const int k = static_cast<int>(in_dim);
    const float one = 1.0f;
    const float zero = 0.0f;
    cublasHandle_t handle = s->cublas();
    if (w.dtype == DType::kF32) {
      ODMOE_CUBLAS_LAUNCH(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, static_cast<int>(n), k, &one, w.data,
                                       CUDA_R_32F, k, x, CUDA_R_32F, k, &zero, y, CUDA_R_32F, m,
                                       CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
      return;
    }
    ODMOE_CHECK(w.dtype == DType::kF16 || w.dtype == DType::kBF16);
    const cudaDataType_t type = w.dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
    const int64_t chunk = GemmChunkRows(n, in_dim);
    void* scratch = s->Scratch(static_cast<size_t>(chunk) * GemmRowBytes(in_dim));
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
      const int64_t rows = std::min(chunk, n - r0);
      const int64_t count = rows * in_dim;
      void* hi = scratch;
      void* lo = static_cast<uint16_t*>(scratch) + count;
      float* row_scale = reinterpret_cast<float*>(static_cast<uint16_t*>(scratch) + 2 * count);
      const float* xc = x + r0 * in_dim;
      if (w.dtype == DType::kF16) {
        ODMOE_CUDA_LAUNCH(kernels::LaunchSplitToPair(xc, rows, in_dim, static_cast<__half*>(hi),
                                                     static_cast<__half*>(lo), row_scale, s->get()));
      } else {
        ODMOE_CUDA_LAUNCH(kernels::LaunchSplitToPair(xc, rows, in_dim, static_cast<__nv_bfloat16*>(hi),
                                                     static_cast<__nv_bfloat16*>(lo), row_scale, s->get()));
      }
      float* yc = y + r0 * out_dim;
      ODMOE_CUBLAS_LAUNCH(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, static_cast<int>(rows), k, &one, w.data,
                                       type, k, hi, type, k, &zero, yc, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
      ODMOE_CUBLAS_LAUNCH(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, static_cast<int>(rows), k, &one, w.data,
                                       type, k, lo, type, k, &one, yc, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
      // Only fp16 rows are ever scaled (bf16 has fp32's range).
      if (w.dtype == DType::kF16) ODMOE_CUDA_LAUNCH(kernels::LaunchScaleRows(yc, rows, out_dim, row_scale, s->get()));
    }
  }

  const int ordinal_;
  const int major_;  // compute capability
  const std::string gpu_name_;
  const std::shared_ptr<Accounting> accounting_;
  const std::shared_ptr<DeviceMemoryPool> pool_;  // every Buffer's memory
  const std::unique_ptr<CudaStream> default_stream_;
  mutable absl::Mutex mu_;
  TransferStats transfers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> op_counts_ ABSL_GUARDED_BY(mu_);
  absl::Mutex rope_mu_;
  // (head_dim, theta) -> [head_dim / 2] floats each, counted in accounting_.
  std::map<std::pair<int64_t, double>, float*> rope_tables_ ABSL_GUARDED_BY(rope_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal, uint64_t capacity_bytes) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return absl::UnavailableError(StrCat("no CUDA device: cudaGetDeviceCount returned ", cudaGetErrorName(err), " (",
                                         cudaGetErrorString(err), "), ", count, " devices"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(
        StrCat("CUDA device ", ordinal, " does not exist: this process sees ", count, " (0 .. ", count - 1, ")"));
  }
  cudaDeviceProp prop{};
  ODMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  if (prop.major < 8) {
    return absl::UnimplementedError(StrCat("CUDA device ", ordinal, " (", prop.name, ") has compute capability ",
                                           prop.major, ".", prop.minor,
                                           "; the kernels are built for 8.0 (Ampere) and newer"));
  }
  UseDevice(ordinal);
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  const cudaError_t info_err = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (info_err != cudaSuccess) {
    return absl::UnavailableError(
        StrCat("CUDA device ", ordinal, " (", prop.name, "): cudaMemGetInfo failed: ", cudaGetErrorString(info_err)));
  }
  const uint64_t capacity = capacity_bytes != 0 ? capacity_bytes : static_cast<uint64_t>(total_bytes);
  return std::unique_ptr<Device>(new CudaDevice(ordinal, prop.major, prop.name, capacity));
}

}  // namespace odmoe
