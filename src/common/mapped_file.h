// Read-only memory mapping of a whole file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace odmoe {

// Thread safety: immutable after Open; safe to read from any thread.
class MappedFile {
 public:
  // NotFound if the file does not exist; other I/O failures name the path and errno text.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size) : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_;
  size_t size_;
};

// Reads a whole (small) file into a string.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
bool FileExists(const std::string& path);

}  // namespace odmoe
