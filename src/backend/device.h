// The backend interface: one Device per compute device, with buffers, streams, copies, memory information and
// the compute ops the engine needs. Every op of the forward pass goes through a Device, so a forward pass can
// run on the CPU reference, on the mock GPU (tests of budgets, loading and stall accounting) or on CUDA.
//
// Conventions for ops:
//  - Pointers are device addresses taken from Buffer::data() (plus byte offsets): host memory for the CPU
//    device, the mock GPU's own arena for the mock GPU, CUDA memory for CUDA. Never pass host memory to an op
//    of a device whose memory is not host memory; data reaches such a device only through Copy*.
//  - Activations are fp32. Weights are a WeightRef: bytes in the checkpoint's dtype (F32, F16 or BF16), read
//    with fp32 accumulation.
//  - Row-major everywhere; shapes are given in the comments as [rows, cols].
//  - Every op and copy is enqueued on a Stream (nullptr: the device's default stream) and is ordered with
//    the other work of that stream. Host code reads results only after Synchronize (or a D2H copy, which
//    synchronizes the stream it runs on).
//  - Ops report programming errors (null pointers, impossible sizes) through CHECK; they do not fail.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/sampling_rule.h"
#include "src/common/dtype.h"

namespace odmoe {

enum class DeviceKind { kCpu, kMockGpu, kCuda };
std::string_view DeviceKindName(DeviceKind kind);  // "cpu", "mock-gpu", "cuda"

class Device;

// A block of memory a Device hands out: its address and size, the memory freed when the object is destroyed.
// Buffer and HostBuffer say which side of the link it is on.
class MemoryBlock {
 public:
  virtual ~MemoryBlock() = default;
  MemoryBlock(const MemoryBlock&) = delete;
  MemoryBlock& operator=(const MemoryBlock&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data_);
  }

 protected:
  MemoryBlock(void* data, size_t size) : data_(data), size_(size) {}

 private:
  void* data_;
  size_t size_;
};

// A block of device memory. Freed (and its bytes returned to the device's budget) when destroyed.
// Thread safety: the object itself is immutable; ordering of accesses is by streams.
class Buffer : public MemoryBlock {
 protected:
  using MemoryBlock::MemoryBlock;
};

// Host memory a device copies results into often (CopyToHost's destination; Device::AllocateHost): page-locked
// where the backend has such a thing (CUDA: cudaMallocHost), so that a copy into it is one DMA the host waits on,
// not one staged through the driver's bounce buffer; plain host memory elsewhere. Freed when destroyed (CUDA:
// cudaFreeHost, which waits for the device). Host code reads it only after the copy's stream is synchronized.
class HostBuffer : public MemoryBlock {
 protected:
  using MemoryBlock::MemoryBlock;
};

// An ordered queue of work on one device. Work on different streams of a device may overlap; an Event
// recorded on one stream and waited on by another orders them.
class Stream {
 public:
  virtual ~Stream() = default;
};

class Event {
 public:
  virtual ~Event() = default;
};

// Work recorded once (Device::CaptureGraph) and replayed as a whole (Device::LaunchGraph): one host call for the
// many launches of a decode step. Holds the addresses the work used, not the memory: that must outlive it.
class Graph {
 public:
  virtual ~Graph() = default;
};

// A weight in device memory in its storage dtype: dense (F32, F16, BF16), or weight-only quantized
// (src/backend/quantize.h layouts, produced at load time for the shadow's replica):
//  - kI8: INT8 rows, `data` int8 [rows, cols], `scales` the per-row absmax [rows];
//  - kU8: NF4, `data` the codes [rows, Nf4RowBytes(cols)], `scales` the block absmax [rows, Nf4BlocksPerRow(cols)].
// Only MatMul takes a quantized weight (as w; never as bias); every other op takes dense weights.
struct WeightRef {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  const float* scales = nullptr;  // quantized weights only
  bool empty() const { return data == nullptr; }
  bool quantized() const { return dtype == DType::kI8 || dtype == DType::kU8; }
};

// A K or V cache in device memory, [rows, kv_heads, head_dim] values of `dtype`: F32, or the F16 / BF16 that
// Device::KvCacheDType chose.
struct KvCacheRef {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// One routed expert's dense weights (F32, F16 or BF16, all three of one dtype): gate and up [intermediate,
// hidden], down [hidden, intermediate]. All three empty: no expert there (a layer without a router).
struct ExpertWeightRefs {
  WeightRef gate, up, down;
};

// Every routed expert of a model as a table the device reads (Device::CreateExpertTable): made once at load time,
// immutable, used by RoutedExperts. Holds no weights, only where they are: the weights must outlive it.
class ExpertTable {
 public:
  virtual ~ExpertTable() = default;
};

struct MemoryInfo {
  uint64_t capacity = 0;  // bytes the device may allocate in all; 0: no limit known
  uint64_t in_use = 0;    // bytes allocated now
  uint64_t peak = 0;      // most bytes allocated at once since creation (or ResetPeak)
};

struct TransferStats {
  uint64_t h2d_bytes = 0;
  uint64_t h2d_copies = 0;
  uint64_t d2h_bytes = 0;
  uint64_t d2h_copies = 0;
  uint64_t d2d_bytes = 0;
  uint64_t d2d_copies = 0;
};

// How a device has been driven since creation (or ResetCounters): what keeps a GPU waiting or busy with
// bookkeeping. Each backend counts its own (see counters()).
struct DeviceCounters {
  uint64_t host_syncs = 0;      // times the host waited for the device: Synchronize*, CopyToHost, frees that wait
  uint64_t allocations = 0;     // device allocations (buffers, and a backend's own scratch and tables)
  uint64_t frees = 0;           // device frees
  uint64_t launches = 0;        // kernel launches (CPU and mock GPU: ops run), those of graphs included
  uint64_t bytes_read = 0;      // bytes read from device memory where the backend knows them (see counters())
  uint64_t graph_launches = 0;  // LaunchGraph calls
  uint64_t graph_kernel_launches = 0;  // of `launches`, the kernels graphs ran (launches the host did not make)
};

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  virtual std::string name() const = 0;

  // ---- memory --------------------------------------------------------------------------------------------
  // `tag` says what the memory is for (for messages and accounting). ResourceExhausted, naming the tag, the
  // request and what is in use, when the device's capacity would be exceeded.
  virtual absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes, std::string_view tag) = 0;
  virtual MemoryInfo memory_info() const = 0;
  virtual void ResetPeak() = 0;
  // Device memory this process holds on the device as the driver counts it: its allocations plus what the
  // runtime keeps for itself (CUDA: the context, module images, library handles; read through NVML). nullopt
  // where the backend has no such notion or the driver does not say.
  virtual std::optional<uint64_t> process_device_bytes() const { return std::nullopt; }

  // ---- streams and copies ----------------------------------------------------------------------------------
  virtual std::unique_ptr<Stream> CreateStream() = 0;
  // Allocates now, within the device's capacity and counted in memory_info(), the workspace that ops on
  // `stream` need for MatMuls of up to `max_rows` rows of `max_in_dim` inputs (CUDA: the cuBLAS workspace and
  // the 16-bit GEMM scratch), so that no op allocates later. ResourceExhausted when it does not fit. Nothing
  // to do on the CPU and the mock GPU.
  virtual absl::Status PrepareStream(Stream* stream, int64_t max_rows, int64_t max_in_dim);
  virtual std::unique_ptr<Event> CreateEvent() = 0;
  virtual void RecordEvent(Event& event, Stream* stream) = 0;
  virtual void WaitEvent(Stream* stream, Event& event) = 0;
  // Blocks the host until all work on `stream` (nullptr: the default stream) has finished.
  virtual void Synchronize(Stream* stream) = 0;
  // Blocks the host until the work captured by `event` (its last RecordEvent) has finished; at once for an event
  // never recorded.
  virtual void SynchronizeEvent(Event& event) = 0;
  // Blocks the host until all work on every stream has finished.
  virtual void SynchronizeAll() = 0;

  // Host memory -> device memory. The host memory must stay valid until the stream is synchronized.
  virtual void CopyToDevice(void* dst, const void* src, size_t bytes, Stream* stream) = 0;
  // Device memory -> host memory; returns when the bytes are in `dst` (synchronizes `stream`).
  virtual void CopyToHost(void* dst, const void* src, size_t bytes, Stream* stream) = 0;
  // Device memory -> host memory without waiting: the bytes are in `dst` once `stream` is synchronized (or an
  // Event recorded after it has completed). `dst` is a HostBuffer of this device (AllocateHost) and must stay
  // valid until then. The default copies at once and waits (CopyToHost): right everywhere, asynchronous only where
  // a backend overrides it (CUDA).
  virtual void CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream* stream) {
    CopyToHost(dst, src, bytes, stream);
  }
  virtual void CopyOnDevice(void* dst, const void* src, size_t bytes, Stream* stream) = 0;
  virtual TransferStats transfer_stats() const = 0;

  // `bytes` of host memory for the device to copy results into (HostBuffer), zero-filled. The default: plain
  // host memory. ResourceExhausted, naming `tag`, when the backend cannot provide it.
  virtual absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes, std::string_view tag);

  // ---- host memory registration ----------------------------------------------------------------------------
  // Registers the host range [p, p + bytes) for fast copies (CUDA: page-locked with cudaHostRegister, read-only
  // and portable where supported, so a read-only shared mapping can be registered; CPU and mock GPU: recorded,
  // and the mock GPU times copies from it at its pinned bandwidth). The range must stay mapped until
  // UnregisterHostMemory(p). InvalidArgument when it overlaps a registered range or is empty; the backend's
  // error when it refuses (the memory is then still usable, copies from it are only slower).
  virtual absl::Status RegisterHostMemory(const void* p, size_t bytes);
  // Undoes RegisterHostMemory(p, ...); nothing when `p` does not start a registered range.
  virtual void UnregisterHostMemory(const void* p);
  // True if [p, p + bytes) lies inside one registered range.
  bool IsRegisteredHostMemory(const void* p, size_t bytes) const;
  // Bytes registered now, over all ranges.
  uint64_t registered_host_bytes() const;

  // ---- graphs -----------------------------------------------------------------------------------------------
  // Whether CaptureGraph works here: CUDA (and its emulation). The CPU, mock GPU and timed devices run every op
  // when it is called, so they have nothing to replay.
  virtual bool SupportsGraphs() const { return false; }
  // Runs `enqueue`, recording the work it puts on `stream` into a Graph instead of running it: the same kernels
  // with the same arguments, and the copies with the same addresses, so a copy from a HostBuffer reads that
  // memory again at every LaunchGraph (how a replay gets new inputs). `enqueue` must only enqueue work on `stream`:
  // no synchronization, no allocation, no copy from or to pageable host memory, nothing on another stream; the
  // ops that take a value known only when the work runs (AttentionAt, WriteKvRows) read it from device memory.
  // Returns `enqueue`'s error, or Internal naming the runtime's error when the capture or its instantiation fails
  // (the stream is usable again either way). Unimplemented where SupportsGraphs() is false.
  virtual absl::StatusOr<std::unique_ptr<Graph>> CaptureGraph(Stream* stream,
                                                              const std::function<absl::Status()>& enqueue);
  // Enqueues the graph's work on `stream`. REQUIRES: `graph` made by this device's CaptureGraph.
  virtual void LaunchGraph(const Graph& graph, Stream* stream);

  // ---- ops -------------------------------------------------------------------------------------------------
  // The dtype this device keeps a KV cache in for a model computing in `compute` (its attention weights' dtype):
  // F32 by default (the CPU devices: the fp32 reference); CUDA keeps F16 / BF16 models' caches in their dtype,
  // as HF does (half the bytes to write and to read at every decode step).
  virtual DType KvCacheDType(DType compute) const {
    (void)compute;
    return DType::kF32;
  }
  // dst[i] = src[i] for `count` values from src_dtype to dst_dtype: F32 to F16 / BF16 (round to nearest even) or
  // back (exact). src and dst are device memory and do not overlap.
  virtual void Convert(const void* src, DType src_dtype, int64_t count, void* dst, DType dst_dtype, Stream* stream) = 0;
  // out[i, :] = table[ids[i], :] as fp32. ids: [n] (device memory), table: [vocab, dim].
  virtual void Embedding(const int32_t* ids, int64_t n, WeightRef table, int64_t dim, float* out, Stream* stream) = 0;
  // out[i, :] = x[i, :] / sqrt(mean(x[i, :]^2) + eps) * weight. x, out: [rows, dim] (may alias).
  virtual void RmsNorm(const float* x, WeightRef weight, int64_t rows, int64_t dim, float eps, float* out,
                       Stream* stream) = 0;
  // x += delta, then out = RmsNorm(x) (all [rows, dim]): a residual addition and the norm after it, bitwise what
  // Add then RmsNorm give (the default does that; a device may do both in one pass). out aliases neither x nor
  // delta.
  virtual void AddRmsNorm(const float* delta, float* x, WeightRef weight, int64_t rows, int64_t dim, float eps,
                          float* out, Stream* stream);
  // y[n, out_dim] = x[n, in_dim] * w[out_dim, in_dim]^T (+ bias[out_dim] when given). y must not alias x.
  // A quantized w gives exactly what the same call gives with w dequantized to fp32 (quantize.h) on the CPU
  // devices; on CUDA, the dequantizing kernels (fp32 accumulation, summation order of their own).
  virtual void MatMul(const float* x, WeightRef w, WeightRef bias, int64_t n, int64_t in_dim, int64_t out_dim, float* y,
                      Stream* stream) = 0;
  // Rotary embedding in the HF "rotate_half" layout, in place. x: [n, heads, head_dim]; token i sits at
  // position positions[i] (device memory, [n]).
  virtual void Rope(float* x, const int32_t* positions, int64_t n, int64_t heads, int64_t head_dim, double theta,
                    Stream* stream) = 0;
  // Per-head q / k norms (Qwen3), then the rotation, in place: RmsNorm of q's n x heads rows of head_dim by q_norm
  // and of k's n x kv_heads rows by k_norm, then Rope of q and of k at `positions`. Bitwise what those four ops
  // give (the default runs them; CUDA does all in one launch). q: [n, heads, head_dim], k: [n, kv_heads,
  // head_dim], not overlapping; q_norm, k_norm: [head_dim].
  virtual void HeadNormRope(float* q, float* k, WeightRef q_norm, WeightRef k_norm, const int32_t* positions, int64_t n,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, double theta, Stream* stream);
  // Causal attention of n new tokens against a cache that already holds `past` tokens plus these n
  // (k_cache, v_cache: [past + n, kv_heads, head_dim], the new tokens at rows past..past+n-1).
  // q: [n, heads, head_dim]; out: [n, heads, head_dim]. Query head h reads kv head h / (heads / kv_heads).
  // REQUIRES: both caches of one dtype, one that KvCacheDType returns on this device.
  virtual void Attention(const float* q, KvCacheRef k_cache, KvCacheRef v_cache, int64_t n, int64_t past, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, float scale, float* out, Stream* stream) = 0;
  // The two ops a captured decode step needs in place of Convert into the cache and Attention: the position is
  // read from device memory when the work runs, so one graph serves every position. Only on devices with graphs
  // (SupportsGraphs(); elsewhere a CHECK failure), and bitwise what the ops above give for the same position.
  // (The engine writes every chunk's K and V with WriteKvRows where it exists: one launch for both caches.)
  // For i < n: k_cache row positions[i] = k_rows[i] and v_cache row positions[i] = v_rows[i], in the caches'
  // dtype (as Convert rounds). k_rows, v_rows: [n, kv_size] fp32; positions: [n] int32, device memory; each cache
  // holds `capacity` rows, and a position outside [0, capacity) writes nothing. REQUIRES: both caches of one dtype.
  virtual void WriteKvRows(const float* k_rows, const float* v_rows, const int32_t* positions, int64_t n,
                           int64_t kv_size, KvCacheRef k_cache, KvCacheRef v_cache, int64_t capacity, Stream* stream);
  // The rotation of q ([n, heads, head_dim]) and of k ([n, kv_heads, head_dim]) at `positions`, then WriteKvRows of
  // k's rotated rows and v's rows ([n, kv_heads * head_dim]) into the caches. With q_norm and k_norm (Qwen3's
  // per-head norms; both or neither), the rotation is HeadNormRope's, otherwise Rope of each. Bitwise what those ops
  // give (the default runs them; CUDA does all in one launch). Only where WriteKvRows is. REQUIRES: q, k and v
  // apart (q and k may be adjacent).
  virtual void RopeWriteKv(float* q, float* k, const float* v, WeightRef q_norm, WeightRef k_norm, float eps,
                           const int32_t* positions, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           double theta, KvCacheRef k_cache, KvCacheRef v_cache, int64_t capacity, Stream* stream);
  // Attention (n <= 4 new tokens) with past = *past, an int32 in device memory, 0 <= *past <= max_past. workspace:
  // device memory of at least AttentionAtWorkspaceBytes(n, max_past, heads, head_dim) bytes, used by this call
  // only until the next work on `stream`.
  virtual size_t AttentionAtWorkspaceBytes(int64_t n, int64_t max_past, int64_t heads, int64_t head_dim) const;
  virtual void AttentionAt(const float* q, KvCacheRef k_cache, KvCacheRef v_cache, int64_t n, const int32_t* past,
                           int64_t max_past, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                           void* workspace, float* out, Stream* stream);
  // Router: softmax over logits[i, :num_experts], top-k (ties: lower expert id first), best first; weights
  // renormalised to sum 1 when `renormalize`. logits: [n, num_experts]; ids, weights: [n, k].
  virtual void RouterTopK(const float* logits, int64_t n, int64_t num_experts, int64_t k, bool renormalize,
                          int32_t* ids, float* weights, Stream* stream) = 0;
  // A sparse layer's post-attention norm and router: AddRmsNorm(delta, x, norm, rows, dim, eps, h), then
  // MatMul(h, router) into logits ([rows, num_experts]) and RouterTopK of those into ids / weights. Bitwise what
  // those three ops give (the default runs them; CUDA, for few experts and rows, in one launch).
  virtual void AddRmsNormRoute(const float* delta, float* x, WeightRef norm, WeightRef router, int64_t rows,
                               int64_t dim, float eps, int64_t num_experts, int64_t k, bool renormalize, float* h,
                               float* logits, int32_t* ids, float* weights, Stream* stream);
  // out = silu(gate) * up, elementwise over `count` values (out may alias gate).
  virtual void SwiGlu(const float* gate, const float* up, int64_t count, float* out, Stream* stream) = 0;
  // y += x elementwise over `count` values.
  virtual void Add(const float* x, int64_t count, float* y, Stream* stream) = 0;
  // dst[i, :] = src[rows[i], :] for i < n. src: [*, dim], dst: [n, dim], rows: [n] (device memory).
  virtual void GatherRows(const float* src, const int32_t* rows, int64_t n, int64_t dim, float* dst,
                          Stream* stream) = 0;
  // dst[rows[i], :] += scale[i] * src[i, :] for i < n, in order of i (deterministic). When `sigmoid_scale`
  // the factor is sigmoid(scale[i]) instead. src: [n, dim], rows, scale: [n] (device memory).
  virtual void ScatterAddScaled(const float* src, const int32_t* rows, const float* scale, int64_t n, int64_t dim,
                                bool sigmoid_scale, float* dst, Stream* stream) = 0;
  // logits[c.index] = ChangedLogit(logits[c.index], c.penalty, c.delta) for each of the n changes: a row's
  // repetition penalty, bias and presence / frequency penalties before its pick, each logit rounded as
  // kernels/sampling_rule.h says, so every backend gives the same bits. changes: [n] (device memory).
  // REQUIRES: the indices are distinct and inside `logits`.
  virtual void ChangeLogits(float* logits, const LogitChange* changes, int64_t n, Stream* stream) = 0;
  // ids[r] = the token picked from logits[r, :] by choices[r]: greedy (the argmax, ties to the lowest id, NaN never
  // wins) or sampled (temperature, top-k, top-p and the row's uniform draw), by the one rule of
  // kernels/sampling_rule.h, so every backend picks the same ids for the same logits and choices (its sums are of
  // integers: no backend's order of additions changes a pick). logits: [rows, vocab]; choices, ids: [rows] (device
  // memory: a decode step copies only the ids back). REQUIRES: 1 <= vocab <= kernels::kSampleMaxVocab.
  virtual void SelectTokens(const float* logits, int64_t rows, int64_t vocab, const TokenChoice* choices, int32_t* ids,
                            Stream* stream) = 0;

  // ---- routed experts with the expert ids on the device ------------------------------------------------------
  // A layer's routed experts straight from the router's device-resident result, so that the host never sees the
  // ids (resident decode: no host synchronization per layer). Optional: the contract for callers is
  //  - RoutedExpertsMaxTokens() > 0: the device has the op for 1..that many tokens (CUDA: kernels::kGemvMaxTokens).
  //    0 (the default; the CPU, mock GPU and timed devices): it has none; callers copy the ids to the host and
  //    compute each expert with the ops above (src/engine/moe_units.h), as they do for more tokens.
  //  - CreateExpertTable: Unimplemented where the op is missing; InvalidArgument unless every non-empty entry is
  //    dense and of one dtype.
  //  - RoutedExperts gives bitwise what the per-expert sequence of this same device gives for the same rows
  //    (moe_units.h: ComputeExpertRows and CombineExpertOutputs: experts in ascending id, rows in order,
  //    MatMul gate, MatMul up, SwiGlu, MatMul down, ScatterAddScaled onto a zeroed `out`), so either path yields
  //    the same tokens.
  virtual int64_t RoutedExpertsMaxTokens() const { return 0; }
  // The table of `experts` ([layers * experts_per_layer], layer-major; empty entries for layers without experts)
  // with expert shapes hidden x intermediate. May synchronize (a load-time call).
  virtual absl::StatusOr<std::unique_ptr<ExpertTable>> CreateExpertTable(std::span<const ExpertWeightRefs> experts,
                                                                         int64_t experts_per_layer, int64_t hidden,
                                                                         int64_t intermediate);
  // For each token i < n, the sum from 0 over its k experts e_j = ids[i, j], in ascending order of e_j:
  //   out[i, :] = 0 + weights[i, j] * down_e(silu(gate_e x[i, :]) * up_e x[i, :]) + ...   (e = e_j of `layer`).
  // `out` is written, not read: the caller need not zero it.
  // x, out: [n, hidden] (must not alias); ids, weights: [n, k], the router's result in device memory.
  // act: [n * k, intermediate], y: [n * k, hidden]: fp32 scratch in device memory.
  // REQUIRES: 0 < n <= RoutedExpertsMaxTokens(); the ids of a row distinct and in [0, experts_per_layer); the
  // layer's entries of `table` present; `table` made by this device.
  virtual void RoutedExperts(const ExpertTable& table, int64_t layer, const float* x, int64_t n, int64_t k,
                             const int32_t* ids, const float* weights, float* act, float* y, float* out,
                             Stream* stream);

  // ---- accounting ------------------------------------------------------------------------------------------
  // How many ops of each name (e.g. "MatMul") this device has run since creation: a test hook that shows on
  // which device a forward pass computed.
  virtual std::map<std::string, int64_t> op_counts() const = 0;

  // The counts of DeviceCounters since creation or the last ResetCounters(). The default is what the backend
  // recorded with the Note* hooks below: the CPU device and the mock GPU count their own synchronizations,
  // allocations and ops (not frees: 0), and the bytes CopyToHost and CopyOnDevice read. The CUDA backend built on the
  // SIMT emulator reports the emulated runtime's own counts (tools/simt/include/simt/counters.h: kernel launches as
  // they ran, bytes read by copies and, in the checked build, by kernels; the runtime is per process, so these
  // are all devices' counts there); on a GPU, its wrappers' counts of the runtime calls it makes (launches: the
  // launch calls of kernels/, bytes read: those copies read).
  virtual DeviceCounters counters() const;
  virtual void ResetCounters();

 protected:
  void NoteHostSync() { host_syncs_.fetch_add(1, std::memory_order_relaxed); }
  void NoteAllocation() { allocations_.fetch_add(1, std::memory_order_relaxed); }
  void NoteFree() { frees_.fetch_add(1, std::memory_order_relaxed); }
  void NoteLaunches(uint64_t n) { launches_.fetch_add(n, std::memory_order_relaxed); }
  void NoteBytesRead(uint64_t n) { bytes_read_.fetch_add(n, std::memory_order_relaxed); }

  // The bookkeeping of RegisterHostMemory for implementations that override it: records [p, p + bytes)
  // (InvalidArgument on overlap or an empty range) / forgets it (false when `p` starts no range).
  absl::Status RecordHostRange(const void* p, size_t bytes);
  bool ForgetHostRange(const void* p);

 private:
  std::atomic<uint64_t> host_syncs_{0};
  std::atomic<uint64_t> allocations_{0};
  std::atomic<uint64_t> frees_{0};
  std::atomic<uint64_t> launches_{0};
  std::atomic<uint64_t> bytes_read_{0};
  mutable absl::Mutex host_mu_;
  std::map<uintptr_t, size_t> host_ranges_ ABSL_GUARDED_BY(host_mu_);  // start -> bytes
};

}  // namespace odmoe
