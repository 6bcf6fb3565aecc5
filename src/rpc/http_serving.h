// What odmoe's HTTP servers (main's OpenAI API, every daemon's /metrics; both cpp-httplib from Debian) share:
// how connections get threads, and how the listening socket is bound.
//
// cpp-httplib serves each connection on one thread for the connection's whole life, keep-alive waits included,
// so a connection that says nothing (a client pool's or Prometheus's connection between requests, a port check)
// holds a thread for the server's keep-alive timeout. httplib's own ThreadPool has a fixed number of threads and
// queues the other connections, without bound, behind the idle ones: a few idle connections made new requests
// wait seconds while the server had nothing to do. HttpConnectionPool keeps one thread spare instead: a thread
// that takes a connection and leaves none idle starts the next, up to `max_threads`, so httplib's accept loop
// only hands connections over (it never waits for a thread to start). A thread idle for `idle_lifetime` while
// another is idle too ends, so a burst's threads do not stay for the server's life; one spare always stays.
// At `max_threads` connections served or waiting, enqueue waits for one to end, so the accept loop
// pauses and further connections wait in the kernel's listen backlog: nothing queues here beyond what a thread
// will take.
//
// Thread safety: enqueue and shutdown may be called from any thread (httplib calls enqueue from its one accept
// thread, then shutdown once); the pool's threads run the connections.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "httplib.h"
#include "src/common/metrics.h"

namespace odmoe::rpc {

// The series an HttpConnectionPool keeps in its daemon's registry, labelled server="api" (main's OpenAI API, with
// its /metrics when both share an address) or "metrics" (a daemon's metrics_address):
//   odmoe_http_connections{server}            connections a thread serves now, idle keep-alive ones included
//   odmoe_http_max_connections{server}        the cap; past it, new connections wait in the listen backlog
//   odmoe_http_connection_waits_total{server} connections that found every thread taken and waited for one
// A default-constructed one keeps none.
struct HttpConnectionMetrics {
  metrics::Gauge* open = nullptr;
  metrics::Counter* waits = nullptr;

  // The series of `server` in `registry` (every HTTP server of a daemon shares the families), the cap set.
  static HttpConnectionMetrics In(metrics::Registry& registry, const std::string& server, size_t max_connections);
};

class HttpConnectionPool final : public httplib::TaskQueue {
 public:
  // Starts the first thread. `name` (host:port) is the server's in log lines. REQUIRES: max_threads >= 1.
  HttpConnectionPool(size_t max_threads, std::string name, HttpConnectionMetrics metrics = {},
                     absl::Duration idle_lifetime = absl::Minutes(1));
  ~HttpConnectionPool() override;  // shutdown(), when httplib has not called it

  // Queues `fn` for a thread: at once while fewer than max_threads connections are served or waiting, else
  // once one of them ends (a warning in the log, at most once a minute).
  void enqueue(std::function<void()> fn) override;
  // Runs what is queued, then joins every thread. Idempotent.
  void shutdown() override;

  // Threads running (serving a connection or idle), at most max_threads; 0 after shutdown.
  size_t threads() const;

 private:
  void Work();
  // Starts one more thread; false (logged) when the system refuses one.
  bool StartThread() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Joins the threads that ended for being idle.
  void JoinRetired() ABSL_LOCKS_EXCLUDED(mu_);

  const size_t max_threads_;
  const std::string name_;
  const HttpConnectionMetrics metrics_;
  const absl::Duration idle_lifetime_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  size_t idle_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for a job
  size_t busy_ ABSL_GUARDED_BY(mu_) = 0;  // threads running one
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_full_warning_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> retired_ ABSL_GUARDED_BY(mu_);  // ended for being idle, not yet joined
};

// Serves `http` (its routes and options set, not yet bound) at `host`:`port` (port 0 picks a free one) on
// `*listener`, returning once it runs (its stop() then ends the listener). Each connection runs on a thread of
// an HttpConnectionPool of `max_connections`, counted in `metrics`. The listening socket is bound without SO_REUSEPORT
// (httplib's default sets it, which lets a second process bind a port already listened on: here a taken port is an
// error at start, not a shared port) and listens with a backlog of SOMAXCONN (httplib's is 5: a burst of clients had
// their connections dropped and sent again a second later). Returns the port bound, or Unavailable with why the
// bind failed ("Address already in use (is another process listening there?)") for the caller to put in its
// context.
absl::StatusOr<int> StartHttpServer(httplib::Server& http, const std::string& host, int port, size_t max_connections,
                                    HttpConnectionMetrics metrics, std::thread* listener);

}  // namespace odmoe::rpc
