// The dense GEMV's one-token variants (kernels/gemv.cu's GemvKernel<W, 1, kRows>), bf16 weights.
#include "bench/gemv_sweep/sweep.h"
#include "kernels/gemv.cu"  // NOLINT: the kernels' own templates, from their anonymous namespace

namespace odmoe::sweep {
namespace {

using kernels::internal::CeilDiv;

struct Shape {
  int64_t out, in;
};
// A decode's shapes on Mixtral-8x7B: the expert's gate/up and down, the stacked q/k/v, o, the LM head.
constexpr Shape kShapes[] = {{14336, 4096}, {4096, 14336}, {6144, 4096}, {4096, 4096}, {32000, 4096}};

template <int kRows>
void Dense(const Shape& s, const float* x, float* y, double copy_gbs) {
  using W = __nv_bfloat16;
  const size_t wbytes = static_cast<size_t>(s.out * s.in) * sizeof(W);
  const int copies = static_cast<int>(std::max<size_t>(2, (size_t{256} << 20) / wbytes + 1));
  std::vector<const W*> w;
  for (int i = 0; i < copies; ++i) w.push_back(static_cast<const W*>(RandomDeviceBytes(wbytes, 7 + i)));
  const auto blocks = static_cast<unsigned>(CeilDiv(s.out, kernels::kWarps * kRows));
  Variant v{"bf16 rows" + std::to_string(kRows),
            std::to_string(s.out) + "x" + std::to_string(s.in),
            static_cast<double>(wbytes) + 4.0 * static_cast<double>(s.in + s.out),
            reinterpret_cast<const void*>(&kernels::GemvKernel<W, 1, kRows>),
            kernels::kThreads,
            copies,
            [&](int c) {
              kernels::GemvKernel<W, 1, kRows>
                  <<<blocks, kernels::kThreads>>>(x, w[c], nullptr, 1, s.in, s.out, y, /*vec=*/true);
            }};
  Report(v, copy_gbs);
  for (const W* p : w) SWEEP_CHECK(cudaFree(const_cast<W*>(p)));
}

}  // namespace

void SweepDense(double copy_gbs) {
  const auto* x = static_cast<const float*>(RandomDeviceBytes(14336 * 4, 3));
  auto* y = static_cast<float*>(RandomDeviceBytes(32000 * 4, 4));
  for (const Shape& s : kShapes) {
    Dense<1>(s, x, y, copy_gbs);
    Dense<2>(s, x, y, copy_gbs);
    Dense<4>(s, x, y, copy_gbs);
  }
  SWEEP_CHECK(cudaFree(const_cast<float*>(x)));
  SWEEP_CHECK(cudaFree(y));
}

}  // namespace odmoe::sweep
