// odmoe cluster up|down|status: runs the daemons of a cluster file on this machine, in the background.
//
// `up` starts every node of the file as its own process (odmoe-main / odmoe-shadow / odmoe-worker from the
// directory of this program), each in its own session with its pid in RUN_DIR/NODE.pid and its output in a
// folder of its own for this run, RUN_DIR/runs/<UTC time>-<n>/NODE.log (RUN_DIR/latest links to it; the
// kRunsKept newest run folders are kept (run_folders.h), so the logs of a crash survive the restart), waits until
// every node reports ready (grpc.health.v1 "odmoe.ready"), and prints "grpc: HOST:PORT", the client API's address,
// on a line of its own (scripts parse it), then "metrics: NODE http://ADDRESS/metrics" for each node with a
// metrics_address. If a node fails to start, the others are stopped again and the failing node's log is shown.
// `down` stops every process of this machine that serves a node of the cluster: those of the pid files and any
// odmoe daemon whose --config is the same cluster file (a node restarted by hand): SIGTERM, then SIGKILL after a
// grace period. Then it removes what they leave: the pid files and the workers' shared expert segments in
// /dev/shm that no process holds any more. `status` asks each node for its liveness, readiness, build version and
// memory, and shows the pid of its process on this machine, found as `down` finds it.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "odmoe/v1/shadow.grpc.pb.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/cli/client_security.h"
#include "src/cli/commands.h"
#include "src/cli/run_folders.h"
#include "src/common/cluster_config.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/logging.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"

namespace odmoe::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "usage: odmoe cluster up --config FILE [--model DIR] [--run-dir DIR] [--ablation-case 1..6]\n"
    "                        [--prediction shadow|random|none] [--shadow-quant fp16|int8|nf4|none]\n"
    "                        [--align-token N] [--align-kv N] [--max-lead-tokens N] [--log-format text|json]\n"
    "                        [--keep-router true|false] [--keep-attention true|false] [--hedge-margin T]\n"
    "         (the [shadow] overrides are passed on to every daemon; --ablation-case: OD-MoE section 4.2,\n"
    "          1 token+KV alignment, 2 token only, 3 KV only, 4 none, 5 random prefetch, 6 load after routing)\n"
    "       odmoe cluster down --config FILE [--run-dir DIR]\n"
    "       odmoe cluster status --config FILE [--run-dir DIR] [--node NAME[,NAME...]] [--json]\n"
    "         (exit 0 when every node, or every one named, is live and ready: a health check)\n"
    "  up and status take --token-file FILE --tls-ca FILE --tls-cert FILE --tls-key FILE; by default the\n"
    "  cluster file's [auth] token_file, [tls] ca and its main node's cert and key.\n";

// The [shadow] overrides `up` checks and passes on to every daemon.
constexpr const char* kShadowFlags[] = {"ablation-case", "prediction",      "shadow-quant",
                                        "align-token",   "align-kv",        "max-lead-tokens",
                                        "keep-router",   "keep-attention",  "hedge-margin"};

uint64_t Fnv(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Where the pid and log files of a cluster live: --run-dir, else a folder under the temp dir named after the
// cluster and the cluster file's absolute path (two checkouts with the same file name do not collide).
std::string RunDir(const Flags& f, const ClusterConfig& c, const std::string& config_path) {
  if (auto d = f.Get("run-dir")) return *d;
  std::error_code ec;
  const std::string abs = fs::weakly_canonical(config_path, ec).string();
  char suffix[17];
  std::snprintf(suffix, sizeof(suffix), "%08llx", static_cast<unsigned long long>(Fnv(abs) & 0xffffffffull));
  const char* tmp = std::getenv("TMPDIR");
  return StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/odmoe-run-", getuid(), "/", c.name, "-", suffix);
}

std::string ProgramDir() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : self.parent_path().string();
}

std::string ProgramFor(NodeRole role) {
  switch (role) {
    case NodeRole::kMain: return "odmoe-main";
    case NodeRole::kShadow: return "odmoe-shadow";
    case NodeRole::kWorker: return "odmoe-worker";
  }
  return "";
}

std::string PidFile(const std::string& run_dir, const NodeConfig& n) { return run_dir + "/" + n.name + ".pid"; }
// `logs`: the folder of one run (NewRunFolder).
std::string LogFile(const std::string& logs, const NodeConfig& n) { return logs + "/" + n.name + ".log"; }

// The pid recorded for `node`, if that process still runs as that node (a recycled pid is not ours).
std::optional<pid_t> LivePid(const std::string& run_dir, const NodeConfig& node) {
  std::ifstream in(PidFile(run_dir, node));
  long pid = 0;
  if (!(in >> pid) || pid <= 0) return std::nullopt;
  std::ifstream cmd(StrCat("/proc/", pid, "/cmdline"), std::ios::binary);
  std::stringstream ss;
  ss << cmd.rdbuf();
  const std::string cmdline = ss.str();
  const std::string marker = StrCat("--node", std::string(1, '\0'), node.name, std::string(1, '\0'));
  if (cmdline.find(marker) == std::string::npos) return std::nullopt;
  return static_cast<pid_t>(pid);
}

std::string Tail(const std::string& path, size_t max_lines) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    lines.push_back(line);
    if (lines.size() > max_lines) lines.erase(lines.begin());
  }
  std::string out;
  for (const auto& l : lines) out += "    " + l + "\n";
  return out;
}

absl::StatusOr<pid_t> Spawn(const std::string& program, const std::vector<std::string>& args,
                            const std::string& log_path) {
  const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0) return absl::UnavailableError(StrCat("cannot write ", log_path, ": ", std::strerror(errno)));
  const pid_t pid = fork();
  if (pid < 0) {
    close(log);
    return absl::UnavailableError(StrCat("fork failed: ", std::strerror(errno)));
  }
  if (pid == 0) {
    setsid();
    const int devnull = open("/dev/null", O_RDONLY);
    dup2(devnull, 0);
    dup2(log, 1);
    dup2(log, 2);
    // The daemon outlives this command: it must not hold any other descriptor of ours (a caller's pipe would
    // otherwise stay open until the cluster stops).
    for (int fd = 3; fd < 1024; ++fd) close(fd);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(program.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(program.c_str(), argv.data());
    std::fprintf(stderr, "cannot run %s: %s\n", program.c_str(), std::strerror(errno));
    _exit(127);
  }
  close(log);
  return pid;
}

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// True while `pid` exists and has not exited (a zombie, exited but not yet reaped by its parent, has).
bool Running(pid_t pid) {
  const std::string stat = ReadWholeFile(StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');  // "PID (COMM) STATE ...": COMM may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

// Stops `pid`: SIGTERM, then SIGKILL when it has not exited after `grace`. Reaps it when it is our child.
void Stop(pid_t pid, std::chrono::milliseconds grace) {
  kill(pid, SIGTERM);
  const auto deadline = Clock::now() + grace;
  while (Clock::now() < deadline) {
    waitpid(pid, nullptr, WNOHANG);
    if (!Running(pid)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, WNOHANG);
  // Not our child: wait until the kernel has ended it (its shared memory and locks are released by then).
  const auto killed = Clock::now() + std::chrono::seconds(5);
  while (Running(pid) && Clock::now() < killed) {
    waitpid(pid, nullptr, WNOHANG);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// A process of this machine serving a node of the cluster.
struct NodeProcess {
  pid_t pid = 0;
  std::string node;
};

// Every odmoe daemon (odmoe-main, odmoe-shadow, odmoe-worker) of this machine whose `--config` is the cluster
// file at `config_path` (the same file, however the path is written; a relative path is taken from the
// process's working directory) and whose `--node` is a node of `c`, plus the live pids of the pid files.
// Processes of other users are listed too (stopping them then fails, and says so).
std::vector<NodeProcess> FindNodeProcesses(const ClusterConfig& c, const std::string& config_path,
                                           const std::string& run_dir) {
  std::map<pid_t, std::string> found;
  for (const NodeConfig& n : c.nodes) {
    if (auto pid = LivePid(run_dir, n)) found[*pid] = n.name;
  }
  std::set<std::string> names;
  for (const NodeConfig& n : c.nodes) names.insert(n.name);
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return {};
  while (const dirent* entry = readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (pid <= 0 || *end != '\0' || pid == getpid()) continue;
    const std::string cmdline = ReadWholeFile(StrCat("/proc/", pid, "/cmdline"));
    std::vector<std::string> argv;
    for (size_t at = 0; at < cmdline.size();) {
      const size_t nul = cmdline.find('\0', at);
      argv.push_back(cmdline.substr(at, nul == std::string::npos ? std::string::npos : nul - at));
      if (nul == std::string::npos) break;
      at = nul + 1;
    }
    if (argv.empty()) continue;
    const std::string program = fs::path(argv[0]).filename().string();
    if (program != "odmoe-main" && program != "odmoe-shadow" && program != "odmoe-worker") continue;
    std::string config, node;
    for (size_t i = 1; i < argv.size(); ++i) {
      for (auto [flag, out] : {std::pair{"--config", &config}, std::pair{"--node", &node}}) {
        const std::string with_eq = StrCat(flag, "=");
        if (argv[i] == flag && i + 1 < argv.size()) *out = argv[i + 1];
        if (argv[i].rfind(with_eq, 0) == 0) *out = argv[i].substr(with_eq.size());
      }
    }
    if (config.empty() || names.count(node) == 0) continue;
    std::error_code ec;
    fs::path path(config);
    if (path.is_relative()) path = fs::read_symlink(StrCat("/proc/", pid, "/cwd"), ec) / path;
    if (!ec && fs::equivalent(path, config_path, ec) && !ec) found[static_cast<pid_t>(pid)] = node;
  }
  closedir(proc);
  std::vector<NodeProcess> out;
  for (const auto& [pid, node] : found) out.push_back({pid, node});
  return out;
}

// The workers' shared expert segments of cluster `c` in `shm_dir` are named "odmoe-<cluster>-e<epoch>-<model
// fingerprint[0:8]>", each with a lock file "<segment>.lock" (src/worker_node/worker_node.cc, expert_store.h).
// Removes every such segment that no process holds: a holder keeps an open-file-description lock on the lock
// file, so the segment is free when the lock can be taken exclusively (without waiting), as ExpertStore's own
// last holder does. Returns the segments removed; `in_use` receives those still held (another cluster with the
// same name and epoch on this machine).
std::vector<std::string> RemoveFreeSegments(const ClusterConfig& c, const std::string& shm_dir,
                                            std::vector<std::string>* in_use) {
  const std::string prefix = StrCat("odmoe-", c.name, "-e", c.epoch, "-");
  std::set<std::string> segments;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(shm_dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".lock") == 0) name.resize(name.size() - 5);
    if (name.size() == prefix.size() + 8) segments.insert(name);  // the fingerprint's 8 characters
  }
  std::vector<std::string> removed;
  for (const std::string& name : segments) {
    const std::string segment = StrCat(shm_dir, "/", name), lock = segment + ".lock";
    const int fd = open(lock.c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
      struct flock fl {};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;
      if (fcntl(fd, F_OFD_SETLK, &fl) != 0) {
        close(fd);
        if (in_use != nullptr) in_use->push_back(segment);
        continue;
      }
    }
    // Free (or a segment without its lock file, which no holder can be using): the segment first, then the
    // lock file, under the lock, as ExpertStore's last holder does.
    const bool gone = unlink(segment.c_str()) == 0 || errno == ENOENT;
    unlink(lock.c_str());
    if (fd >= 0) close(fd);
    if (gone) removed.push_back(segment);
  }
  return removed;
}

absl::Status Up(const Flags& f, const ClusterConfig& c, const std::string& config_path) {
  const std::string run_dir = RunDir(f, c, config_path);
  if (const std::vector<NodeProcess> running = FindNodeProcesses(c, config_path, run_dir); !running.empty()) {
    return absl::AlreadyExistsError(StrCat("node '", running[0].node, "' of cluster '", c.name,
                                           "' is already running (pid ", running[0].pid,
                                           "); run `odmoe cluster down --config ", config_path, "` first"));
  }
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) return absl::UnavailableError(StrCat("cannot create ", run_dir, ": ", ec.message()));
  ODMOE_ASSIGN_OR_RETURN(const std::string logs, NewRunFolder(run_dir, kRunsKept));
  const std::string bin = ProgramDir();
  std::string model = f.Get("model").value_or("");
  if (!model.empty()) model = fs::absolute(model, ec).string();
  const std::string abs_config = fs::absolute(config_path, ec).string();

  std::map<std::string, pid_t> started;
  auto stop_all = [&] {
    for (const auto& [name, pid] : started) {
      Stop(pid, std::chrono::milliseconds(3000));
      fs::remove(run_dir + "/" + name + ".pid", ec);
    }
  };
  for (const NodeConfig& n : c.nodes) {
    const std::string program = bin + "/" + ProgramFor(n.role);
    std::vector<std::string> args = {"--config", abs_config, "--node", n.name};
    if (!model.empty()) {
      args.push_back("--model");
      args.push_back(model);
    }
    for (const char* flag : kShadowFlags) {
      if (auto v = f.Get(flag)) {
        args.push_back(StrCat("--", flag));
        args.push_back(*v);
      }
    }
    if (auto v = f.Get("log-format")) {
      args.push_back("--log-format");
      args.push_back(*v);
    }
    auto pid = Spawn(program, args, LogFile(logs, n));
    if (!pid.ok()) {
      stop_all();
      return pid.status();
    }
    started[n.name] = *pid;
    std::ofstream(PidFile(run_dir, n)) << *pid << "\n";
  }

  // Wait until every node serves. A node that exits stops the whole start-up.
  const auto deadline = Clock::now() + std::chrono::milliseconds(c.startup_timeout_ms);
  std::map<std::string, bool> serving;
  while (true) {
    for (const NodeConfig& n : c.nodes) {
      if (serving[n.name]) continue;
      int status = 0;
      if (waitpid(started[n.name], &status, WNOHANG) == started[n.name]) {
        started.erase(n.name);
        stop_all();
        return absl::UnavailableError(StrCat("node '", n.name, "' exited during start-up (",
                                             WIFEXITED(status) ? "exit code " : "signal ",
                                             WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), "); its log ",
                                             LogFile(logs, n), ":\n", Tail(LogFile(logs, n), 10)));
      }
      auto ok = rpc::CheckServing(n.address, 500, rpc::kReadinessService);
      if (ok.ok() && *ok) serving[n.name] = true;
    }
    size_t up = 0;
    for (const auto& [name, s] : serving) up += s;
    if (up == c.nodes.size()) break;
    if (Clock::now() > deadline) {
      std::string waiting;
      for (const NodeConfig& n : c.nodes) {
        if (!serving[n.name]) waiting += StrCat(waiting.empty() ? "" : ", ", n.name);
      }
      stop_all();
      return absl::DeadlineExceededError(StrCat("nodes not serving after ", c.startup_timeout_ms,
                                                " ms (startup_timeout_ms): ", waiting, "; logs in ", logs));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::printf("cluster '%s' up: %zu nodes serving; logs in %s\n", c.name.c_str(), c.nodes.size(), logs.c_str());
  std::printf("grpc: %s\n", c.main()->address.c_str());
  if (!c.main()->http_address.empty()) std::printf("http: %s\n", c.main()->http_address.c_str());
  for (const NodeConfig& n : c.nodes) {
    if (n.metrics_address.empty()) continue;
    std::printf("metrics: %s http://%s/metrics\n", n.name.c_str(), n.metrics_address.c_str());
  }
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status Down(const Flags& f, const ClusterConfig& c, const std::string& config_path) {
  const std::string run_dir = RunDir(f, c, config_path);
  std::error_code ec;
  // Stop every process at once (SIGTERM; SIGKILL after the grace period), then wait for all of them.
  const std::vector<NodeProcess> processes = FindNodeProcesses(c, config_path, run_dir);
  std::vector<std::thread> stoppers;
  const std::chrono::milliseconds grace(c.shutdown_timeout_ms + 5000);  // their drain, then their exit
  for (const NodeProcess& p : processes) {
    stoppers.emplace_back([pid = p.pid, grace] { Stop(pid, grace); });
  }
  for (auto& t : stoppers) t.join();
  std::string still_running;
  size_t stopped = 0;
  for (const NodeProcess& p : processes) {
    if (Running(p.pid)) {
      still_running += StrCat(still_running.empty() ? "" : ", ", p.node, " (pid ", p.pid, ")");
    } else {
      ++stopped;
    }
  }
  for (const NodeConfig& n : c.nodes) fs::remove(PidFile(run_dir, n), ec);
  std::vector<std::string> in_use;
  const std::vector<std::string> removed = RemoveFreeSegments(c, "/dev/shm", &in_use);
  std::printf("cluster '%s': stopped %zu node%s", c.name.c_str(), stopped, stopped == 1 ? "" : "s");
  for (size_t i = 0; i < processes.size(); ++i) {
    std::printf("%s%s %d", i == 0 ? " (" : ", ", processes[i].node.c_str(), static_cast<int>(processes[i].pid));
  }
  std::printf("%s; removed %zu shared segment%s\n", processes.empty() ? "" : ")", removed.size(),
              removed.size() == 1 ? "" : "s");
  for (const std::string& s : in_use) std::printf("left %s: another process still holds it\n", s.c_str());
  std::fflush(stdout);
  if (!still_running.empty()) {
    return absl::UnavailableError(StrCat("could not stop ", still_running, " (another user's process?)"));
  }
  return absl::OkStatus();
}

// The nodes `--node` names (comma-separated), in the cluster file's order; every node without it. InvalidArgument
// naming a name the file does not have.
absl::StatusOr<std::vector<const NodeConfig*>> ChosenNodes(const Flags& f, const ClusterConfig& c,
                                                           const std::string& config_path) {
  std::vector<const NodeConfig*> out;
  const std::optional<std::string> names = f.Get("node");
  if (!names.has_value()) {
    for (const NodeConfig& n : c.nodes) out.push_back(&n);
    return out;
  }
  std::set<std::string> wanted;
  std::istringstream list(*names);
  for (std::string name; std::getline(list, name, ',');) {
    if (c.Find(name) == nullptr) {
      std::string all;
      for (const NodeConfig& n : c.nodes) all += StrCat(all.empty() ? "" : ", ", n.name);
      return absl::InvalidArgumentError(StrCat("--node: no node '", name, "' in ", config_path, " (it has ", all, ")"));
    }
    wanted.insert(name);
  }
  if (wanted.empty()) return absl::InvalidArgumentError("--node: expected one or more node names, comma-separated");
  for (const NodeConfig& n : c.nodes) {
    if (wanted.contains(n.name)) out.push_back(&n);
  }
  return out;
}

absl::Status Status(const Flags& f, const ClusterConfig& c, const std::string& config_path) {
  ODMOE_ASSIGN_OR_RETURN(const std::vector<const NodeConfig*> chosen, ChosenNodes(f, c, config_path));
  const std::string run_dir = RunDir(f, c, config_path);
  // Each node's process on this machine: the one of its pid file, else one started by hand (or by systemd) from
  // this cluster file, the lowest pid where there are several.
  std::map<std::string, pid_t> local;
  for (const NodeProcess& p : FindNodeProcesses(c, config_path, run_dir)) local.emplace(p.node, p.pid);
  for (const NodeConfig& n : c.nodes) {
    if (auto pid = LivePid(run_dir, n)) local[n.name] = *pid;
  }
  Json nodes = Json::array();
  bool all_serving = true;
  for (const NodeConfig* chosen_node : chosen) {
    const NodeConfig& n = *chosen_node;
    Json j = {{"node", n.name}, {"role", NodeRoleName(n.role)}, {"address", n.address}, {"device", n.device}};
    const auto pid = local.find(n.name);
    j["pid"] = pid != local.end() ? Json(pid->second) : Json(nullptr);
    // Liveness (the process serves), readiness (it can do its part: main reaches an owner of every sparse layer)
    // and the node's build version.
    auto health = rpc::CheckHealth(n.address, 3000);
    auto word = [&](bool serving) { return !health.ok() ? "UNREACHABLE" : (serving ? "SERVING" : "NOT_SERVING"); };
    j["health"] = word(health.ok() && health->live);
    j["ready"] = word(health.ok() && health->ready);
    j["version"] = health.ok() && !health->version.empty() ? Json(health->version) : Json(nullptr);
    j["cluster"] = health.ok() && !health->cluster.empty() ? Json(health->cluster) : Json(nullptr);
    all_serving = all_serving && health.ok() && health->live && health->ready;
    const v1::DeviceMemory* mem = nullptr;
    v1::WorkerStats ws;
    v1::ShadowStats ss;
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, 1000);
    if (health.ok() && n.role == NodeRole::kWorker) {
      if (v1::Worker::NewStub(rpc::MakeChannel(n.address))->GetStats(&ctx, {}, &ws).ok()) mem = &ws.memory();
    } else if (health.ok() && n.role == NodeRole::kShadow) {
      if (v1::Shadow::NewStub(rpc::MakeChannel(n.address))->GetStats(&ctx, {}, &ss).ok()) mem = &ss.memory();
    }
    if (mem != nullptr) {
      j["gpu_memory"] = {{"device", mem->device()},
                         {"capacity_bytes", mem->capacity_bytes()},
                         {"in_use_bytes", mem->in_use_bytes()},
                         {"peak_bytes", mem->peak_bytes()},
                         {"context_bytes", mem->context_bytes()}};
    }
    nodes.push_back(j);
  }
  // A node that serves another cluster than main (started from another cluster file, or with another model)
  // refuses main's calls; main keeps it out of the placement.
  std::string main_cluster;
  for (const Json& j : nodes) {
    if (j["role"] == "main" && !j["cluster"].is_null()) main_cluster = j["cluster"].get<std::string>();
  }
  std::vector<std::string> foreign;
  for (Json& j : nodes) {
    const bool other = !main_cluster.empty() && !j["cluster"].is_null() && j["cluster"] != main_cluster;
    j["same_cluster_as_main"] = main_cluster.empty() || j["cluster"].is_null() ? Json(nullptr) : Json(!other);
    if (other) {
      foreign.push_back(StrCat("node ", j["node"].get<std::string>(), " serves ", j["cluster"].get<std::string>(),
                               ", main ", main_cluster));
    }
  }
  if (f.Has("json")) {
    std::printf("%s\n", DumpJson(Json{{"cluster", c.name}, {"nodes", nodes}}).c_str());
  } else {
    std::printf("cluster '%s' (%s)\n%-10s %-7s %-22s %-12s %-12s %-20s %-9s %s\n", c.name.c_str(),
                config_path.c_str(), "node", "role", "address", "live", "ready", "version", "pid",
                "gpu memory (in use / peak / budget)");
    for (const Json& j : nodes) {
      std::string mem = "-";
      if (j.contains("gpu_memory")) {
        const Json& m = j["gpu_memory"];
        auto mib = [](const Json& v) {
          const uint64_t b = v.get<uint64_t>();
          return b >= (uint64_t{1} << 20) ? StrCat(b >> 20, " MiB") : StrCat((b + 1023) >> 10, " KiB");
        };
        mem = StrCat(mib(m["in_use_bytes"]), " / ", mib(m["peak_bytes"]), " / ",
                     m["capacity_bytes"].get<uint64_t>() == 0 ? std::string("-") : mib(m["capacity_bytes"]));
      }
      std::printf("%-10s %-7s %-22s %-12s %-12s %-20s %-9s %s\n", j["node"].get<std::string>().c_str(),
                  j["role"].get<std::string>().c_str(), j["address"].get<std::string>().c_str(),
                  j["health"].get<std::string>().c_str(), j["ready"].get<std::string>().c_str(),
                  j["version"].is_null() ? "-" : j["version"].get<std::string>().c_str(),
                  j["pid"].is_null() ? "-" : std::to_string(j["pid"].get<int64_t>()).c_str(), mem.c_str());
    }
    for (const std::string& line : foreign) std::printf("another cluster: %s\n", line.c_str());
  }
  if (!foreign.empty()) {
    return absl::FailedPreconditionError(StrCat(
        foreign.size(), foreign.size() == 1 ? " node serves" : " nodes serve",
        " another cluster than main (another cluster file or model): ", foreign[0], foreign.size() > 1 ? "; ..." : ""));
  }
  if (!all_serving) {
    return absl::UnavailableError(chosen.size() == c.nodes.size() ? "not every node is live and ready"
                                                                  : "not every node named is live and ready");
  }
  return absl::OkStatus();
}

}  // namespace

int RunCluster(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? kExitUsage : kExitOk;
  }
  const std::string verb = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  absl::Status status = [&]() -> absl::Status {
    std::set<std::string> with_value = {"config", "model", "run-dir", "tls-ca", "tls-cert", "tls-key", "token-file"};
    if (verb == "up") {
      with_value.insert(std::begin(kShadowFlags), std::end(kShadowFlags));
      with_value.insert("log-format");
    }
    if (verb == "status") with_value.insert("node");
    ODMOE_ASSIGN_OR_RETURN(Flags f, Flags::Parse(rest, with_value, {"json"}));
    ODMOE_ASSIGN_OR_RETURN(std::string config_path, f.Required("config"));
    ODMOE_ASSIGN_OR_RETURN(ClusterConfig c, LoadClusterConfig(config_path));
    // Checked here too, so a bad override fails at once with one message instead of in every daemon.
    ShadowOverrides overrides{f.Get("ablation-case"), f.Get("prediction"), f.Get("shadow-quant"),
                              f.Get("align-token"),   f.Get("align-kv"),   f.Get("max-lead-tokens"),
                              f.Get("keep-router"),   f.Get("keep-attention"), f.Get("hedge-margin")};
    ODMOE_RETURN_IF_ERROR(ApplyShadowOverrides(overrides, c.shadow() != nullptr, &c.shadow_settings));
    if (auto v = f.Get("log-format")) ODMOE_RETURN_IF_ERROR(logging::ParseLogFormat(*v).status());
    if (verb != "down") ODMOE_RETURN_IF_ERROR(InstallClientSecurity(f, &c));
    if (verb == "up") return Up(f, c, config_path);
    if (verb == "down") return Down(f, c, config_path);
    if (verb == "status") return Status(f, c, config_path);
    return absl::InvalidArgumentError(StrCat("unknown cluster command '", verb, "' (up, down, status)"));
  }();
  if (status.ok()) return kExitOk;
  // One line for the reason; a start-up failure appends the failing node's log below it.
  std::fprintf(stderr, "odmoe cluster %s: %s\n", verb.c_str(), std::string(status.message()).c_str());
  return ExitCodeFor(status);
}

}  // namespace odmoe::cli
