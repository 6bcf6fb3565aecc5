// The SIMT scheduler: every CUDA thread of a block is a fiber (a stack and a 20-instruction switch); blocks run one
// after another on the launching host thread. One fixed schedule: warp by warp, each lane runs until it waits (barrier
// or warp collective) or exits; a warp collective completes the moment the last lane of its mask arrives; __syncthreads
// releases when every thread still running waits at it.
#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "simt/simt.h"
#include "src/internal.h"

#if !defined(__x86_64__)
#error "tools/simt: the fiber switch below is written for x86-64"
#endif

// Saves the callee-saved registers on the current stack, stores the stack pointer in *from, and resumes the fiber
// whose saved stack pointer is `to`. (glibc's swapcontext makes a system call per switch to save the signal mask,
// which made the emulator several times slower.) MXCSR and the x87 control word are not switched: every fiber runs
// with the launching thread's, and kernel code never changes them (saving and restoring them was 80% of a switch).
extern "C" void simt_switch_context(void** from, void* to);
asm(R"(
  .text
  .globl simt_switch_context
  .type simt_switch_context, @function
simt_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch_context, .-simt_switch_context
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace simt {
namespace detail {

thread_local uint3 tls_thread_idx;
thread_local uint3 tls_block_idx;
thread_local dim3 tls_block_dim;
thread_local dim3 tls_grid_dim;
RunningFiber running_fiber;

namespace {

constexpr size_t kStackBytes = 256 * 1024;  // mapped lazily: untouched pages cost nothing
// Fiber i's stack starts (i % kStaggerSlots) * kStaggerBytes below the top of its mapping (see InitialStack).
constexpr size_t kStaggerBytes = 320;
constexpr unsigned kStaggerSlots = 256;
constexpr unsigned char kSharedPoison = 0xCB;
constexpr size_t kDynamicSharedRedzone = 1024;  // past the dynamic shared memory, for the checker

enum class State : uint8_t { kReady, kBarrier, kWarp, kDone };

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  void* stack = nullptr;
  State state = State::kReady;
  uint3 tid;
  unsigned linear = 0;
  const char* file = "";  // where it waits
  int line = 0;
  CollectiveOp op = CollectiveOp::kSyncWarp;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 32;
};

struct BlockRun {
  std::vector<Fiber> fibers;  // by linear thread index
  // Per warp, the lanes waiting in a collective (State::kWarp) and the lanes that exited (State::kDone): a
  // collective's completion is one mask test, not a walk over its lanes at every arrival.
  std::vector<uint32_t> waiting;
  std::vector<uint32_t> exited;
  void* scheduler_sp = nullptr;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  bool abandoned = false;
};

std::recursive_mutex launch_mu;  // one launch at a time
BlockRun* run = nullptr;         // the block being run (guarded by launch_mu)
uint64_t block_epoch = 0;        // increments at every block start
std::vector<unsigned char> dynamic_shared;
const LaunchSite* current_site = nullptr;
bool current_in_graph = false;  // the running launch is a node of a graph (cudaGraphLaunch)
std::vector<void*> stack_pool;

std::mutex handler_mu;
ReportHandler handler;

void* AllocStack() {
  if (!stack_pool.empty()) {
    void* s = stack_pool.back();
    stack_pool.pop_back();
    return s;
  }
  void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (s == MAP_FAILED) {
    std::fprintf(stderr, "simt: cannot map a fiber stack\n");
    std::abort();
  }
  return s;
}

void Yield(Fiber* f);

// One past the last lane of warp `warp` in the running block.
unsigned WarpEnd(unsigned warp) { return std::min(static_cast<unsigned>(run->fibers.size()), (warp + 1) * 32); }

// A fiber's first frame. Never returns: after the kernel body it yields for good.
[[noreturn]] void FiberMain() {
  Fiber* f = run->current;
  (*run->body)();
  f->state = State::kDone;
  run->exited[f->linear / 32] |= 1u << (f->linear % 32);
  Yield(f);
  __builtin_unreachable();
}

// A new fiber's stack, laid out as simt_switch_context leaves a switched-out one: six callee-saved registers, then
// FiberMain as the return address (entered with rsp = 8 mod 16, as after a call). Its top is staggered by the
// fiber's index: the stacks are 256 KiB apart, and at the same offset the hot frames of a warp's 32 lanes would
// share the same few cache sets (the emulated goldens ran 5% slower).
void* InitialStack(void* stack, unsigned linear) {
  const size_t stagger = (linear % kStaggerSlots) * kStaggerBytes;
  auto* top = reinterpret_cast<uint64_t*>(static_cast<char*>(stack) + kStackBytes - stagger);
  *--top = 0;  // FiberMain's return address: none
  *--top = reinterpret_cast<uint64_t>(&FiberMain);
  for (int i = 0; i < 6; ++i) *--top = 0;  // rbp rbx r12 r13 r14 r15
  return top;
}

// Makes `f` the running thread (before switching to it).
void Enter(Fiber* f) {
  run->current = f;
  tls_thread_idx = f->tid;
  running_fiber = {f->linear, reinterpret_cast<uintptr_t>(f->stack), kStackBytes};
}

// Called by the scheduler: runs `f`, and the lanes after it that it hands on to (see Yield), until one of them
// yields to the scheduler. Returns that last lane.
Fiber* SwitchTo(Fiber* f) {
  Enter(f);
  simt_switch_context(&run->scheduler_sp, f->sp);
  Fiber* last = run->current;
  running_fiber = RunningFiber{};
  run->current = nullptr;
  return last;
}

// Called on fiber `f`, which has stopped (waits or exited): switches to the next ready lane of its warp, as the
// scheduler would run next (RunBlock), else back to the scheduler. One switch per lane instead of two through the
// scheduler: a warp collective costs each of its lanes a switch out and in, the emulator's largest cost.
void Yield(Fiber* f) {
  for (unsigned i = f->linear + 1; i < WarpEnd(f->linear / 32); ++i) {
    Fiber* next = &run->fibers[i];
    if (next->state == State::kReady) {
      Enter(next);
      simt_switch_context(&f->sp, next->sp);
      return;
    }
  }
  simt_switch_context(&f->sp, run->scheduler_sp);
}

// Called on a fiber: gives control away until released (whoever switches back to it has entered it).
void Wait() { Yield(run->current); }

std::string ThreadName(const Fiber& f) {
  return "block (" + std::to_string(tls_block_idx.x) + "," + std::to_string(tls_block_idx.y) + "," +
         std::to_string(tls_block_idx.z) + ") thread (" + std::to_string(f.tid.x) + "," + std::to_string(f.tid.y) +
         "," + std::to_string(f.tid.z) + ")";
}

const char* OpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kSyncWarp:
      return "__syncwarp";
    case CollectiveOp::kShfl:
      return "__shfl_sync";
    case CollectiveOp::kShflXor:
      return "__shfl_xor_sync";
    case CollectiveOp::kShflUp:
      return "__shfl_up_sync";
    case CollectiveOp::kShflDown:
      return "__shfl_down_sync";
  }
  return "?";
}

std::string WaitList() {
  std::string out;
  // Group threads by where they wait, so 256 threads at one barrier read as one line.
  std::map<std::string, std::vector<unsigned>> by_site;
  for (const Fiber& f : run->fibers) {
    std::string where;
    switch (f.state) {
      case State::kDone:
        where = "exited";
        break;
      case State::kReady:
        where = "runnable";
        break;
      case State::kBarrier:
        where = std::string("__syncthreads at ") + f.file + ":" + std::to_string(f.line);
        break;
      case State::kWarp:
        where = std::string(OpName(f.op)) + " (mask 0x" +
                [&] {
                  char b[16];
                  std::snprintf(b, sizeof b, "%08x", f.mask);
                  return std::string(b);
                }() +
                ") at " + f.file + ":" + std::to_string(f.line);
        break;
    }
    by_site[where].push_back(f.linear);
  }
  for (const auto& [where, threads] : by_site) {
    out += "\n  threads ";
    // Print ranges of consecutive linear ids.
    for (size_t i = 0; i < threads.size();) {
      size_t j = i;
      while (j + 1 < threads.size() && threads[j + 1] == threads[j] + 1) ++j;
      if (i) out += ",";
      out += std::to_string(threads[i]);
      if (j > i) out += "-" + std::to_string(threads[j]);
      i = j + 1;
    }
    out += ": " + where;
  }
  return out;
}

std::string BlockName() {
  return "block (" + std::to_string(tls_block_idx.x) + "," + std::to_string(tls_block_idx.y) + "," +
         std::to_string(tls_block_idx.z) + ")";
}

// Lane indices of warp `warp` that exist in this block.
unsigned LanesPresent(unsigned warp) {
  const unsigned count = WarpEnd(warp) - warp * 32;
  return count == 32 ? 0xffffffffu : ((1u << count) - 1);
}

// Completes the collective of the warp containing `f` if every lane of its mask has arrived or exited (an exited
// lane is reported: the hardware's result is undefined; the collective completes with the lanes present).
void TryCompleteCollective(Fiber* f) {
  const unsigned warp = f->linear / 32;
  const unsigned base = warp * 32;
  const unsigned mask = f->mask & LanesPresent(warp);
  const uint32_t waiting = run->waiting[warp];
  if ((mask & ~(waiting | run->exited[warp])) != 0) return;  // not every lane arrived yet
  const unsigned exited = mask & run->exited[warp];
  if (exited) {
    char lanes[16];
    std::snprintf(lanes, sizeof lanes, "0x%08x", exited);
    Raise(ErrorKind::kWarpCollective, std::string(OpName(f->op)) + " at " + f->file + ":" + std::to_string(f->line) +
                                          " in " + ThreadName(*f) + ": lanes " + lanes +
                                          " of its mask exited without taking part");
  }
  // Every lane has arrived: check they agree, then compute.
  uint64_t values[32];
  bool in[32];
  for (unsigned l = 0; l < 32; ++l) {
    in[l] = (mask & waiting) >> l & 1;
    values[l] = in[l] ? run->fibers[base + l].value : 0;
  }
  for (unsigned l = 0; l < 32; ++l) {
    if (!in[l]) continue;
    Fiber& o = run->fibers[base + l];
    if (o.mask != f->mask || o.op != f->op) {
      Raise(ErrorKind::kWarpCollective, std::string("lanes disagree: ") + OpName(f->op) + " at " + f->file + ":" +
                                            std::to_string(f->line) + " in " + ThreadName(*f) + " vs " + OpName(o.op) +
                                            " at " + o.file + ":" + std::to_string(o.line) + " in " + ThreadName(o));
    }
  }
  for (unsigned l = 0; l < 32; ++l) {
    if (!in[l]) continue;
    Fiber& o = run->fibers[base + l];
    int src = static_cast<int>(l);
    const int w = o.width;
    const int seg = static_cast<int>(l) & ~(w - 1);
    switch (o.op) {
      case CollectiveOp::kSyncWarp:
        break;
      case CollectiveOp::kShfl:
        src = seg + (o.arg & (w - 1));
        break;
      case CollectiveOp::kShflXor: {
        const int s = static_cast<int>(l) ^ o.arg;
        src = (s & ~(w - 1)) == seg ? s : static_cast<int>(l);
        break;
      }
      case CollectiveOp::kShflUp:
        src = static_cast<int>(l) - o.arg >= seg ? static_cast<int>(l) - o.arg : l;
        break;
      case CollectiveOp::kShflDown:
        src = static_cast<int>(l) + o.arg < seg + w ? static_cast<int>(l) + o.arg : l;
        break;
    }
    if (o.op != CollectiveOp::kSyncWarp && (src < 0 || src > 31 || !in[src])) {
      Raise(ErrorKind::kWarpCollective, std::string(OpName(o.op)) + " at " + o.file + ":" + std::to_string(o.line) +
                                            " in " + ThreadName(o) + " reads lane " + std::to_string(src) +
                                            ", which is not in its mask or has exited");
      src = static_cast<int>(l);
    }
    o.value = values[src];
  }
  const unsigned met = mask & waiting;
  for (unsigned l = 0; l < 32; ++l) {
    if (in[l]) run->fibers[base + l].state = State::kReady;
  }
  run->waiting[warp] &= ~met;
  // Recorded now, before any of these lanes goes on: an access after the collective is ordered after it.
  OnWarpSync(warp, met);
}

}  // namespace

void Raise(ErrorKind kind, const std::string& message) {
  Report r{kind, current_site ? current_site->kernel : "", message};
  if (current_site)
    r.message += std::string("\n  kernel ") + current_site->kernel + " launched at " + current_site->file + ":" +
                 std::to_string(current_site->line) +
                 (current_in_graph ? " (captured there; run by cudaGraphLaunch)" : "");
  ReportHandler h;
  {
    std::lock_guard<std::mutex> lock(handler_mu);
    h = handler;
  }
  if (h) {
    h(r);
    return;
  }
  std::fprintf(stderr, "simt: %s in kernel %s: %s\n", ErrorKindName(kind), r.kernel.c_str(), r.message.c_str());
  std::abort();
}

uint64_t SharedVar::CurrentBlockEpoch() { return block_epoch; }

void SharedVar::Enter(void* p, size_t bytes, const char* name) {
  epoch_ = block_epoch;
  std::memset(p, kSharedPoison, bytes);
  OnSharedBlockStart(p, bytes, name);
}

void* DynamicShared() { return dynamic_shared.data(); }

void SyncThreads(const char* file, int line) {
  Fiber* f = run->current;
  f->state = State::kBarrier;
  f->file = file;
  f->line = line;
  Wait();
}

uint64_t WarpCollective(CollectiveOp op, unsigned mask, uint64_t value, int arg, int width, const char* file,
                        int line) {
  Fiber* f = run->current;
  if (!(mask >> (f->linear % 32) & 1)) {
    Raise(ErrorKind::kWarpCollective, std::string(OpName(op)) + " at " + file + ":" + std::to_string(line) + " in " +
                                          ThreadName(*f) + ": the calling lane is not in its mask");
  }
  if (width <= 0 || width > 32 || (width & (width - 1))) {
    Raise(ErrorKind::kWarpCollective, std::string(OpName(op)) + " at " + file + ":" + std::to_string(line) +
                                          ": width " + std::to_string(width) + " is not a power of two up to 32");
    width = 32;
  }
  f->state = State::kWarp;
  run->waiting[f->linear / 32] |= 1u << (f->linear % 32);
  f->op = op;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
  f->file = file;
  f->line = line;
  TryCompleteCollective(f);
  if (f->state == State::kWarp) Wait();
  return f->value;
}

namespace {

// Runs one block to completion. Returns false if it had to be abandoned.
bool RunBlock(const std::function<void()>& body, dim3 block) {
  BlockRun br;
  run = &br;
  br.body = &body;
  const unsigned n = block.x * block.y * block.z;
  br.fibers.resize(n);
  br.waiting.assign((n + 31) / 32, 0);
  br.exited.assign((n + 31) / 32, 0);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = br.fibers[i];
    f.linear = i;
    f.tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
    f.stack = AllocStack();
    f.sp = InitialStack(f.stack, i);
  }
  const unsigned warps = (n + 31) / 32;
  bool ok = true;
  for (;;) {
    bool progress = false;
    for (unsigned w = 0; w < warps; ++w) {
      // Run the warp's lanes until none of them can go on.
      for (bool again = true; again;) {
        again = false;
        // In lane order: lane i runs until it stops, then hands on to the next ready lane (Yield); the scheduler
        // goes on after the last lane that ran.
        for (unsigned i = w * 32; i < WarpEnd(w); ++i) {
          if (br.fibers[i].state == State::kReady) {
            i = SwitchTo(&br.fibers[i])->linear;
            again = progress = true;
          }
        }
        // A collective waiting on lanes that have since exited completes now (and is reported).
        for (unsigned i = w * 32; i < WarpEnd(w) && !again && br.waiting[w] != 0; ++i) {
          if (br.fibers[i].state == State::kWarp) {
            TryCompleteCollective(&br.fibers[i]);
            if (br.fibers[i].state == State::kReady) again = true;
          }
        }
      }
    }
    unsigned done = 0, at_barrier = 0;
    const Fiber* first_barrier = nullptr;
    for (const Fiber& f : br.fibers) {
      if (f.state == State::kDone) ++done;
      if (f.state == State::kBarrier) {
        ++at_barrier;
        if (!first_barrier) first_barrier = &f;
      }
    }
    if (done == n) break;
    if (at_barrier + done == n) {
      bool same = true;
      for (const Fiber& f : br.fibers) {
        if (f.state == State::kBarrier && (f.line != first_barrier->line || std::strcmp(f.file, first_barrier->file))) {
          same = false;
        }
      }
      if (!same) {
        Raise(ErrorKind::kBarrierDivergence,
              "__syncthreads reached at different call sites in " + BlockName() + ":" + WaitList());
        ok = false;
        break;
      }
      OnBlockBarrier();
      for (Fiber& f : br.fibers) {
        if (f.state == State::kBarrier) f.state = State::kReady;
      }
      continue;
    }
    if (!progress) {
      Raise(ErrorKind::kDeadlock, "no thread of " + BlockName() + " can go on:" + WaitList());
      ok = false;
      break;
    }
  }
  for (Fiber& f : br.fibers) stack_pool.push_back(f.stack);
  run = nullptr;
  return ok;
}

// Runs a launch that passed its checks: every block, one after another. `in_graph`: as a node of a graph.
cudaError_t Execute(const LaunchSite& site, dim3 grid, dim3 block, size_t dynamic_smem,
                    const std::function<void()>& body, bool in_graph) {
  const LaunchSite* outer = current_site;
  const bool outer_in_graph = current_in_graph;
  current_site = &site;
  current_in_graph = in_graph;
  tls_grid_dim = grid;
  tls_block_dim = block;
  dynamic_shared.assign(dynamic_smem + kDynamicSharedRedzone, kSharedPoison);
  OnKernelStart(site);
  cudaError_t result = cudaSuccess;
  for (unsigned z = 0; z < grid.z && result == cudaSuccess; ++z) {
    for (unsigned y = 0; y < grid.y && result == cudaSuccess; ++y) {
      for (unsigned x = 0; x < grid.x && result == cudaSuccess; ++x) {
        tls_block_idx = uint3{x, y, z};
        ++block_epoch;
        if (dynamic_smem) std::memset(dynamic_shared.data(), kSharedPoison, dynamic_smem);
        OnBlockStart(dynamic_shared.data(), dynamic_smem, kDynamicSharedRedzone);
        if (!RunBlock(body, block)) result = cudaErrorLaunchFailure;
      }
    }
  }
  OnKernelEnd();
  CountLaunch(site, in_graph);
  current_site = outer;
  current_in_graph = outer_in_graph;
  if (result != cudaSuccess) SetLastError(result, /*sticky=*/true);
  return result;
}

}  // namespace

cudaError_t RunKernel(const LaunchSite& site, const void* func, dim3 grid, dim3 block, size_t dynamic_smem,
                      cudaStream_t stream, const std::function<void()>& body) {
  std::lock_guard<std::recursive_mutex> lock(launch_mu);
  const cudaError_t bad = CheckLaunch(site, func, grid, block, dynamic_smem, stream);
  if (bad != cudaSuccess) {
    InvalidateCapture(stream);  // as on the hardware, a refused launch invalidates the capture it was issued into
    SetLastError(bad);
    return bad;
  }
  bool capture = false;
  const cudaError_t issue = IssueWork(stream, &capture);
  if (issue != cudaSuccess) return issue;
  if (capture) {
    RecordNode(stream, cudaGraphNodeTypeKernel,
               [launch = KernelLaunch{site, func, grid, block, dynamic_smem, body}](cudaStream_t s) {
                 return RunGraphKernel(launch, s);
               });
    return cudaSuccess;
  }
  return Execute(site, grid, block, dynamic_smem, body, /*in_graph=*/false);
}

cudaError_t RunGraphKernel(const KernelLaunch& launch, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(launch_mu);
  const cudaError_t bad = CheckLaunch(launch.site, launch.func, launch.grid, launch.block, launch.dynamic_smem, stream);
  if (bad != cudaSuccess) {
    SetLastError(bad);
    return bad;
  }
  return Execute(launch.site, launch.grid, launch.block, launch.dynamic_smem, launch.body, /*in_graph=*/true);
}

bool InKernel() { return run != nullptr; }

std::unique_lock<std::recursive_mutex> HoldLaunches() { return std::unique_lock<std::recursive_mutex>(launch_mu); }

std::string CurrentThreadName() {
  if (!run || !run->current) return "host";
  return ThreadName(*run->current);
}

unsigned CurrentLinearThread() { return run && run->current ? run->current->linear : ~0u; }

}  // namespace detail

const char* ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kDeadlock:
      return "deadlock";
    case ErrorKind::kBarrierDivergence:
      return "barrier divergence";
    case ErrorKind::kWarpCollective:
      return "warp collective error";
    case ErrorKind::kLaunch:
      return "launch error";
    case ErrorKind::kOutOfBounds:
      return "out-of-bounds access";
    case ErrorKind::kUseAfterFree:
      return "use after free";
    case ErrorKind::kMisaligned:
      return "misaligned access";
    case ErrorKind::kRace:
      return "data race";
    case ErrorKind::kUninitShared:
      return "read of uninitialized shared memory";
    case ErrorKind::kConstWrite:
      return "write to constant memory";
  }
  return "?";
}

ReportHandler SetReportHandler(ReportHandler h) {
  std::lock_guard<std::mutex> lock(detail::handler_mu);
  ReportHandler old = std::move(detail::handler);
  detail::handler = std::move(h);
  return old;
}

}  // namespace simt
