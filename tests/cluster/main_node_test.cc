// The main node with real workers, in one process on loopback: N WorkerNode services and a MainNode, each on
// its own gRPC server at 127.0.0.1 with a free port, and clients through GenerateRemote (and the odmoe CLI).
// Results must equal the single-process engine exactly: tokens and routing, and the last logits bit for bit.
// Needs ../shared/models (each test says which model it skips without).
#include "src/main_node/main_node.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/cluster/client.h"
#include "src/common/json.h"
#include "src/common/limits.h"
#include "src/common/placement.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "src/main_node/remote_experts.h"
#include "src/model/tokenizer.h"
#include "src/rpc/peer_version.h"
#include "src/rpc/rpc_util.h"
#include "src/shadow_node/shadow_node.h"
#include "src/worker_node/worker_node.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using ::odmoe::testing::CapturedLog;
using ::odmoe::testing::HaveSharedModel;
using ::odmoe::testing::SharedModel;

constexpr uint64_t kEpoch = 7;
constexpr int64_t kTimeoutMs = 120000;

// A Worker service that never answers ComputeExperts until the call is cancelled (its deadline passes).
class HungWorker final : public v1::Worker::Service {
 public:
  grpc::Status ComputeExperts(grpc::ServerContext* context, const v1::ComputeExpertsRequest*,
                              v1::ComputeExpertsResponse*) override {
    while (!context->IsCancelled() && !stop_.WaitForNotificationWithTimeout(absl::Milliseconds(10))) {
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "gave up");
  }
  void Stop() { stop_.Notify(); }

 private:
  absl::Notification stop_;
};

// A real worker behind a Worker service that records, for each ComputeExperts call, the bytes of its hidden
// states and outputs and of the padding around them (emulation: PayloadScale).
class RecordingWorker final : public v1::Worker::Service {
 public:
  struct Call {
    size_t hidden = 0, request_padding = 0, outputs = 0, response_padding = 0;
  };
  explicit RecordingWorker(WorkerNode* inner) : inner_(inner) {}
  grpc::Status ComputeExperts(grpc::ServerContext* context, const v1::ComputeExpertsRequest* request,
                              v1::ComputeExpertsResponse* response) override {
    const grpc::Status status = inner_->ComputeExperts(context, request, response);
    Call call{request->hidden().data().size(), request->padding().size(), 0, response->padding().size()};
    for (const v1::ExpertOutput& o : response->outputs()) call.outputs += o.output().data().size();
    absl::MutexLock lock(&mu_);
    calls_.push_back(call);
    return status;
  }
  grpc::Status Prefetch(grpc::ServerContext* context, const v1::PrefetchRequest* request,
                        v1::PrefetchResponse* response) override {
    return inner_->Prefetch(context, request, response);
  }
  grpc::Status GetStats(grpc::ServerContext* context, const v1::StatsRequest* request,
                        v1::WorkerStats* response) override {
    return inner_->GetStats(context, request, response);
  }
  grpc::Status GetMembership(grpc::ServerContext* context, const v1::MembershipRequest* request,
                             v1::Membership* response) override {
    return inner_->GetMembership(context, request, response);
  }
  std::vector<Call> calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  WorkerNode* const inner_;
  mutable absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
};

struct ClusterSpec {
  std::string model;
  int workers = 8;
  int group_size = 0;  // 0: the model's top-k
  std::string main_device = "cpu";
  std::string worker_device = "mock-gpu";
  int64_t rpc_timeout_ms = 60000;
  int down_worker = -1;  // this worker gets an address where nothing listens
  int hung_worker = -1;  // this worker never answers
  int foreign_worker = -1;  // this worker runs another cluster epoch (started from another cluster file)
  bool identify = true;     // the workers' answers name their cluster (false: as builds before identities)
  uint64_t epoch = kEpoch;
  int64_t prefill_minibatch_rows = -1;  // -1: the cluster file's default
  std::string cluster_extra;            // more lines of the [cluster] table
  bool record_calls = false;            // every worker behind a RecordingWorker
  MainNodeOptions main_options;
};

std::string ClusterToml(const ClusterSpec& spec, const std::string& main_address,
                        const std::vector<std::string>& worker_addresses) {
  std::string t =
      StrCat("[cluster]\nname = \"test\"\nepoch = ", spec.epoch, "\ngroup_size = ", spec.group_size,
             "\nrpc_timeout_ms = ", spec.rpc_timeout_ms,
             spec.prefill_minibatch_rows >= 0 ? StrCat("\nprefill_minibatch_rows = ", spec.prefill_minibatch_rows)
                                              : std::string(),
             "\n", spec.cluster_extra, "\n[model]\npath = \"", SharedModel(spec.model),
             "\"\n[[node]]\nname = \"main\"\nrole = \"main\"\naddress = \"", main_address, "\"\ndevice = \"",
             spec.main_device, "\"\n");
  for (size_t i = 0; i < worker_addresses.size(); ++i) {
    t += StrCat("[[node]]\nname = \"w", i, "\"\nrole = \"worker\"\naddress = \"", worker_addresses[i],
                "\"\ndevice = \"", spec.worker_device, "\"\n");
  }
  return t;
}

ClusterConfig ParseToml(const std::string& toml) {
  absl::StatusOr<ClusterConfig> c = ParseClusterConfig(toml, "test.toml", "/");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// A loopback port where nothing listens: bound (so no one else takes it) but not listening, so connections
// are refused. Held until the test ends.
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  static std::vector<int>* held = new std::vector<int>();  // closed when the test process exits
  held->push_back(fd);
  return ntohs(addr.sin_port);
}

// Workers and main, all in this process.
class TestCluster {
 public:
  explicit TestCluster(ClusterSpec spec) : spec_(std::move(spec)) {}

  absl::Status Start() {
    const std::string model_dir = SharedModel(spec_.model);
    // The workers are built from a config with placeholder addresses (they only need their index, the epoch
    // and the group size); main then gets the real ports.
    std::vector<std::string> placeholder;
    for (int i = 0; i < spec_.workers; ++i) placeholder.push_back(StrCat("127.0.0.1:", 2 + i));
    const ClusterConfig worker_view = ParseToml(ClusterToml(spec_, "127.0.0.1:1", placeholder));
    std::vector<std::string> addresses;
    for (int i = 0; i < spec_.workers; ++i) {
      if (i == spec_.down_worker) {
        addresses.push_back(StrCat("127.0.0.1:", ClosedPort()));
        workers_.push_back(nullptr);
        continue;
      }
      std::unique_ptr<rpc::Server> server;
      if (i == spec_.hung_worker) {
        hung_ = std::make_unique<HungWorker>();
        ODMOE_ASSIGN_OR_RETURN(server, rpc::Server::Start({"127.0.0.1:0", 2}, {hung_.get()}));
        workers_.push_back(nullptr);
      } else {
        ClusterSpec foreign = spec_;
        foreign.epoch = spec_.epoch + 1;
        const ClusterConfig& view =
            i == spec_.foreign_worker
                ? foreign_view_.emplace(ParseToml(ClusterToml(foreign, "127.0.0.1:1", placeholder)))
                : worker_view;
        const NodeConfig& self = *view.workers()[static_cast<size_t>(i)];
        ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(self.device, self.gpu_budget_bytes));
        ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<WorkerNode> w,
                               WorkerNode::Create(view, self, model_dir, std::move(device)));
        grpc::Service* service = w.get();
        if (spec_.record_calls) {
          recorders_.push_back(std::make_unique<RecordingWorker>(w.get()));
          service = recorders_.back().get();
        }
        ODMOE_ASSIGN_OR_RETURN(
            server, rpc::Server::Start({.address = "127.0.0.1:0",
                                        .threads = 2,
                                        .cluster = spec_.identify ? rpc::ClusterIdentity(w->epoch(), w->fingerprint())
                                                                  : std::string()},
                                       {service}));
        workers_.push_back(std::move(w));
      }
      server->MarkServing(true);
      addresses.push_back(StrCat("127.0.0.1:", server->port()));
      worker_servers_.push_back(std::move(server));
    }
    cluster_ = ParseToml(ClusterToml(spec_, "127.0.0.1:1", addresses));
    rpc::DaemonArgs args{cluster_, *cluster_.main(), model_dir};
    ODMOE_ASSIGN_OR_RETURN(main_, MainNode::Create(args, spec_.main_options));
    ODMOE_ASSIGN_OR_RETURN(main_server_, rpc::Server::Start({"127.0.0.1:0", 2}, {main_.get()}));
    main_server_->MarkServing(true);
    endpoint_ = StrCat("127.0.0.1:", main_server_->port());
    return absl::OkStatus();
  }

  ~TestCluster() {
    if (hung_ != nullptr) hung_->Stop();
    if (main_server_ != nullptr) main_server_->Shutdown(0);
    for (auto& s : worker_servers_) s->Shutdown(0);
  }

  const std::string& endpoint() const { return endpoint_; }
  MainNode& main() { return *main_; }
  WorkerNode* worker(int i) { return workers_[static_cast<size_t>(i)].get(); }
  // With spec.record_calls: the recorders of the workers, in order.
  const std::vector<std::unique_ptr<RecordingWorker>>& recorders() const { return recorders_; }
  const ClusterConfig& cluster() const { return cluster_; }

 private:
  ClusterSpec spec_;
  ClusterConfig cluster_;
  std::optional<ClusterConfig> foreign_view_;  // the foreign worker's cluster file
  std::unique_ptr<HungWorker> hung_;
  std::vector<std::unique_ptr<WorkerNode>> workers_;  // nullptr for a down or hung worker
  std::vector<std::unique_ptr<RecordingWorker>> recorders_;
  std::vector<std::unique_ptr<rpc::Server>> worker_servers_;
  std::unique_ptr<MainNode> main_;
  std::unique_ptr<rpc::Server> main_server_;
  std::string endpoint_;
};

v1::GenerateRequest IdsRequest(const std::vector<int32_t>& ids, int64_t max_new_tokens) {
  v1::GenerateRequest r;
  r.mutable_prompt_ids()->Add(ids.begin(), ids.end());
  r.set_max_new_tokens(max_new_tokens);
  r.set_ignore_eos(true);
  r.set_dump_logits(true);
  r.set_dump_routing(true);
  return r;
}

// A prompt of `n` ids spread over the vocabulary.
std::vector<int32_t> SpreadPrompt(const ModelConfig& c, int n) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>((1 + 37 * i + 11 * i * i) % c.vocab_size));
  return ids;
}

GenerateResult LocalReference(const std::string& model, const std::string& device, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, EngineOptions engine = {}) {
  auto dev = CreateDevice(device);
  EXPECT_TRUE(dev.ok()) << dev.status();
  auto local = LocalModel::Open(SharedModel(model), std::move(dev).value(), engine);
  EXPECT_TRUE(local.ok()) << local.status();
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.ignore_eos = true;
  o.record_routing = true;
  o.keep_last_logits = true;
  auto r = Generate((*local)->engine(), prompt, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

void ExpectSameAsLocal(const RemoteResult& remote, const GenerateResult& local, const std::vector<int32_t>& prompt) {
  EXPECT_EQ(remote.prompt_ids, prompt);
  EXPECT_EQ(remote.tokens, local.tokens);
  EXPECT_EQ(remote.stop_reason, local.stop_reason);
  ASSERT_EQ(remote.routing.size(), local.routing.size());
  for (size_t p = 0; p < local.routing.size(); ++p) EXPECT_EQ(remote.routing[p], local.routing[p]) << "position " << p;
  ASSERT_EQ(remote.last_logits.size(), local.last_logits.size());
  EXPECT_EQ(std::memcmp(remote.last_logits.data(), local.last_logits.data(), local.last_logits.size() * sizeof(float)),
            0)
      << "last_logits differ from the single-process engine's bit for bit";
  for (float v : remote.last_logits) ASSERT_TRUE(std::isfinite(v));
}

// Per worker, what main's placement must have sent: (token, expert) rows and (expert, call) pairs. Prefill
// (the prompt, one chunk) sends expert e to worker e mod N_W; each decode position sends the layer's actual
// set to its group, one-to-one.
struct Expected {
  std::vector<uint64_t> rows, experts;
};
Expected ExpectedWork(const ModelConfig& c, const std::vector<PositionRouting>& routing, size_t prompt_len, int workers,
                      int group_size) {
  const int32_t g = group_size > 0 ? group_size : static_cast<int32_t>(c.top_k);
  const Placement placement = *Placement::Create(workers, g);
  Expected e{std::vector<uint64_t>(static_cast<size_t>(workers)), std::vector<uint64_t>(static_cast<size_t>(workers))};
  const size_t sparse = c.SparseLayers().size();
  // A one-token prompt runs as a decode step.
  const size_t first_decode = prompt_len > 1 ? prompt_len : 0;
  for (size_t s = 0; s < sparse; ++s) {
    std::map<int32_t, int> prefill;  // expert -> tokens that chose it
    for (size_t p = 0; p < first_decode; ++p) {
      for (int32_t x : routing[p][s]) ++prefill[x];
    }
    for (const auto& [x, count] : prefill) {
      const size_t w = static_cast<size_t>(placement.PrefillWorkerOf(x));
      e.rows[w] += static_cast<uint64_t>(count);
      e.experts[w] += 1;
    }
    for (size_t p = first_decode; p < routing.size(); ++p) {
      for (const Assignment& a : placement.Assign(static_cast<int64_t>(s), routing[p][s])) {
        e.rows[static_cast<size_t>(a.worker)] += 1;
        e.experts[static_cast<size_t>(a.worker)] += 1;
      }
    }
  }
  return e;
}

void CheckStats(const RemoteResult& r, const ModelConfig& c, size_t prompt_len, TestCluster& cluster, int workers,
                int group_size) {
  const v1::RequestStats& st = r.stats;
  const uint64_t positions = prompt_len + (r.tokens.empty() ? 0 : r.tokens.size() - 1);
  EXPECT_EQ(st.positions(), positions);
  EXPECT_EQ(st.expert_tensors_opened(), 0u);
  EXPECT_EQ(cluster.main().expert_tensors_opened(), 0);
  ASSERT_EQ(st.workers_size(), workers);
  uint64_t rows = 0, loads = 0, bytes = 0;
  for (const v1::WorkerRequestStats& w : st.workers()) {
    rows += w.rows_computed();
    loads += w.loads_on_demand();
    bytes += w.bytes_loaded();
  }
  // Every (token, expert) pair of every sparse layer computed exactly once, somewhere.
  EXPECT_EQ(rows, static_cast<uint64_t>(c.top_k) * c.SparseLayers().size() * positions);
  EXPECT_EQ(st.loads_on_demand(), loads);
  EXPECT_EQ(st.bytes_loaded(), bytes);
  EXPECT_GT(loads, 0u);  // no shadow: every expert is loaded after routing
  EXPECT_GT(bytes, 0u);
  const Expected want = ExpectedWork(c, r.routing, prompt_len, workers, group_size);
  for (int i = 0; i < workers; ++i) {
    const v1::WorkerRequestStats& w = st.workers(i);
    EXPECT_EQ(w.node(), StrCat("w", i));
    EXPECT_EQ(w.rows_computed(), want.rows[static_cast<size_t>(i)]) << "worker " << i;
    EXPECT_EQ(w.experts_computed(), want.experts[static_cast<size_t>(i)]) << "worker " << i;
    // The worker's own counters agree with what main accounted.
    if (WorkerNode* node = cluster.worker(i)) {
      const v1::WorkerStats ws = node->Stats(/*reset=*/true);
      EXPECT_EQ(ws.rows_computed(), w.rows_computed()) << "worker " << i;
      EXPECT_EQ(ws.experts_computed(), w.experts_computed()) << "worker " << i;
      EXPECT_EQ(ws.loads_on_demand(), w.loads_on_demand()) << "worker " << i;
      EXPECT_EQ(ws.bytes_loaded(), w.bytes_loaded()) << "worker " << i;
      // The peak main reports is the worker's own (as its last reply said; nothing from a worker it did not
      // call), and within its budget when it has one.
      EXPECT_EQ(w.gpu_peak_bytes(), w.calls() > 0 ? ws.memory().peak_bytes() : 0) << "worker " << i;
      if (ws.memory().capacity_bytes() > 0) {
        EXPECT_LE(w.gpu_peak_bytes(), ws.memory().capacity_bytes()) << "worker " << i;
      }
    }
  }
}

// ---- PlanCalls -----------------------------------------------------------------------------------------------

TEST(PlanCallsTest, KeepsExpertsWholeAndRespectsLimits) {
  std::vector<ExpertBatch> batches(3);
  batches[0] = {1, {0, 1, 2, 3}, {1, 1, 1, 1}};
  batches[1] = {4, {2, 3, 4}, {1, 1, 1}};
  batches[2] = {6, {0, 5}, {1, 1}};
  // Experts 1 and 6 on worker 1, expert 4 on worker 0.
  std::vector<PlannedCall> calls = PlanCalls(batches, {1, 0, 1}, 100, 100);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].worker, 0);
  EXPECT_EQ(calls[0].rows, (std::vector<int32_t>{2, 3, 4}));
  ASSERT_EQ(calls[0].tasks.size(), 1u);
  EXPECT_EQ(calls[1].worker, 1);
  EXPECT_EQ(calls[1].rows, (std::vector<int32_t>{0, 1, 2, 3, 5}));  // the union, each row sent once
  ASSERT_EQ(calls[1].tasks.size(), 2u);
  EXPECT_EQ(calls[1].tasks[0].batch, 0u);
  EXPECT_EQ(calls[1].tasks[1].batch, 2u);

  // At most 4 rows sent per call: experts 1 and 6 no longer fit together.
  calls = PlanCalls(batches, {1, 0, 1}, 4, 100);
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[1].rows, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(calls[2].rows, (std::vector<int32_t>{0, 5}));

  // At most 3 rows: expert 1's four rows are split into 3 + 1.
  calls = PlanCalls(batches, {0, 0, 0}, 3, 100);
  size_t covered = 0;
  for (const PlannedCall& c : calls) {
    EXPECT_LE(c.rows.size(), 3u);
    for (const PlannedCall::Task& t : c.tasks) covered += t.end - t.begin;
  }
  EXPECT_EQ(covered, 9u);

  // At most 5 task rows per call (outputs): expert 4 (3 rows) cannot join expert 1 (4 rows).
  calls = PlanCalls(batches, {0, 0, 0}, 100, 5);
  for (const PlannedCall& c : calls) {
    size_t task_rows = 0;
    for (const PlannedCall::Task& t : c.tasks) task_rows += t.end - t.begin;
    EXPECT_LE(task_rows, 5u);
  }
}

// ---- the cluster against the single-process engine ----------------------------------------------------------

class ClusterMatchesEngine : public ::testing::TestWithParam<std::string> {};

TEST_P(ClusterMatchesEngine, TokensRoutingAndLogitsIdentical) {
  const std::string model = GetParam();
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const ModelConfig& c = cluster.main().config();
  const std::vector<int32_t> prompt = SpreadPrompt(c, 9);
  constexpr int64_t kNew = 6;
  const GenerateResult local = LocalReference(model, "cpu", prompt, kNew);

  std::vector<int32_t> streamed;
  int finals = 0;
  auto remote =
      GenerateRemote(cluster.endpoint(), IdsRequest(prompt, kNew), kTimeoutMs, [&](const v1::GenerateResponse& m) {
        streamed.insert(streamed.end(), m.tokens().begin(), m.tokens().end());
        finals += m.done();
      });
  ASSERT_TRUE(remote.ok()) << remote.status();
  ExpectSameAsLocal(*remote, local, prompt);
  EXPECT_EQ(streamed, local.tokens);  // each token streamed once, in order
  EXPECT_EQ(finals, 1);
  CheckStats(*remote, c, prompt.size(), cluster, 8, 0);

  // A one-token prompt (decode placement from the first position) and a second request on the same main.
  const std::vector<int32_t> one = {prompt[3]};
  const GenerateResult local1 = LocalReference(model, "cpu", one, 4);
  auto remote1 = GenerateRemote(cluster.endpoint(), IdsRequest(one, 4), kTimeoutMs, nullptr);
  ASSERT_TRUE(remote1.ok()) << remote1.status();
  ExpectSameAsLocal(*remote1, local1, one);
  CheckStats(*remote1, c, 1, cluster, 8, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, ClusterMatchesEngine,
                         ::testing::Values("mixtral-tiny", "qwen2moe-tiny", "qwen3moe-tiny", "olmoe-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(MainNodeTest, ChunkedCallsAndOtherTopologiesStayExact) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  // Four workers in groups of one, main on the mock GPU, prefill in chunks of 5 tokens, and calls limited to
  // 3 rows of hidden state so that experts are split over several calls.
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 4;
  spec.group_size = 1;
  spec.main_device = "mock-gpu";
  spec.main_options.engine.max_tokens_per_forward = 5;
  spec.main_options.max_tensor_bytes_per_call = 3 * 128 * sizeof(float);
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const std::vector<int32_t> prompt = SpreadPrompt(cluster.main().config(), 13);
  EngineOptions engine;
  engine.max_tokens_per_forward = 5;
  const GenerateResult local = LocalReference(model, "mock-gpu", prompt, 5, engine);
  auto remote = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 5), kTimeoutMs, nullptr);
  ASSERT_TRUE(remote.ok()) << remote.status();
  ExpectSameAsLocal(*remote, local, prompt);
  const ModelConfig& c = cluster.main().config();
  uint64_t rows = 0, calls = 0, experts = 0, retries = 0;
  for (const auto& w : remote->stats.workers()) {
    rows += w.rows_computed();
    calls += w.calls();
    experts += w.experts_computed();
    retries += w.busy_retries();
  }
  RecordProperty("busy_retries", static_cast<int>(retries));  // a worker with no thread free: retried
  EXPECT_EQ(rows, static_cast<uint64_t>(c.top_k) * c.SparseLayers().size() * remote->stats.positions());
  EXPECT_GE(calls, experts / 2);  // sanity: calls were made; with 3 rows per call, many
  EXPECT_EQ(remote->stats.expert_tensors_opened(), 0u);
}

// Emulation (issue 28): with main and the workers on mock GPUs, a request's stats carry the modelled busy time
// of main's device and of each decode layer's slowest worker call, and the wall time of the same layers by
// sparse index; a CPU main models nothing and reports none.
TEST(MainNodeTest, MockGpuNodesReportTheModelledTimeOfEachDecodeLayer) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  for (const std::string main_device : {"mock-gpu", "cpu"}) {
    SCOPED_TRACE(main_device);
    ClusterSpec spec;
    spec.model = model;
    spec.workers = 4;
    spec.main_device = main_device;
    TestCluster cluster(spec);
    const absl::Status started = cluster.Start();
    ASSERT_TRUE(started.ok()) << started;
    const ModelConfig& c = cluster.main().config();
    const std::vector<int32_t> prompt = SpreadPrompt(c, 7);
    constexpr int64_t kNew = 5;
    auto remote = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, kNew), kTimeoutMs, nullptr);
    ASSERT_TRUE(remote.ok()) << remote.status();
    const v1::RequestStats& st = remote->stats;
    const uint64_t sparse = c.SparseLayers().size();
    // kNew - 1 decode positions (the first token comes from the prefill); the first decode layer has no
    // previous layer's end to time from.
    const uint64_t decode_layers = (kNew - 1) * sparse;
    if (main_device == "cpu") {
      EXPECT_EQ(st.modeled_layers(), 0u);
      EXPECT_EQ(st.modeled_main_ms(), 0.0);
      EXPECT_EQ(st.measured_ms_per_layer_size(), 0);
      continue;
    }
    EXPECT_EQ(st.modeled_layers(), decode_layers - 1);
    EXPECT_GT(st.modeled_main_ms(), 0.0);
    EXPECT_GT(st.modeled_worker_ms(), 0.0);
    ASSERT_EQ(st.measured_ms_per_layer_size(), static_cast<int>(sparse));
    double sum = 0;
    for (double ms : st.measured_ms_per_layer()) {
      EXPECT_GT(ms, 0.0);
      sum += ms;
    }
    EXPECT_NEAR(sum, st.measured_layers_ms(), 1e-6 * st.measured_layers_ms());
  }
}

// Emulation over shaped links (issue 28): with a [cluster] timing_model, every expert call and its reply are
// padded to the bytes the timing model's hidden states would take (Mixtral-8x7B's hidden 4096 over the running
// model's), and the tokens stay the single-process engine's.
TEST(MainNodeTest, ATimingModelPadsExpertCallsToTheTargetsBytes) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 2;
  spec.group_size = 2;
  spec.record_calls = true;
  spec.cluster_extra =
      StrCat("timing_model = \"", odmoe::testing::SourceDir(), "/configs/models/mixtral-8x7b/config.json\"");
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const ModelConfig& c = cluster.main().config();
  ASSERT_EQ(4096 % c.hidden_size, 0);
  const size_t pad = 4096 / c.hidden_size - 1;  // padding bytes per payload byte
  const std::vector<int32_t> prompt = SpreadPrompt(c, 5);
  auto remote = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 3), kTimeoutMs, nullptr);
  ASSERT_TRUE(remote.ok()) << remote.status();
  ExpectSameAsLocal(*remote, LocalReference(model, "cpu", prompt, 3), prompt);
  size_t calls = 0;
  for (const auto& recorder : cluster.recorders()) {
    for (const RecordingWorker::Call& call : recorder->calls()) {
      ++calls;
      EXPECT_GT(call.hidden, 0u);
      EXPECT_EQ(call.request_padding, pad * call.hidden);
      EXPECT_EQ(call.response_padding, pad * call.outputs);
    }
  }
  EXPECT_GT(calls, 0u);
}

// Continuous batching (Client API 2/2): eight greedy requests of different prompts and lengths, at once, give
// exactly the tokens, routing and last logits each gives alone in the single-process engine, decoded together
// (main's mean decode batch well above one); with max_running = 8 and max_queued = 0 a ninth, sent while they
// run, is refused at once, busy (RESOURCE_EXHAUSTED, the CLI's exit 10).
TEST(MainNodeTest, EightConcurrentRequestsGiveTheirSoloTokensAndANinthIsRefusedBusy) {
  const std::string model = "tiny-mixtral-kjv";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  spec.cluster_extra = "max_running = 8\nmax_queued = 0";
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const ModelConfig& c = cluster.main().config();
  constexpr int kClients = 8;
  const int prompt_lens[kClients] = {16, 3, 40, 9, 1, 21, 27, 12};
  const int new_tokens[kClients] = {48, 60, 40, 52, 44, 36, 56, 64};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<GenerateResult> solo;
  for (int i = 0; i < kClients; ++i) {
    std::vector<int32_t> p = SpreadPrompt(c, prompt_lens[i] + i);
    p.erase(p.begin(), p.begin() + i);  // different prompts, not prefixes of one another
    prompts.push_back(p);
    solo.push_back(LocalReference(model, "cpu", p, new_tokens[i]));
  }
  absl::Mutex mu;
  int first_tokens = 0;  // clients that have had their first token
  std::vector<absl::StatusOr<RemoteResult>> results(kClients, absl::UnknownError("not run"));
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      bool counted = false;
      results[static_cast<size_t>(i)] = GenerateRemote(
          cluster.endpoint(), IdsRequest(prompts[static_cast<size_t>(i)], new_tokens[i]), kTimeoutMs,
          [&](const v1::GenerateResponse& r) {
            if (counted || r.tokens_size() == 0) return;
            counted = true;
            absl::MutexLock lock(&mu);
            ++first_tokens;
          });
    });
  }
  {
    // All eight run (each has streamed a token): a ninth finds no place, and no queue.
    absl::MutexLock lock(&mu);
    auto all_running = [&first_tokens]() { return first_tokens == kClients; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all_running), absl::Seconds(120)));
  }
  const auto ninth = GenerateRemote(cluster.endpoint(), IdsRequest(prompts[0], 4), kTimeoutMs, nullptr);
  EXPECT_TRUE(IsServerBusy(ninth.status())) << ninth.status();
  EXPECT_TRUE(absl::IsResourceExhausted(ninth.status())) << ninth.status();
  EXPECT_NE(ninth.status().message().find("8 requests running (max_running = 8)"), std::string::npos)
      << ninth.status();
  EXPECT_EQ(ExitCodeFor(ninth.status()), kExitBusy);
  for (std::thread& t : clients) t.join();
  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE(StrCat("client ", i));
    const absl::StatusOr<RemoteResult>& r = results[static_cast<size_t>(i)];
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectSameAsLocal(*r, solo[static_cast<size_t>(i)], prompts[static_cast<size_t>(i)]);
  }
  const v1::MainStats stats = cluster.main().Stats(/*reset=*/false);
  ASSERT_GT(stats.decode_steps(), 0u);
  const double mean_batch = static_cast<double>(stats.decode_rows()) / static_cast<double>(stats.decode_steps());
  RecordProperty("mean_decode_batch", std::to_string(mean_batch));
  EXPECT_GT(mean_batch, 3.0) << "the requests were not decoded together";
  // After the burst, one more is served: the places were given back.
  auto after = GenerateRemote(cluster.endpoint(), IdsRequest(prompts[1], 6), kTimeoutMs, nullptr);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->tokens, std::vector<int32_t>(solo[1].tokens.begin(), solo[1].tokens.begin() + 6));
}

// Main's KV caches are allocated whole when a request joins the batch. A request whose cache does not fit beside
// the running requests' waits until one leaves, then runs, with its solo tokens; one that cannot fit even alone
// fails with ResourceExhausted. (Such a request once failed at once, 503 on the HTTP API.)
TEST(MainNodeTest, ARequestWhoseKvCacheDoesNotFitWaitsForTheRunningOnes) {
  const std::string model = "tiny-mixtral-kjv";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  // `decoding` runs a while with a KV cache of 299 positions (over 1 MiB); `long_prompt`'s is larger (1003
  // positions) and takes one prefill and 4 steps. Tokens only (no logits or routing): the test is about memory.
  const absl::StatusOr<ModelConfig> config = LoadModelConfig(SharedModel(model));
  ASSERT_TRUE(config.ok()) << config.status();
  std::vector<int32_t> decoding = SpreadPrompt(*config, 203);
  decoding.erase(decoding.begin(), decoding.begin() + 3);  // not a prefix of long_prompt
  constexpr int kDecodingTokens = 100;
  const std::vector<int32_t> long_prompt = SpreadPrompt(*config, 1000);
  auto tokens_only = [](const std::vector<int32_t>& prompt, int64_t max_new_tokens) {
    v1::GenerateRequest r = IdsRequest(prompt, max_new_tokens);
    r.set_dump_logits(false);
    r.set_dump_routing(false);
    return r;
  };
  // Main's memory idle, and what `long_prompt` adds to it, on a device with room for much more.
  uint64_t idle = 0, long_prompt_needs = 0;
  {
    ClusterSpec spec;
    spec.model = model;
    spec.main_device = "mock-gpu";
    TestCluster cluster(spec);
    const absl::Status started = cluster.Start();
    ASSERT_TRUE(started.ok()) << started;
    idle = cluster.main().Stats(/*reset=*/false).memory().in_use_bytes();
    auto r = GenerateRemote(cluster.endpoint(), tokens_only(long_prompt, 4), kTimeoutMs, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    long_prompt_needs = cluster.main().Stats(/*reset=*/false).memory().peak_bytes() - idle;
    ASSERT_GT(long_prompt_needs, uint64_t{3} << 20);
  }
  // Room for either, less than a MiB to spare: not for both.
  ClusterSpec spec;
  spec.model = model;
  spec.main_device = StrCat("mock-gpu:", (idle + long_prompt_needs + (uint64_t{1} << 20) - 1) >> 20);
  CapturedLog log;  // before the cluster, which joins the threads that log as it goes
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  absl::Notification first_token;
  absl::StatusOr<RemoteResult> a = absl::UnknownError("not run");
  std::thread client([&] {
    a = GenerateRemote(cluster.endpoint(), tokens_only(decoding, kDecodingTokens), kTimeoutMs,
                       [&](const v1::GenerateResponse& r) {
                         if (r.tokens_size() > 0 && !first_token.HasBeenNotified()) first_token.Notify();
                       });
  });
  ASSERT_TRUE(first_token.WaitForNotificationWithTimeout(absl::Seconds(120)));
  // While `decoding` runs: a cache that would not fit even alone (the whole context) fails at once; one that
  // waits leaves at its deadline; one that waits joins once `decoding` has left.
  const int64_t all = cluster.main().config().max_position_embeddings - static_cast<int64_t>(decoding.size());
  auto never = GenerateRemote(cluster.endpoint(), tokens_only(decoding, all), kTimeoutMs, nullptr);
  EXPECT_TRUE(absl::IsResourceExhausted(never.status())) << never.status();
  EXPECT_FALSE(IsServerBusy(never.status()));
  auto late = GenerateRemote(cluster.endpoint(), tokens_only(long_prompt, 4), 500 * kBuildSlowdown, nullptr);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  auto b = GenerateRemote(cluster.endpoint(), tokens_only(long_prompt, 4), kTimeoutMs, nullptr);
  client.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  // `late` waited, and `b` unless `decoding` had ended first.
  EXPECT_GE(log.Count("waits for device memory beside 1 running request(s)"), 1) << log.text();
  EXPECT_EQ(a->tokens, LocalReference(model, "cpu", decoding, kDecodingTokens).tokens);
  EXPECT_EQ(b->tokens, LocalReference(model, "cpu", long_prompt, 4).tokens);
  // Main ends `late` on its side when its loop next looks (or after the step it had joined): every request has
  // finished, and logged so, before the log is let go.
  for (int i = 0; i < 1000 && log.Count("finished: outcome=") < 4; ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(log.Count("finished: outcome="), 4) << log.text();
  const v1::MainStats stats = cluster.main().Stats(/*reset=*/false);
  EXPECT_EQ(stats.memory().in_use_bytes(), idle) << "every cache freed";
}

TEST(MainNodeTest, PrefillMiniBatchesKeepTheTokensAndLoadEachExpertOnce) {
  // The same prompt without mini-batches and in mini-batches of 3 rows: the same tokens, routing and logits as
  // the single-process engine; with mini-batches main has two calls in flight per worker and each worker
  // still loads each expert once per layer (it keeps it between its mini-batches), then frees it.
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  struct Run {
    std::vector<uint64_t> calls, loads, rows, peak, kept;
  };
  std::map<int64_t, Run> runs;
  std::vector<int32_t> prompt;
  for (const int64_t minibatch : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(StrCat("prefill_minibatch_rows = ", minibatch));
    ClusterSpec spec;
    spec.model = model;
    spec.workers = 4;
    spec.prefill_minibatch_rows = minibatch;
    TestCluster cluster(spec);
    const absl::Status started = cluster.Start();
    ASSERT_TRUE(started.ok()) << started;
    if (prompt.empty()) prompt = SpreadPrompt(cluster.main().config(), 40);
    const GenerateResult local = LocalReference(model, "cpu", prompt, 4);
    auto remote = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 4), kTimeoutMs, nullptr);
    ASSERT_TRUE(remote.ok()) << remote.status();
    ExpectSameAsLocal(*remote, local, prompt);
    Run& run = runs[minibatch];
    for (int i = 0; i < spec.workers; ++i) {
      const v1::WorkerRequestStats& w = remote->stats.workers(i);
      run.calls.push_back(w.calls());
      run.loads.push_back(w.loads_on_demand());
      run.rows.push_back(w.rows_computed());
      run.peak.push_back(w.peak_calls_in_flight());
      const v1::WorkerStats ws = cluster.worker(i)->Stats(false);
      EXPECT_EQ(ws.loads(), w.loads_on_demand()) << "worker " << i;
      EXPECT_EQ(ws.evictions(), ws.loads()) << "worker " << i;  // every expert freed in the end
      EXPECT_EQ(cluster.worker(i)->ResidentExperts(), 0) << "worker " << i;
      run.kept.push_back(ws.experts_kept());
    }
  }
  const Run& whole = runs[0];
  const Run& mini = runs[3];
  for (size_t i = 0; i < whole.calls.size(); ++i) {
    SCOPED_TRACE(StrCat("worker ", i));
    EXPECT_EQ(mini.rows[i], whole.rows[i]);
    EXPECT_EQ(mini.loads[i], whole.loads[i]);  // one load per (layer, expert), however many mini-batches
    EXPECT_GT(mini.calls[i], whole.calls[i]);
    EXPECT_EQ(mini.peak[i], 2u);
    EXPECT_EQ(whole.peak[i], 1u);  // one call per worker and layer: nothing to pipeline
    EXPECT_GT(mini.kept[i], 0u);
    EXPECT_EQ(whole.kept[i], 0u);
  }
}

TEST(MainNodeTest, TextPromptStreamsTheSameText) {
  const std::string model = "demo-mixtral-kjv";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  ASSERT_TRUE(cluster.main().has_tokenizer());
  auto tokenizer = Tokenizer::Load(SharedModel(model));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::string text = "In the beginning God created";
  const std::vector<int32_t> prompt = (*tokenizer)->EncodeForModel(text);
  const GenerateResult local = LocalReference(model, "cpu", prompt, 12);

  v1::GenerateRequest req = IdsRequest({}, 12);
  req.set_prompt(text);
  std::string streamed;
  bool every_chunk_has_text = true;
  auto remote = GenerateRemote(cluster.endpoint(), req, kTimeoutMs, [&](const v1::GenerateResponse& m) {
    streamed += m.text();
    every_chunk_has_text = every_chunk_has_text && m.has_text();
  });
  ASSERT_TRUE(remote.ok()) << remote.status();
  ExpectSameAsLocal(*remote, local, prompt);
  EXPECT_TRUE(remote->has_text);
  EXPECT_TRUE(every_chunk_has_text);
  // The streamed text continues the prompt's text (as the local command prints it), and the final message's
  // full_text is that text too, its leading space kept (Decode of the tokens alone drops it).
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), local.tokens.begin(), local.tokens.end());
  EXPECT_EQ((*tokenizer)->Decode(prompt) + streamed, (*tokenizer)->Decode(all));
  EXPECT_EQ(remote->text, streamed);
  EXPECT_EQ(remote->text, (*tokenizer)->DecodeAfter(prompt, local.tokens));
}

// ---- bad requests ------------------------------------------------------------------------------------------

TEST(MainNodeTest, BadRequestsFailAndMainKeepsServing) {
  const std::string model = "qwen2moe-tiny";  // no tokenizer.model
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const ModelConfig& c = cluster.main().config();
  ASSERT_FALSE(cluster.main().has_tokenizer());

  auto expect_error = [&](const v1::GenerateRequest& req, absl::StatusCode code, const std::string& words) {
    int messages = 0;
    auto r = GenerateRemote(cluster.endpoint(), req, kTimeoutMs, [&](const v1::GenerateResponse&) { ++messages; });
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(words), absl::string_view::npos) << r.status();
    EXPECT_EQ(messages, 0);
  };
  expect_error(IdsRequest({}, 4), absl::StatusCode::kInvalidArgument, "prompt is empty");
  expect_error(IdsRequest({1, static_cast<int32_t>(c.vocab_size)}, 4), absl::StatusCode::kOutOfRange, "vocabulary");
  expect_error(IdsRequest({1, -3}, 4), absl::StatusCode::kOutOfRange, "vocabulary");
  v1::GenerateRequest both = IdsRequest({1, 2}, 4);
  both.set_prompt("hello");
  expect_error(both, absl::StatusCode::kInvalidArgument, "not both");
  v1::GenerateRequest text = IdsRequest({}, 4);
  text.set_prompt("hello");
  expect_error(text, absl::StatusCode::kFailedPrecondition, "prompt_ids");
  expect_error(IdsRequest({1, 2}, c.max_position_embeddings), absl::StatusCode::kOutOfRange, "max_position_embeddings");
  expect_error(IdsRequest({1, 2}, -1), absl::StatusCode::kInvalidArgument, "max_new_tokens");
  v1::GenerateRequest hot = IdsRequest({1, 2}, 4);
  hot.mutable_sampling()->set_temperature(-1);
  expect_error(hot, absl::StatusCode::kInvalidArgument, "temperature");
  v1::GenerateRequest top_alone = IdsRequest({1, 2}, 4);
  top_alone.set_top_logprobs(2);
  expect_error(top_alone, absl::StatusCode::kInvalidArgument, "needs logprobs");
  v1::GenerateRequest too_many = IdsRequest({1, 2}, 4);
  too_many.set_logprobs(true);
  too_many.set_top_logprobs(kMaxTopLogprobs + 1);
  expect_error(too_many, absl::StatusCode::kInvalidArgument, "logprobs must be");

  // Still serving, and still exact.
  const std::vector<int32_t> prompt = {5, 6, 7};
  auto ok = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 3), kTimeoutMs, nullptr);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ExpectSameAsLocal(*ok, LocalReference(model, "cpu", prompt, 3), prompt);

  // Membership: every node, the epoch and the fingerprint the workers have.
  auto stub = v1::Inference::NewStub(rpc::MakeChannel(cluster.endpoint()));
  grpc::ClientContext ctx;
  rpc::SetDeadline(ctx, kTimeoutMs);
  v1::Membership m;
  ASSERT_TRUE(stub->GetMembership(&ctx, v1::MembershipRequest(), &m).ok());
  EXPECT_EQ(m.epoch(), kEpoch);
  EXPECT_EQ(m.self(), "main");
  EXPECT_EQ(m.model_fingerprint(), cluster.worker(0)->fingerprint());
  EXPECT_EQ(m.nodes_size(), 9);
}

// Main's one "finished:" line per request (RunRequest's, for the gRPC and HTTP APIs alike), with the figures as
// far as the request got: here the client goes after its third token, a bad request is refused at once, and a
// request is stopped by its StopCheck (another choice of its API request failed) with that reason as its outcome.
TEST(MainNodeTest, EveryRequestLogsItsFiguresWhateverItsOutcome) {
  const std::string model = "qwen2moe-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  CapturedLog log;  // before the cluster, whose threads log, and ended after it
  MainNode::RequestRecord gone, refused, aborted;
  {
    ClusterSpec spec;
    spec.model = model;
    TestCluster cluster(spec);
    const absl::Status started = cluster.Start();
    ASSERT_TRUE(started.ok()) << started;
    int messages = 0;
    const absl::Status s = cluster.main().RunRequest(
        IdsRequest({5, 6, 7}, 12), [&](const v1::GenerateResponse&) { return ++messages < 3; }, nullptr, &gone);
    EXPECT_TRUE(absl::IsCancelled(s)) << s;
    const absl::Status bad = cluster.main().RunRequest(
        IdsRequest({}, 4), [](const v1::GenerateResponse&) { return true; }, nullptr, &refused);
    EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
    std::atomic<int> tokens{0};
    const absl::Status stopped = cluster.main().RunRequest(
        IdsRequest({5, 6, 7}, 40),
        [&](const v1::GenerateResponse& r) {
          tokens += r.tokens_size();
          return true;
        },
        [&] { return tokens.load() >= 2 ? absl::AbortedError("a sibling failed") : absl::OkStatus(); }, &aborted);
    EXPECT_TRUE(absl::IsAborted(stopped)) << stopped;
    EXPECT_EQ(stopped.message(), "a sibling failed");
  }
  EXPECT_GE(aborted.generated_tokens, 2);
  EXPECT_LT(aborted.generated_tokens, 40);
  EXPECT_EQ(gone.prompt_tokens, 3);
  EXPECT_GE(gone.generated_tokens, 3);
  EXPECT_GT(gone.ttft_ms, 0.0);
  EXPECT_GE(gone.total_ms, gone.ttft_ms);
  EXPECT_EQ(refused.generated_tokens, 0);
  EXPECT_GT(refused.total_ms, 0.0);

  const std::string text = log.text();
  std::smatch m;
  const std::regex cancelled(
      "\\[warning\\] finished: outcome=cancelled prompt_tokens=3 generated_tokens=([0-9]+) ttft_ms=([0-9.]+) "
      "tokens_per_s=[0-9.]+ total_ms=([0-9.]+) error: ");
  ASSERT_TRUE(std::regex_search(text, m, cancelled)) << text;
  EXPECT_EQ(std::stoll(m[1]), gone.generated_tokens);
  EXPECT_GT(std::stod(m[2]), 0.0);
  EXPECT_GT(std::stod(m[3]), 0.0);
  EXPECT_EQ(log.Count("finished: outcome=invalid_argument prompt_tokens=0 generated_tokens=0 "), 1) << text;
  EXPECT_EQ(log.Count("finished: outcome=aborted prompt_tokens=3 "), 1) << text;
  EXPECT_EQ(log.Count("error: a sibling failed"), 1) << text;
  EXPECT_EQ(log.Count("finished: "), 3) << text;
}

// A cluster file for `model` whose four workers' addresses have nothing listening: for main alone, which starts
// without its workers being up.
ClusterConfig ConfigWithUnreachableWorkers(const std::string& model) {
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 4;
  std::vector<std::string> nowhere;
  for (int i = 0; i < spec.workers; ++i) nowhere.push_back(StrCat("127.0.0.1:", ClosedPort()));
  return ParseToml(ClusterToml(spec, "127.0.0.1:1", nowhere));
}

TEST(MainNodeTest, TextPromptOnMainWithoutTokenizerWithoutWorkers) {
  // RunRequest directly: validation needs no worker, and main starts without its workers being up.
  const std::string model = "olmoe-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  const ClusterConfig cluster = ConfigWithUnreachableWorkers(model);
  auto main = MainNode::Create({cluster, *cluster.main(), SharedModel(model)});
  ASSERT_TRUE(main.ok()) << main.status();
  v1::GenerateRequest req;
  req.set_prompt("hello");
  req.set_max_new_tokens(2);
  const absl::Status s = (*main)->RunRequest(req, [](const v1::GenerateResponse&) { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("prompt_ids"), absl::string_view::npos) << s;
  EXPECT_EQ((*main)->expert_tensors_opened(), 0);

  // A place in the queue taken beforehand (as the HTTP API takes them) goes back when the request is refused: at
  // the front of the queue, it would hold back every later arrival.
  absl::StatusOr<Admission::Ticket> place = (*main)->Admit();
  ASSERT_TRUE(place.ok()) << place.status();
  MainNode::RequestRecord record;
  record.admitted = &*place;
  const absl::Status refused = (*main)->RunRequest(
      req, [](const v1::GenerateResponse&) { return true; }, nullptr, &record);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  absl::StatusOr<Admission::Ticket> next = (*main)->Admit();
  ASSERT_TRUE(next.ok()) << next.status();
  const absl::Status turn = next->WaitTurn(nullptr, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(turn.ok()) << turn;
}

// A tokenizer.json main cannot run stops main at startup, naming the field and the way to serve ids only.
TEST(MainNodeTest, ATokenizerMainCannotRunStopsItSayingHowToServeIdsOnly) {
  const std::string model = "olmoe-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  odmoe::testing::TempDir dir;
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors"}) {
    std::filesystem::create_symlink(SharedModel(model) + "/" + f, dir.File(f));
  }
  odmoe::testing::WriteFile(dir.File("tokenizer.json"),
                            R"({"pre_tokenizer": {"type": "Metaspace"}, "decoder": {"type": "Metaspace"},
                                "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
  const ClusterConfig cluster = ConfigWithUnreachableWorkers(model);
  auto main = MainNode::Create({cluster, *cluster.main(), dir.path()});
  ASSERT_FALSE(main.ok());
  EXPECT_EQ(main.status().code(), absl::StatusCode::kUnimplemented) << main.status();
  EXPECT_NE(main.status().message().find(dir.File("tokenizer.json") + ": field 'pre_tokenizer.type'"),
            absl::string_view::npos)
      << main.status();
  EXPECT_NE(main.status().message().find("move the tokenizer file out of the checkpoint folder"),
            absl::string_view::npos)
      << main.status();
}

// ---- failing workers -----------------------------------------------------------------------------------------

// Failover (Operations 4/4): a worker down from the start is left out of the placement (main's prober finds it
// within a period; a call made before that is re-issued); the other worker computes every expert, and tokens,
// routing and logits are the engine's, bit for bit.
TEST(MainNodeTest, AWorkerDownIsLeftOutAndTheOutputIsTheEnginesBitForBit) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 2;
  spec.group_size = 1;  // two groups: sparse layer 1's home is w1 alone
  spec.down_worker = 1;
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const std::vector<int32_t> prompt = SpreadPrompt(cluster.main().config(), 9);
  const GenerateResult local = LocalReference(model, "cpu", prompt, 6);
  auto r = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 6), kTimeoutMs, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectSameAsLocal(*r, local, prompt);
  // Once main knows, w1 gets nothing: no call to re-issue, w0 computes every expert.
  ASSERT_TRUE(odmoe::testing::Eventually(
      [&] { return cluster.main().peer_health().state(1) == PeerState::kDown; }, std::chrono::seconds(10)));
  auto again = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 6), kTimeoutMs, nullptr);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameAsLocal(*again, local, prompt);
  EXPECT_EQ(again->stats.calls_reissued(), 0u);
  ASSERT_EQ(again->stats.workers_size(), 2);
  EXPECT_EQ(again->stats.workers(1).calls(), 0u);
  EXPECT_GT(again->stats.workers(0).calls(), 0u);
  EXPECT_GT(again->stats.membership_epoch(), 0u);
}

// A worker whose expert calls never return (its health checks still answer: a gray failure): each call to it
// misses its deadline (rpc_timeout_ms), which main takes as the worker gone; the call is re-issued to the other
// worker and the output is the engine's.
// Two workers of one group each on `model`, the first hung (it answers health checks, never an expert call).
ClusterSpec HungWorkerSpec(const std::string& model, int64_t rpc_timeout_ms) {
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 2;
  spec.group_size = 1;
  spec.hung_worker = 0;
  spec.rpc_timeout_ms = rpc_timeout_ms;
  return spec;
}

TEST(MainNodeTest, AHungWorkerIsLeftOutWithoutWaitingForTheDeadline) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  TestCluster cluster(HungWorkerSpec(model, /*rpc_timeout_ms=*/1000));
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const std::vector<int32_t> prompt = {3, 4, 5};
  const GenerateResult local = LocalReference(model, "cpu", prompt, 1);
  auto r = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 1), kTimeoutMs, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectSameAsLocal(*r, local, prompt);
  EXPECT_GT(r->stats.calls_reissued(), 0u);
}

// A request whose client's deadline passes while a worker's call is out fails with DeadlineExceeded, and the
// worker is not taken for down: the call's deadline was the client's, not rpc_timeout_ms. (Main once marked every
// worker with a call out down, which failed the other requests running beside it.)
TEST(MainNodeTest, AClientsDeadlinePassingSaysNothingAboutTheWorkers) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  CapturedLog log;  // before the cluster, which joins the threads that log as it goes
  // The hung worker's calls outlast the client's deadline, well before rpc_timeout_ms.
  TestCluster cluster(HungWorkerSpec(model, kTimeoutMs));
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  auto r = GenerateRemote(cluster.endpoint(), IdsRequest({3, 4, 5}, 1), /*timeout_ms=*/500, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  // Main ends the request on its side a moment later.
  for (int i = 0; i < 500 && log.Count("finished: outcome=") == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(log.Count("finished: outcome=deadline"), 1) << log.text();
  EXPECT_EQ(log.Count(" is down"), 0) << log.text();
  EXPECT_EQ(log.Count(" left"), 0) << log.text();
}

// A worker started from another cluster file (another epoch) answers its health checks naming that cluster:
// main takes it for down at once and leaves it out of the placement, so that the other worker serves every
// request, bit for bit the engine's, and no call reaches the foreign worker.
TEST(MainNodeTest, AWorkerOfAnotherClusterIsLeftOutAndTheOthersServe) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  CapturedLog log;  // before the cluster, which joins the threads that log as it goes
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 2;
  spec.group_size = 1;
  spec.foreign_worker = 1;
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  ASSERT_TRUE(odmoe::testing::Eventually([&] { return cluster.main().peer_health().state(1) == PeerState::kDown; },
                                         std::chrono::seconds(10)));
  const std::string fingerprint = cluster.main().fingerprint();
  EXPECT_EQ(log.Count(StrCat("is down: serves another cluster (epoch ", kEpoch + 1, ", model ", fingerprint,
                             "; this cluster: epoch ", kEpoch, ", model ", fingerprint,
                             "): check its cluster file and model")),
            1)
      << log.text();
  const std::vector<int32_t> prompt = SpreadPrompt(cluster.main().config(), 9);
  const GenerateResult local = LocalReference(model, "cpu", prompt, 4);
  auto r = GenerateRemote(cluster.endpoint(), IdsRequest(prompt, 4), kTimeoutMs, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectSameAsLocal(*r, local, prompt);
  ASSERT_EQ(r->stats.workers_size(), 2);
  EXPECT_EQ(r->stats.workers(1).calls(), 0u);
  EXPECT_GT(r->stats.workers(0).calls(), 0u);
  EXPECT_EQ(cluster.main().peer_health().state(1), PeerState::kDown);
}

// The same worker of a build before cluster identities (its answers name none) is judged by its answers alone
// and refuses main's calls. That is the cluster's fault, not the client's: the request fails INTERNAL (HTTP 500)
// naming the worker and the mismatch, not as invalid.
TEST(MainNodeTest, AnUnidentifiedWorkerOfAnotherClusterFailsTheRequestAsAServerErrorNamingIt) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 2;
  spec.group_size = 1;
  spec.foreign_worker = 1;
  spec.identify = false;
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  auto r = GenerateRemote(cluster.endpoint(), IdsRequest({3, 4, 5}, 2), kTimeoutMs, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("worker w1 at 127.0.0.1:")) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              ::testing::HasSubstr(
                  StrCat("membership epoch ", kEpoch, " of main does not match this node's epoch ", kEpoch + 1)))
      << r.status();
}

// ---- the shadow (health, stats, membership only) -------------------------------------------------------------

TEST(ShadowNodeTest, AnswersStatsAndMembership) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  ClusterSpec spec;
  spec.model = model;
  spec.workers = 2;
  std::string toml = ClusterToml(spec, "127.0.0.1:1", {"127.0.0.1:2", "127.0.0.1:3"});
  toml += "[[node]]\nname = \"shadow\"\nrole = \"shadow\"\naddress = \"127.0.0.1:4\"\ndevice = \"mock-gpu:64\"\n";
  const ClusterConfig cluster = ParseToml(toml);
  auto shadow = ShadowNode::Create({cluster, *cluster.shadow(), SharedModel(model)});
  ASSERT_TRUE(shadow.ok()) << shadow.status();
  auto server = rpc::Server::Start({"127.0.0.1:0", 2}, {shadow->get()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Shadow::NewStub(rpc::MakeChannel(StrCat("127.0.0.1:", (*server)->port())));
  {
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kTimeoutMs);
    v1::ShadowStats st;
    ASSERT_TRUE(stub->GetStats(&ctx, v1::StatsRequest(), &st).ok());
    EXPECT_EQ(st.node(), "shadow");
    EXPECT_EQ(st.requests(), 0u);
    EXPECT_EQ(st.memory().capacity_bytes(), uint64_t{64} << 20);
  }
  {
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kTimeoutMs);
    v1::Membership m;
    const grpc::Status s = stub->GetMembership(&ctx, v1::MembershipRequest(), &m);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(m.self(), "shadow");
    EXPECT_EQ(m.epoch(), kEpoch);
    EXPECT_EQ(m.nodes_size(), 4);
    EXPECT_EQ(m.model_fingerprint(), (*shadow)->fingerprint());
  }
}

// ---- odmoe generate --endpoint ------------------------------------------------------------------------------

TEST(GenerateEndpointCliTest, SameJsonAsLocalPlusStats) {
  const std::string model = "mixtral-tiny";
  if (!HaveSharedModel(model)) GTEST_SKIP() << "needs " << SharedModel(model);
  const std::string odmoe = testing::ProgramPath("odmoe");
  ClusterSpec spec;
  spec.model = model;
  TestCluster cluster(spec);
  const absl::Status started = cluster.Start();
  ASSERT_TRUE(started.ok()) << started;
  const std::vector<std::string> common = {
      "--prompt-ids", "3,14,15,92", "--max-new-tokens",  "5",     "--ignore-eos", "--dump-logits", "--dump-routing",
      "--logprobs",   "2",          "--prompt-logprobs", "--json"};
  std::vector<std::string> local_argv = {odmoe, "generate", "--model", SharedModel(model)};
  local_argv.insert(local_argv.end(), common.begin(), common.end());
  std::vector<std::string> remote_argv = {odmoe, "generate", "--endpoint", cluster.endpoint()};
  remote_argv.insert(remote_argv.end(), common.begin(), common.end());
  const testing::RunResult local = testing::RunProgram(local_argv);
  const testing::RunResult remote = testing::RunProgram(remote_argv);
  ASSERT_EQ(local.exit_code, 0) << local.err;
  ASSERT_EQ(remote.exit_code, 0) << remote.err;
  auto lj = ParseJson(local.out, "local");
  auto rj = ParseJson(remote.out, "remote");
  ASSERT_TRUE(lj.ok() && rj.ok()) << local.out << remote.out;
  for (const char* key :
       {"prompt_ids", "tokens", "stop_reason", "last_logits", "routing", "logprobs", "prompt_logprobs"}) {
    EXPECT_EQ((*rj)[key], (*lj)[key]) << key;
  }
  EXPECT_EQ((*rj)["logprobs"].size(), 5u);
  EXPECT_EQ((*rj)["prompt_logprobs"].size(), 3u);
  EXPECT_TRUE((*rj)["timings"].contains("ttft_ms"));
  EXPECT_TRUE((*rj)["timings"].contains("decode_tokens_per_s"));
  const Json& st = (*rj)["stats"];
  EXPECT_EQ(st["expert_tensors_opened"], 0);
  EXPECT_EQ(st["workers"].size(), 8u);
  for (const char* key : {"bytes_loaded", "loads_on_demand", "on_demand_load_ms", "ttft_ms", "decode_tokens_per_s"}) {
    EXPECT_TRUE(st.contains(key)) << key;
  }
  uint64_t rows = 0;
  for (const Json& w : st["workers"]) {
    EXPECT_TRUE(w.contains("node") && w.contains("experts_computed") && w.contains("bytes_loaded"));
    rows += w["rows_computed"].get<uint64_t>();
  }
  EXPECT_EQ(rows, 2u * 3u * (4u + 4u));  // k x sparse layers x positions

  // Without --json: the ids as they stream (no tokenizer), one line.
  const testing::RunResult plain =
      testing::RunProgram({odmoe, "generate", "--endpoint", cluster.endpoint(), "--prompt-ids", "3,14,15,92",
                           "--max-new-tokens", "5", "--ignore-eos"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  std::string ids;
  for (const Json& t : (*lj)["tokens"]) ids += StrCat(ids.empty() ? "" : " ", t.get<int>());
  EXPECT_EQ(plain.out, ids + "\n");

  // Usage errors and an unreachable main: one stderr line, exit codes by status.
  const testing::RunResult both =
      testing::RunProgram({odmoe, "generate", "--endpoint", cluster.endpoint(), "--model", SharedModel(model),
                           "--prompt-ids", "1", "--max-new-tokens", "1"});
  EXPECT_EQ(both.exit_code, 2) << both.err;
  EXPECT_NE(both.err.find("--model"), std::string::npos) << both.err;
  const testing::RunResult down =
      testing::RunProgram({odmoe, "generate", "--endpoint", StrCat("127.0.0.1:", ClosedPort()), "--prompt-ids", "1",
                           "--max-new-tokens", "1"});
  EXPECT_EQ(down.exit_code, 9) << down.err;
  EXPECT_EQ(std::count(down.err.begin(), down.err.end(), '\n'), 1) << down.err;
  const testing::RunResult bad = testing::RunProgram(
      {odmoe, "generate", "--endpoint", cluster.endpoint(), "--prompt-ids", "1,99999", "--max-new-tokens", "1"});
  EXPECT_EQ(bad.exit_code, 7) << bad.err;  // OutOfRange from main
}

}  // namespace
}  // namespace odmoe
