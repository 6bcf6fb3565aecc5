// Checks that scripts/sanitize.sh's ThreadSanitizer setup can see races and sees through absl synchronization.
//   tsan_canary race     two threads increment a counter with no synchronization: TSan must report it. The second
//                        starts its increments once the first has finished, told by a relaxed atomic (which gives
//                        TSan no happens-before): TSan can miss a race whose two accesses are truly simultaneous
//                        (CI's stop 55 saw a lost update go unreported), never one whose accesses are apart in time.
//   tsan_canary locked   the same under absl::MutexLock, plus hand-offs through CondVar::Wait(WithTimeout),
//                        Mutex::Await(WithTimeout), LockWhen and Notification: TSan must report nothing (needs
//                        tsan_absl_shim preloaded; without it TSan reports the first of them)
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace {

int counter = 0;  // the raced-on value

void Race() {
  std::atomic<bool> first_done{false};
  std::thread a([&] {
    for (int i = 0; i < 1000; ++i) ++counter;
    first_done.store(true, std::memory_order_relaxed);
  });
  std::thread b([&] {
    while (!first_done.load(std::memory_order_relaxed)) std::this_thread::yield();
    for (int i = 0; i < 1000; ++i) ++counter;
  });
  a.join();
  b.join();
}

void Locked() {
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        absl::MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();

  // Producer/consumer through a CondVar: the consumer reads what the producer wrote before signalling.
  absl::CondVar cv;
  int payload = 0;
  bool ready = false;
  std::thread producer([&] {
    payload = 42;
    absl::MutexLock lock(&mu);
    ready = true;
    cv.Signal();
  });
  {
    absl::MutexLock lock(&mu);
    while (!ready) cv.Wait(&mu);
  }
  if (payload != 42) std::abort();
  producer.join();

  // The same through Mutex::Await.
  int payload2 = 0;
  bool ready2 = false;
  std::thread producer2([&] {
    payload2 = 7;
    absl::MutexLock lock(&mu);
    ready2 = true;
  });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&ready2));
  }
  if (payload2 != 7) std::abort();
  producer2.join();

  // The timed variants, which Abseil implements by calling the deadline ones through the PLT.
  int payload4 = 0;
  bool ready4 = false;
  std::thread producer4([&] {
    payload4 = 11;
    absl::MutexLock lock(&mu);
    ready4 = true;
    cv.SignalAll();
  });
  {
    absl::MutexLock lock(&mu);
    while (!ready4) cv.WaitWithTimeout(&mu, absl::Milliseconds(5));
  }
  if (payload4 != 11) std::abort();
  producer4.join();
  int payload5 = 0;
  bool ready5 = false;
  std::thread producer5([&] {
    payload5 = 13;
    absl::MutexLock lock(&mu);
    ready5 = true;
  });
  mu.LockWhen(absl::Condition(&ready5));
  mu.Unlock();
  if (payload5 != 13) std::abort();
  producer5.join();
  {
    absl::MutexLock lock(&mu);
    ready5 = false;
  }
  std::thread producer6([&] {
    payload5 = 17;
    absl::MutexLock lock(&mu);
    ready5 = true;
  });
  {
    absl::MutexLock lock(&mu);
    while (!mu.AwaitWithTimeout(absl::Condition(&ready5), absl::Milliseconds(5))) {
    }
  }
  if (payload5 != 17) std::abort();
  producer6.join();

  // And through a Notification.
  int payload3 = 0;
  absl::Notification done;
  std::thread producer3([&] {
    payload3 = 9;
    done.Notify();
  });
  done.WaitForNotification();
  if (payload3 != 9) std::abort();
  producer3.join();
  int payload7 = 0;
  absl::Notification done7;
  std::thread producer7([&] {
    payload7 = 19;
    done7.Notify();
  });
  while (!done7.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
  }
  if (payload7 != 19) std::abort();
  producer7.join();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "race") == 0) {
    Race();
  } else if (argc == 2 && std::strcmp(argv[1], "locked") == 0) {
    Locked();
  } else {
    std::fprintf(stderr, "usage: tsan_canary race|locked\n");
    return 2;
  }
  std::printf("counter %d\n", counter);
  return 0;
}
