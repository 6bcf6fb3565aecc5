// Checked mode: kernel files compiled with -fsanitize=thread (and TSan's runtime not linked) call the
// __tsan_read*/__tsan_write* functions below for every load and store. Each access is checked for
//   - out-of-bounds and use-after-free, relative to the device allocations of runtime.cc (and their guard pages);
//   - misalignment (an N-byte access at an address not a multiple of N);
//   - reads of static or dynamic shared memory not written earlier in the same block;
//   - data races: two accesses to the same byte by different threads, at least one a write, not both atomic, and
//     not ordered by happens-before. Orders known here: program order; __syncthreads (every thread of the block);
//     warp collectives (the lanes that met); nothing between blocks (they run concurrently on the hardware).
//     Global memory is tracked for one launch (launches on a stream are ordered), shared memory for one block.
// Each report names the kernel, block, thread and both accesses' file:line (from the debug information).
// Accesses to memory that is neither device memory nor shared memory (the stack, host memory) are not checked.
// Apart from the checks, read-only loads (__ldg, NoteReadOnlyLoad) are grouped into warp requests for the counts
// of simt/counters.h's LoadRequests.
//
// Shadow memory. Every device allocation a checked kernel touches, and every shared region, gets a flat shadow
// (one mapping, MAP_NORESERVE, so only the pages behind touched memory cost anything): one Granule per 8 bytes.
// A granule remembers up to kSlots accesses (who, where in the block's order of barriers and warp meetings,
// which of its 8 bytes, read or write, atomic or not) and, for shared memory, which bytes this block wrote. A
// granule stamped with an older launch (global memory) or block (shared memory) counts as empty, so nothing is
// cleared between launches or blocks. What an access makes obsolete is dropped: a write supersedes every earlier
// access to its bytes, a read the same thread's earlier read; an access that adds nothing to a slot the same
// thread already holds at the same point of the block's order is skipped without a check (it would find exactly
// what that slot found).
// Precision: per granule at most kSlots (4) accesses are remembered. Needing a fifth, the checker forgets a read
// (round robin) before it forgets a write. So a race with a forgotten read goes unreported when the 4 remembered
// accesses do not race with it too: a write racing with 5+ unordered reads of other threads is still found
// through the reads remembered, but e.g. one forgotten reader among threads ordered with the writer is not. The
// per-byte write record of shared memory (for reads of unwritten bytes) is exact.
// Happens-before through warp collectives is pairwise (lanes a and b met after the access), not transitive
// through a third lane: such an order is missed and reported as a race (none of our kernels relies on it).
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "src/internal.h"

namespace simt::detail {

bool checked_mode = false;

namespace {

constexpr unsigned kSlots = 4;
constexpr uintptr_t kGranule = 8;
constexpr int kMaxReportsPerLaunch = 20;
constexpr unsigned kNoThread = ~0u;

// Slot::flags
constexpr uint8_t kWrite = 1;
constexpr uint8_t kAtomic = 2;
constexpr uint8_t kAtomicSite = 4;  // `site` is an AtomicSite* (atomics are not instrumented: no pc)

// An atomic's call site, interned (its address is a Slot's site).
struct AtomicSite {
  const char* file;
  int line;
};

// One remembered access to some bytes of a granule.
struct Slot {
  uint64_t site;     // the access's return address (pc), or an AtomicSite* with kAtomicSite
  uint32_t block;    // linear block index in the launch
  uint32_t barrier;  // the block's __syncthreads count at the access
  uint32_t meet;     // the warp-meeting clock at the access
  uint16_t thread;   // linear thread index in the block
  uint8_t mask;      // which of the granule's 8 bytes; 0: the slot is free
  uint8_t flags;
};
static_assert(sizeof(Slot) == 24);

struct Granule {
  uint32_t epoch;       // the launch (global) or block (shared) the slots and `written` belong to; 0: never
  uint8_t written;      // shared memory: the bytes written in this block
  uint8_t next_victim;  // round-robin start when every slot is taken
  uint16_t unused;
  Slot slots[kSlots];
};
static_assert(sizeof(Granule) == 104);

// The shadow of [lo, lo + bytes): a granule per 8 bytes from lo rounded down. Memory that is zero (never touched)
// reads as epoch 0, empty.
class Shadow {
 public:
  Shadow(uintptr_t lo, size_t bytes) : base_(lo & ~(kGranule - 1)) {
    const size_t granules = (lo + bytes - base_ + kGranule - 1) / kGranule;
    map_bytes_ = granules * sizeof(Granule);
    void* m = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "simt: cannot map %zu bytes of shadow memory for %zu bytes at 0x%" PRIxPTR "\n", map_bytes_,
                   bytes, lo);
      std::abort();
    }
    granules_ = static_cast<Granule*>(m);
    end_ = base_ + granules * kGranule;
  }
  ~Shadow() { munmap(granules_, map_bytes_); }
  Shadow(const Shadow&) = delete;
  Shadow& operator=(const Shadow&) = delete;

  // Whether [lo, lo + bytes) is covered.
  bool Covers(uintptr_t lo, size_t bytes) const { return lo >= base_ && lo + bytes <= end_; }
  Granule& At(uintptr_t granule_address) { return granules_[(granule_address - base_) / kGranule]; }

 private:
  uintptr_t base_;
  uintptr_t end_ = 0;
  size_t map_bytes_ = 0;
  Granule* granules_ = nullptr;
};

// An address range of global memory already classified: a live device allocation with its shadow, or a gap between
// device mappings (shadow null: nothing there is checked).
struct Region {
  uintptr_t lo = 0;
  uintptr_t hi = 0;  // an access [a, a + n) with lo <= a and a + n <= hi is inside
  Shadow* shadow = nullptr;
};
constexpr size_t kRegionCache = 8;

struct SharedRegion {
  uintptr_t lo;
  size_t bytes;
  size_t redzone;  // bytes after the region that are no one's: an access there is out of bounds
  const char* name;
  Shadow* shadow;
};

// The access being checked.
struct Now {
  uint64_t site;
  uint32_t block;
  uint32_t barrier;
  uint32_t meet;
  uint16_t thread;
  uint8_t flags;
};

struct State {
  bool active = false;  // inside a launch
  uint32_t launch_epoch = 0;
  uint32_t block_epoch = 0;
  uint32_t block = 0;
  uint32_t barrier = 0;
  uint32_t meet_clock = 0;  // increments at every completed collective; never reset within a block
  unsigned threads = 0;     // in the block
  // The meet clock when lanes a and b of warp w last met: pair_meet[(w * 32 + a) * 32 + b]; when all lanes of w
  // present met: full_meet[w]. Entries from earlier blocks are below every clock value of this block.
  std::vector<uint32_t> pair_meet;
  std::vector<uint32_t> full_meet;

  std::vector<SharedRegion> shared;   // this block's
  uintptr_t shared_lo = UINTPTR_MAX;  // bounds of every shared region (and redzone)
  uintptr_t shared_hi = 0;
  std::map<uintptr_t, std::unique_ptr<Shadow>> shared_shadows;  // by region start, kept across blocks

  Region last_region;  // the last hit, tried first
  Region regions[kRegionCache];
  size_t next_region = 0;
  std::map<uintptr_t, std::unique_ptr<Shadow>> device_shadows;  // by allocation base, until cudaFree

  std::map<std::pair<const char*, int>, std::unique_ptr<AtomicSite>> atomic_sites;
  std::set<std::tuple<int, uint64_t, uint64_t>> reported;
  int reports = 0;

  // The launch's traffic to device allocations (simt/counters.h): totals, and the bytes written per allocation
  // (the allocation being written now kept apart, so a run of stores into one buffer costs no map lookup).
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uintptr_t write_base = 0;
  uint64_t write_base_bytes = 0;
  std::map<uintptr_t, uint64_t> writes;

  // Read-only loads as warp requests (LoadRequests in simt/counters.h). A call site's id is its index in
  // ldg_sites (kept for the run); ldg_executions[site][thread]: how many times the thread ran it in this block;
  // ldg_pending: each request of this block (key: execution << 24 | site << 8 | warp: a block's 32 warps, and
  // fewer than 2^16 call sites) and the sectors its lanes touched, reduced into ldg_launch when the block ends.
  std::map<std::pair<const char*, int>, uint32_t> ldg_sites;
  std::pair<const char*, int> ldg_last_site{nullptr, 0};
  uint32_t ldg_last_id = 0;
  std::vector<std::vector<uint32_t>> ldg_executions;
  std::unordered_map<uint64_t, std::vector<uint64_t>> ldg_pending;
  LoadRequests ldg_launch;
};
State st;

void FlushWriteBase() {
  if (st.write_base_bytes != 0) st.writes[st.write_base] += st.write_base_bytes;
  st.write_base_bytes = 0;
}

std::string Where(const void* pc) {
  if (pc == nullptr) return "?";
  Dl_info info;
  if (dladdr(pc, &info) == 0 || info.dli_fname == nullptr) return "?";
  // The return address is after the call: step back one byte to stay within the access's line.
  const uintptr_t offset = reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(info.dli_fbase) - 1;
  char cmd[1024];
  std::snprintf(cmd, sizeof cmd, "addr2line -e '%s' -i 0x%" PRIxPTR " 2>/dev/null", info.dli_fname, offset);
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char line[512];
    // With -i, the first line is the innermost inlined frame: the access itself.
    if (std::fgets(line, sizeof line, p)) out = line;
    pclose(p);
  }
  if (const size_t d = out.find(" (discriminator"); d != std::string::npos) out.resize(d);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  if (out.empty() || out[0] == '?') {
    char b[64];
    std::snprintf(b, sizeof b, "pc 0x%" PRIxPTR, offset);
    return b;
  }
  return out;
}

std::string Dim(uint32_t linear, dim3 d) {
  return "(" + std::to_string(linear % d.x) + "," + std::to_string(linear / d.x % d.y) + "," +
         std::to_string(linear / (d.x * d.y)) + ")";
}

std::string Describe(uint8_t flags, uint64_t site, uint32_t block, uint32_t thread, size_t bytes) {
  std::string s = flags & kAtomic ? "atomic " : "";
  s += flags & kWrite ? "write" : "read";
  s += " of " + std::to_string(bytes) + " bytes by block " + Dim(block, tls_grid_dim) + " thread " +
       Dim(thread, tls_block_dim) + " at ";
  if (flags & kAtomicSite) {
    const auto* a = reinterpret_cast<const AtomicSite*>(site);
    s += std::string(a->file) + ":" + std::to_string(a->line);
  } else {
    s += Where(reinterpret_cast<const void*>(site));
  }
  return s;
}
std::string Describe(const Now& n, size_t bytes) { return Describe(n.flags, n.site, n.block, n.thread, bytes); }

// Reports once per (kind, sites) and at most kMaxReportsPerLaunch times per launch. The message is built only
// then: naming file:line runs addr2line.
template <typename MakeMessage>
void Flag(ErrorKind kind, uint64_t site, uint64_t other_site, MakeMessage make_message) {
  if (st.reports >= kMaxReportsPerLaunch) return;
  if (!st.reported.emplace(static_cast<int>(kind), site, other_site).second) return;
  ++st.reports;
  Raise(kind, make_message());
}

std::string Hex(uintptr_t p) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%" PRIxPTR, p);
  return b;
}

// Whether `earlier`, an access of another thread, happens before `now`.
bool Ordered(const Slot& earlier, const Now& now) {
  if (earlier.block != now.block) return false;
  if (earlier.barrier < now.barrier) return true;
  const unsigned warp = earlier.thread / 32u;
  if (warp != now.thread / 32u) return false;
  if (st.full_meet[warp] > earlier.meet) return true;
  return st.pair_meet[(warp * 32u + earlier.thread % 32u) * 32u + now.thread % 32u] > earlier.meet;
}

// Whether a slot `held` of the same thread at the same point of the block's order makes an access with `flags`
// redundant: any access that conflicts with the new one conflicts with `held` as well.
bool Subsumes(uint8_t held, uint8_t flags) {
  constexpr uint8_t kKind = kWrite | kAtomic;
  return (held & kKind) == (flags & kKind) || (held & kKind) == kWrite;
}

void CheckGranule(Granule& g, uint8_t mask, const Now& now, uintptr_t granule_address, size_t bytes, bool shared) {
  const bool write = now.flags & kWrite;
  int extend = -1;  // this thread's slot at the same point of the block's order, same site and kind
  for (unsigned i = 0; i < kSlots; ++i) {
    const Slot& s = g.slots[i];
    if (s.mask == 0 || s.thread != now.thread || s.block != now.block || s.barrier != now.barrier ||
        s.meet != now.meet) {
      continue;
    }
    if ((s.mask & mask) == mask && Subsumes(s.flags, now.flags)) return;
    if (s.site == now.site && s.flags == now.flags) extend = static_cast<int>(i);
  }
  int free_slot = -1;
  for (unsigned i = 0; i < kSlots; ++i) {
    Slot& s = g.slots[i];
    const uint8_t overlap = s.mask & mask;
    if (overlap == 0) {
      if (s.mask == 0 && free_slot < 0) free_slot = static_cast<int>(i);
      continue;
    }
    const bool same_thread = s.thread == now.thread && s.block == now.block;
    if (!same_thread && ((s.flags | now.flags) & kWrite) && !(s.flags & now.flags & kAtomic) && !Ordered(s, now)) {
      const Slot other = s;
      Flag(ErrorKind::kRace, now.site, other.site, [&] {
        return std::string(shared ? "shared" : "global") + " memory at " +
               Hex(granule_address + static_cast<uintptr_t>(__builtin_ctz(overlap))) + ": " + Describe(now, bytes) +
               " races with the earlier " + Describe(other.flags, other.site, other.block, other.thread, bytes);
      });
    }
    if (write || (same_thread && !(s.flags & kWrite))) {
      s.mask &= static_cast<uint8_t>(~mask);
      if (s.mask == 0 && free_slot < 0) free_slot = static_cast<int>(i);
    }
  }
  if (free_slot < 0) {
    // Every slot is taken: extend this thread's identical access, else forget a read, else a write.
    if (extend >= 0) {
      g.slots[extend].mask |= mask;
      return;
    }
    for (unsigned k = 0; k < kSlots && free_slot < 0; ++k) {
      const unsigned i = (g.next_victim + k) % kSlots;
      if (!(g.slots[i].flags & kWrite)) free_slot = static_cast<int>(i);
    }
    if (free_slot < 0) free_slot = g.next_victim % kSlots;
    g.next_victim = static_cast<uint8_t>((free_slot + 1) % kSlots);
  }
  g.slots[free_slot] = Slot{now.site, now.block, now.barrier, now.meet, now.thread, mask, now.flags};
}

const SharedRegion* FindShared(uintptr_t a) {
  for (const SharedRegion& r : st.shared) {
    if (a >= r.lo && a < r.lo + r.bytes + r.redzone) return &r;
  }
  return nullptr;
}

Shadow* SharedShadow(uintptr_t lo, size_t bytes) {
  std::unique_ptr<Shadow>& s = st.shared_shadows[lo];
  if (!s || !s->Covers(lo, bytes)) s = std::make_unique<Shadow>(lo, bytes);
  return s.get();
}

void AddShared(uintptr_t lo, size_t bytes, size_t redzone, const char* name) {
  for (auto it = st.shared.begin(); it != st.shared.end(); ++it) {
    if (it->lo == lo) {
      st.shared.erase(it);
      break;
    }
  }
  st.shared.push_back(SharedRegion{lo, bytes, redzone, name, bytes ? SharedShadow(lo, bytes) : nullptr});
  st.shared_lo = std::min(st.shared_lo, lo);
  st.shared_hi = std::max(st.shared_hi, lo + bytes + redzone);
}

void FlushRegions() {
  st.last_region = Region{};
  for (Region& r : st.regions) r = Region{};
}

// The shadow of the device allocation wholly holding [a, a + bytes), or null: not device memory (nothing to check)
// or a bad access (reported here).
Shadow* FindGlobal(uintptr_t a, size_t bytes, const Now& now) {
  if (a >= st.last_region.lo && a + bytes <= st.last_region.hi) return st.last_region.shadow;
  for (const Region& r : st.regions) {
    if (a >= r.lo && a + bytes <= r.hi) {
      st.last_region = r;
      return r.shadow;
    }
  }
  const void* addr = reinterpret_cast<const void*>(a);
  const AllocationView v = FindAllocation(addr, bytes);
  Region region;
  switch (v.status) {
    case AllocationView::Status::kNone:
      region = Region{v.gap_lo, v.gap_hi, nullptr};
      break;
    case AllocationView::Status::kFreed:
      Flag(ErrorKind::kUseAfterFree, now.site, 0,
           [&] { return Describe(now, bytes) + " touches freed device memory " + Hex(a); });
      return nullptr;
    case AllocationView::Status::kOutOfBounds: {
      const long long off = static_cast<long long>(a - reinterpret_cast<uintptr_t>(v.base));
      Flag(ErrorKind::kOutOfBounds, now.site, 0, [&] {
        return Describe(now, bytes) + " at offset " + std::to_string(off) + " of a device allocation of " +
               std::to_string(v.size) + " bytes";
      });
      return nullptr;
    }
    case AllocationView::Status::kInside: {
      const uintptr_t base = reinterpret_cast<uintptr_t>(v.base);
      std::unique_ptr<Shadow>& s = st.device_shadows[base];
      if (!s) s = std::make_unique<Shadow>(base, v.size);
      region = Region{base, base + v.size, s.get()};
      break;
    }
  }
  st.regions[st.next_region] = region;
  st.last_region = region;
  st.next_region = (st.next_region + 1) % kRegionCache;
  return region.shadow;
}

void OnAccess(const void* addr, size_t bytes, uint8_t flags, uint64_t site, bool unaligned_ok) {
  if (!st.active) return;
  const RunningFiber& fiber = running_fiber;
  if (fiber.linear == kNoThread || bytes == 0) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  if (a - fiber.stack_lo < fiber.stack_bytes) return;  // the thread's own stack
  const Now now{site, st.block, st.barrier, st.meet_clock, static_cast<uint16_t>(fiber.linear), flags};
  Shadow* shadow = nullptr;
  const SharedRegion* shared = nullptr;
  if (a >= st.shared_lo && a < st.shared_hi) shared = FindShared(a);
  if (shared != nullptr) {
    if (a + bytes > shared->lo + shared->bytes) {
      Flag(ErrorKind::kOutOfBounds, site, 0, [&] {
        return Describe(now, bytes) + " runs past the end of shared memory '" + shared->name + "' (" +
               std::to_string(shared->bytes) + " bytes) at offset " + std::to_string(a - shared->lo);
      });
      return;
    }
    shadow = shared->shadow;
  } else {
    shadow = FindGlobal(a, bytes, now);
    if (shadow == nullptr) return;
    // FindGlobal left the allocation's region in last_region.
    if (flags & kWrite) {
      st.bytes_written += bytes;
      if (st.last_region.lo != st.write_base) {
        FlushWriteBase();
        st.write_base = st.last_region.lo;
      }
      st.write_base_bytes += bytes;
    } else {
      st.bytes_read += bytes;
    }
  }
  // Sizes checked for alignment are powers of two (the instrumentation's 1 to 16, atomics' operands).
  if (!unaligned_ok && (a & (bytes - 1)) != 0) {
    Flag(ErrorKind::kMisaligned, site, 0,
         [&] { return Describe(now, bytes) + " at the misaligned address " + Hex(a); });
  }
  const uint32_t epoch = shared ? st.block_epoch : st.launch_epoch;
  const uintptr_t end = a + bytes;
  for (uintptr_t ga = a & ~(kGranule - 1); ga < end; ga += kGranule) {
    const uintptr_t lo = std::max(ga, a);
    const uintptr_t hi = std::min(ga + kGranule, end);
    const uint8_t mask = static_cast<uint8_t>(((1u << (hi - lo)) - 1) << (lo - ga));
    Granule& g = shadow->At(ga);
    bool fresh = false;
    if (g.epoch != epoch) {
      g.epoch = epoch;
      g.written = 0;
      for (Slot& s : g.slots) s.mask = 0;
      fresh = true;
    }
    if (shared) {
      if (flags & kWrite) {
        g.written |= mask;
      } else if ((g.written & mask) != mask) {
        Flag(ErrorKind::kUninitShared, site, 0, [&] {
          return Describe(now, bytes) + " of shared variable '" + shared->name + "' at offset " +
                 std::to_string(a - shared->lo) + ", never written in this block";
        });
      }
    }
    if (fresh) {
      // First access to the granule in this launch or block: nothing to check against.
      g.slots[0] = Slot{now.site, now.block, now.barrier, now.meet, now.thread, mask, now.flags};
      continue;
    }
    CheckGranule(g, mask, now, ga, bytes, shared != nullptr);
  }
}

// Reduces this block's requests into the launch's counts.
void FlushLoadRequests() {
  for (auto& [key, sectors] : st.ldg_pending) {
    std::sort(sectors.begin(), sectors.end());
    sectors.erase(std::unique(sectors.begin(), sectors.end()), sectors.end());
    uint64_t lines = 0;
    for (size_t i = 0; i < sectors.size(); ++i) lines += i == 0 || sectors[i] / 4 != sectors[i - 1] / 4;
    ++st.ldg_launch.requests;
    st.ldg_launch.sectors += sectors.size();
    st.ldg_launch.lines += lines;
  }
  st.ldg_pending.clear();
  for (std::vector<uint32_t>& e : st.ldg_executions) e.assign(e.size(), 0);
}

}  // namespace

void NoteReadOnlyLoad(const void* p, size_t bytes, const char* file, int line) {
  if (!st.active || bytes == 0) return;
  const unsigned thread = running_fiber.linear;
  if (thread == kNoThread) return;
  const std::pair<const char*, int> site{file, line};
  if (site != st.ldg_last_site) {
    const auto [it, added] = st.ldg_sites.emplace(site, static_cast<uint32_t>(st.ldg_sites.size()));
    if (added) st.ldg_executions.emplace_back();
    st.ldg_last_site = site;
    st.ldg_last_id = it->second;
  }
  std::vector<uint32_t>& executions = st.ldg_executions[st.ldg_last_id];
  if (executions.size() < st.threads) executions.resize(st.threads, 0);
  const uint64_t n = executions[thread]++;
  const uint64_t key = n << 24 | static_cast<uint64_t>(st.ldg_last_id & 0xffff) << 8 | (thread / 32);
  std::vector<uint64_t>& sectors = st.ldg_pending[key];
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t s = a / 32; s <= (a + bytes - 1) / 32; ++s) sectors.push_back(s);
  st.ldg_launch.bytes += bytes;
}

void OnKernelStart(const LaunchSite&) {
  if (!checked_mode) return;
  st.active = true;
  ++st.launch_epoch;
  st.block = 0;
  st.reported.clear();
  st.reports = 0;
  st.bytes_read = 0;
  st.bytes_written = 0;
  st.write_base_bytes = 0;
  st.writes.clear();
  st.ldg_launch = LoadRequests{};
}

void OnKernelEnd() {
  st.active = false;
  if (!checked_mode) return;
  FlushWriteBase();
  FlushLoadRequests();
  LaunchAccesses accesses;
  accesses.bytes_read = st.bytes_read;
  accesses.bytes_written = st.bytes_written;
  accesses.ldg = st.ldg_launch;
  for (const auto& [base, bytes] : st.writes) accesses.writes.emplace_back(reinterpret_cast<const void*>(base), bytes);
  CountKernelAccesses(accesses);
}

void OnBlockStart(void* dynamic_shared, size_t bytes, size_t redzone) {
  if (!checked_mode) return;
  FlushLoadRequests();
  st.block = tls_block_idx.x + tls_block_idx.y * tls_grid_dim.x + tls_block_idx.z * tls_grid_dim.x * tls_grid_dim.y;
  ++st.block_epoch;
  st.barrier = 0;
  st.threads = tls_block_dim.x * tls_block_dim.y * tls_block_dim.z;
  const size_t warps = (st.threads + 31) / 32;
  if (st.meet_clock > (1u << 31)) {
    // Far from wrapping: start over (entries of earlier blocks would otherwise compare wrongly).
    st.meet_clock = 0;
    st.pair_meet.assign(st.pair_meet.size(), 0);
    st.full_meet.assign(st.full_meet.size(), 0);
  }
  if (st.full_meet.size() < warps) {
    st.full_meet.resize(warps, 0);
    st.pair_meet.resize(warps * 32 * 32, 0);
  }
  // Static shared variables re-register as the block reaches them; the dynamic area is this launch's.
  st.shared.clear();
  st.shared_lo = UINTPTR_MAX;
  st.shared_hi = 0;
  AddShared(reinterpret_cast<uintptr_t>(dynamic_shared), bytes, redzone, "extern __shared__");
}

void OnSharedBlockStart(void* p, size_t bytes, const char* name) {
  if (!checked_mode) return;
  AddShared(reinterpret_cast<uintptr_t>(p), bytes, 0, name);
}

void OnBlockBarrier() { ++st.barrier; }

void OnWarpSync(unsigned warp, unsigned lanes) {
  // Called once per completed collective, before any of its lanes goes on.
  if (!checked_mode) return;
  const uint32_t clock = ++st.meet_clock;
  const unsigned first = warp * 32;
  const unsigned present = st.threads - first >= 32 ? 0xffffffffu : (1u << (st.threads - first)) - 1;
  if (lanes == present) {
    st.full_meet[warp] = clock;
    return;
  }
  for (unsigned a = 0; a < 32; ++a) {
    if (!(lanes >> a & 1)) continue;
    for (unsigned b = 0; b < 32; ++b) {
      if (lanes >> b & 1) st.pair_meet[(first + a) * 32 + b] = clock;
    }
  }
}

void OnDeviceMemoryChanged(const void* freed) {
  FlushRegions();
  if (freed != nullptr) st.device_shadows.erase(reinterpret_cast<uintptr_t>(freed));
}

void ReportMisaligned(const void* p, size_t bytes, const char* file, int line) {
  Raise(ErrorKind::kMisaligned, "load of " + std::to_string(bytes) + " bytes by " + CurrentThreadName() + " at " +
                                    file + ":" + std::to_string(line) + " from the misaligned address " +
                                    Hex(reinterpret_cast<uintptr_t>(p)));
}

void NoteAtomic(const void* p, size_t bytes, const char* file, int line) {
  if (!st.active) return;
  std::unique_ptr<AtomicSite>& site = st.atomic_sites[{file, line}];
  if (!site) site = std::make_unique<AtomicSite>(AtomicSite{file, line});
  OnAccess(p, bytes, kWrite | kAtomic | kAtomicSite, reinterpret_cast<uint64_t>(site.get()), /*unaligned_ok=*/false);
}

}  // namespace simt::detail

// The ThreadSanitizer instrumentation's entry points (the runtime itself is not linked).
namespace {
constexpr uint8_t kRead = 0;
constexpr uint8_t kWrite = 1;
inline uint64_t Pc(const void* pc) { return reinterpret_cast<uint64_t>(pc); }
}  // namespace
using simt::detail::OnAccess;
extern "C" {
void __tsan_init() { simt::detail::checked_mode = true; }
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_ignore_thread_begin() {}
void __tsan_ignore_thread_end() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
#define SIMT_TSAN_ACCESS(n)                                                                                  \
  void __tsan_read##n(void* p) { OnAccess(p, n, kRead, Pc(__builtin_return_address(0)), false); }            \
  void __tsan_write##n(void* p) { OnAccess(p, n, kWrite, Pc(__builtin_return_address(0)), false); }          \
  void __tsan_unaligned_read##n(void* p) { OnAccess(p, n, kRead, Pc(__builtin_return_address(0)), true); }   \
  void __tsan_unaligned_write##n(void* p) { OnAccess(p, n, kWrite, Pc(__builtin_return_address(0)), true); } \
  void __tsan_volatile_read##n(void* p) { OnAccess(p, n, kRead, Pc(__builtin_return_address(0)), false); }   \
  void __tsan_volatile_write##n(void* p) { OnAccess(p, n, kWrite, Pc(__builtin_return_address(0)), false); } \
  void __tsan_read##n##_pc(void* p, void* pc) { OnAccess(p, n, kRead, Pc(pc), false); }                      \
  void __tsan_write##n##_pc(void* p, void* pc) { OnAccess(p, n, kWrite, Pc(pc), false); }
SIMT_TSAN_ACCESS(1)
SIMT_TSAN_ACCESS(2)
SIMT_TSAN_ACCESS(4)
SIMT_TSAN_ACCESS(8)
SIMT_TSAN_ACCESS(16)
#undef SIMT_TSAN_ACCESS
void __tsan_read_range(void* p, unsigned long n) { OnAccess(p, n, kRead, Pc(__builtin_return_address(0)), true); }
void __tsan_write_range(void* p, unsigned long n) { OnAccess(p, n, kWrite, Pc(__builtin_return_address(0)), true); }
}
