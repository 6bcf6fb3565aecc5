// Checks that ThreadSanitizer still sees races on the numeric kernels' buffers, although TSan builds compile the
// kernels without per-access checks (scripts/sanitize/tsan_ignorelist.txt): each kernel declares the ranges it
// reads and writes (src/common/tsan_ranges.h). Built by tests/CMakeLists.txt in TSan builds only; run by
// scripts/sanitize.sh tsan before the suite.
//   odmoe_tsan_kernel_canary race    two threads add into one buffer with cpu::Add, unsynchronized: TSan must
//                                    report a race (the second adds once the first has finished, told by a
//                                    relaxed atomic: no happens-before for TSan, and no truly simultaneous
//                                    accesses, which TSan can miss)
//   odmoe_tsan_kernel_canary apart   the same, each thread into its own buffer: TSan must report nothing
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "src/backend/cpu_kernels.h"

int main(int argc, char** argv) {
  const bool race = argc == 2 && std::strcmp(argv[1], "race") == 0;
  if (!race && !(argc == 2 && std::strcmp(argv[1], "apart") == 0)) {
    std::fprintf(stderr, "usage: odmoe_tsan_kernel_canary race|apart\n");
    return 2;
  }
  constexpr int64_t kCount = 256;
  const std::vector<float> x(kCount, 1.0f);
  std::vector<float> a(kCount, 0.0f), b(kCount, 0.0f);
  float* first = a.data();
  float* second = race ? a.data() : b.data();
  std::atomic<bool> first_done{false};
  std::thread t1([&] {
    for (int i = 0; i < 100; ++i) odmoe::cpu::Add(x.data(), kCount, first);
    first_done.store(true, std::memory_order_relaxed);
  });
  std::thread t2([&] {
    while (!first_done.load(std::memory_order_relaxed)) std::this_thread::yield();
    for (int i = 0; i < 100; ++i) odmoe::cpu::Add(x.data(), kCount, second);
  });
  t1.join();
  t2.join();
  std::printf("%g %g\n", a[0], b[0]);
  return 0;
}
