// The INT8 and NF4 GEMVs' one-token variants (kernels/quant_gemm.cu's GemvInt8Kernel / GemvNf4Kernel<1, kRows,
// kDepth, true>), at every rows per warp and ring depth the library could pick, each followed by its candidate
// with 16-byte code loads (LaunchGemvInt8Wide / LaunchGemvNf4Wide: GemvWideKernel<Format, kRows, kDepth>).
#include "bench/gemv_sweep/sweep.h"
#include "kernels/quant_gemm.cu"  // NOLINT: the kernels' own templates, from their anonymous namespace

namespace odmoe::sweep {
namespace {

struct Shape {
  int64_t out, in;
};
constexpr Shape kShapes[] = {{14336, 4096}, {4096, 14336}};

// Bytes of one copy of a format's weights: codes, then the scales.
struct Sizes {
  size_t codes, scales;
};
Sizes Int8Sizes(const Shape& s) { return {static_cast<size_t>(s.out * s.in), static_cast<size_t>(s.out) * 4}; }
Sizes Nf4Sizes(const Shape& s) {
  return {static_cast<size_t>(s.out * kernels::Nf4RowBytes(s.in)),
          static_cast<size_t>(s.out * kernels::Nf4BlocksPerRow(s.in)) * 4};
}

// Copies of one format's weights for a shape, enough to rotate through 256 MiB (more than L2), freed with it.
template <typename Code>
struct Copies {
  Copies(const Shape& s, const Sizes& sz) : bytes(sz.codes + sz.scales) {
    const int count = static_cast<int>(std::max<size_t>(2, (size_t{256} << 20) / bytes + 1));
    for (int i = 0; i < count; ++i) {
      q.push_back(static_cast<const Code*>(RandomDeviceBytes(sz.codes, 11 + i)));
      scales.push_back(static_cast<const float*>(RandomDeviceBytes(sz.scales, 101 + i)));
    }
  }
  ~Copies() {
    for (const Code* p : q) SWEEP_CHECK(cudaFree(const_cast<Code*>(p)));
    for (const float* p : scales) SWEEP_CHECK(cudaFree(const_cast<float*>(p)));
  }
  int count() const { return static_cast<int>(q.size()); }
  size_t bytes;
  std::vector<const Code*> q;
  std::vector<const float*> scales;
};

template <bool kNf4, int kRows, int kDepth>
void Quant(const Shape& s, const float* x, float* y, double copy_gbs) {
  using Code = std::conditional_t<kNf4, uint8_t, int8_t>;
  const Copies<Code> c(s, kNf4 ? Nf4Sizes(s) : Int8Sizes(s));
  const void* func = kNf4 ? reinterpret_cast<const void*>(&kernels::GemvNf4Kernel<1, kRows, kDepth, true>)
                          : reinterpret_cast<const void*>(&kernels::GemvInt8Kernel<1, kRows, kDepth, true>);
  const unsigned blocks = kernels::GemvBlocks<kRows>(s.out);
  Variant v{std::string(kNf4 ? "nf4" : "int8") + " rows" + std::to_string(kRows) + " depth" + std::to_string(kDepth),
            std::to_string(s.out) + "x" + std::to_string(s.in),
            static_cast<double>(c.bytes) + 4.0 * static_cast<double>(s.in + s.out),
            func,
            kernels::kGemvThreads,
            c.count(),
            [&](int i) {
              if constexpr (kNf4) {
                kernels::GemvNf4Kernel<1, kRows, kDepth, true>
                    <<<blocks, kernels::kGemvThreads>>>(x, c.q[i], c.scales[i], 1, s.in, s.out, y);
              } else {
                kernels::GemvInt8Kernel<1, kRows, kDepth, true>
                    <<<blocks, kernels::kGemvThreads>>>(x, c.q[i], c.scales[i], 1, s.in, s.out, y);
              }
            }};
  Report(v, copy_gbs);
}

// The candidate GEMVs (kernels::LaunchGemvInt8Wide / LaunchGemvNf4Wide: 16-byte code loads, x in shared memory) at
// kRows x kDepth.
template <bool kNf4, int kRows, int kDepth>
void Wide(const Shape& s, const float* x, float* y, double copy_gbs) {
  using Format = std::conditional_t<kNf4, kernels::Nf4Format, kernels::Int8Format>;
  const Copies<typename Format::Code> c(s, kNf4 ? Nf4Sizes(s) : Int8Sizes(s));
  Variant v{std::string(kNf4 ? "nf4" : "int8") + "-wide rows" + std::to_string(kRows) + " depth" +
                std::to_string(kDepth),
            std::to_string(s.out) + "x" + std::to_string(s.in),
            static_cast<double>(c.bytes) + 4.0 * static_cast<double>(s.in + s.out),
            reinterpret_cast<const void*>(&kernels::GemvWideKernel<Format, kRows, kDepth>),
            kernels::kGemvThreads,
            c.count(),
            [&](int i) {
              const cudaError_t e =
                  kernels::LaunchWide<Format, kRows, kDepth>(x, c.q[i], c.scales[i], s.in, s.out, y, nullptr);
              SWEEP_CHECK(e);
            },
            kernels::WideSharedBytes<Format>(s.in)};
  Report(v, copy_gbs);
}

template <bool kNf4>
void Format(const Shape& s, const float* x, float* y, double copy_gbs) {
  Quant<kNf4, 1, 4>(s, x, y, copy_gbs);
  Quant<kNf4, 1, 8>(s, x, y, copy_gbs);
  Quant<kNf4, 1, 16>(s, x, y, copy_gbs);
  Quant<kNf4, 2, 4>(s, x, y, copy_gbs);
  Quant<kNf4, 2, 8>(s, x, y, copy_gbs);
  Quant<kNf4, 4, 2>(s, x, y, copy_gbs);
  Quant<kNf4, 4, 4>(s, x, y, copy_gbs);
  Quant<kNf4, 4, 8>(s, x, y, copy_gbs);
  Wide<kNf4, 1, 2>(s, x, y, copy_gbs);
  Wide<kNf4, 1, 4>(s, x, y, copy_gbs);
  Wide<kNf4, 1, 8>(s, x, y, copy_gbs);
  Wide<kNf4, 2, 2>(s, x, y, copy_gbs);
  Wide<kNf4, 2, 4>(s, x, y, copy_gbs);
  Wide<kNf4, 4, 1>(s, x, y, copy_gbs);
  Wide<kNf4, 4, 2>(s, x, y, copy_gbs);
}

}  // namespace

void SweepQuant(double copy_gbs) {
  const auto* x = static_cast<const float*>(RandomDeviceBytes(14336 * 4, 5));
  auto* y = static_cast<float*>(RandomDeviceBytes(14336 * 4, 6));
  for (const Shape& s : kShapes) {
    Format<false>(s, x, y, copy_gbs);
    Format<true>(s, x, y, copy_gbs);
  }
  SWEEP_CHECK(cudaFree(const_cast<float*>(x)));
  SWEEP_CHECK(cudaFree(y));
}

}  // namespace odmoe::sweep
