// ExpertStore: a worker's routed experts in host memory, each packed contiguously (gate, up, down at 256-byte
// aligned offsets inside one block) so that one CopyToDevice moves an expert, and registered with the device
// (pinned on CUDA) so the copy runs at the link's pinned speed (../shared/DESIGN.md, "A worker memory-maps the
// checkpoint and keeps pinned ...").
//
// Two modes:
//  - private: an anonymous mapping holding only the experts the worker serves (`served`).
//  - shared (the default): a file in `shm_dir` (/dev/shm: POSIX shared memory) named
//    odmoe-<cluster>-e<epoch>-<fingerprint[0:8]> holding the experts the host's workers serve together
//    (`shared_keys`, every routed expert when empty), in one fixed order (sparse layers ascending, experts
//    ascending), so every worker of a host computes the same layout and maps the same bytes read-only. The first worker creates and fills it; the others wait and map it.
//
// Shared segment protocol. A companion lock file (<segment>.lock) carries open-file-description locks
// (fcntl F_OFD_*, per open file, not per process, so two stores in one process exclude each other):
//  - opening: try the lock exclusively without waiting. Got it: nobody uses the segment, so any segment there
//    is a leftover (a crashed or killed holder): it is removed and rebuilt; the header's magic is written
//    last, then the lock is turned into a shared one (atomically). Did not get it: wait for a shared lock
//    (the creator holds it exclusively until the segment is complete), then map the segment and check its
//    header (magic, version, layout hash, size); a segment that fails the check (a creator died half-way)
//    is released and the whole step retried, which then rebuilds it. After any lock, the lock file's inode
//    is compared with the path's, so a lock on a file a departing holder has just unlinked is never trusted.
//    A segment another layout (another odmoe version) holds in use, so that it can be neither used nor
//    rebuilt, makes the store fall back to private mode after a few tries (with a warning).
//  - closing: the holder that can take the lock exclusively (without waiting) is the last: it removes the
//    segment, then the lock file. A holder that crashed releases its lock with its process, so the next
//    start (or the last remaining holder's exit) removes what it left.
//
// Experts not in the store (private mode: experts the worker does not serve) are the caller's business: it
// reads them from the weight source (slower, still correct).
//
// Thread safety: after Open, every method is const and may be called concurrently; the bytes are read-only.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/common/dtype.h"
#include "src/model/model_config.h"
#include "src/model/model_layout.h"
#include "src/model/tensor_source.h"

namespace odmoe {

struct ExpertStoreOptions {
  // (layer, expert) pairs to pack in private mode (any order; duplicates ignored).
  std::vector<std::pair<int64_t, int64_t>> served;
  // Shared mode: the experts the segment holds (the union of what the host's workers serve; any order,
  // duplicates ignored); empty: every routed expert of the model.
  std::vector<std::pair<int64_t, int64_t>> shared_keys;
  bool share = true;                 // false: private mode
  std::string shm_dir = "/dev/shm";  // where shared segments and their lock files live
  std::string segment_name;          // shared mode: the file name, e.g. odmoe-local-e1-0123abcd
  std::string fingerprint;           // the model's; part of the layout hash in the segment's header
};

class ExpertStore {
 public:
  // Offsets are 256-byte aligned (as cudaMalloc aligns), so a device allocation of `block_bytes` receives the
  // block with one copy of `copy_bytes` and every projection keeps its offset.
  static constexpr uint64_t kAlignment = 256;

  // One packed expert: projections in ExpertTensors order (gate, up, down).
  struct Expert {
    const uint8_t* data = nullptr;  // host memory, valid while the store lives
    uint64_t copy_bytes = 0;        // bytes from data to the end of the last projection
    uint64_t block_bytes = 0;       // copy_bytes rounded up to kAlignment: the device allocation
    uint64_t tensor_bytes = 0;      // the projections' bytes (no padding)
    std::array<uint64_t, 3> offsets{};
    std::array<DType, 3> dtypes{};
  };

  // Rounds `bytes` up to kAlignment.
  static uint64_t AlignUp(uint64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
  // The block layout of expert (layer, e) from its tensors' metadata (TensorSource::Meta; nothing is read):
  // offsets, dtypes and sizes set, `data` null. The one rule for where each projection sits, used by the store
  // and by whoever loads an expert from outside it.
  static absl::StatusOr<Expert> LayoutOf(const ModelConfig& config, const TensorSource& source, int64_t layer,
                                         int64_t e);

  // Packs (or maps) the experts. `source` gives each tensor's dtype and size, and its bytes (read only when
  // this store fills memory). `device` (nullable) gets the mapping registered; a refusal is logged and the
  // store stays unpinned. Errors: those of `source`; Internal for failed system calls (naming the file).
  static absl::StatusOr<std::unique_ptr<ExpertStore>> Open(const ModelConfig& config, TensorSource& source,
                                                           const ExpertStoreOptions& options, Device* device);
  ~ExpertStore();
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;

  // The packed expert (layer, e); nullptr when the store does not hold it.
  const Expert* Find(int64_t layer, int64_t e) const;
  // Bytes of host memory the store maps (header and padding included).
  uint64_t host_bytes() const { return size_; }
  // How many experts the store holds.
  int64_t experts() const { return static_cast<int64_t>(experts_.size()); }
  // True in shared mode (a segment mapped by every worker of the host).
  bool shared() const { return shared_; }
  // True when this store filled the memory (private mode, or the creator of the shared segment); false when it
  // mapped a segment another worker filled.
  bool packed_here() const { return packed_here_; }
  // Bytes registered with the device (0 when it refused or none was given).
  uint64_t pinned_bytes() const { return pinned_bytes_; }
  // The shared segment's path ("" in private mode).
  const std::string& segment_path() const { return segment_path_; }
  // Where the segment's lock file is ("" in private mode).
  const std::string& lock_path() const { return lock_path_; }

 private:
  ExpertStore() = default;

  // The layout of `keys` in order: every expert's block; total size into *total.
  absl::Status Plan(const ModelConfig& config, const std::vector<std::pair<int64_t, int64_t>>& keys,
                    const TensorSource& source, uint64_t* total);
  uint64_t LayoutHash(const std::string& fingerprint) const;
  // Copies every expert's tensors from `source` to base_ + offsets.
  absl::Status Fill(const ModelConfig& config, TensorSource& source);
  absl::Status OpenPrivate(const ModelConfig& config, TensorSource& source);
  // One attempt of the shared protocol. *retry: the caller should try again (released everything);
  // *foreign: the segment is in use with another layout.
  absl::Status TryOpenShared(const ModelConfig& config, TensorSource& source, const ExpertStoreOptions& options,
                             bool* retry, bool* foreign);
  void Unmap();

  std::map<std::pair<int64_t, int64_t>, Expert> experts_;  // data pointers set once mapped
  std::map<std::pair<int64_t, int64_t>, uint64_t> block_offset_;
  uint64_t size_ = 0;  // header + blocks
  uint8_t* base_ = nullptr;
  bool shared_ = false;
  bool packed_here_ = false;
  std::string segment_path_;
  std::string lock_path_;
  int lock_fd_ = -1;
  Device* device_ = nullptr;
  uint64_t pinned_bytes_ = 0;
  uint64_t layout_hash_ = 0;
};

}  // namespace odmoe
