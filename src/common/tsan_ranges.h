// Buffer accesses declared to ThreadSanitizer by code it does not instrument.
//
// In TSan builds the numeric kernels (src/backend/cpu_kernels.cc, src/backend/quantize.cc) are compiled without
// TSan's per-access checks (scripts/sanitize/tsan_ignorelist.txt): instrumented, their element loops made the TSan
// step's longest tests take about twice as long, though the kernels start no threads and share nothing of their
// own. So that a race on the buffers they are given stays visible, every kernel declares on entry the bytes it
// will read and write, with the calls below: TSan checks each range as accessed there, by the calling thread, as
// it does for memcpy. A race is then reported at the kernel's entry (its stack names the kernel and its caller)
// rather than at the element. Without TSan the calls compile to nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ODMOE_TSAN_RANGES 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define ODMOE_TSAN_RANGES 1
#endif

#ifdef ODMOE_TSAN_RANGES
// The TSan runtime's own entry points (compiler-rt and libtsan both export them; no public header declares them).
extern "C" void __tsan_read_range(void* addr, unsigned long size);   // NOLINT(bugprone-reserved-identifier)
extern "C" void __tsan_write_range(void* addr, unsigned long size);  // NOLINT(bugprone-reserved-identifier)
#endif

namespace odmoe::tsan {

// The calling thread reads bytes [p, p + bytes).
inline void ReadBytes([[maybe_unused]] const void* p, [[maybe_unused]] size_t bytes) {
#ifdef ODMOE_TSAN_RANGES
  if (bytes > 0) __tsan_read_range(const_cast<void*>(p), bytes);
#endif
}

// The calling thread writes (or reads and writes) bytes [p, p + bytes).
inline void WriteBytes([[maybe_unused]] const void* p, [[maybe_unused]] size_t bytes) {
#ifdef ODMOE_TSAN_RANGES
  if (bytes > 0) __tsan_write_range(const_cast<void*>(p), bytes);
#endif
}

// The same for `count` values of T at p.
template <typename T>
void Reads(const T* p, int64_t count) {
  ReadBytes(p, static_cast<size_t>(count) * sizeof(T));
}
template <typename T>
void Writes(T* p, int64_t count) {
  WriteBytes(p, static_cast<size_t>(count) * sizeof(T));
}

}  // namespace odmoe::tsan
