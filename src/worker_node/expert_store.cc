#include "src/worker_node/expert_store.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "spdlog/spdlog.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

// The segment's first page. `magic` is written last (release) and read first (acquire).
struct SegmentHeader {
  uint64_t magic;
  uint64_t version;
  uint64_t layout_hash;
  uint64_t total_bytes;
  uint64_t experts;
  uint64_t creator_pid;
};
constexpr uint64_t kReadyMagic = 0x59444145524d444full;  // "ODMREADY"
constexpr uint64_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 4096;
constexpr int kMaxAttempts = 40;

void Mix(uint64_t& h, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
}

absl::Status Errno(std::string_view what, const std::string& path) {
  return absl::InternalError(StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// An open-file-description lock on the whole file: F_RDLCK, F_WRLCK or F_UNLCK. 0 on success, else errno.
int OfdLock(int fd, short type, bool wait) {
  struct flock fl;
  std::memset(&fl, 0, sizeof(fl));
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  for (;;) {
    if (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) == 0) return 0;
    if (errno != EINTR) return errno;
  }
}

// True when `fd` is still the file at `path` (not unlinked or replaced by a departing holder).
bool SameFile(int fd, const std::string& path) {
  struct stat a, b;
  if (fstat(fd, &a) != 0 || stat(path.c_str(), &b) != 0) return false;
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertStore>> ExpertStore::Open(const ModelConfig& config, TensorSource& source,
                                                               const ExpertStoreOptions& options, Device* device) {
  std::unique_ptr<ExpertStore> store(new ExpertStore());
  std::vector<std::pair<int64_t, int64_t>> keys;
  if (options.share && options.shared_keys.empty()) {
    for (int64_t l : config.SparseLayers()) {
      for (int64_t e = 0; e < config.num_experts; ++e) keys.emplace_back(l, e);
    }
  } else if (options.share) {
    std::set<std::pair<int64_t, int64_t>> unique(options.shared_keys.begin(), options.shared_keys.end());
    keys.assign(unique.begin(), unique.end());
  } else {
    std::set<std::pair<int64_t, int64_t>> unique(options.served.begin(), options.served.end());
    keys.assign(unique.begin(), unique.end());
  }
  ODMOE_RETURN_IF_ERROR(store->Plan(config, keys, source, &store->size_));
  store->layout_hash_ = store->LayoutHash(options.fingerprint);

  bool opened = false;
  if (options.share) {
    if (options.segment_name.empty() || options.segment_name.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(StrCat("expert store: bad segment name '", options.segment_name, "'"));
    }
    store->segment_path_ = StrCat(options.shm_dir, "/", options.segment_name);
    store->lock_path_ = StrCat(store->segment_path_, ".lock");
    int foreign_count = 0;
    for (int attempt = 0; attempt < kMaxAttempts && !opened; ++attempt) {
      bool retry = false;
      bool foreign = false;
      const absl::Status shared = store->TryOpenShared(config, source, options, &retry, &foreign);
      if (!shared.ok()) {
        // No shared segment here (a full or missing /dev/shm, permissions): the worker still runs, privately.
        spdlog::warn("expert store: {}", shared.ToString());
        break;
      }
      if (!retry) {
        opened = true;
        break;
      }
      if (foreign && ++foreign_count >= 3) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * (attempt + 1)));
    }
    if (!opened) {
      spdlog::warn("expert store: cannot use the shared segment {} (in use with another layout, or contended); "
                   "packing this worker's experts privately",
                   store->segment_path_);
      store->segment_path_.clear();
      store->lock_path_.clear();
      std::set<std::pair<int64_t, int64_t>> unique(options.served.begin(), options.served.end());
      keys.assign(unique.begin(), unique.end());
      store->experts_.clear();
      store->block_offset_.clear();
      ODMOE_RETURN_IF_ERROR(store->Plan(config, keys, source, &store->size_));
    }
  }
  if (!opened) ODMOE_RETURN_IF_ERROR(store->OpenPrivate(config, source));

  for (auto& [key, expert] : store->experts_) expert.data = store->base_ + store->block_offset_[key];
  if (device != nullptr && store->size_ > 0) {
    const absl::Status registered = device->RegisterHostMemory(store->base_, store->size_);
    if (registered.ok()) {
      store->device_ = device;
      store->pinned_bytes_ = store->size_;
    } else {
      spdlog::warn("expert store: host memory not registered with {} (copies will be slower): {}", device->name(),
                   registered.ToString());
    }
  }
  return store;
}

absl::StatusOr<ExpertStore::Expert> ExpertStore::LayoutOf(const ModelConfig& config, const TensorSource& source,
                                                          int64_t layer, int64_t e) {
  Expert x;
  uint64_t in_block = 0;
  const std::vector<TensorSpec> specs = ExpertTensors(config, layer, e);
  for (size_t i = 0; i < specs.size() && i < 3; ++i) {
    ODMOE_ASSIGN_OR_RETURN(const TensorMeta m, source.Meta(specs[i]));
    in_block = AlignUp(in_block);
    x.offsets[i] = in_block;
    x.dtypes[i] = m.dtype;
    in_block += m.nbytes;
    x.tensor_bytes += m.nbytes;
  }
  x.copy_bytes = in_block;
  x.block_bytes = AlignUp(in_block);
  return x;
}

absl::Status ExpertStore::Plan(const ModelConfig& config, const std::vector<std::pair<int64_t, int64_t>>& keys,
                               const TensorSource& source, uint64_t* total) {
  uint64_t offset = kHeaderBytes;
  for (const auto& key : keys) {
    ODMOE_ASSIGN_OR_RETURN(const Expert x, LayoutOf(config, source, key.first, key.second));
    block_offset_[key] = offset;
    offset += x.block_bytes;
    experts_[key] = x;
  }
  *total = experts_.empty() ? 0 : offset;
  return absl::OkStatus();
}

uint64_t ExpertStore::LayoutHash(const std::string& fingerprint) const {
  uint64_t h = 0xcbf29ce484222325ull;
  Mix(h, &kVersion, sizeof(kVersion));
  Mix(h, fingerprint.data(), fingerprint.size());
  for (const auto& [key, x] : experts_) {
    const uint64_t fields[] = {static_cast<uint64_t>(key.first), static_cast<uint64_t>(key.second),
                               block_offset_.at(key),         x.offsets[0],
                               x.offsets[1],                  x.offsets[2],
                               x.copy_bytes,                  x.tensor_bytes};
    Mix(h, fields, sizeof(fields));
    for (DType d : x.dtypes) {
      const int v = static_cast<int>(d);
      Mix(h, &v, sizeof(v));
    }
  }
  return h;
}

absl::Status ExpertStore::Fill(const ModelConfig& config, TensorSource& source) {
  for (const auto& [key, x] : experts_) {
    const std::vector<TensorSpec> specs = ExpertTensors(config, key.first, key.second);
    uint8_t* block = base_ + block_offset_.at(key);
    uint64_t end = 0;
    for (size_t i = 0; i < specs.size() && i < 3; ++i) {
      ODMOE_ASSIGN_OR_RETURN(SourceTensor t, source.Read(specs[i]));
      if (t.dtype != x.dtypes[i] || x.offsets[i] + t.nbytes > x.copy_bytes) {
        return absl::InternalError(StrCat("expert store: tensor ", specs[i].name, " changed size or dtype"));
      }
      std::memset(block + end, 0, x.offsets[i] - end);  // padding
      std::memcpy(block + x.offsets[i], t.data, t.nbytes);
      end = x.offsets[i] + t.nbytes;
    }
    std::memset(block + end, 0, x.block_bytes - end);
  }
  return absl::OkStatus();
}

absl::Status ExpertStore::OpenPrivate(const ModelConfig& config, TensorSource& source) {
  shared_ = false;
  packed_here_ = true;
  if (size_ == 0) return absl::OkStatus();
  void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Errno("mmap (anonymous) of the expert store for", StrCat(size_, " bytes"));
  base_ = static_cast<uint8_t*>(p);
  return Fill(config, source);
}

absl::Status ExpertStore::TryOpenShared(const ModelConfig& config, TensorSource& source,
                                        const ExpertStoreOptions& /*options*/, bool* retry, bool* foreign) {
  *retry = false;
  *foreign = false;
  const int fd = open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", lock_path_);
  auto give_up = [&]() {
    close(fd);
    *retry = true;
    return absl::OkStatus();
  };

  if (OfdLock(fd, F_WRLCK, /*wait=*/false) == 0) {
    if (!SameFile(fd, lock_path_)) return give_up();
    // Nobody holds the segment: whatever is there is a leftover.
    if (unlink(segment_path_.c_str()) == 0) {
      spdlog::warn("expert store: removed the leftover segment {} (its holders are gone)", segment_path_);
    }
    const int seg = open(segment_path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (seg < 0) {
      const absl::Status s = Errno("create", segment_path_);
      close(fd);
      return s;
    }
    auto fail = [&](absl::Status s) {
      if (base_ != nullptr) munmap(base_, size_);
      base_ = nullptr;
      close(seg);
      unlink(segment_path_.c_str());
      unlink(lock_path_.c_str());
      close(fd);
      return s;
    };
    // Reserve the bytes now (tmpfs allocates on write, and a full /dev/shm would otherwise be a SIGBUS
    // half-way through the fill): a full one is an error here, and the store falls back to private memory.
    if (const int err = posix_fallocate(seg, 0, static_cast<off_t>(size_)); err != 0) {
      errno = err;
      return fail(Errno(StrCat("reserve ", size_, " bytes for"), segment_path_));
    }
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, seg, 0);
    if (p == MAP_FAILED) return fail(Errno("mmap", segment_path_));
    base_ = static_cast<uint8_t*>(p);
    const absl::Status filled = Fill(config, source);
    if (!filled.ok()) return fail(filled);
    auto* header = reinterpret_cast<SegmentHeader*>(base_);
    header->version = kVersion;
    header->layout_hash = layout_hash_;
    header->total_bytes = size_;
    header->experts = experts_.size();
    header->creator_pid = static_cast<uint64_t>(getpid());
    __atomic_store_n(&header->magic, kReadyMagic, __ATOMIC_RELEASE);
    close(seg);
    mprotect(base_, size_, PROT_READ);
    // Exclusive to shared, atomically (a record lock conversion): waiters may now map it.
    if (OfdLock(fd, F_RDLCK, /*wait=*/false) != 0) return fail(Errno("lock (shared)", lock_path_));
    lock_fd_ = fd;
    shared_ = true;
    packed_here_ = true;
    return absl::OkStatus();
  }

  // Someone holds it: wait until the creator (if that is who) is done.
  if (const int err = OfdLock(fd, F_RDLCK, /*wait=*/true); err != 0) {
    errno = err;
    const absl::Status s = Errno("lock (shared)", lock_path_);
    close(fd);
    return s;
  }
  if (!SameFile(fd, lock_path_)) return give_up();
  const int seg = open(segment_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (seg < 0) return give_up();  // the creator failed and removed it
  struct stat st;
  if (fstat(seg, &st) != 0 || static_cast<uint64_t>(st.st_size) < kHeaderBytes) {
    close(seg);
    return give_up();  // half-written
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, file_size, PROT_READ, MAP_SHARED, seg, 0);
  close(seg);
  if (p == MAP_FAILED) return give_up();
  const auto* header = static_cast<const SegmentHeader*>(p);
  const bool ready = __atomic_load_n(&header->magic, __ATOMIC_ACQUIRE) == kReadyMagic;
  if (!ready || header->version != kVersion || header->layout_hash != layout_hash_ || header->total_bytes != size_ ||
      file_size != size_) {
    *foreign = ready;  // complete but of another layout: in use by another version
    munmap(p, file_size);
    return give_up();
  }
  base_ = static_cast<uint8_t*>(p);
  lock_fd_ = fd;
  shared_ = true;
  packed_here_ = false;
  return absl::OkStatus();
}

void ExpertStore::Unmap() {
  if (device_ != nullptr && base_ != nullptr) device_->UnregisterHostMemory(base_);
  device_ = nullptr;
  pinned_bytes_ = 0;
  if (base_ != nullptr) munmap(base_, size_);
  base_ = nullptr;
}

ExpertStore::~ExpertStore() {
  Unmap();
  if (lock_fd_ >= 0) {
    // The last holder (the only one that can lock exclusively) removes the segment, then the lock file.
    if (OfdLock(lock_fd_, F_WRLCK, /*wait=*/false) == 0 && SameFile(lock_fd_, lock_path_)) {
      unlink(segment_path_.c_str());
      unlink(lock_path_.c_str());
    }
    close(lock_fd_);
  }
}

const ExpertStore::Expert* ExpertStore::Find(int64_t layer, int64_t e) const {
  auto it = experts_.find({layer, e});
  return it == experts_.end() ? nullptr : &it->second;
}

}  // namespace odmoe
