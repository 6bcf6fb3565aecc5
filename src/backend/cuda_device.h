// The CUDA backend: a Device whose memory is the memory of one GPU and whose ops run the kernels of kernels/
// (and cuBLAS for dense products of more than kernels::kGemvMaxTokens tokens).
//
//  - Memory: each Buffer comes from a CUDA memory pool of the device's own (cudaMallocFromPoolAsync) and goes back to
//    it with cudaFreeAsync when destroyed, so neither Allocate nor a Buffer's destruction makes the host wait for the
//    GPU (cudaMalloc / cudaFree would: loading and evicting experts would drain the device; only when the GPU itself is
//    full does an allocation wait once for the frees still pending). A Buffer may be used on any of the device's
//    streams once Allocate returns; destroying it frees it after the work enqueued until then on every stream of the
//    device. Buffers are accounted, in bytes asked, against `capacity_bytes` (0: the GPU's total memory as
//    cudaMemGetInfo reports it): ResourceExhausted when the budget or the pool says no. The pool keeps up to the
//    capacity reserved across frees (its release threshold), so an eviction's memory serves the next load; for a moment
//    it may hold more (frees still pending on the GPU), given back at the next synchronization. Per-stream scratch
//    (attention splits, 16-bit copies of activations for cuBLAS, the cuBLAS workspace; at most a few tens of MiB per
//    stream) is cudaMalloc'd, grown rarely, and counted in MemoryInfo (within the capacity when PrepareStream reserves
//    it, past it when an op must grow it).
//  - Streams are non-blocking CUDA streams (the default stream, nullptr, is one the device owns), events are
//    CUDA events without timing. Each stream owns its cuBLAS handle and scratch, so work on different streams
//    shares nothing.
//  - Weights stay in their checkpoint dtype. MatMul of up to kGemvMaxTokens tokens runs the bandwidth-bound
//    GEMV kernel (fp32 accumulation). Larger products go to cuBLAS: fp32 weights with
//    CUBLAS_COMPUTE_32F_PEDANTIC (no TF32); fp16/bf16 weights with fp32 accumulation on tensor cores, the fp32
//    activations being split into a hi + lo pair of the weight's dtype (two GEMMs), which keeps about 16
//    (bf16) or 22 (fp16) bits of each activation instead of 8 or 11.
//  - RoutedExperts (up to kGemvMaxTokens tokens): three launches per layer over every (token, expert) slot, the
//    expert ids read on the device from the router's output through a table of expert weight pointers made at
//    load time (kernels/moe_grouped.h); bitwise the per-expert GEMV path.
//  - SelectTokens: one launch, a block per row (kernels/sampling.h), the ids the CPU reference picks.
//  - Attention: the split-sequence decode kernel for up to 4 new tokens, the tiled prefill kernel beyond, both
//    over a KV cache in the model's compute dtype (KvCacheDType: F16 / BF16 models keep theirs in that dtype,
//    as HF does, half the bytes of fp32; every other model in F32), written by RopeWriteKv (with k's rotation,
//    in RoPE's launch), WriteKvRows (K and V in one launch) or Convert (fp32 rows rounded to nearest even: the
//    same bits).
//  - Graphs (CaptureGraph / LaunchGraph): the stream is captured in thread-local mode into a CUDA graph,
//    instantiated at once; a launch replays it with the arguments of the capture. While a stream is captured, the
//    memory pool's allocations and frees leave it alone (so another thread loading or evicting does not join the
//    capture). RopeWriteKv, WriteKvRows and AttentionAt read the position from device memory
//    (kernels::LaunchRopeKvStore, LaunchKvStore, LaunchAttentionDecodeAt), so a recorded decode step serves every
//    position. Launches and ops enqueued while capturing are counted at each launch of the graph, not at the
//    capture (DeviceCounters::graph_launches).
//  - Rope rotates by the inverse frequencies of the CPU reference (cpu::RopeInvFreq, uploaded once per
//    head_dim and theta), so both backends use bitwise the same frequencies.
//  - Ops report CUDA errors (a bad launch, a fault) by aborting with the error's text: like CHECKs, they are
//    bugs, not input errors.
//
// Thread safety: methods may be called from any thread; accounting (memory, transfers, op counts) is guarded by
// a mutex. A Stream must be used by one thread at a time (its scratch and cuBLAS handle are not shared).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "src/backend/device.h"

namespace odmoe {

// The GPU `ordinal` as a Device. Unavailable when the process sees no CUDA device (the message carries
// cudaGetDeviceCount's error), InvalidArgument for an ordinal that does not exist, Unimplemented for a GPU older
// than compute capability 8.0 (the kernels are built for 8.0, 8.6, 8.9 and 9.0).
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal, uint64_t capacity_bytes /*0 = whole GPU*/);

}  // namespace odmoe
