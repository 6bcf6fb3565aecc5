#include "src/common/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

absl::Status IoError(const std::string& path, std::string_view what, int err) {
  if (err == ENOENT) return absl::NotFoundError(StrCat(path, ": no such file"));
  return absl::UnavailableError(StrCat(path, ": ", what, ": ", std::strerror(err)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError(path, "open", errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError(path, "stat", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(StrCat(path, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return IoError(path, "mmap", err);
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return std::unique_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return IoError(path, "stat", errno);
  if (!S_ISREG(st.st_mode)) return absl::FailedPreconditionError(StrCat(path, ": not a regular file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::UnavailableError(StrCat(path, ": cannot be read"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::UnavailableError(StrCat(path, ": read failed"));
  return ss.str();
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace odmoe
