// Makes Debian's Abseil synchronization and gRPC's completion queues visible to ThreadSanitizer (scripts/sanitize.sh
// tsan preloads it).
//
// libabsl_synchronization.so is not built with -fsanitize=thread, so TSan sees neither absl::Mutex's atomics nor
// its futex waits: without help, every access made under an absl::MutexLock looks unsynchronized. This library,
// put first with LD_PRELOAD, interposes the Mutex / CondVar / Notification entry points (odmoe's code, gRPC and
// Abseil itself call them through the PLT), forwards each to the real one (dlsym(RTLD_NEXT)) and reports it
// with TSan's annotation API: lock / unlock (read or write, try), the unlock-and-relock inside Await and
// CondVar::Wait, and Notify -> WaitForNotification as release -> acquire. That is the annotation Abseil itself
// compiles in when it is built with TSan (ABSL_TSAN_MUTEX_*); the shim hides no report.
//
// As with Abseil's own annotations, everything the real function does (its atomics, and the conditions of
// LockWhen / Await, which absl evaluates with the mutex held, possibly in the unlocking thread) runs between the
// pre and post hooks, where TSan ignores memory accesses. Several entry points call others through the PLT
// (WaitWithTimeout -> WaitWithDeadline, Notify -> Lock, ...): only the outermost call of a thread is annotated.
//
// gRPC core is not built with TSan either, and hands a batch of operations from the thread that starts it to the
// thread that completes it through its own lock-free queues. The same way, the shim makes the tag of a batch a
// release -> acquire pair: grpc_call_start_batch and grpc_server_request_(registered_)call release the tag, and
// grpc_completion_queue_next / _pluck acquire the tag of the event they return (the thread that then runs the
// completion: a sync-API caller, a server thread, or the callback API's "nexting" thread). So what a thread
// wrote before starting a call (the response message, the callback tag) happens before its completion runs.
//
// Limits: Notification::HasBeenNotified() is inline (polling it gives no happens-before here); Await and
// CondVar::Wait are annotated as exclusive (odmoe holds its mutexes exclusively when it waits).
//
// Build (no sanitizer; the __tsan_* hooks are weak and come from the TSan runtime of the executable):
//   clang++ -std=c++20 -O1 -fPIC -shared -Wl,-Bsymbolic tsan_absl_shim.cc -o libodmoe_tsan_absl_shim.so -ldl
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpc/grpc.h"

extern "C" {
// From compiler-rt's sanitizer/tsan_interface.h, weak: in a process without TSan they are null and skipped.
void __tsan_acquire(void* addr) __attribute__((weak));
void __tsan_release(void* addr) __attribute__((weak));
void __tsan_mutex_pre_lock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_mutex_post_lock(void* addr, unsigned flags, int recursion) __attribute__((weak));
int __tsan_mutex_pre_unlock(void* addr, unsigned flags) __attribute__((weak));
void __tsan_mutex_post_unlock(void* addr, unsigned flags) __attribute__((weak));
}

namespace {

constexpr unsigned kReadLock = 1 << 3;       // __tsan_mutex_read_lock
constexpr unsigned kTryLock = 1 << 4;        // __tsan_mutex_try_lock
constexpr unsigned kTryLockFailed = 1 << 5;  // __tsan_mutex_try_lock_failed

bool Tsan() { return __tsan_mutex_pre_lock != nullptr; }

void PreLock(const void* mu, unsigned flags) {
  if (Tsan()) __tsan_mutex_pre_lock(const_cast<void*>(mu), flags);
}
void PostLock(const void* mu, unsigned flags) {
  if (Tsan()) __tsan_mutex_post_lock(const_cast<void*>(mu), flags, 0);
}
void PreUnlock(const void* mu, unsigned flags) {
  if (Tsan()) __tsan_mutex_pre_unlock(const_cast<void*>(mu), flags);
}
void PostUnlock(const void* mu, unsigned flags) {
  if (Tsan()) __tsan_mutex_post_unlock(const_cast<void*>(mu), flags);
}
void Release(const void* addr) {
  if (Tsan()) __tsan_release(const_cast<void*>(addr));
}
void Acquire(const void* addr) {
  if (Tsan()) __tsan_acquire(const_cast<void*>(addr));
}

// Only the outermost interposed call of a thread is annotated (see the top of the file).
thread_local int depth = 0;
struct Outer {
  Outer() : outer(depth++ == 0) {}
  ~Outer() { --depth; }
  Outer(const Outer&) = delete;
  Outer& operator=(const Outer&) = delete;
  const bool outer;
};

// The real function behind one of this file's definitions: its own symbol name (dladdr on its address, which
// -Bsymbolic binds to this library), looked up in the libraries loaded after this one.
template <typename MemberFn>
void* RealOf(MemberFn fn) {
  static_assert(sizeof(fn) >= sizeof(void*));
  void* ours = nullptr;
  std::memcpy(&ours, &fn, sizeof(ours));  // Itanium ABI: a non-virtual member pointer starts with the address
  Dl_info info;
  if (dladdr(ours, &info) == 0 || info.dli_sname == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: cannot name the function at %p\n", ours);
    std::abort();
  }
  void* real = dlsym(RTLD_NEXT, info.dli_sname);
  if (real == nullptr || real == ours) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found after the shim (is libabsl_synchronization loaded?)\n",
                 info.dli_sname);
    std::abort();
  }
  return real;
}

// Calls the real `fn` on `self`; the static per instantiation caches the lookup.
#define ODMOE_REAL(Ret, fn, ...) reinterpret_cast<Ret (*)(__VA_ARGS__)>(RealOf(fn))

// The real C function `name` (libgrpc), looked up after this library.
template <typename Fn>
Fn RealC(const char* name) {
  void* real = dlsym(RTLD_NEXT, name);
  if (real == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found after the shim\n", name);
    std::abort();
  }
  return reinterpret_cast<Fn>(real);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static auto real = ODMOE_REAL(void, &Mutex::Lock, Mutex*);
  const Outer o;
  if (o.outer) PreLock(this, 0);
  real(this);
  if (o.outer) PostLock(this, 0);
}

void Mutex::ReaderLock() {
  static auto real = ODMOE_REAL(void, &Mutex::ReaderLock, Mutex*);
  const Outer o;
  if (o.outer) PreLock(this, kReadLock);
  real(this);
  if (o.outer) PostLock(this, kReadLock);
}

bool Mutex::TryLock() {
  static auto real = ODMOE_REAL(bool, &Mutex::TryLock, Mutex*);
  const Outer o;
  if (o.outer) PreLock(this, kTryLock);
  const bool locked = real(this);
  if (o.outer) PostLock(this, locked ? kTryLock : kTryLock | kTryLockFailed);
  return locked;
}

bool Mutex::ReaderTryLock() {
  static auto real = ODMOE_REAL(bool, &Mutex::ReaderTryLock, Mutex*);
  const Outer o;
  if (o.outer) PreLock(this, kReadLock | kTryLock);
  const bool locked = real(this);
  if (o.outer) PostLock(this, locked ? kReadLock | kTryLock : kReadLock | kTryLock | kTryLockFailed);
  return locked;
}

void Mutex::Unlock() {
  static auto real = ODMOE_REAL(void, &Mutex::Unlock, Mutex*);
  const Outer o;
  if (o.outer) PreUnlock(this, 0);
  real(this);
  if (o.outer) PostUnlock(this, 0);
}

void Mutex::ReaderUnlock() {
  static auto real = ODMOE_REAL(void, &Mutex::ReaderUnlock, Mutex*);
  const Outer o;
  if (o.outer) PreUnlock(this, kReadLock);
  real(this);
  if (o.outer) PostUnlock(this, kReadLock);
}

// LockWhen*: held on return (the bool only says whether the condition became true).
void Mutex::LockWhen(const Condition& cond) {
  static auto real = ODMOE_REAL(void, &Mutex::LockWhen, Mutex*, const Condition&);
  const Outer o;
  if (o.outer) PreLock(this, 0);
  real(this, cond);
  if (o.outer) PostLock(this, 0);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static auto real = ODMOE_REAL(void, &Mutex::ReaderLockWhen, Mutex*, const Condition&);
  const Outer o;
  if (o.outer) PreLock(this, kReadLock);
  real(this, cond);
  if (o.outer) PostLock(this, kReadLock);
}

#define ODMOE_LOCK_WHEN(Name, Arg, flags)                                             \
  bool Mutex::Name(const Condition& cond, Arg arg) {                                  \
    static auto real = ODMOE_REAL(bool, &Mutex::Name, Mutex*, const Condition&, Arg); \
    const Outer o;                                                                    \
    if (o.outer) PreLock(this, flags);                                                \
    const bool met = real(this, cond, arg);                                           \
    if (o.outer) PostLock(this, flags);                                               \
    return met;                                                                       \
  }
ODMOE_LOCK_WHEN(LockWhenWithTimeout, absl::Duration, 0)
ODMOE_LOCK_WHEN(LockWhenWithDeadline, absl::Time, 0)
ODMOE_LOCK_WHEN(ReaderLockWhenWithTimeout, absl::Duration, kReadLock)
ODMOE_LOCK_WHEN(ReaderLockWhenWithDeadline, absl::Time, kReadLock)

// Await and CondVar waits release the mutex while they wait and hold it again on return: an unlock (the
// release, before the real call) and a lock (the acquire, after it).
void Mutex::Await(const Condition& cond) {
  static auto real = ODMOE_REAL(void, &Mutex::Await, Mutex*, const Condition&);
  const Outer o;
  if (o.outer) PreUnlock(this, 0);
  real(this, cond);
  if (o.outer) {
    PostUnlock(this, 0);
    PreLock(this, 0);
    PostLock(this, 0);
  }
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration arg) {
  static auto real = ODMOE_REAL(bool, &Mutex::AwaitWithTimeout, Mutex*, const Condition&, absl::Duration);
  const Outer o;
  if (o.outer) PreUnlock(this, 0);
  const bool r = real(this, cond, arg);
  if (o.outer) {
    PostUnlock(this, 0);
    PreLock(this, 0);
    PostLock(this, 0);
  }
  return r;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time arg) {
  static auto real = ODMOE_REAL(bool, &Mutex::AwaitWithDeadline, Mutex*, const Condition&, absl::Time);
  const Outer o;
  if (o.outer) PreUnlock(this, 0);
  const bool r = real(this, cond, arg);
  if (o.outer) {
    PostUnlock(this, 0);
    PreLock(this, 0);
    PostLock(this, 0);
  }
  return r;
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration arg) {
  static auto real = ODMOE_REAL(bool, &CondVar::WaitWithTimeout, CondVar*, Mutex*, absl::Duration);
  const Outer o;
  if (o.outer) PreUnlock(mu, 0);
  const bool r = real(this, mu, arg);
  if (o.outer) {
    PostUnlock(mu, 0);
    PreLock(mu, 0);
    PostLock(mu, 0);
  }
  return r;
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time arg) {
  static auto real = ODMOE_REAL(bool, &CondVar::WaitWithDeadline, CondVar*, Mutex*, absl::Time);
  const Outer o;
  if (o.outer) PreUnlock(mu, 0);
  const bool r = real(this, mu, arg);
  if (o.outer) {
    PostUnlock(mu, 0);
    PreLock(mu, 0);
    PostLock(mu, 0);
  }
  return r;
}

void CondVar::Wait(Mutex* mu) {
  static auto real = ODMOE_REAL(void, &CondVar::Wait, CondVar*, Mutex*);
  const Outer o;
  if (o.outer) PreUnlock(mu, 0);
  real(this, mu);
  if (o.outer) {
    PostUnlock(mu, 0);
    PreLock(mu, 0);
    PostLock(mu, 0);
  }
}

// Notify -> WaitForNotification*: a release / acquire on the Notification (its own mutex and flag are used
// inside the real calls, which are not annotated).
void Notification::Notify() {
  static auto real = ODMOE_REAL(void, &Notification::Notify, Notification*);
  const Outer o;
  if (o.outer) Release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  static auto real = ODMOE_REAL(void, &Notification::WaitForNotification, const Notification*);
  const Outer o;
  real(this);
  if (o.outer) Acquire(this);
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  static auto real =
      ODMOE_REAL(bool, &Notification::WaitForNotificationWithTimeout, const Notification*, absl::Duration);
  const Outer o;
  const bool notified = real(this, timeout);
  if (o.outer && notified) Acquire(this);
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  static auto real = ODMOE_REAL(bool, &Notification::WaitForNotificationWithDeadline, const Notification*, absl::Time);
  const Outer o;
  const bool notified = real(this, deadline);
  if (o.outer && notified) Acquire(this);
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl

// ---- gRPC: a batch's tag is released when the batch starts and acquired where its completion is returned ------

extern "C" {

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag, void* reserved) {
  static auto real =
      RealC<grpc_call_error (*)(grpc_call*, const grpc_op*, size_t, void*, void*)>("grpc_call_start_batch");
  if (tag != nullptr) Release(tag);
  return real(call, ops, nops, tag, reserved);
}

grpc_call_error grpc_server_request_call(grpc_server* server, grpc_call** call, grpc_call_details* details,
                                         grpc_metadata_array* request_metadata, grpc_completion_queue* cq_bound,
                                         grpc_completion_queue* cq_notify, void* tag) {
  static auto real =
      RealC<grpc_call_error (*)(grpc_server*, grpc_call**, grpc_call_details*, grpc_metadata_array*,
                                grpc_completion_queue*, grpc_completion_queue*, void*)>("grpc_server_request_call");
  if (tag != nullptr) Release(tag);
  return real(server, call, details, request_metadata, cq_bound, cq_notify, tag);
}

grpc_call_error grpc_server_request_registered_call(grpc_server* server, void* method, grpc_call** call,
                                                    gpr_timespec* deadline, grpc_metadata_array* request_metadata,
                                                    grpc_byte_buffer** payload, grpc_completion_queue* cq_bound,
                                                    grpc_completion_queue* cq_notify, void* tag) {
  static auto real =
      RealC<grpc_call_error (*)(grpc_server*, void*, grpc_call**, gpr_timespec*, grpc_metadata_array*,
                                grpc_byte_buffer**, grpc_completion_queue*, grpc_completion_queue*, void*)>(
          "grpc_server_request_registered_call");
  if (tag != nullptr) Release(tag);
  return real(server, method, call, deadline, request_metadata, payload, cq_bound, cq_notify, tag);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline, void* reserved) {
  static auto real = RealC<grpc_event (*)(grpc_completion_queue*, gpr_timespec, void*)>("grpc_completion_queue_next");
  const grpc_event event = real(cq, deadline, reserved);
  if (event.type == GRPC_OP_COMPLETE && event.tag != nullptr) Acquire(event.tag);
  return event;
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag, gpr_timespec deadline, void* reserved) {
  static auto real =
      RealC<grpc_event (*)(grpc_completion_queue*, void*, gpr_timespec, void*)>("grpc_completion_queue_pluck");
  const grpc_event event = real(cq, tag, deadline, reserved);
  if (event.type == GRPC_OP_COMPLETE && event.tag != nullptr) Acquire(event.tag);
  return event;
}

}  // extern "C"
