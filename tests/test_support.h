// Helpers shared by the tests: where ../shared and the build live, temporary folders, running programs.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace spdlog {
class logger;
}  // namespace spdlog

namespace odmoe::testing {

// ../shared next to the project root (CMake's ODMOE_SHARED_DIR).
std::string SharedDir();
// ../shared/models/NAME.
std::string SharedModel(const std::string& name);
// True if ../shared/models/NAME exists; tests that need it skip with a message naming the path otherwise.
bool HaveSharedModel(const std::string& name);
// Names of every model folder under ../shared/models (sorted).
std::vector<std::string> SharedModelNames();

std::string SourceDir();
std::string BinaryDir();
// build/bin/NAME.
std::string ProgramPath(const std::string& name);

// A fresh empty directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const std::string& contents);
std::string ReadFile(const std::string& path);
// Copies every regular file of `from` into `to` (which must exist).
void CopyDir(const std::string& from, const std::string& to);

// The character that stands for `byte` in the byte-level alphabet of tokenizer.json BPE models (GPT-2's
// bytes_to_unicode), in UTF-8; and `bytes` spelled in it.
std::string ByteLevelChar(uint8_t byte);
std::string ByteLevelChars(std::string_view bytes);

// `n` distinct TCP ports on 127.0.0.1 that were free a moment ago, so tests that start servers can run in
// parallel. They are drawn at random below the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port
// the kernel hands out for port 0 or for an outgoing connection may be taken by another test's client before
// our server binds it ("Address already in use"). And each port drawn is claimed among the test processes (a
// flock on /tmp/odmoe-test-ports/PORT, held while the process lives, for its newest 256 ports), so that two tests
// running side by side never draw the same one between its draw and its server's bind.
std::vector<int> PickFreePorts(int n);

// A TCP connection to 127.0.0.1:`port`: its socket (the caller closes it), or -1 when it is refused.
int ConnectLoopback(int port);

// `n` TCP connections to 127.0.0.1:`port` that send nothing, as a client's idle keep-alive connections; closed
// when it goes.
class IdleConnections {
 public:
  IdleConnections(int port, int n);
  ~IdleConnections();
  IdleConnections(const IdleConnections&) = delete;
  IdleConnections& operator=(const IdleConnections&) = delete;

  size_t connected() const { return fds_.size(); }
  // How many the server has closed (or reset) so far.
  int ClosedByServer() const;

 private:
  std::vector<int> fds_;
};

struct RunResult {
  int exit_code = -1;  // the program's exit status; -1 if it did not exit normally (signal)
  int signal = 0;      // the signal that ended it, if any
  std::string out;     // stdout
  std::string err;     // stderr
};
// Runs `argv` (argv[0] a path) to completion with no stdin, capturing stdout and stderr.
RunResult RunProgram(const std::vector<std::string>& argv);

// The sum of the samples of metric `name` in `metrics` (Prometheus text, as a /metrics page serves it) whose line
// contains every one of `filters` (label pairs such as `code="200"`); -1 when there is none.
double MetricSum(std::string_view metrics, std::string_view name, const std::vector<std::string>& filters = {});

// Polls `cond` every 50 ms until it holds (true) or `limit` has passed (false).
bool Eventually(const std::function<bool()>& cond, std::chrono::seconds limit);

// Collects what spdlog's default logger writes while it lives. Make it before starting anything that logs from
// threads of its own and end it after they stop: swapping the default logger is not safe against a concurrent
// log call. text() and Count() may be called while other threads log (they read under the sink's lock).
class CapturedLog {
 public:
  CapturedLog();
  ~CapturedLog();
  CapturedLog(const CapturedLog&) = delete;
  CapturedLog& operator=(const CapturedLog&) = delete;
  std::string text() const;
  // How many times `needle` occurs in the text.
  int Count(const std::string& needle) const;

  class Sink;  // test_support.cc

 private:
  std::shared_ptr<spdlog::logger> previous_;
  std::shared_ptr<Sink> sink_;
};

}  // namespace odmoe::testing
