// Graceful shutdown and stalled peers, with the daemons as real processes (main and two workers on loopback,
// synthetic weights of tests/data/tiny-mixtral): SIGTERM to main during a request lets the request finish,
// refuses new ones (UNAVAILABLE, or CANCELLED on a connection opened before) and exits 0, for a gRPC call and for
// a stream of the HTTP API alike (whose port closes at the signal); a stream still running at the end of the drain
// ends with an error event, not cut; a worker stopped with SIGSTOP fails a call with DEADLINE_EXCEEDED within the
// call's deadline plus one second.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/cluster/client.h"
#include "src/common/json.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using Clock = std::chrono::steady_clock;
using odmoe::testing::ProgramPath;

// A daemon started by this test (its own session, output to `log`); killed on destruction if still running.
class Daemon {
 public:
  Daemon(const std::vector<std::string>& argv, const std::string& log) {
    pid_ = fork();
    if (pid_ == 0) {
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
  }
  ~Daemon() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGCONT);
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // The exit status once it exits within `timeout`; -1 if it did not (or ended by a signal).
  int WaitExit(std::chrono::seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
};

bool WaitReady(const std::string& address, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    auto s = rpc::CheckServing(address, 500, rpc::kReadinessService);
    if (s.ok() && *s) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

class ShutdownTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::vector<int> ports = odmoe::testing::PickFreePorts(4);
    for (int p : ports) addresses_.push_back(StrCat("127.0.0.1:", p));
    http_ = addresses_.back();
    addresses_.pop_back();
    std::string toml =
        StrCat("[cluster]\nname = \"shutdown-", getpid(),
               "\"\ngroup_size = 2\nrpc_timeout_ms = 30000\nshutdown_timeout_ms = ", shutdown_timeout_ms_, "\n",
               "share_host_experts = false\n[model]\nsynthetic = \"", odmoe::testing::SourceDir(),
               "/tests/data/tiny-mixtral/config.json\"\nlayers = 2\nseed = 1\n");
    const char* names[] = {"main", "worker0", "worker1"};
    for (size_t i = 0; i < 3; ++i) {
      toml += StrCat("\n[[node]]\nname = \"", names[i], "\"\nrole = \"", i == 0 ? "main" : "worker", "\"\naddress = \"",
                     addresses_[i], "\"\n",
                     i == 0 ? StrCat("device = \"cpu\"\nhttp_address = \"", http_, "\"\n",
                                     metrics_on_http_ ? StrCat("metrics_address = \"", http_, "\"\n") : "")
                            : std::string("device = \"mock-gpu\"\ngpu_budget_mb = 64\n"));
    }
    config_ = dir_.File("cluster.toml");
    odmoe::testing::WriteFile(config_, toml);
    for (size_t i = 0; i < 3; ++i) {
      const std::string program = i == 0 ? "odmoe-main" : "odmoe-worker";
      daemons_.push_back(std::make_unique<Daemon>(
          std::vector<std::string>{ProgramPath(program), "--config", config_, "--node", names[i]},
          dir_.File(StrCat(names[i], ".log"))));
    }
    for (size_t i = 0; i < 3; ++i) {
      ASSERT_TRUE(WaitReady(addresses_[i], std::chrono::seconds(60)))
          << names[i] << " not ready:\n"
          << odmoe::testing::ReadFile(dir_.File(StrCat(names[i], ".log")));
    }
  }
  std::string Log(const std::string& node) const { return odmoe::testing::ReadFile(dir_.File(node + ".log")); }

  // A streamed completion of `max_tokens` from main's HTTP API, read line by line through curl; `on_first_event`
  // runs when the first event has come. The body as received.
  std::string Stream(int max_tokens, const std::function<void()>& on_first_event) const {
    const std::string body = StrCat(R"({"model":")", Model(), R"(","prompt":[1,5,9,13],"max_tokens":)", max_tokens,
                                    R"(,"ignore_eos":true,"stream":true})");
    const std::string command = StrCat("curl -sS -N -H 'Content-Type: application/json' --data-binary '", body,
                                       "' http://", http_, "/v1/completions 2>&1");
    FILE* pipe = popen(command.c_str(), "r");
    EXPECT_NE(pipe, nullptr);
    if (pipe == nullptr) return "";
    std::string received;
    bool first = true;
    char line[4096];
    while (std::fgets(line, sizeof(line), pipe) != nullptr) {
      received += line;
      if (first && received.find("data: {") != std::string::npos) {
        first = false;
        on_first_event();
      }
    }
    pclose(pipe);
    return received;
  }
  // The model id the HTTP API serves.
  std::string Model() const {
    const auto r = odmoe::testing::RunProgram({"/usr/bin/curl", "-sS", StrCat("http://", http_, "/v1/models")});
    const absl::StatusOr<Json> models = ParseJson(r.out, "/v1/models");
    if (!models.ok() || !models->contains("data") || (*models)["data"].empty()) return "";
    return (*models)["data"][0].value("id", "");
  }
  // A completions request on a new connection: curl's exit code and what it printed (7: connection refused).
  odmoe::testing::RunResult NewRequest() const {
    return odmoe::testing::RunProgram({"/usr/bin/curl", "-sS", "-H", "Content-Type: application/json", "--data-binary",
                                       StrCat(R"({"model":"x","prompt":"a"})"),
                                       StrCat("http://", http_, "/v1/completions")});
  }

  // GET `path` from main's HTTP API on a new connection.
  odmoe::testing::RunResult Get(const std::string& path) const {
    return odmoe::testing::RunProgram({"/usr/bin/curl", "-sS", StrCat("http://", http_, path)});
  }

  // A derived fixture's constructor may change these.
  int64_t shutdown_timeout_ms_ = 20000;
  bool metrics_on_http_ = false;  // main's HTTP port serves /metrics too
  odmoe::testing::TempDir dir_;
  std::string config_;
  std::vector<std::string> addresses_;  // gRPC: main, worker0, worker1
  std::string http_;                    // main's HTTP API
  std::vector<std::unique_ptr<Daemon>> daemons_;
};

// The JSON events of a streamed completion, in order ("data: [DONE]" left out); a line that is not JSON fails
// the test.
std::vector<Json> StreamedEvents(const std::string& body) {
  std::vector<Json> events;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (!absl::ConsumePrefix(&line, "data: ") || line == "[DONE]") continue;
    absl::StatusOr<Json> event = ParseJson(std::string_view(line.data(), line.size()), "a streamed event");
    EXPECT_TRUE(event.ok()) << event.status();
    if (event.ok()) events.push_back(*std::move(event));
  }
  return events;
}

// Tokens in the chunks of a streamed completion.
size_t StreamedTokens(const std::string& body) {
  size_t tokens = 0;
  for (const Json& event : StreamedEvents(body)) {
    if (event.contains("choices")) tokens += event["choices"][0]["token_ids"].size();
  }
  return tokens;
}

TEST_F(ShutdownTest, SigtermLetsTheRequestInFlightFinishRefusesNewOnesAndExitsZero) {
  v1::GenerateRequest req;
  for (int32_t id : {1, 5, 9, 13}) req.add_prompt_ids(id);
  req.set_max_new_tokens(400);
  req.set_ignore_eos(true);
  std::atomic<bool> signalled{false};
  absl::StatusOr<RemoteResult> second = absl::UnknownError("not sent");
  bool second_sent = false;
  auto on_chunk = [&](const v1::GenerateResponse&) {
    if (signalled.exchange(true)) return;
    ASSERT_EQ(kill(daemons_[0]->pid(), SIGTERM), 0);
    // Main has stopped taking calls once readiness says so (at once after the signal).
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (Clock::now() < deadline) {
      auto ready = rpc::CheckServing(addresses_[0], 500, rpc::kReadinessService);
      if (!ready.ok() || !*ready) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    v1::GenerateRequest small = req;
    small.set_max_new_tokens(2);
    second = GenerateRemote(addresses_[0], small, 5000);
    second_sent = true;
  };
  const auto start = Clock::now();
  absl::StatusOr<RemoteResult> first = GenerateRemote(addresses_[0], req, 60000, on_chunk);
  ASSERT_TRUE(first.ok()) << first.status() << "\n" << Log("main");
  EXPECT_EQ(first->tokens.size(), 400u);
  ASSERT_TRUE(signalled.load());
  ASSERT_TRUE(second_sent);
  // Refused: UNAVAILABLE on a new connection (the port is closed); a call that reaches main on a connection
  // opened before the signal is cancelled by gRPC's shutdown (CANCELLED). Either way it never runs.
  EXPECT_TRUE(second.status().code() == absl::StatusCode::kUnavailable ||
              second.status().code() == absl::StatusCode::kCancelled)
      << second.status();
  EXPECT_EQ(daemons_[0]->WaitExit(std::chrono::seconds(20)), 0) << Log("main");
  const std::string log = Log("main");
  EXPECT_NE(log.find("shutting down; calls in flight get 20000 ms"), std::string::npos) << log;
  std::cout << "[shutdown] request of 400 tokens done in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()
            << " ms across SIGTERM\n";
  for (size_t w = 1; w < 3; ++w) {
    ASSERT_EQ(kill(daemons_[w]->pid(), SIGTERM), 0);
    EXPECT_EQ(daemons_[w]->WaitExit(std::chrono::seconds(20)), 0) << Log(StrCat("worker", w - 1));
  }
}

TEST_F(ShutdownTest, SigtermLetsAnHttpStreamFinishAndClosesTheHttpPort) {
  ASSERT_FALSE(Model().empty());
  int refused_exit = -1;
  const std::string body = Stream(400, [&] {
    ASSERT_EQ(kill(daemons_[0]->pid(), SIGTERM), 0);
    // The port closes at the signal: a new connection is refused within a moment.
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (Clock::now() < deadline) {
      refused_exit = NewRequest().exit_code;
      if (refused_exit == 7) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  EXPECT_EQ(refused_exit, 7) << "curl's 'failed to connect'";
  EXPECT_EQ(StreamedTokens(body), 400u) << body.substr(0, 2000);
  EXPECT_NE(body.find("data: [DONE]"), std::string::npos) << body.substr(body.size() > 2000 ? body.size() - 2000 : 0);
  EXPECT_EQ(body.find("\"error\""), std::string::npos);
  EXPECT_EQ(daemons_[0]->WaitExit(std::chrono::seconds(20)), 0) << Log("main");
  EXPECT_EQ(Log("main").find("still running at the shutdown deadline"), std::string::npos) << Log("main");
}

// Main with no time to drain: a stream in flight at the signal ends with OpenAI's error event and [DONE], as vLLM's
// does, not cut off.
class NoDrainShutdownTest : public ShutdownTest {
 protected:
  NoDrainShutdownTest() { shutdown_timeout_ms_ = 0; }
};

TEST_F(NoDrainShutdownTest, AnHttpStreamStillRunningEndsWithAnErrorEvent) {
  ASSERT_FALSE(Model().empty());
  const std::string body = Stream(1000, [&] { ASSERT_EQ(kill(daemons_[0]->pid(), SIGTERM), 0); });
  EXPECT_LT(StreamedTokens(body), 1000u);
  const std::vector<Json> events = StreamedEvents(body);
  ASSERT_FALSE(events.empty()) << body;
  EXPECT_EQ(events.back().value("/error/message"_json_pointer, ""), "the HTTP server is shutting down")
      << body.substr(body.size() > 2000 ? body.size() - 2000 : 0);
  EXPECT_TRUE(body.ends_with("}\n\ndata: [DONE]\n\n")) << body.substr(body.size() > 2000 ? body.size() - 2000 : 0);
  EXPECT_EQ(daemons_[0]->WaitExit(std::chrono::seconds(20)), 0) << Log("main");
  const std::string log = Log("main");
  EXPECT_NE(log.find("1 HTTP request(s) still running at the shutdown deadline"), std::string::npos) << log;
  EXPECT_NE(log.find("finished: outcome=unavailable"), std::string::npos) << log;
}

// Main whose HTTP port also serves /metrics: the port stays open through the drain, so that it can be watched.
class SharedMetricsShutdownTest : public ShutdownTest {
 protected:
  SharedMetricsShutdownTest() { metrics_on_http_ = true; }
};

TEST_F(SharedMetricsShutdownTest, TheHttpPortAnswersMetricsThroughTheDrainAndRefusesTheRest) {
  ASSERT_FALSE(Model().empty());
  odmoe::testing::RunResult health, metrics, refused;
  const std::string body = Stream(1000, [&] {
    ASSERT_EQ(kill(daemons_[0]->pid(), SIGTERM), 0);
    // /health says so within a moment of the signal; meanwhile the stream goes on.
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (Clock::now() < deadline) {
      health = Get("/health");
      if (health.out.find("shutting down") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    metrics = Get("/metrics");
    refused = NewRequest();
  });
  EXPECT_NE(health.out.find("main is shutting down"), std::string::npos) << health.out;
  EXPECT_NE(metrics.out.find("odmoe_http_requests_total{"), std::string::npos) << metrics.out.substr(0, 2000);
  EXPECT_EQ(refused.exit_code, 0) << "connected: the port is open";
  EXPECT_NE(refused.out.find("main is shutting down"), std::string::npos) << refused.out;
  EXPECT_EQ(StreamedTokens(body), 1000u) << body.substr(0, 2000);
  EXPECT_NE(body.find("data: [DONE]"), std::string::npos) << body.substr(body.size() > 2000 ? body.size() - 2000 : 0);
  EXPECT_EQ(daemons_[0]->WaitExit(std::chrono::seconds(20)), 0) << Log("main");
}

TEST_F(ShutdownTest, AStalledWorkersCallFailsWithDeadlineExceededWithinItsDeadline) {
  ASSERT_EQ(kill(daemons_[1]->pid(), SIGSTOP), 0);
  auto stub = v1::Worker::NewStub(rpc::MakeChannel(addresses_[1]));
  // One call, as main makes it: with a deadline, on a channel that may already be connected.
  constexpr int64_t kDeadlineMs = 1000;
  grpc::ClientContext ctx;
  rpc::SetDeadline(ctx, kDeadlineMs);
  v1::WorkerStats stats;
  const auto start = Clock::now();
  const grpc::Status st = stub->GetStats(&ctx, {}, &stats);
  const int64_t took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_LT(took, kDeadlineMs + 1000);
  std::cout << "[stalled worker] DEADLINE_EXCEEDED after " << took << " ms (deadline " << kDeadlineMs << " ms)\n";
  ASSERT_EQ(kill(daemons_[1]->pid(), SIGCONT), 0);
}

}  // namespace
}  // namespace odmoe
