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
#include <dlfcn.h>

#include <cinttypes>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "src/internal.h"

namespace simt::detail {

bool checked_mode = false;

namespace {

struct Access {
  uint32_t block = 0;    // linear block index in the launch
  uint32_t thread = 0;   // linear thread index in the block
  uint32_t barrier = 0;  // the block's __syncthreads count when it happened
  uint64_t meet = 0;     // the warp-meeting clock when it happened
  const void* pc = nullptr;
  const char* file = nullptr;  // atomics: the call site (they are not instrumented)
  int line = 0;
  bool write = false;
  bool atomic = false;
};

struct Cell {
  bool written = false;
  Access last_write;
  std::vector<Access> reads;  // since the last write, one per thread, at most kMaxReads
};
constexpr size_t kMaxReads = 8;
constexpr int kMaxReportsPerLaunch = 20;

struct State {
  bool active = false;  // inside a launch
  const LaunchSite* site = nullptr;
  uint32_t block = 0;
  uint32_t barrier = 0;
  uint64_t meet_clock = 0;
  std::vector<uint64_t> last_meet;  // [warp][lane][lane]: the meet clock when two lanes last met
  struct SharedRegion {
    size_t bytes;
    size_t redzone;  // bytes after the region that are no one's: an access there is out of bounds
    const char* name;
  };
  std::map<const char*, SharedRegion> shared;  // by base address
  std::unordered_map<uintptr_t, Cell> global_cells;
  std::unordered_map<uintptr_t, Cell> shared_cells;
  std::set<std::string> reported;
  int reports = 0;
};
State st;

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

std::string Describe(const Access& a, size_t bytes) {
  std::string s = a.atomic ? "atomic " : "";
  s += a.write ? "write" : "read";
  s += " of " + std::to_string(bytes) + " bytes by block " + Dim(a.block, tls_grid_dim) + " thread " +
       Dim(a.thread, tls_block_dim);
  if (a.file)
    s += " at " + std::string(a.file) + ":" + std::to_string(a.line);
  else
    s += " at " + Where(a.pc);
  return s;
}

// Reports once per (kind, key) and at most kMaxReportsPerLaunch times per launch. The message is built only
// then: naming file:line runs addr2line.
template <typename MakeMessage>
void Flag(ErrorKind kind, const std::string& key, MakeMessage make_message) {
  if (st.reports >= kMaxReportsPerLaunch) return;
  if (!st.reported.insert(std::to_string(static_cast<int>(kind)) + key).second) return;
  ++st.reports;
  Raise(kind, make_message());
}

std::string Hex(const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", p);
  return b;
}

// Whether `earlier` happens before an access by the current thread now.
bool Ordered(const Access& earlier, const Access& now) {
  if (earlier.block != now.block) return false;
  if (earlier.thread == now.thread) return true;
  if (earlier.barrier < now.barrier) return true;
  const unsigned wa = earlier.thread / 32, wb = now.thread / 32;
  if (wa != wb) return false;
  const size_t idx = (static_cast<size_t>(wa) * 32 + earlier.thread % 32) * 32 + now.thread % 32;
  return idx < st.last_meet.size() && st.last_meet[idx] > earlier.meet;
}

void CheckRace(Cell& cell, const Access& now, uintptr_t byte, size_t bytes, bool shared) {
  auto race = [&](const Access& other) {
    if (other.atomic && now.atomic) return;
    if (Ordered(other, now)) return;
    Flag(ErrorKind::kRace, Hex(other.pc) + Hex(now.pc) + (now.file ? now.file : "") + std::to_string(now.line), [&] {
      return std::string(shared ? "shared" : "global") + " memory at " + Hex(reinterpret_cast<void*>(byte)) + ": " +
             Describe(now, bytes) + " races with the earlier " + Describe(other, bytes);
    });
  };
  if (cell.written) race(cell.last_write);
  if (now.write) {
    for (const Access& r : cell.reads) race(r);
    cell.reads.clear();
    cell.written = true;
    cell.last_write = now;
  } else {
    for (auto it = cell.reads.begin(); it != cell.reads.end(); ++it) {
      if (it->thread == now.thread && it->block == now.block) {
        cell.reads.erase(it);
        break;
      }
    }
    if (cell.reads.size() >= kMaxReads) cell.reads.erase(cell.reads.begin());
    cell.reads.push_back(now);
  }
}

const std::pair<const char* const, State::SharedRegion>* FindShared(const char* p) {
  auto it = st.shared.upper_bound(p);
  if (it == st.shared.begin()) return nullptr;
  --it;
  if (p < it->first + it->second.bytes + it->second.redzone) return &*it;
  return nullptr;
}

void OnAccess(const void* addr, size_t bytes, bool write, const void* pc, bool unaligned_ok, bool atomic = false,
              const char* file = nullptr, int line = 0) {
  if (!st.active || !InKernel()) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  Access now;
  now.block = st.block;
  now.thread = CurrentLinearThread();
  now.barrier = st.barrier;
  now.meet = st.meet_clock;
  now.pc = pc;
  now.write = write;
  now.atomic = atomic;
  now.file = file;
  now.line = line;
  const char* c = static_cast<const char*>(addr);
  bool shared = false;
  if (const auto* region = FindShared(c)) {
    shared = true;
    if (c + bytes > region->first + region->second.bytes) {
      Flag(ErrorKind::kOutOfBounds, Hex(pc), [&] {
        return Describe(now, bytes) + " runs past the end of shared memory '" + region->second.name + "' (" +
               std::to_string(region->second.bytes) + " bytes) at offset " + std::to_string(c - region->first);
      });
      return;
    }
  } else {
    const AllocationView v = FindAllocation(addr, bytes);
    if (v.status == AllocationView::Status::kNone) return;  // stack, host or constant memory
    if (v.status == AllocationView::Status::kFreed) {
      Flag(ErrorKind::kUseAfterFree, Hex(pc),
           [&] { return Describe(now, bytes) + " touches freed device memory " + Hex(addr); });
      return;
    }
    if (v.status == AllocationView::Status::kOutOfBounds) {
      const long long off = static_cast<long long>(c - static_cast<const char*>(v.base));
      Flag(ErrorKind::kOutOfBounds, Hex(pc), [&] {
        return Describe(now, bytes) + " at offset " + std::to_string(off) + " of a device allocation of " +
               std::to_string(v.size) + " bytes";
      });
      return;
    }
  }
  if (!unaligned_ok && bytes > 1 && (a % bytes) != 0) {
    Flag(ErrorKind::kMisaligned, Hex(pc),
         [&] { return Describe(now, bytes) + " at the misaligned address " + Hex(addr); });
  }
  auto& cells = shared ? st.shared_cells : st.global_cells;
  for (size_t i = 0; i < bytes; ++i) {
    Cell& cell = cells[a + i];
    if (shared && !write && !cell.written) {
      const auto* region = FindShared(c);
      Flag(ErrorKind::kUninitShared, Hex(pc), [&] {
        return Describe(now, bytes) + " of shared variable '" + (region ? region->second.name : "?") + "' at offset " +
               std::to_string(region ? c - region->first : 0) + ", never written in this block";
      });
    }
    CheckRace(cell, now, a + i, bytes, shared);
    if (cell.reads.empty() && !cell.written) cells.erase(a + i);
  }
}

}  // namespace

void OnKernelStart(const LaunchSite& site) {
  st.active = true;
  st.site = &site;
  st.block = 0;
  st.global_cells.clear();
  st.reported.clear();
  st.reports = 0;
}

void OnKernelEnd() {
  st.active = false;
  st.global_cells.clear();
  st.shared_cells.clear();
}

void OnBlockStart(void* dynamic_shared, size_t bytes, size_t redzone) {
  st.block = tls_block_idx.x + tls_block_idx.y * tls_grid_dim.x + tls_block_idx.z * tls_grid_dim.x * tls_grid_dim.y;
  st.barrier = 0;
  st.meet_clock = 0;
  const size_t threads = static_cast<size_t>(tls_block_dim.x) * tls_block_dim.y * tls_block_dim.z;
  st.last_meet.assign((threads + 31) / 32 * 32 * 32, 0);
  st.shared_cells.clear();
  // Static shared variables re-register as the block reaches them; the dynamic area is this launch's.
  st.shared.clear();
  st.shared[static_cast<const char*>(dynamic_shared)] = {bytes, redzone, "extern __shared__"};
}

void OnSharedBlockStart(void* p, size_t bytes, const char* name) {
  st.shared[static_cast<const char*>(p)] = {bytes, 0, name};
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (size_t i = 0; i < bytes; ++i) st.shared_cells.erase(a + i);
}

void OnBlockBarrier() { ++st.barrier; }

void OnWarpSync(unsigned warp, unsigned lanes) {
  // Called once per completed collective, before any of its lanes goes on.
  const uint64_t clock = ++st.meet_clock;
  for (unsigned a = 0; a < 32; ++a) {
    if (!(lanes >> a & 1)) continue;
    for (unsigned b = 0; b < 32; ++b) {
      if (lanes >> b & 1) st.last_meet[(static_cast<size_t>(warp) * 32 + a) * 32 + b] = clock;
    }
  }
}

void ReportMisaligned(const void* p, size_t bytes, const char* file, int line) {
  Raise(ErrorKind::kMisaligned, "load of " + std::to_string(bytes) + " bytes by " + CurrentThreadName() + " at " +
                                    file + ":" + std::to_string(line) + " from the misaligned address " + Hex(p));
}

void NoteAtomic(const void* p, size_t bytes, const char* file, int line) {
  OnAccess(p, bytes, /*write=*/true, nullptr, /*unaligned_ok=*/false, /*atomic=*/true, file, line);
}

}  // namespace simt::detail

// The ThreadSanitizer instrumentation's entry points (the runtime itself is not linked).
using simt::detail::OnAccess;
extern "C" {
void __tsan_init() { simt::detail::checked_mode = true; }
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_ignore_thread_begin() {}
void __tsan_ignore_thread_end() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
#define SIMT_TSAN_ACCESS(n)                                                                            \
  void __tsan_read##n(void* p) { OnAccess(p, n, false, __builtin_return_address(0), false); }          \
  void __tsan_write##n(void* p) { OnAccess(p, n, true, __builtin_return_address(0), false); }          \
  void __tsan_unaligned_read##n(void* p) { OnAccess(p, n, false, __builtin_return_address(0), true); } \
  void __tsan_unaligned_write##n(void* p) { OnAccess(p, n, true, __builtin_return_address(0), true); } \
  void __tsan_volatile_read##n(void* p) { OnAccess(p, n, false, __builtin_return_address(0), false); } \
  void __tsan_volatile_write##n(void* p) { OnAccess(p, n, true, __builtin_return_address(0), false); } \
  void __tsan_read##n##_pc(void* p, void* pc) { OnAccess(p, n, false, pc, false); }                    \
  void __tsan_write##n##_pc(void* p, void* pc) { OnAccess(p, n, true, pc, false); }
SIMT_TSAN_ACCESS(1)
SIMT_TSAN_ACCESS(2)
SIMT_TSAN_ACCESS(4)
SIMT_TSAN_ACCESS(8)
SIMT_TSAN_ACCESS(16)
#undef SIMT_TSAN_ACCESS
void __tsan_read_range(void* p, unsigned long n) { OnAccess(p, n, false, __builtin_return_address(0), true); }
void __tsan_write_range(void* p, unsigned long n) { OnAccess(p, n, true, __builtin_return_address(0), true); }
}
