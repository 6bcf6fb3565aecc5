// Operating a cluster started with `odmoe cluster up` (real processes on loopback, synthetic weights of
// tests/data/tiny-mixtral, so no ../shared is needed): one request's id in the logs of every node that served
// it, bad prompts refused with a clear message, run folders kept across restarts, and `cluster down` stopping
// every process of the cluster (pid files or not) and removing the workers' shared memory.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"
#include "src/cluster/client.h"
#include "src/common/json.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

namespace fs = std::filesystem;
using odmoe::testing::ProgramPath;
using odmoe::testing::RunProgram;
using odmoe::testing::RunResult;

// A cluster of main, shadow and `workers` workers with synthetic weights; `cluster up` on Up(), `cluster down`
// on destruction. The cluster name is unique to this process and test, so its /dev/shm segments are its own.
class OpsCluster {
 public:
  OpsCluster(const std::string& tag, int workers) {
    name_ = StrCat("ops-", getpid(), "-", tag);
    const std::vector<int> ports = odmoe::testing::PickFreePorts(workers + 2);
    std::string toml = StrCat("[cluster]\nname = \"", name_,
                              "\"\nepoch = 3\ngroup_size = 2\nrpc_timeout_ms = 30000\nstartup_timeout_ms = 60000\n",
                              "[model]\nsynthetic = \"", odmoe::testing::SourceDir(),
                              "/tests/data/tiny-mixtral/config.json\"\nlayers = 2\nseed = 1\n");
    auto node = [&](const std::string& name, const std::string& role, int port, const std::string& extra) {
      toml += StrCat("\n[[node]]\nname = \"", name, "\"\nrole = \"", role, "\"\naddress = \"127.0.0.1:", port,
                     "\"\nthreads = 2\n", extra);
    };
    node("main", "main", ports[0], "device = \"cpu\"\n");
    node("shadow", "shadow", ports[1], "device = \"cpu\"\n");
    for (int w = 0; w < workers; ++w) {
      node(Worker(w), "worker", ports[static_cast<size_t>(w + 2)], "device = \"mock-gpu\"\ngpu_budget_mb = 64\n");
      worker_addresses_.push_back(StrCat("127.0.0.1:", ports[static_cast<size_t>(w + 2)]));
    }
    config_ = dir_.File("cluster.toml");
    odmoe::testing::WriteFile(config_, toml);
  }
  ~OpsCluster() {
    Down();
    for (const std::string& s : Segments()) fs::remove(s);
  }

  // `cluster up` with `extra` flags; the endpoint and the log folder it printed.
  RunResult Up(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {ProgramPath("odmoe"), "cluster", "up", "--config", config_,
                                     "--run-dir",          run_dir()};
    argv.insert(argv.end(), extra.begin(), extra.end());
    RunResult up = RunProgram(argv);
    std::smatch m;
    static const std::regex kGrpc("(^|\\n)grpc: ([^\\n]+)\\n"), kLogs("logs in ([^\\n]+)\\n");
    if (std::regex_search(up.out, m, kGrpc)) endpoint_ = m[2];
    if (std::regex_search(up.out, m, kLogs)) logs_ = m[1];
    return up;
  }
  RunResult Down() {
    return RunProgram({ProgramPath("odmoe"), "cluster", "down", "--config", config_, "--run-dir", run_dir()});
  }

  static std::string Worker(int w) { return StrCat("worker", w); }
  std::string Log(const std::string& node) const { return odmoe::testing::ReadFile(logs_ + "/" + node + ".log"); }
  pid_t PidOf(const std::string& node) const {
    return static_cast<pid_t>(std::stol(odmoe::testing::ReadFile(run_dir() + "/" + node + ".pid")));
  }
  // The workers' shared expert segments (and lock files) of this cluster in /dev/shm.
  std::vector<std::string> Segments() const {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
      if (e.path().filename().string().rfind(StrCat("odmoe-", name_, "-"), 0) == 0) out.push_back(e.path().string());
    }
    return out;
  }

  const std::string& endpoint() const { return endpoint_; }
  const std::string& logs() const { return logs_; }
  const std::string& config() const { return config_; }
  const std::string& worker_address(int w) const { return worker_addresses_[static_cast<size_t>(w)]; }
  std::string run_dir() const { return dir_.File("run"); }

 private:
  odmoe::testing::TempDir dir_;
  std::string name_, config_, endpoint_, logs_;
  std::vector<std::string> worker_addresses_;
};

// Starts `argv` in the background (its own session, output to `log`); the caller reaps it.
pid_t SpawnDaemon(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    setsid();
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

// Waits up to `timeout` for the gRPC health service at `address` to say SERVING.
bool WaitServing(const std::string& address, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    auto s = rpc::CheckServing(address, 500);
    if (s.ok() && *s) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// Waits up to `timeout` for our child `pid` to exit.
bool WaitExited(pid_t pid, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// True when `pid` has exited (it may be a zombie: `up`'s children are reaped by whoever adopted them).
bool ProcessGone(pid_t pid) {
  std::ifstream in(StrCat("/proc/", pid, "/stat"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string stat = ss.str();
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || stat[paren + 2] == 'Z';
}

// Lines of `log` that carry `request_id=ID`.
int CountLinesWith(const std::string& log, const std::string& needle) {
  int n = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

TEST(OpsTest, OneRequestIdInTheLogsOfMainTheShadowAndTheWorkersThatServedIt) {
  OpsCluster cluster("rid", 2);
  const RunResult up = cluster.Up();
  ASSERT_EQ(up.exit_code, 0) << up.out << up.err;

  // Main makes the id: 16 lowercase hex characters, printed by generate --json.
  RunResult gen = RunProgram({ProgramPath("odmoe"), "generate", "--endpoint", cluster.endpoint(), "--prompt-ids",
                              "1,2,3,4", "--max-new-tokens", "4", "--ignore-eos", "--json"});
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  auto j = ParseJson(gen.out, "generate");
  ASSERT_TRUE(j.ok()) << gen.out;
  const std::string id = (*j)["request_id"].get<std::string>();
  EXPECT_TRUE(std::regex_match(id, std::regex("[0-9a-f]{16}"))) << id;

  // The client chooses it.
  RunResult chosen = RunProgram({ProgramPath("odmoe"), "generate", "--endpoint", cluster.endpoint(), "--prompt-ids",
                                 "5,6", "--max-new-tokens", "2", "--json", "--request-id", "client-chosen.7"});
  ASSERT_EQ(chosen.exit_code, 0) << chosen.err;
  EXPECT_EQ((*ParseJson(chosen.out, "generate"))["request_id"], "client-chosen.7");

  // Stop the cluster so that every log is complete, then read them.
  ASSERT_EQ(cluster.Down().exit_code, 0);
  const std::string tag = "request_id=" + id;
  const std::string main_log = cluster.Log("main");
  EXPECT_GE(CountLinesWith(main_log, tag), 2) << main_log;
  // One line per finished request, with its figures.
  EXPECT_TRUE(std::regex_search(main_log, std::regex("\\[info\\] " + tag +
                                                     " finished: outcome=ok prompt_tokens=4 generated_tokens=4 "
                                                     "ttft_ms=[0-9.]+ tokens_per_s=[0-9.]+")))
      << main_log;
  EXPECT_GE(CountLinesWith(cluster.Log("shadow"), tag), 1) << cluster.Log("shadow");
  int workers_served = 0;
  for (const Json& w : (*j)["stats"]["workers"]) {
    if (w["experts_computed"].get<uint64_t>() == 0) continue;
    ++workers_served;
    const std::string log = cluster.Log(w["node"].get<std::string>());
    EXPECT_GE(CountLinesWith(log, tag), 1) << w["node"] << ":\n" << log;
  }
  EXPECT_GT(workers_served, 0);
  EXPECT_GE(CountLinesWith(main_log, "request_id=client-chosen.7 finished: outcome=ok"), 1) << main_log;
  EXPECT_GE(CountLinesWith(cluster.Log("shadow"), "request_id=client-chosen.7"), 1);
}

TEST(OpsTest, JsonLogsAndBadPromptsGetAClearErrorAndNoRawLibraryLines) {
  OpsCluster cluster("json", 2);
  const RunResult up = cluster.Up({"--log-format", "json"});
  ASSERT_EQ(up.exit_code, 0) << up.out << up.err;

  // The command line checks the prompt before sending it.
  RunResult cli = RunProgram({ProgramPath("odmoe"), "generate", "--endpoint", cluster.endpoint(), "--prompt",
                              "And God \xff said", "--max-new-tokens", "2"});
  EXPECT_EQ(cli.exit_code, 2) << cli.err;
  EXPECT_NE(cli.err.find("--prompt is not valid UTF-8: byte 0xff at offset 8"), std::string::npos) << cli.err;
  EXPECT_EQ(std::count(cli.err.begin(), cli.err.end(), '\n'), 1) << cli.err;
  EXPECT_EQ(cli.err.find("libprotobuf"), std::string::npos) << cli.err;

  // Another client's bytes reach main (a text prompt travels as bytes), which names the problem.
  v1::GenerateRequest req;
  req.set_prompt(std::string("ok \xc3("));
  req.set_max_new_tokens(2);
  auto r = GenerateRemote(cluster.endpoint(), req, 30000, nullptr, "bad-prompt-1");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("prompt is not valid UTF-8: byte 0xc3 at offset 3"), std::string_view::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("bad-prompt-1"), std::string_view::npos) << r.status();

  ASSERT_EQ(cluster.Down().exit_code, 0);
  // Every line of every log is one JSON object; main's about the bad request carry its id.
  bool saw_refusal = false;
  for (const std::string node : {"main", "shadow", "worker0", "worker1"}) {
    std::istringstream in(cluster.Log(node));
    int lines = 0;
    for (std::string line; std::getline(in, line); ++lines) {
      auto obj = ParseJson(line, node);
      ASSERT_TRUE(obj.ok() && obj->is_object()) << node << ": " << line;
      for (const char* key : {"time", "level", "logger", "node", "message"}) {
        EXPECT_TRUE(obj->contains(key)) << key << " in " << line;
      }
      EXPECT_EQ((*obj)["node"], node) << line;
      if (obj->contains("request_id") && (*obj)["request_id"] == "bad-prompt-1" &&
          (*obj)["message"].get<std::string>().find("outcome=invalid_argument") != std::string::npos) {
        saw_refusal = true;
      }
    }
    EXPECT_GT(lines, 0) << node;
  }
  EXPECT_TRUE(saw_refusal) << cluster.Log("main");
}

TEST(OpsTest, EachUpKeepsItsOwnLogFolder) {
  OpsCluster cluster("runs", 2);
  ASSERT_EQ(cluster.Up().exit_code, 0);
  const std::string first = cluster.logs();
  ASSERT_EQ(cluster.Down().exit_code, 0);
  ASSERT_EQ(cluster.Up().exit_code, 0);
  const std::string second = cluster.logs();
  ASSERT_EQ(cluster.Down().exit_code, 0);
  EXPECT_NE(first, second);
  for (const std::string& logs : {first, second}) {
    EXPECT_NE(odmoe::testing::ReadFile(logs + "/main.log").find("serving"), std::string::npos) << logs;
    EXPECT_NE(odmoe::testing::ReadFile(logs + "/worker1.log").find("shut down"), std::string::npos) << logs;
  }
  EXPECT_EQ(fs::canonical(cluster.run_dir() + "/latest"), fs::canonical(second));
  int folders = 0;
  for (const auto& e : fs::directory_iterator(cluster.run_dir() + "/runs")) folders += e.is_directory();
  EXPECT_EQ(folders, 2);
}

TEST(OpsTest, DownStopsAWorkerRestartedByHand) {
  OpsCluster cluster("hand", 2);
  ASSERT_EQ(cluster.Up().exit_code, 0);
  // worker1 dies and an operator starts it again by hand, outside the pid files.
  const pid_t old_pid = cluster.PidOf("worker1");
  ASSERT_EQ(kill(old_pid, SIGKILL), 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!ProcessGone(old_pid) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  odmoe::testing::TempDir tmp;
  // A relative --config from another working directory names the same file.
  const std::string rel = fs::relative(cluster.config(), fs::current_path()).string();
  const pid_t by_hand =
      SpawnDaemon({ProgramPath("odmoe-worker"), "--config", rel, "--node", "worker1"}, tmp.File("worker1.log"));
  ASSERT_TRUE(WaitServing(cluster.worker_address(1), std::chrono::seconds(30)))
      << odmoe::testing::ReadFile(tmp.File("worker1.log"));
  const RunResult down = cluster.Down();
  EXPECT_EQ(down.exit_code, 0) << down.out << down.err;
  EXPECT_NE(down.out.find(StrCat("worker1 ", by_hand)), std::string::npos) << down.out;
  const bool exited = WaitExited(by_hand, std::chrono::seconds(5));
  EXPECT_TRUE(exited) << down.out;
  if (!exited) {
    kill(by_hand, SIGKILL);
    waitpid(by_hand, nullptr, 0);
  }
  EXPECT_TRUE(cluster.Segments().empty());
}

TEST(OpsTest, DownRemovesTheSharedSegmentOfKilledWorkers) {
  OpsCluster cluster("shm", 2);
  ASSERT_EQ(cluster.Up().exit_code, 0);
  EXPECT_FALSE(cluster.Segments().empty()) << "the workers share their experts through /dev/shm";
  for (const std::string w : {"worker0", "worker1"}) ASSERT_EQ(kill(cluster.PidOf(w), SIGKILL), 0);
  const RunResult down = cluster.Down();
  EXPECT_EQ(down.exit_code, 0) << down.out << down.err;
  EXPECT_TRUE(cluster.Segments().empty()) << down.out;
  EXPECT_NE(down.out.find("removed 1 shared segment"), std::string::npos) << down.out;
}

TEST(OpsTest, DaemonsCheckTheLogFormatAndWriteEvenTheirExitInIt) {
  odmoe::testing::TempDir tmp;
  for (const std::string program : {"odmoe-main", "odmoe-shadow", "odmoe-worker"}) {
    RunResult bad = RunProgram({ProgramPath(program), "--log-format", "xml", "--config", "c.toml", "--node", "n"});
    EXPECT_EQ(bad.exit_code, 2) << bad.err;
    EXPECT_NE(bad.err.find("--log-format: expected text or json, got 'xml'"), std::string::npos) << bad.err;
    // A failure to start is one JSON line in json mode.
    RunResult missing =
        RunProgram({ProgramPath(program), "--log-format", "json", "--config", tmp.File("missing.toml"), "--node", "n"});
    EXPECT_NE(missing.exit_code, 0);
    ASSERT_EQ(std::count(missing.err.begin(), missing.err.end(), '\n'), 1) << missing.err;
    auto line = ParseJson(missing.err, program);
    ASSERT_TRUE(line.ok()) << missing.err;
    EXPECT_EQ((*line)["level"], "error");
    EXPECT_EQ((*line)["logger"], program);
    EXPECT_NE((*line)["message"].get<std::string>().find(program + ": "), std::string::npos) << missing.err;
    EXPECT_NE((*line)["message"].get<std::string>().find("missing.toml"), std::string::npos) << missing.err;
  }
  OpsCluster cluster("fmt", 2);
  RunResult up = cluster.Up({"--log-format", "xml"});
  EXPECT_EQ(up.exit_code, 2) << up.err;
  EXPECT_NE(up.err.find("--log-format"), std::string::npos) << up.err;
}

}  // namespace
}  // namespace odmoe
