// Reader for the safetensors format: an 8-byte little-endian header length, a JSON header mapping tensor names
// to {dtype, shape, data_offsets}, then the data section. The file is memory-mapped; the whole header is
// validated before any tensor is handed out: bounded header size, valid JSON, known dtypes, offsets inside the
// data section and consistent with shape x dtype, and no two tensors overlapping.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "src/common/dtype.h"
#include "src/common/mapped_file.h"

namespace odmoe {

// Headers larger than this are refused before parsing (the format's reference reader uses the same bound).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct TensorInfo {
  std::string name;
  std::string dtype_name;      // as written in the file, e.g. "BF16"
  std::optional<DType> dtype;  // nullopt: a valid safetensors dtype that odmoe does not compute with
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // absolute byte offset in the file
  uint64_t nbytes = 0;

  int64_t numel() const;
  std::string ShapeString() const;  // "[4096, 14336]"
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in the order of their data
  std::unordered_map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // absolute offset of the data section
};

// Parses and validates a complete safetensors file image of `size` bytes. `where` (the path) prefixes every
// message. Errors: DataLoss for anything malformed or inconsistent.
absl::StatusOr<SafetensorsHeader> ParseSafetensors(const uint8_t* data, size_t size, const std::string& where);

// A validated, memory-mapped safetensors file. Thread safety: immutable; safe to share.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  const std::string& path() const { return file_->path(); }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::unordered_map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorInfo* Find(std::string_view name) const;
  const uint8_t* DataOf(const TensorInfo& t) const { return file_->data() + t.offset; }
  const MappedFile& mapped() const { return *file_; }

 private:
  SafetensorsFile(std::unique_ptr<MappedFile> file, SafetensorsHeader header);
  std::unique_ptr<MappedFile> file_;
  SafetensorsHeader header_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace odmoe
