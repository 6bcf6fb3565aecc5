#include "src/rpc/http_serving.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <system_error>
#include <utility>

#include "spdlog/spdlog.h"
#include "src/common/host_port.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe::rpc {
namespace {

// How often at most a full pool is told in the log: a pool near its cap fills and frees many times a second.
constexpr absl::Duration kFullWarningInterval = absl::Minutes(1);

}  // namespace

HttpConnectionMetrics HttpConnectionMetrics::In(metrics::Registry& registry, const std::string& server,
                                                size_t max_connections) {
  registry
      .SharedGauge("odmoe_http_max_connections",
                   "Connections an HTTP server serves at once; more wait in the listen backlog.", {"server"})
      .With({server})
      .Set(static_cast<double>(max_connections));
  return {
      .open = &registry
                   .SharedGauge("odmoe_http_connections",
                                "Connections an HTTP server serves now, idle keep-alive ones included.", {"server"})
                   .With({server}),
      .waits = &registry
                    .SharedCounter("odmoe_http_connection_waits_total",
                                   "Connections that found odmoe_http_max_connections taken and waited for one to end.",
                                   {"server"})
                    .With({server}),
  };
}

HttpConnectionPool::HttpConnectionPool(size_t max_threads, std::string name, HttpConnectionMetrics metrics,
                                       absl::Duration idle_lifetime)
    : max_threads_(max_threads), name_(std::move(name)), metrics_(metrics), idle_lifetime_(idle_lifetime) {
  ODMOE_CHECK(max_threads >= 1);
  absl::MutexLock lock(&mu_);
  StartThread();
}

HttpConnectionPool::~HttpConnectionPool() { shutdown(); }

bool HttpConnectionPool::StartThread() {
  try {
    threads_.emplace_back([this] { Work(); });
    return true;
  } catch (const std::system_error& e) {
    spdlog::warn("HTTP server at {}: cannot start a thread for connections ({}) beside {} running", name_, e.what(),
                 threads_.size());
    return false;
  }
}

void HttpConnectionPool::JoinRetired() {
  std::vector<std::thread> retired;
  {
    absl::MutexLock lock(&mu_);
    retired.swap(retired_);
  }
  for (std::thread& t : retired) t.join();  // each has left Work(): nothing to wait for
}

void HttpConnectionPool::enqueue(std::function<void()> fn) {
  JoinRetired();
  mu_.Lock();
  const auto has_room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return busy_ + jobs_.size() < max_threads_ || shutdown_;
  };
  if (!has_room()) {
    if (metrics_.waits != nullptr) metrics_.waits->Add();
    if (absl::Now() - last_full_warning_ >= kFullWarningInterval) {
      last_full_warning_ = absl::Now();
      spdlog::warn(
          "HTTP server at {}: all {} connections are taken (requests and idle keep-alive connections); "
          "new ones wait in the listen backlog",
          name_, max_threads_);
    }
  }
  mu_.Await(absl::Condition(&has_room));
  // After shutdown (httplib does not enqueue then) or with no thread at all (the system refused every one),
  // nothing would run it: it runs here.
  if (shutdown_ || (threads_.empty() && !StartThread())) {
    mu_.Unlock();
    fn();
    return;
  }
  jobs_.push_back(std::move(fn));
  mu_.Unlock();
}

void HttpConnectionPool::Work() {
  mu_.Lock();
  for (;;) {
    ++idle_;
    const auto has_job = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !jobs_.empty() || shutdown_; };
    const bool woken = mu_.AwaitWithTimeout(absl::Condition(&has_job), idle_lifetime_);
    --idle_;
    if (!woken) {
      if (idle_ == 0) continue;  // the spare stays
      // Idle beside another idle thread: this one ends, its handle left for the next enqueue (or shutdown) to join.
      const auto self = std::find_if(threads_.begin(), threads_.end(),
                                     [](const std::thread& t) { return t.get_id() == std::this_thread::get_id(); });
      if (self != threads_.end()) {  // not yet taken by shutdown
        retired_.push_back(std::move(*self));
        threads_.erase(self);
      }
      break;
    }
    if (jobs_.empty()) break;  // shut down, nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    ++busy_;
    if (metrics_.open != nullptr) metrics_.open->Add(1);  // under mu_, so that it counts the jobs in the order taken
    // Keep one thread spare, so that the next connection is taken at once.
    if (idle_ == 0 && threads_.size() < max_threads_ && !shutdown_) StartThread();
    mu_.Unlock();
    job();
    job = nullptr;  // the connection's state goes before the thread counts as free
    mu_.Lock();
    --busy_;
    if (metrics_.open != nullptr) metrics_.open->Add(-1);
  }
  mu_.Unlock();
}

void HttpConnectionPool::shutdown() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
  JoinRetired();  // after the joins: a thread may retire until shutdown_ is seen
}

size_t HttpConnectionPool::threads() const {
  absl::MutexLock lock(&mu_);
  return threads_.size();
}

absl::StatusOr<int> StartHttpServer(httplib::Server& http, const std::string& host, int port, size_t max_connections,
                                    HttpConnectionMetrics metrics, std::thread* listener) {
  auto listening = std::make_shared<int>(-1);  // httplib's listening socket, as it is bound
  http.set_socket_options([listening](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    *listening = sock;
  });
  errno = 0;
  const int bound = port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    const int err = errno;
    return absl::UnavailableError(
        StrCat(err != 0 ? std::strerror(err) : "bind failed", " (is another process listening there?)"));
  }
  // listen() again on a listening socket sets its backlog anew.
  if (*listening < 0 || listen(*listening, SOMAXCONN) != 0) {
    spdlog::warn("HTTP server at {}: listen backlog left at httplib's 5 ({})", JoinHostPort(host, bound),
                 *listening < 0 ? "socket not seen" : std::strerror(errno));
  }
  http.new_task_queue = [max_connections, name = JoinHostPort(host, bound), metrics] {
    return new HttpConnectionPool(max_connections, name, metrics);
  };
  *listener = std::thread([&http] { http.listen_after_bind(); });  // it makes the task queue
  // stop() only stops a server that is running: wait for it, so that the caller's stop() never misses it.
  while (!http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return bound;
}

}  // namespace odmoe::rpc
