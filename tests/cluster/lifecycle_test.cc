// The daemons' life cycle as real processes on loopback, with a tiny synthetic model (no ../shared needed):
// a second daemon on a taken port exits naming node and address; a daemon tells systemd READY=1 once it
// listens (main: whether or not its workers are up), pings the watchdog and says STOPPING=1 on SIGTERM; a
// killed or hung worker costs a request in flight latency, not its tokens (failover, Operations 4/4), main's
// readiness ("odmoe.ready") turns NOT_SERVING only when no worker is left and SERVING again when one returns;
// and `odmoe cluster status` shows liveness, readiness and each node's build version.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "odmoe/v1/main.grpc.pb.h"
#include "src/common/json.h"
#include "src/common/limits.h"
#include "src/common/strings.h"
#include "src/common/status.h"
#include "src/common/version.h"
#include "src/rpc/rpc_util.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using odmoe::testing::ProgramPath;
using odmoe::testing::ReadFile;
using odmoe::testing::RunProgram;
using odmoe::testing::Eventually;
using odmoe::testing::RunResult;
using Clock = std::chrono::steady_clock;

// A cluster file of main and two workers (one group: top-2 of 4 experts) on free loopback ports, with the
// synthetic tiny Mixtral of tests/data (2 layers).
// `cluster_extra`: more [cluster] keys; main serves the OpenAI API at Address(3).
struct ClusterFile {
  explicit ClusterFile(const std::string& cluster_extra = "") {
    ports = odmoe::testing::PickFreePorts(4);
    const std::string toml =
        StrCat("[cluster]\nname = \"lifecycle\"\nrpc_timeout_ms = 30000\nstartup_timeout_ms = 60000\n",
               cluster_extra, "[model]\nsynthetic = \"", odmoe::testing::SourceDir(),
               "/tests/data/tiny-mixtral/config.json\"\nlayers = 2\nseed = 1\n",
               "[[node]]\nname = \"main\"\nrole = \"main\"\naddress = \"", Address(0), "\"\ndevice = \"cpu\"\n",
               "http_address = \"", Address(3), "\"\n",
               "[[node]]\nname = \"w0\"\nrole = \"worker\"\naddress = \"", Address(1), "\"\ndevice = \"mock-gpu\"\n",
               "[[node]]\nname = \"w1\"\nrole = \"worker\"\naddress = \"", Address(2), "\"\ndevice = \"mock-gpu\"\n");
    path = dir.File("cluster.toml");
    odmoe::testing::WriteFile(path, toml);
  }
  std::string Address(size_t i) const { return StrCat("127.0.0.1:", ports[i]); }

  odmoe::testing::TempDir dir;
  std::vector<int> ports;
  std::string path;
};

// Starts `argv` in the background with `env` added to its environment, stdout and stderr to `log`.
pid_t Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    setsid();
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

// SIGTERM, then the exit code (-1 for a signal); SIGKILL after 20 s.
int Terminate(pid_t pid) {
  kill(pid, SIGTERM);
  const auto give_up = Clock::now() + std::chrono::seconds(20);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > give_up) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A spawned daemon, stopped on scope exit unless Stop() was called (so a failed assertion leaves none behind).
class Daemon {
 public:
  explicit Daemon(pid_t pid) : pid_(pid) {}
  ~Daemon() {
    if (pid_ > 0) Terminate(pid_);
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;
  pid_t pid() const { return pid_; }
  // SIGTERM and the exit code.
  int Stop() {
    const int code = Terminate(pid_);
    pid_ = -1;
    return code;
  }

 private:
  pid_t pid_;
};

bool Serving(const std::string& address, const std::string& service) {
  auto s = rpc::CheckServing(address, 1000, service);
  return s.ok() && *s;
}

TEST(LifecycleTest, ASecondDaemonOnATakenPortExitsNamingNodeAndAddress) {
  ClusterFile c;
  const std::string log = c.dir.File("w0.log");
  Daemon first(Spawn({ProgramPath("odmoe-worker"), "--config", c.path, "--node", "w0"}, {}, log));
  ASSERT_TRUE(Eventually([&] { return Serving(c.Address(1), rpc::kLivenessService); }, std::chrono::seconds(30)))
      << ReadFile(log);
  const RunResult second = RunProgram({ProgramPath("odmoe-worker"), "--config", c.path, "--node", "w0"});
  EXPECT_NE(second.exit_code, 0) << second.err;
  EXPECT_EQ(second.signal, 0);
  bool named = false;  // one log line of ours names the node and the address
  std::istringstream lines(second.err);
  for (std::string line; std::getline(lines, line);) {
    named = named || (line.find("odmoe-worker: ") != std::string::npos && line.find("'w0'") != std::string::npos &&
                      line.find(c.Address(1)) != std::string::npos && line.find("in use") != std::string::npos);
  }
  EXPECT_TRUE(named) << second.err;
  // The first is unaffected and stops cleanly.
  EXPECT_TRUE(Serving(c.Address(1), rpc::kReadinessService));
  EXPECT_EQ(first.Stop(), 0) << ReadFile(log);
}

// A unix datagram socket standing in for systemd's notify socket.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    ok_ = fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~NotifySocket() {
    if (fd_ >= 0) close(fd_);
    unlink(path_.c_str());
  }
  bool ok() const { return ok_; }
  // Reads messages until one contains `line` (a whole line), up to `limit`; true if it came.
  bool WaitFor(const std::string& line, std::chrono::seconds limit) {
    const auto give_up = Clock::now() + limit;
    while (Clock::now() < give_up) {
      timeval tv{0, 100000};
      setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) continue;
      const std::string msg(buf, static_cast<size_t>(n));
      messages_.push_back(msg);
      std::istringstream lines(msg);
      for (std::string l; std::getline(lines, l);) {
        if (l == line) return true;
      }
    }
    return false;
  }
  std::string all() const {
    std::string out;
    for (const auto& m : messages_) out += "[" + m + "] ";
    return out;
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool ok_ = false;
  std::vector<std::string> messages_;
};

TEST(LifecycleTest, MainTellsSystemdReadyWhenItListensPingsTheWatchdogAndSaysStopping) {
  ClusterFile c;  // no worker runs: main is live but not ready, and still READY=1 for systemd
  NotifySocket notify(c.dir.File("notify"));
  ASSERT_TRUE(notify.ok()) << std::strerror(errno);
  const std::string log = c.dir.File("main.log");
  Daemon main(Spawn({ProgramPath("odmoe-main"), "--config", c.path, "--node", "main"},
                    {"NOTIFY_SOCKET=" + c.dir.File("notify"), "WATCHDOG_USEC=200000"}, log));
  ASSERT_TRUE(notify.WaitFor("READY=1", std::chrono::seconds(30))) << notify.all() << ReadFile(log);
  // READY=1 came after the server listens.
  EXPECT_TRUE(Serving(c.Address(0), rpc::kLivenessService));
  EXPECT_FALSE(Serving(c.Address(0), rpc::kReadinessService)) << "no worker runs";
  EXPECT_TRUE(notify.WaitFor("WATCHDOG=1", std::chrono::seconds(5))) << notify.all();
  EXPECT_TRUE(notify.WaitFor("WATCHDOG=1", std::chrono::seconds(5))) << notify.all();
  kill(main.pid(), SIGTERM);
  EXPECT_TRUE(notify.WaitFor("STOPPING=1", std::chrono::seconds(10))) << notify.all();
  EXPECT_EQ(main.Stop(), 0) << ReadFile(log);
  EXPECT_NE(ReadFile(log).find(StrCat("node main (odmoe ", BuildVersion(), ") live on ", c.Address(0))),
            std::string::npos)
      << ReadFile(log);
}

// `odmoe cluster status --json` (with `extra` flags) by node; its exit code in `exit_code`.
Json Status(const ClusterFile& c, const std::string& run_dir, int* exit_code,
            const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {ProgramPath("odmoe"), "cluster", "status", "--config", c.path,
                                   "--run-dir",          run_dir,   "--json"};
  args.insert(args.end(), extra.begin(), extra.end());
  const RunResult r = RunProgram(args);
  *exit_code = r.exit_code;
  auto j = ParseJson(r.out, "cluster status");
  EXPECT_TRUE(j.ok()) << r.out << r.err;
  Json by_node = Json::object();
  if (j.ok()) {
    for (const Json& n : (*j)["nodes"]) by_node[n["node"].get<std::string>()] = n;
  }
  return by_node;
}

// `odmoe cluster up` of `c` into its run folder (the result in `up`), and `cluster down` when it goes, every
// node in `resume` first sent SIGCONT (a stopped process keeps SIGTERM pending).
struct UpCluster {
  explicit UpCluster(const ClusterFile& file)
      : c(file),
        run_dir(file.dir.File("run")),
        up(RunProgram({ProgramPath("odmoe"), "cluster", "up", "--config", file.path, "--run-dir", run_dir})) {}
  ~UpCluster() {
    for (pid_t pid : resume) kill(pid, SIGCONT);
    RunProgram({ProgramPath("odmoe"), "cluster", "down", "--config", c.path, "--run-dir", run_dir});
  }
  pid_t Pid(const std::string& node) const { return std::stoi(ReadFile(run_dir + "/" + node + ".pid")); }

  const ClusterFile& c;
  const std::string run_dir;
  const RunResult up;
  std::vector<pid_t> resume;
};

// One streamed request through main's gRPC API: every generated token, in order. `after_first` runs once, when
// the first token has arrived (the request is then in decode).
struct Streamed {
  grpc::Status status;
  std::vector<int32_t> tokens;
  uint64_t calls_reissued = 0;
};
Streamed StreamGenerate(const std::string& address, int64_t max_new_tokens,
                        const std::function<void()>& after_first = nullptr) {
  auto stub = v1::Inference::NewStub(rpc::MakeChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::GenerateRequest req;
  for (int32_t id : {1, 5, 9, 13}) req.add_prompt_ids(id);
  req.set_max_new_tokens(max_new_tokens);
  req.set_ignore_eos(true);
  Streamed out;
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse msg;
  bool first = true;
  while (reader->Read(&msg)) {
    if (msg.done()) {
      out.calls_reissued = msg.stats().calls_reissued();
      continue;
    }
    out.tokens.insert(out.tokens.end(), msg.tokens().begin(), msg.tokens().end());
    if (first && after_first) after_first();
    first = false;
  }
  out.status = reader->Finish();
  return out;
}

// Operations 4/4 on the plain loopback cluster: SIGKILL of a worker mid-request costs latency, never the
// request (same tokens, its calls re-issued to the other worker); main stays ready, degraded, and serves the
// next request without it; with every worker gone it is NOT_SERVING and fails fast naming the layer and the
// workers; a worker started again rejoins under a new membership epoch and main is ready again by itself.
TEST(LifecycleTest, AKilledWorkerCostsNoRequestAndMainIsNotReadyOnlyWithNoWorkerLeft) {
  ClusterFile c;
  UpCluster cluster(c);
  ASSERT_EQ(cluster.up.exit_code, 0) << cluster.up.out << cluster.up.err;
  const std::string& run_dir = cluster.run_dir;
  // `up` waits for readiness: main reaches both workers.
  EXPECT_TRUE(Serving(c.Address(0), rpc::kReadinessService));
  int code = -1;
  Json status = Status(c, run_dir, &code);
  EXPECT_EQ(code, 0);
  for (const char* node : {"main", "w0", "w1"}) {
    EXPECT_EQ(status[node]["health"], "SERVING") << status.dump();
    EXPECT_EQ(status[node]["ready"], "SERVING") << status.dump();
    EXPECT_EQ(status[node]["version"], std::string(BuildVersion())) << status.dump();
    EXPECT_EQ(status[node]["pid"], cluster.Pid(node)) << status.dump();
  }
  constexpr int64_t kTokens = 400;  // long enough (the tiny model decodes fast) for the fault to land mid-request
  const Streamed fault_free = StreamGenerate(c.Address(0), kTokens);
  ASSERT_TRUE(fault_free.status.ok()) << fault_free.status.error_message();
  ASSERT_EQ(fault_free.tokens.size(), static_cast<size_t>(kTokens));
  EXPECT_EQ(fault_free.calls_reissued, 0u);

  // Kill w1 the hard way while the request decodes: it completes with the same tokens.
  const pid_t w1 = cluster.Pid("w1");
  const std::string main_log = run_dir + "/latest/main.log";
  const Streamed faulted = StreamGenerate(c.Address(0), kTokens, [&] { ASSERT_EQ(kill(w1, SIGKILL), 0); });
  ASSERT_TRUE(faulted.status.ok()) << faulted.status.error_message() << ReadFile(main_log);
  EXPECT_EQ(faulted.tokens, fault_free.tokens);
  EXPECT_GT(faulted.calls_reissued, 0u) << ReadFile(main_log);
  EXPECT_NE(ReadFile(main_log).find("worker w1 left"), std::string::npos) << ReadFile(main_log);
  // The next request is served without it, from the start; main is ready (degraded) and says who is missing.
  const Streamed next = StreamGenerate(c.Address(0), kTokens);
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.tokens, fault_free.tokens);
  EXPECT_EQ(next.calls_reissued, 0u);
  EXPECT_TRUE(Serving(c.Address(0), rpc::kReadinessService));
  status = Status(c, run_dir, &code);
  EXPECT_EQ(status["main"]["ready"], "SERVING") << status.dump();
  EXPECT_EQ(status["w1"]["health"], "UNREACHABLE") << status.dump();
  EXPECT_TRUE(status["w1"]["version"].is_null()) << status.dump();
  EXPECT_NE(ReadFile(main_log).find("1 unreachable: w1"), std::string::npos) << ReadFile(main_log);
  // A health check of some nodes (a container's): the others do not count.
  status = Status(c, run_dir, &code, {"--node", "w0,main"});
  EXPECT_EQ(code, 0) << status.dump();
  EXPECT_EQ(status.size(), 2u) << status.dump();
  EXPECT_EQ(status["w0"]["ready"], "SERVING") << status.dump();
  Status(c, run_dir, &code, {"--node", "w1"});
  EXPECT_NE(code, 0);

  // No worker left: not ready, and a request fails fast naming the layer and the workers.
  ASSERT_EQ(kill(cluster.Pid("w0"), SIGKILL), 0);
  EXPECT_TRUE(Eventually([&] { return !Serving(c.Address(0), rpc::kReadinessService); }, std::chrono::seconds(10)))
      << ReadFile(main_log);
  EXPECT_TRUE(Serving(c.Address(0), rpc::kLivenessService));
  const Streamed none = StreamGenerate(c.Address(0), kTokens);
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(none.status.error_message().find("cannot be served: every worker is out of the placement"),
            std::string::npos)
      << none.status.error_message();
  EXPECT_NE(none.status.error_message().find("layer"), std::string::npos) << none.status.error_message();
  for (const char* w : {"w0 (", "w1 ("}) {
    EXPECT_NE(none.status.error_message().find(w), std::string::npos) << none.status.error_message();
  }
  EXPECT_NE(ReadFile(main_log).find("no reachable owner: w0"), std::string::npos) << ReadFile(main_log);

  // Restart w1 by hand: it rejoins, main is ready again by itself and serves the same tokens.
  const std::string log = c.dir.File("w1-again.log");
  Daemon again(Spawn({ProgramPath("odmoe-worker"), "--config", c.path, "--node", "w1"}, {}, log));
  EXPECT_TRUE(Eventually([&] { return Serving(c.Address(0), rpc::kReadinessService); }, std::chrono::seconds(20)))
      << ReadFile(log) << ReadFile(main_log);
  EXPECT_NE(ReadFile(main_log).find("worker w1 rejoined"), std::string::npos) << ReadFile(main_log);
  status = Status(c, run_dir, &code);
  EXPECT_EQ(status["w1"]["pid"], again.pid()) << status.dump();  // not in the pid file: found by its --config
  EXPECT_TRUE(status["w0"]["pid"].is_null()) << status.dump();
  const Streamed back = StreamGenerate(c.Address(0), kTokens);
  ASSERT_TRUE(back.status.ok()) << back.status.error_message();
  EXPECT_EQ(back.tokens, fault_free.tokens);
  EXPECT_EQ(again.Stop(), 0) << ReadFile(log);
}

// A hung worker (SIGSTOP) mid-request: main takes it out of the placement within its detection time (or sooner,
// when a call to it outlives its learnt bound) and the request completes with the same tokens, long before
// rpc_timeout_ms (30 s here); after SIGCONT it rejoins by itself.
TEST(LifecycleTest, AHungWorkerCostsLatencyNotTheRequestAndRejoinsAfterSigcont) {
  ClusterFile c;
  UpCluster cluster(c);
  ASSERT_EQ(cluster.up.exit_code, 0) << cluster.up.out << cluster.up.err;
  const std::string& run_dir = cluster.run_dir;
  const pid_t w1 = cluster.Pid("w1");
  cluster.resume.push_back(w1);
  constexpr int64_t kTokens = 400;  // long enough (the tiny model decodes fast) for the fault to land mid-request
  auto start = Clock::now();
  const Streamed before = StreamGenerate(c.Address(0), kTokens);
  const auto before_took = Clock::now() - start;
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();

  const std::string main_log = run_dir + "/latest/main.log";
  start = Clock::now();
  const Streamed hung = StreamGenerate(c.Address(0), kTokens, [&] { ASSERT_EQ(kill(w1, SIGSTOP), 0); });
  const auto hung_took = Clock::now() - start;
  ASSERT_TRUE(hung.status.ok()) << hung.status.error_message() << ReadFile(main_log);
  EXPECT_EQ(hung.tokens, before.tokens);
  EXPECT_GT(hung.calls_reissued, 0u);
  // The fault costs about the detection time, 1.75 s (x kBuildSlowdown under the sanitizers), or less when a
  // call outlives its learnt bound first; waiting for the deadline would cost 30 s.
  EXPECT_LT(hung_took - before_took, std::chrono::seconds(3 + 3 * kBuildSlowdown)) << "waited for the deadline";
  EXPECT_TRUE(Eventually(
      [&] { return ReadFile(main_log).find("peer w1 at " + c.Address(2) + " is down") != std::string::npos; },
      std::chrono::seconds(5)))
      << ReadFile(main_log);
  EXPECT_TRUE(Serving(c.Address(0), rpc::kReadinessService));

  ASSERT_EQ(kill(w1, SIGCONT), 0);
  EXPECT_TRUE(Eventually([&] { return ReadFile(main_log).find("worker w1 rejoined") != std::string::npos; },
                         std::chrono::seconds(10)))
      << ReadFile(main_log);
  const Streamed after = StreamGenerate(c.Address(0), kTokens);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_NE(ReadFile(main_log).find("peer w1 at " + c.Address(2) + " is up"), std::string::npos);
}

// Admission control: with max_running = 1 and max_queued = 0, a request arriving while one runs is refused at
// once, busy: gRPC RESOURCE_EXHAUSTED saying so (what `odmoe generate` exits 10 for), HTTP 429 with Retry-After,
// streamed or not; the request running is untouched, and the next one after it is served (one of three choices
// too, each in turn). Its queue time is in its stats.
TEST(LifecycleTest, ABusyMainRefusesAtOnceAsBusyOverGrpcAndHttp) {
  ClusterFile c("max_running = 1\nmax_queued = 0\n");
  UpCluster cluster(c);
  ASSERT_EQ(cluster.up.exit_code, 0) << cluster.up.out << cluster.up.err;
  const std::string http = "http://" + c.Address(3);
  const std::string model = "tiny-mixtral-synthetic";  // a synthetic model's id: its config's folder, -synthetic
  auto curl = [&](bool stream, int n = 1) {
    return RunProgram({"/usr/bin/curl", "-s", "-i", "--max-time", "20", "-H", "Content-Type: application/json",
                       "--data-binary",
                       StrCat("{\"model\": \"", model, "\", \"prompt\": [1, 2, 3], \"max_tokens\": 2, \"n\": ", n,
                              stream ? ", \"stream\": true" : "", "}"),
                       http + "/v1/completions"});
  };
  Streamed running;
  std::atomic<bool> busy_checked{false};
  std::thread t([&] {
    running = StreamGenerate(c.Address(0), 1000, [&] {
      // The engine is taken: every other request is refused now.
      auto stub = v1::Inference::NewStub(rpc::MakeChannel(c.Address(0)));
      grpc::ClientContext ctx;
      v1::GenerateRequest req;
      req.add_prompt_ids(1);
      req.set_max_new_tokens(1);
      auto reader = stub->Generate(&ctx, req);
      v1::GenerateResponse msg;
      while (reader->Read(&msg)) {
      }
      const grpc::Status refused = reader->Finish();
      EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_EQ(refused.error_message(),
                "the server is busy: 1 request running (max_running = 1) and 0 queued (max_queued = 0); retry "
                "later");
      EXPECT_TRUE(IsServerBusy(rpc::FromGrpc(refused, "main")));
      EXPECT_EQ(ExitCodeFor(rpc::FromGrpc(refused, "main")), kExitBusy);
      for (const bool stream : {false, true}) {
        const RunResult r = curl(stream);
        EXPECT_NE(r.out.find("HTTP/1.1 429"), std::string::npos) << r.out;
        EXPECT_NE(r.out.find("Retry-After: 1"), std::string::npos) << r.out;
        EXPECT_NE(r.out.find("\"code\":\"server_busy\""), std::string::npos) << r.out;
      }
      busy_checked = true;
    });
  });
  t.join();
  EXPECT_TRUE(busy_checked);
  ASSERT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.tokens.size(), 1000u);
  // Free again: served, through both APIs.
  const Streamed after = StreamGenerate(c.Address(0), 4);
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_NE(curl(false).out.find("HTTP/1.1 200"), std::string::npos);
  // Three choices with room for one at a time: each after the other, every one served.
  const RunResult three = curl(false, 3);
  EXPECT_NE(three.out.find("HTTP/1.1 200"), std::string::npos) << three.out;
  EXPECT_NE(three.out.find("\"index\":2"), std::string::npos) << three.out;
  const RunResult cli = RunProgram({ProgramPath("odmoe"), "generate", "--endpoint", c.Address(0), "--prompt-ids",
                                    "1,2,3", "--max-new-tokens", "2", "--json"});
  ASSERT_EQ(cli.exit_code, 0) << cli.err;
  auto j = ParseJson(cli.out, "odmoe generate --json");
  ASSERT_TRUE(j.ok()) << cli.out;
  EXPECT_GE((*j)["stats"]["queue_ms"].get<double>(), 0.0);
  EXPECT_GE((*j)["stats"]["ttft_ms"].get<double>(), (*j)["stats"]["queue_ms"].get<double>());
}

// Sixteen clients at once (the default max_queued = 32): every one is served, in turn, with the tokens it gets
// alone; none is turned away by the gRPC server's thread quota ("Server Threadpool Exhausted").
TEST(LifecycleTest, SixteenClientsAtOnceAreAllServedInTurn) {
  ClusterFile c;
  UpCluster cluster(c);
  ASSERT_EQ(cluster.up.exit_code, 0) << cluster.up.out << cluster.up.err;
  const Streamed alone = StreamGenerate(c.Address(0), 40);
  ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
  std::vector<Streamed> results(16);
  std::vector<std::thread> clients;
  for (Streamed& r : results) clients.emplace_back([&] { r = StreamGenerate(c.Address(0), 40); });
  for (std::thread& t : clients) t.join();
  for (const Streamed& r : results) {
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, alone.tokens);
  }
}

}  // namespace
}  // namespace odmoe
