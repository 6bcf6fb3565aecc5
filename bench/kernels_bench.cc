// odmoe-bench kernels: achieved memory bandwidth of the decode kernels, against the device copy bandwidth
// measured in the same run.
//
//  - expert-FFN GEMV at batch 1: Device::MatMul with n = 1 over bf16 weights of the gate/up shape
//    [inter, hidden] and the down shape [hidden, inter]; on CUDA builds with --backend cuda also the INT8 and NF4
//    dequantizing GEMVs of kernels/quant.h (called directly: the Device interface has no quantized op). Bytes
//    counted: the weights (codes + scales for INT8/NF4) + x + y.
//  - routed experts on CUDA: the resident decode's grouped launches (kernels/moe_grouped.h), one token's gate and up
//    of its k = 2 experts in one launch and their down projections in another, bf16, experts chosen from 8 so that
//    successive calls read other weights. Bytes counted: the two experts' weights + x + the outputs.
//  - decode attention: Device::Attention for one new token against `context` cached positions (fp32 K/V),
//    bytes = K + V read (+ q and out).
// Every figure rotates over as many copies of its operands as make up --rotate-mb (at least 2), so that with
// the default (256 MB, five times an H100's 50 MB L2) no call finds its weights in cache.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "src/backend/cpu_kernels.h"
#include "src/backend/device_factory.h"
#include "src/common/flags.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/synthetic.h"

#ifdef ODMOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/moe_grouped.h"
#include "kernels/quant.h"
#endif

namespace odmoe::bench {
namespace {

struct Result {
  std::string kernel;
  std::string shape;
  double bytes_per_call = 0;
  double us_per_call = 0;
  double gb_per_s = 0;
};

size_t Copies(double rotate_bytes, double bytes_each) {
  return static_cast<size_t>(std::max(2.0, std::ceil(rotate_bytes / bytes_each)));
}

// Times `iters` calls of `call(i)` (i = 0, 1, ...) after `copies` warm-up calls; the device is synchronized at
// both ends and `sync` is what does that.
template <typename Call, typename Sync>
Result Time(const std::string& kernel, const std::string& shape, double bytes_per_call, int64_t iters, size_t copies,
            Call call, Sync sync) {
  for (size_t i = 0; i < copies; ++i) call(i);
  sync();
  const Clock::time_point start = Clock::now();
  for (int64_t i = 0; i < iters; ++i) call(static_cast<size_t>(i) % copies);
  sync();
  const double s = SecondsSince(start);
  Result r{kernel, shape, bytes_per_call, 1e6 * s / static_cast<double>(iters), 0};
  r.gb_per_s = s > 0 ? bytes_per_call * static_cast<double>(iters) / s / 1e9 : 0;
  return r;
}

absl::StatusOr<Result> BenchGemvBf16(Device& dev, int64_t out_dim, int64_t in_dim, double rotate_bytes, int64_t iters) {
  const size_t wbytes = static_cast<size_t>(out_dim * in_dim) * 2;
  const size_t copies = Copies(rotate_bytes, static_cast<double>(wbytes));
  std::vector<uint8_t> host(wbytes);
  TensorSpec spec{"bench.gemv.weight", {out_dim, in_dim}, TensorRole::kExpertGate};
  GenerateSyntheticTensor(1, spec, DType::kBF16, 0, static_cast<uint64_t>(out_dim * in_dim), host.data());
  std::vector<std::unique_ptr<Buffer>> w;
  for (size_t i = 0; i < copies; ++i) {
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> b, dev.Allocate(wbytes, "bench gemv weight"));
    dev.CopyToDevice(b->data(), host.data(), wbytes, nullptr);
    dev.SynchronizeAll();
    w.push_back(std::move(b));
  }
  std::vector<float> xh(static_cast<size_t>(in_dim), 0.5f);
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> x, dev.Allocate(xh.size() * 4, "bench gemv x"));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> y, dev.Allocate(static_cast<size_t>(out_dim) * 4, "bench gemv y"));
  dev.CopyToDevice(x->data(), xh.data(), xh.size() * 4, nullptr);
  dev.SynchronizeAll();
  const double bytes = static_cast<double>(wbytes) + 4.0 * static_cast<double>(in_dim + out_dim);
  return Time(
      "gemv_bf16", StrCat(out_dim, "x", in_dim), bytes, iters, copies,
      [&](size_t i) {
        dev.MatMul(x->as<float>(), WeightRef{w[i]->data(), DType::kBF16}, WeightRef{}, 1, in_dim, out_dim,
                   y->as<float>(), nullptr);
      },
      [&] { dev.SynchronizeAll(); });
}

// Decode attention of a bf16 model: its KV cache in the dtype the device keeps one in (Device::KvCacheDType).
absl::StatusOr<Result> BenchAttention(Device& dev, int64_t context, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      double rotate_bytes, int64_t iters) {
  const DType kv_dtype = dev.KvCacheDType(DType::kBF16);
  const int64_t values = context * kv_heads * head_dim;  // K or V
  const size_t kv_bytes = static_cast<size_t>(values) * DTypeSize(kv_dtype);
  const size_t copies = Copies(rotate_bytes, 2.0 * static_cast<double>(kv_bytes));
  std::vector<float> values_f32(static_cast<size_t>(values));
  for (size_t i = 0; i < values_f32.size(); ++i) values_f32[i] = SyntheticValue(2, i % 7, false, i) * 50.0f;
  std::vector<uint8_t> host(kv_bytes);
  cpu::Convert(values_f32.data(), DType::kF32, values, host.data(), kv_dtype);
  std::vector<std::unique_ptr<Buffer>> k, v;
  for (size_t i = 0; i < copies; ++i) {
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> kb, dev.Allocate(kv_bytes, "bench attention k"));
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> vb, dev.Allocate(kv_bytes, "bench attention v"));
    dev.CopyToDevice(kb->data(), host.data(), kv_bytes, nullptr);
    dev.CopyToDevice(vb->data(), host.data(), kv_bytes, nullptr);
    dev.SynchronizeAll();
    k.push_back(std::move(kb));
    v.push_back(std::move(vb));
  }
  const size_t qbytes = static_cast<size_t>(heads * head_dim) * 4;
  std::vector<float> qh(qbytes / 4, 0.1f);
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> q, dev.Allocate(qbytes, "bench attention q"));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> out, dev.Allocate(qbytes, "bench attention out"));
  dev.CopyToDevice(q->data(), qh.data(), qbytes, nullptr);
  dev.SynchronizeAll();
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const double bytes = 2.0 * static_cast<double>(kv_bytes) + 2.0 * static_cast<double>(qbytes);
  return Time(
      "attention_decode",
      StrCat("ctx", context, " h", heads, "/", kv_heads, " d", head_dim, " kv ", DTypeName(kv_dtype)), bytes, iters,
      copies,
      [&](size_t i) {
        dev.Attention(q->as<float>(), KvCacheRef{k[i]->data(), kv_dtype}, KvCacheRef{v[i]->data(), kv_dtype}, 1,
                      context - 1, heads, kv_heads, head_dim, scale, out->as<float>(), nullptr);
      },
      [&] { dev.SynchronizeAll(); });
}

#ifdef ODMOE_HAVE_CUDA
absl::Status CudaOk(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(StrCat(what, ": ", cudaGetErrorString(e)));
}

// CUDA memory outside the Device's accounting, freed with the object.
class CudaMemory {
 public:
  CudaMemory() = default;
  CudaMemory(const CudaMemory&) = delete;
  CudaMemory& operator=(const CudaMemory&) = delete;
  ~CudaMemory() {
    for (void* p : blocks_) cudaFree(p);
  }
  // `bytes` of device memory, uninitialized.
  absl::StatusOr<void*> Allocate(size_t bytes) {
    void* p = nullptr;
    ODMOE_RETURN_IF_ERROR(CudaOk(cudaMalloc(&p, bytes), "cudaMalloc"));
    blocks_.push_back(p);
    return p;
  }
  // Device memory holding a copy of the `bytes` at `host`.
  absl::StatusOr<void*> Upload(const void* host, size_t bytes) {
    ODMOE_ASSIGN_OR_RETURN(void* p, Allocate(bytes));
    ODMOE_RETURN_IF_ERROR(CudaOk(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy"));
    return p;
  }
  template <typename T>
  absl::StatusOr<void*> Upload(const std::vector<T>& host) {
    return Upload(host.data(), host.size() * sizeof(T));
  }

 private:
  std::vector<void*> blocks_;
};

// Times `iters` launches by `launch(i)`, which returns the launch's error; the first error fails the figure.
template <typename Launch>
absl::StatusOr<Result> TimeCuda(const std::string& kernel, const std::string& shape, double bytes, int64_t iters,
                                size_t copies, Launch launch) {
  cudaError_t error = cudaSuccess;
  Result r = Time(
      kernel, shape, bytes, iters, copies,
      [&](size_t i) {
        const cudaError_t e = launch(i);
        if (error == cudaSuccess) error = e;
      },
      [&] {
        const cudaError_t e = cudaDeviceSynchronize();
        if (error == cudaSuccess) error = e;
      });
  ODMOE_RETURN_IF_ERROR(CudaOk(error, kernel.c_str()));
  return r;
}

// The routed experts of one decode token as the resident engine launches them: k = 2 of 8 bf16 experts, call i
// taking experts 2 (i % 4) and 2 (i % 4) + 1. Appends the gate-and-up figure, then the down projection's.
absl::Status BenchRoutedExperts(int64_t hidden, int64_t inter, int64_t iters, std::vector<Result>* results) {
  constexpr int kExperts = 8, kTopK = 2;
  const int64_t per_matrix = inter * hidden;
  const size_t matrix_bytes = static_cast<size_t>(per_matrix) * 2;
  std::vector<uint8_t> host(matrix_bytes);
  TensorSpec spec{"bench.experts.weight", {inter, hidden}, TensorRole::kExpertGate};
  GenerateSyntheticTensor(1, spec, DType::kBF16, 0, static_cast<uint64_t>(per_matrix), host.data());
  CudaMemory mem;
  std::vector<kernels::ExpertPointers> table(kExperts);
  for (kernels::ExpertPointers& e : table) {
    ODMOE_ASSIGN_OR_RETURN(void* gate, mem.Upload(host.data(), matrix_bytes));
    ODMOE_ASSIGN_OR_RETURN(void* up, mem.Upload(host.data(), matrix_bytes));
    ODMOE_ASSIGN_OR_RETURN(void* down, mem.Upload(host.data(), matrix_bytes));  // as [hidden, inter]
    e = {gate, up, down};
  }
  ODMOE_ASSIGN_OR_RETURN(void* experts, mem.Upload(table));
  std::vector<int32_t> ids;
  for (int32_t pair = 0; pair < kExperts / kTopK; ++pair) ids.insert(ids.end(), {2 * pair, 2 * pair + 1});
  ODMOE_ASSIGN_OR_RETURN(void* ids_dev, mem.Upload(ids));
  std::vector<float> xh(static_cast<size_t>(hidden));
  for (size_t i = 0; i < xh.size(); ++i) xh[i] = SyntheticValue(3, 0, false, i);
  ODMOE_ASSIGN_OR_RETURN(void* x, mem.Upload(xh));
  ODMOE_ASSIGN_OR_RETURN(void* act, mem.Allocate(static_cast<size_t>(kTopK * inter) * 4));
  ODMOE_ASSIGN_OR_RETURN(void* y, mem.Allocate(static_cast<size_t>(kTopK * hidden) * 4));
  const auto* experts_dev = static_cast<const kernels::ExpertPointers*>(experts);
  auto pair_ids = [&](size_t i) { return static_cast<const int32_t*>(ids_dev) + kTopK * (i % (kExperts / kTopK)); };
  const double weights = static_cast<double>(kTopK * matrix_bytes);
  const std::string shape = StrCat("2 of 8, ", inter, "x", hidden);
  ODMOE_ASSIGN_OR_RETURN(Result gate_up, TimeCuda("experts_gate_up", shape,
                                                  2 * weights + 4.0 * static_cast<double>(hidden + kTopK * inter),
                                                  iters, kExperts / kTopK, [&](size_t i) {
                                                    return kernels::LaunchGroupedGateUp<__nv_bfloat16>(
                                                        static_cast<const float*>(x), experts_dev, pair_ids(i), 1,
                                                        kTopK, hidden, inter, static_cast<float*>(act), nullptr);
                                                  }));
  ODMOE_ASSIGN_OR_RETURN(
      Result down, TimeCuda("experts_down", shape, weights + 4.0 * static_cast<double>(kTopK * (inter + hidden)), iters,
                            kExperts / kTopK, [&](size_t i) {
                              return kernels::LaunchGroupedDown<__nv_bfloat16>(static_cast<const float*>(act),
                                                                               experts_dev, pair_ids(i), kTopK, inter,
                                                                               hidden, static_cast<float*>(y), nullptr);
                            }));
  results->push_back(gate_up);
  results->push_back(down);
  return absl::OkStatus();
}

// INT8 (nf4 = false) or NF4 GEMV straight through kernels/quant.h on CUDA memory outside the Device's accounting.
absl::StatusOr<Result> BenchGemvQuant(bool nf4, int64_t rows, int64_t cols, double rotate_bytes, int64_t iters) {
  const size_t code_bytes =
      nf4 ? static_cast<size_t>(rows * kernels::Nf4RowBytes(cols)) : static_cast<size_t>(rows * cols);
  const size_t scale_floats =
      nf4 ? static_cast<size_t>(rows * kernels::Nf4BlocksPerRow(cols)) : static_cast<size_t>(rows);
  const size_t each = code_bytes + scale_floats * 4;
  const size_t copies = Copies(rotate_bytes, static_cast<double>(each));
  std::vector<uint8_t> codes(code_bytes);
  uint64_t h = 0x12345678;
  for (uint8_t& b : codes) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    b = static_cast<uint8_t>(h >> 56);
  }
  std::vector<float> scales(scale_floats, 0.05f);
  CudaMemory mem;
  std::vector<void*> q(copies, nullptr), s(copies, nullptr);
  for (size_t i = 0; i < copies; ++i) {
    ODMOE_ASSIGN_OR_RETURN(q[i], mem.Upload(codes));
    ODMOE_ASSIGN_OR_RETURN(s[i], mem.Upload(scales));
  }
  ODMOE_ASSIGN_OR_RETURN(void* x, mem.Upload(std::vector<float>(static_cast<size_t>(cols), 0.5f)));
  ODMOE_ASSIGN_OR_RETURN(void* y, mem.Allocate(static_cast<size_t>(rows) * 4));
  const double bytes = static_cast<double>(each) + 4.0 * static_cast<double>(rows + cols);
  return TimeCuda(nf4 ? "gemv_nf4" : "gemv_int8", StrCat(rows, "x", cols), bytes, iters, copies, [&](size_t i) {
    return nf4 ? kernels::LaunchGemvNf4(static_cast<const float*>(x), static_cast<const uint8_t*>(q[i]),
                                        static_cast<const float*>(s[i]), 1, cols, rows, static_cast<float*>(y), 0)
               : kernels::LaunchGemvInt8(static_cast<const float*>(x), static_cast<const int8_t*>(q[i]),
                                         static_cast<const float*>(s[i]), 1, cols, rows, static_cast<float*>(y), 0);
  });
}
#endif

}  // namespace

absl::Status RunKernels(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(Flags f, Flags::Parse(args,
                                               {"backend", "hidden", "inter", "contexts", "heads", "kv-heads",
                                                "head-dim", "rotate-mb", "iters", "copy-mb"},
                                               {}));
  const std::string backend = f.Get("backend").value_or("cpu");
  ODMOE_ASSIGN_OR_RETURN(int64_t hidden, f.Int("hidden", 4096));
  ODMOE_ASSIGN_OR_RETURN(int64_t inter, f.Int("inter", 14336));
  ODMOE_ASSIGN_OR_RETURN(std::vector<int64_t> contexts, f.IntList("contexts"));
  ODMOE_ASSIGN_OR_RETURN(int64_t heads, f.Int("heads", 32));
  ODMOE_ASSIGN_OR_RETURN(int64_t kv_heads, f.Int("kv-heads", 8));
  ODMOE_ASSIGN_OR_RETURN(int64_t head_dim, f.Int("head-dim", 128));
  ODMOE_ASSIGN_OR_RETURN(int64_t rotate_mb, f.Int("rotate-mb", 256));
  ODMOE_ASSIGN_OR_RETURN(int64_t iters, f.Int("iters", backend == "cpu" ? 4 : 200));
  ODMOE_ASSIGN_OR_RETURN(int64_t copy_mb, f.Int("copy-mb", 1024));
  if (contexts.empty()) contexts = {1024, 4096, 16384};
  if (hidden < 1 || inter < 1 || heads < 1 || kv_heads < 1 || head_dim < 1 || heads % kv_heads != 0 || rotate_mb < 0 ||
      iters < 1 || copy_mb < 1) {
    return absl::InvalidArgumentError(
        "--hidden, --inter, --heads, --kv-heads, --head-dim, --iters, --copy-mb must be positive, --heads a multiple "
        "of --kv-heads");
  }
  for (int64_t c : contexts) {
    if (c < 1) return absl::InvalidArgumentError(StrCat("--contexts: positive lengths, got ", c));
  }
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, CreateDevice(backend));
  ODMOE_ASSIGN_OR_RETURN(const double copy_bw,
                         MeasureCopyBandwidth(*dev, static_cast<size_t>(copy_mb) << 20, backend == "cpu" ? 4 : 20));
  const double copy_gbs = copy_bw / 1e9;
  const double rotate = static_cast<double>(rotate_mb) * (1 << 20);
  PrintJsonLine({{"bench", "kernels"},
                 {"kernel", "copy"},
                 {"backend", backend},
                 {"device", dev->name()},
                 {"bytes", static_cast<double>(copy_mb) * (1 << 20)},
                 {"gb_per_s", copy_gbs}});

  std::vector<Result> results;
  std::vector<std::pair<int64_t, int64_t>> gemv_shapes = {{inter, hidden}, {hidden, inter}};
  for (auto [o, i] : gemv_shapes) {
    ODMOE_ASSIGN_OR_RETURN(Result r, BenchGemvBf16(*dev, o, i, rotate, iters));
    results.push_back(r);
  }
  bool quant = false;
#ifdef ODMOE_HAVE_CUDA
  if (dev->kind() == DeviceKind::kCuda) {
    quant = true;
    for (bool nf4 : {false, true}) {
      for (auto [o, i] : gemv_shapes) {
        ODMOE_ASSIGN_OR_RETURN(Result r, BenchGemvQuant(nf4, o, i, rotate, iters));
        results.push_back(r);
      }
    }
    ODMOE_RETURN_IF_ERROR(BenchRoutedExperts(hidden, inter, iters, &results));
  }
#endif
  for (int64_t ctx : contexts) {
    ODMOE_ASSIGN_OR_RETURN(Result r, BenchAttention(*dev, ctx, heads, kv_heads, head_dim, rotate, iters));
    results.push_back(r);
  }
  for (const Result& r : results) {
    PrintJsonLine({{"bench", "kernels"},
                   {"kernel", r.kernel},
                   {"shape", r.shape},
                   {"backend", backend},
                   {"bytes_per_call", r.bytes_per_call},
                   {"us_per_call", r.us_per_call},
                   {"gb_per_s", r.gb_per_s},
                   {"fraction_of_copy", copy_gbs > 0 ? r.gb_per_s / copy_gbs : 0}});
  }
  std::printf("\n%s (%s): copy %.1f GB/s (read + write)%s\n", backend.c_str(), dev->name().c_str(), copy_gbs,
              quant ? "" : "; INT8/NF4 GEMVs and routed experts only with --backend cuda");
  std::printf("%-18s %-22s %12s %12s %10s %10s\n", "kernel", "shape", "MB/call", "us/call", "GB/s", "of_copy");
  for (const Result& r : results) {
    std::printf("%-18s %-22s %12.2f %12.1f %10.1f %9.1f%%\n", r.kernel.c_str(), r.shape.c_str(), r.bytes_per_call / 1e6,
                r.us_per_call, r.gb_per_s, copy_gbs > 0 ? 100 * r.gb_per_s / copy_gbs : 0);
  }
  return absl::OkStatus();
}

}  // namespace odmoe::bench
