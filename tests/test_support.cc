#include "tests/test_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "spdlog/sinks/base_sink.h"
#include "spdlog/spdlog.h"

namespace odmoe::testing {
namespace {

// spdlog's registry is a function-local static of libspdlog, which is not instrumented: when a test's first log
// line comes from a gRPC thread (main's health checks of its workers), ThreadSanitizer does not see the static's
// guard and reports the registry's construction as a race with the next thread that logs. Construct it before
// main(), on the main thread, as the daemons do by setting up logging first.
[[maybe_unused]] const bool kLoggerReady = spdlog::default_logger_raw() != nullptr;

}  // namespace

namespace fs = std::filesystem;

std::string SharedDir() { return ODMOE_SHARED_DIR; }
std::string SharedModel(const std::string& name) { return SharedDir() + "/models/" + name; }
bool HaveSharedModel(const std::string& name) { return fs::is_directory(SharedModel(name)); }

std::vector<std::string> SharedModelNames() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(SharedDir() + "/models", ec)) {
    if (e.is_directory()) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string SourceDir() { return ODMOE_SOURCE_DIR; }
std::string BinaryDir() { return ODMOE_BINARY_DIR; }
std::string ProgramPath(const std::string& name) { return BinaryDir() + "/bin/" + name; }

TempDir::TempDir() {
  std::string tmpl = (fs::temp_directory_path() / "odmoe-test-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}
TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void CopyDir(const std::string& from, const std::string& to) {
  for (const auto& e : fs::directory_iterator(from)) {
    if (e.is_regular_file()) {
      fs::copy_file(e.path(), fs::path(to) / e.path().filename(), fs::copy_options::overwrite_existing);
    }
  }
}

std::string ByteLevelChar(uint8_t byte) {
  // Printable Latin-1 bytes stand for themselves; the other 68 take U+0100 and up, in byte order.
  int next = 256, code = 0;
  for (int b = 0; b <= byte; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    code = printable ? b : next++;
  }
  std::string s;
  if (code < 0x80) {
    s += static_cast<char>(code);
  } else {
    s += static_cast<char>(0xC0 | (code >> 6));
    s += static_cast<char>(0x80 | (code & 0x3F));
  }
  return s;
}

std::string ByteLevelChars(std::string_view bytes) {
  std::string s;
  for (const char b : bytes) s += ByteLevelChar(static_cast<uint8_t>(b));
  return s;
}

namespace {

// The first port of the kernel's ephemeral range (32768 when it cannot be read).
int EphemeralLow() {
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (f >> low >> high && low > 2048) return low;
  return 32768;
}

bool CanBind(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// The test processes of this machine claim the ports they draw here, one file per port.
constexpr char kPortClaims[] = "/tmp/odmoe-test-ports";
// A process keeps its newest claims only (a test binary run whole may draw thousands of ports over its life).
constexpr size_t kPortClaimsKept = 256;
constexpr int kTakenByAnother = -1;
constexpr int kNoClaims = -2;  // the folder cannot be used: the bind check alone decides

// An exclusive flock on `port`'s file: its descriptor (held until the process exits or drops the claim),
// kTakenByAnother when another process holds it, or kNoClaims.
int ClaimPort(int port) {
  mkdir(kPortClaims, 0777);  // EEXIST when another process made it
  char path[64];
  std::snprintf(path, sizeof(path), "%s/%d", kPortClaims, port);
  const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return kNoClaims;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const bool taken = errno == EWOULDBLOCK;
    close(fd);
    return taken ? kTakenByAnother : kNoClaims;
  }
  return fd;
}

}  // namespace

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

IdleConnections::IdleConnections(int port, int n) {
  for (int i = 0; i < n; ++i) {
    if (const int fd = ConnectLoopback(port); fd >= 0) fds_.push_back(fd);
  }
}

IdleConnections::~IdleConnections() {
  for (int fd : fds_) close(fd);
}

int IdleConnections::ClosedByServer() const {
  int closed = 0;
  for (int fd : fds_) {
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    // Nothing was sent to these connections, so anything to read is the server's end of it.
    if (poll(&p, 1, 0) != 0) ++closed;
  }
  return closed;
}

std::vector<int> PickFreePorts(int n) {
  static std::mutex mu;
  static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  static std::deque<int> claims;  // the descriptors of this process's newest claims
  std::lock_guard<std::mutex> lock(mu);
  std::uniform_int_distribution<int> draw(10000, EphemeralLow() - 1);
  std::vector<int> ports;
  for (int tries = 0; static_cast<int>(ports.size()) < n; ++tries) {
    if (tries > 10000) throw std::runtime_error("cannot find free ports below the ephemeral range");
    const int port = draw(rng);
    if (std::find(ports.begin(), ports.end(), port) != ports.end()) continue;
    const int claim = ClaimPort(port);
    if (claim == kTakenByAnother) continue;  // another test process drew it, and may not have bound it yet
    if (!CanBind(port)) {
      if (claim >= 0) close(claim);
      continue;
    }
    ports.push_back(port);
    if (claim < 0) continue;
    claims.push_back(claim);
    if (claims.size() > kPortClaimsKept) {
      close(claims.front());
      claims.pop_front();
    }
  }
  return ports;
}

RunResult RunProgram(const std::vector<std::string>& argv) {
  int out_pipe[2], err_pipe[2];
  // Close-on-exec: the program gets only its own ends as stdout/stderr, so nothing it starts in the
  // background (e.g. daemons) keeps the pipes open after it exits.
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int devnull = open("/dev/null", O_RDONLY);
    dup2(devnull, 0);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    close(out_pipe[0]);
    close(err_pipe[0]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  RunResult r;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      } else {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(n));
      }
    }
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
  return r;
}

double MetricSum(std::string_view metrics, std::string_view name, const std::vector<std::string>& filters) {
  double sum = -1;
  std::istringstream lines{std::string(metrics)};
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with(name) || line.size() == name.size()) continue;
    if (line[name.size()] != '{' && line[name.size()] != ' ') continue;  // another metric whose name begins so
    if (!std::ranges::all_of(filters, [&](const std::string& f) { return line.find(f) != std::string::npos; })) {
      continue;
    }
    sum = std::max(sum, 0.0) + std::atof(line.c_str() + line.rfind(' ') + 1);
  }
  return sum;
}

bool Eventually(const std::function<bool()>& cond, std::chrono::seconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

// The formatted lines in a string, written and read under base_sink's mutex (a test reads them while the threads
// it started may still log).
class CapturedLog::Sink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::string text() {
    std::lock_guard<std::mutex> lock(mutex_);
    return text_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    text_.append(formatted.data(), formatted.size());
  }
  void flush_() override {}

 private:
  std::string text_;
};

CapturedLog::CapturedLog() : previous_(spdlog::default_logger()), sink_(std::make_shared<Sink>()) {
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("captured", sink_));
}

CapturedLog::~CapturedLog() { spdlog::set_default_logger(previous_); }

std::string CapturedLog::text() const { return sink_->text(); }

int CapturedLog::Count(const std::string& needle) const {
  const std::string t = text();
  int n = 0;
  for (size_t at = t.find(needle); at != std::string::npos; at = t.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace odmoe::testing
