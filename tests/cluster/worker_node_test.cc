// The worker daemon's service on a real gRPC server on loopback (in-process), on ../shared/models/mixtral-tiny:
// outputs bit for bit equal to the single-process engine's expert computation, on-demand loading and
// prefetching counted, experts evicted after use, the GPU budget kept, bad input to every RPC refused while
// the worker keeps serving, and no non-expert tensor ever read. The last tests run the odmoe-worker program.
#include "src/worker_node/worker_node.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "src/backend/cpu_device.h"
#include "src/backend/device_factory.h"
#include "src/backend/mock_gpu_device.h"
#include "src/common/placement.h"
#include "src/common/strings.h"
#include "src/engine/engine.h"
#include "src/model/fingerprint.h"
#include "src/model/model_layout.h"
#include "src/rpc/rpc_util.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using ::odmoe::testing::HaveSharedModel;
using ::odmoe::testing::SharedModel;

constexpr char kModel[] = "mixtral-tiny";
constexpr uint64_t kEpoch = 7;
constexpr int64_t kDeadlineMs = 60000;

// A cluster of one main and two workers (group size 1: w0 serves sparse layers 0, 2, ...; w1 serves 1, 3, ...).
std::string ClusterToml(const std::string& model_dir, int w0_port = 2) {
  return StrCat(R"([cluster]
name = "worker-test"
epoch = 7
group_size = 1
[model]
path = ")",
                model_dir, R"("
[[node]]
name = "main"
role = "main"
address = "127.0.0.1:1"
[[node]]
name = "w0"
role = "worker"
address = "127.0.0.1:)",
                w0_port, R"("
device = "mock-gpu"
[[node]]
name = "w1"
role = "worker"
address = "127.0.0.1:3"
device = "mock-gpu"
)");
}

ClusterConfig MakeCluster(const std::string& model_dir) {
  absl::StatusOr<ClusterConfig> c = ParseClusterConfig(ClusterToml(model_dir), "worker_test.toml", "/");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ClusterConfig{};
}

struct Routing {
  std::vector<int32_t> ids;    // [n, k]
  std::vector<float> weights;  // [n, k]
};

// k distinct experts per token, best first in no particular sense (the executor only groups them).
Routing RandomRouting(int64_t n, int64_t k, int64_t num_experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  Routing r;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> all(static_cast<size_t>(num_experts));
    for (int32_t e = 0; e < num_experts; ++e) all[static_cast<size_t>(e)] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t j = 0; j < k; ++j) {
      r.ids.push_back(all[static_cast<size_t>(j)]);
      r.weights.push_back(weight(rng));
    }
  }
  return r;
}

std::vector<float> RandomHidden(int64_t n, int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> h(static_cast<size_t>(n * hidden));
  for (float& v : h) v = dist(rng);
  return h;
}

bool BitwiseEqual(const float* a, const float* b, size_t count) { return std::memcmp(a, b, count * 4) == 0; }

class WorkerNodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveSharedModel(kModel)) GTEST_SKIP() << "needs ../shared: " << SharedModel(kModel) << " is missing";
    model_dir_ = SharedModel(kModel);
    cluster_ = MakeCluster(model_dir_);
    ASSERT_EQ(cluster_.workers().size(), 2u);

    // The reference: every weight on a CPU device, as the single-process engine holds them.
    absl::StatusOr<ModelConfig> config = LoadModelConfig(model_dir_);
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    auto checkpoint = Checkpoint::Open(model_dir_);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    ref_checkpoint_ = std::move(checkpoint).value();
    auto weights = ModelWeights::Load(config_, *ref_checkpoint_, ref_device_, WeightSelection::All());
    ASSERT_TRUE(weights.ok()) << weights.status();
    ref_weights_ = std::move(weights).value();
    auto executor = LocalExpertExecutor::Create(ref_device_, *ref_weights_, kRefMaxTokens);
    ASSERT_TRUE(executor.ok()) << executor.status();
    ref_executor_ = std::move(executor).value();
  }

  void TearDown() override {
    StopWorker();
    if (!shm_dir_.empty()) std::filesystem::remove_all(shm_dir_);
  }

  // A private folder for this test's shared expert segments (in /dev/shm where there is one), so tests running
  // in parallel never share a segment.
  const std::string& ShmDir() {
    if (shm_dir_.empty()) {
      std::string pattern = access("/dev/shm", W_OK) == 0 ? "/dev/shm/odmoe-test-XXXXXX" : "/tmp/odmoe-test-XXXXXX";
      EXPECT_NE(mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
      shm_dir_ = pattern;
    }
    return shm_dir_;
  }
  // The device a worker daemon makes for `self` (its spec, capped at its budget); `*gpu` (optional) is set to
  // it as the mock GPU the test cluster's nodes have.
  static std::unique_ptr<Device> DaemonDevice(const NodeConfig& self, MockGpuDevice** gpu = nullptr) {
    absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(self.device, self.gpu_budget_bytes);
    EXPECT_TRUE(device.ok()) << device.status();
    if (!device.ok()) return nullptr;
    if (gpu != nullptr) {
      *gpu = dynamic_cast<MockGpuDevice*>(device->get());
      EXPECT_NE(*gpu, nullptr) << self.device;
    }
    return std::move(device).value();
  }

  // A worker of the cluster made directly (no server), with this test's shm folder; `*gpu` (optional) gets its
  // mock GPU.
  std::unique_ptr<WorkerNode> MakeWorker(const std::string& name, uint64_t budget_bytes = 0, bool share = true,
                                         MockGpuDevice** gpu = nullptr) {
    NodeConfig self = *cluster_.Find(name);
    self.gpu_budget_bytes = budget_bytes;
    WorkerOptions options;
    options.share_host_experts = share;
    options.shm_dir = ShmDir();
    auto node = WorkerNode::Create(cluster_, self, model_dir_, DaemonDevice(self, gpu), options);
    EXPECT_TRUE(node.ok()) << node.status();
    return node.ok() ? std::move(node).value() : nullptr;
  }

  // Starts worker `name` of the cluster (with `budget_bytes` when non-zero) on a free loopback port.
  // `threads` bounds the server's handler threads (rpc::ServerOptions). Not the daemons' default of 2: with 2,
  // rpc::Server's thread quota refuses a few percent of even sequential calls ("Server Threadpool Exhausted",
  // RESOURCE_EXHAUSTED), which is the server's business, not the worker's.
  void StartWorker(const std::string& name = "w0", uint64_t budget_bytes = 0, WorkerOptions options = {},
                   int threads = 8) {
    StopWorker();
    NodeConfig self = *cluster_.Find(name);
    self.gpu_budget_bytes = budget_bytes;
    if (options.shm_dir == WorkerOptions{}.shm_dir) options.shm_dir = ShmDir();
    auto node = WorkerNode::Create(cluster_, self, model_dir_, DaemonDevice(self), options);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = std::move(node).value();
    auto server = rpc::Server::Start({"127.0.0.1:0", threads}, {node_.get()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    address_ = StrCat("127.0.0.1:", server_->port());
    stub_ = v1::Worker::NewStub(rpc::MakeChannel(address_));
  }

  void StopWorker() {
    stub_.reset();
    if (server_ != nullptr) server_->Shutdown(0);
    server_.reset();
    node_.reset();
  }

  // (Tests that make workers without a server, node_ unset, fill the header themselves.)
  void FillGoodHeader(v1::RequestHeader* header) {
    rpc::FillHeader(header, kEpoch, node_ != nullptr ? node_->fingerprint() : std::string(), "test");
  }

  // A request for the experts of `routing` grouped as every executor groups them.
  v1::ComputeExpertsRequest MakeRequest(int64_t layer, const std::vector<float>& hidden, int64_t n,
                                        const std::vector<ExpertBatch>& batches) {
    v1::ComputeExpertsRequest req;
    FillGoodHeader(req.mutable_header());
    req.set_layer(static_cast<int32_t>(layer));
    const int64_t shape[] = {n, config_.hidden_size};
    rpc::EncodeF32(hidden, shape, req.mutable_hidden());
    for (const ExpertBatch& b : batches) {
      v1::ExpertTask* t = req.add_tasks();
      t->set_expert(b.expert);
      for (int32_t r : b.rows) t->add_rows(r);
    }
    return req;
  }

  grpc::Status Compute(const v1::ComputeExpertsRequest& req, v1::ComputeExpertsResponse* resp) {
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    return stub_->ComputeExperts(&ctx, req, resp);
  }
  grpc::Status Prefetch(int64_t layer, const std::vector<int32_t>& experts, v1::PrefetchResponse* resp,
                        uint64_t epoch = kEpoch) {
    v1::PrefetchRequest req;
    FillGoodHeader(req.mutable_header());
    req.mutable_header()->set_epoch(epoch);
    req.set_layer(static_cast<int32_t>(layer));
    for (int32_t e : experts) req.add_experts(e);
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    return stub_->Prefetch(&ctx, req, resp);
  }
  v1::WorkerStats Stats(bool reset = false) {
    v1::StatsRequest req;
    req.set_reset(reset);
    v1::WorkerStats stats;
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    const grpc::Status s = stub_->GetStats(&ctx, req, &stats);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return stats;
  }

  // out[n, hidden] of the layer's routed experts as the single-process engine computes it.
  std::vector<float> LocalMoe(int64_t layer, const std::vector<float>& hidden, int64_t n, const Routing& r) {
    const size_t count = hidden.size();
    std::vector<float> out(count, 0.0f);
    const absl::Status s = ref_executor_->Run(layer, hidden.data(), n, r.ids, r.weights, out.data(), nullptr);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  // The same sum from a worker's unweighted outputs, as main forms it: ScatterAddScaled in ascending expert
  // order.
  std::vector<float> SumOutputs(const v1::ComputeExpertsResponse& resp, const std::vector<ExpertBatch>& batches,
                                int64_t n) {
    std::vector<float> out(static_cast<size_t>(n * config_.hidden_size), 0.0f);
    EXPECT_EQ(resp.outputs_size(), static_cast<int>(batches.size()));
    for (size_t i = 0; i < batches.size() && static_cast<int>(i) < resp.outputs_size(); ++i) {
      const v1::ExpertOutput& o = resp.outputs(static_cast<int>(i));
      EXPECT_EQ(o.expert(), batches[i].expert);
      const int64_t m = static_cast<int64_t>(batches[i].rows.size());
      const int64_t shape[] = {m, config_.hidden_size};
      auto values = rpc::DecodeF32(o.output(), shape, "output");
      EXPECT_TRUE(values.ok()) << values.status();
      if (!values.ok()) continue;
      ref_device_.ScatterAddScaled(values->data(), batches[i].rows.data(), batches[i].weights.data(), m,
                                   config_.hidden_size, /*sigmoid_scale=*/false, out.data(), nullptr);
    }
    return out;
  }

  // One expert's output on the reference device: gathered rows through RunMlp.
  std::vector<float> LocalExpert(int64_t layer, int32_t e, const std::vector<float>& hidden,
                                 const std::vector<int32_t>& rows) {
    const int64_t h = config_.hidden_size;
    const int64_t m = static_cast<int64_t>(rows.size());
    std::vector<float> x;
    for (int32_t r : rows) x.insert(x.end(), hidden.begin() + r * h, hidden.begin() + (r + 1) * h);
    auto ws = MlpWorkspace::Create(ref_device_, m, config_.expert_intermediate_size);
    EXPECT_TRUE(ws.ok()) << ws.status();
    std::vector<float> y(static_cast<size_t>(m * h));
    RunMlp(ref_device_, *ref_weights_->expert(layer, e), x.data(), m, h, **ws, y.data(), nullptr);
    return y;
  }

  // Every tensor the worker read is a routed expert's.
  void ExpectOnlyExpertTensorsRead() {
    for (const std::string& name : node_->checkpoint().ReadNames()) {
      EXPECT_TRUE(IsExpertTensorName(name)) << "the worker read the non-expert tensor " << name;
    }
  }

  static constexpr int64_t kRefMaxTokens = 64;
  std::string model_dir_;
  ClusterConfig cluster_;
  ModelConfig config_;
  CpuDevice ref_device_;
  std::unique_ptr<Checkpoint> ref_checkpoint_;
  std::unique_ptr<ModelWeights> ref_weights_;
  std::unique_ptr<LocalExpertExecutor> ref_executor_;

  std::string shm_dir_;
  std::unique_ptr<WorkerNode> node_;
  std::unique_ptr<rpc::Server> server_;
  std::string address_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(WorkerNodeTest, OutputsEqualLocalExecutorBitwise) {
  StartWorker();
  const uint64_t workspace = node_->device().memory_info().in_use;
  EXPECT_EQ(workspace, node_->workspace_bytes());
  int64_t experts = 0, rows = 0;
  std::set<std::string> expected_reads;
  for (int64_t layer : config_.SparseLayers()) {
    for (int64_t n : {1, 2, 5, 17}) {
      SCOPED_TRACE(StrCat("layer ", layer, ", ", n, " tokens"));
      const uint32_t seed = static_cast<uint32_t>(layer * 100 + n);
      const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, seed);
      const Routing routing = RandomRouting(n, config_.top_k, config_.num_experts, seed);
      const std::vector<ExpertBatch> batches = GroupByExpert(routing.ids, routing.weights, n, config_.top_k);

      v1::ComputeExpertsResponse resp;
      const grpc::Status s = Compute(MakeRequest(layer, hidden, n, batches), &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      const std::vector<float> local = LocalMoe(layer, hidden, n, routing);
      const std::vector<float> remote = SumOutputs(resp, batches, n);
      EXPECT_TRUE(BitwiseEqual(local.data(), remote.data(), local.size()));

      for (int i = 0; i < resp.outputs_size(); ++i) {
        const ExpertBatch& b = batches[static_cast<size_t>(i)];
        const std::vector<float> y = LocalExpert(layer, b.expert, hidden, b.rows);
        ASSERT_EQ(resp.outputs(i).output().data().size(), y.size() * 4);
        EXPECT_TRUE(
            BitwiseEqual(y.data(), reinterpret_cast<const float*>(resp.outputs(i).output().data().data()), y.size()))
            << "expert " << b.expert;
        EXPECT_TRUE(resp.outputs(i).loaded_on_demand());
        EXPECT_GE(resp.outputs(i).load_ms(), 0.0);
        EXPECT_GE(resp.outputs(i).compute_ms(), 0.0);
        rows += static_cast<int64_t>(b.rows.size());
        for (const TensorSpec& t : ExpertTensors(config_, layer, b.expert)) expected_reads.insert(t.name);
      }
      experts += resp.outputs_size();
      // Evicted after compute: only the workspace is left on the device.
      EXPECT_EQ(node_->device().memory_info().in_use, workspace);
    }
  }
  const v1::WorkerStats stats = Stats();
  EXPECT_EQ(stats.node(), "w0");
  EXPECT_EQ(stats.experts_computed(), static_cast<uint64_t>(experts));
  EXPECT_EQ(stats.rows_computed(), static_cast<uint64_t>(rows));
  EXPECT_EQ(stats.loads(), static_cast<uint64_t>(experts));
  EXPECT_EQ(stats.loads_on_demand(), static_cast<uint64_t>(experts));
  EXPECT_EQ(stats.evictions(), static_cast<uint64_t>(experts));
  EXPECT_EQ(stats.prefetches(), 0u);
  EXPECT_EQ(stats.bytes_loaded(), static_cast<uint64_t>(experts) * 3 * 128 * 192 * 2);  // bf16 projections
  EXPECT_EQ(stats.memory().in_use_bytes(), workspace);
  EXPECT_GE(stats.memory().peak_bytes(), workspace + node_->expert_bytes());
  EXPECT_LE(stats.memory().peak_bytes(), workspace + node_->expert_bytes());  // one expert at a time

  // The worker read only expert tensors: those it packed at start (here the shared store: all of them),
  // among them every expert it computed.
  ExpectOnlyExpertTensorsRead();
  const std::vector<std::string> read = node_->checkpoint().ReadNames();
  const std::set<std::string> read_set(read.begin(), read.end());
  for (const std::string& name : expected_reads) EXPECT_TRUE(read_set.contains(name)) << name;
}

TEST_F(WorkerNodeTest, SplitAcrossCallsEqualsOneCall) {
  // Main may send one call per expert (experts on different workers): the sum is the same bit for bit.
  StartWorker();
  const int64_t n = 9, layer = 1;
  const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, 5);
  const Routing routing = RandomRouting(n, config_.top_k, config_.num_experts, 5);
  const std::vector<ExpertBatch> batches = GroupByExpert(routing.ids, routing.weights, n, config_.top_k);
  v1::ComputeExpertsResponse all;
  for (const ExpertBatch& b : batches) {
    v1::ComputeExpertsResponse one;
    const grpc::Status s = Compute(MakeRequest(layer, hidden, n, {b}), &one);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(one.outputs_size(), 1);
    *all.add_outputs() = one.outputs(0);
  }
  const std::vector<float> local = LocalMoe(layer, hidden, n, routing);
  const std::vector<float> remote = SumOutputs(all, batches, n);
  EXPECT_TRUE(BitwiseEqual(local.data(), remote.data(), local.size()));
}

TEST_F(WorkerNodeTest, PrefetchedExpertIsNotLoadedOnDemand) {
  StartWorker();
  const uint64_t workspace = node_->workspace_bytes();
  const uint64_t expert = node_->expert_bytes();
  v1::PrefetchResponse pre;
  grpc::Status s = Prefetch(1, {2, 5}, &pre);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(pre.accepted(), 2);
  s = Prefetch(1, {5, 2}, &pre);  // already resident: nothing started
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(pre.accepted(), 0);
  EXPECT_EQ(node_->ResidentExperts(), 2);
  EXPECT_EQ(node_->device().memory_info().in_use, workspace + 2 * expert);
  v1::WorkerStats stats = Stats();
  EXPECT_EQ(stats.loads(), 2u);
  EXPECT_EQ(stats.prefetches(), 2u);
  EXPECT_EQ(stats.loads_on_demand(), 0u);

  const int64_t n = 4;
  const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, 11);
  const std::vector<ExpertBatch> batches = {
      {2, {0, 3}, {0.5f, 0.25f}}, {5, {1, 2, 3}, {0.5f, 0.5f, 0.75f}}, {7, {0, 1, 2}, {0.5f, 0.5f, 0.25f}}};
  v1::ComputeExpertsResponse resp;
  s = Compute(MakeRequest(1, hidden, n, batches), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(resp.outputs_size(), 3);
  EXPECT_FALSE(resp.outputs(0).loaded_on_demand());
  EXPECT_FALSE(resp.outputs(1).loaded_on_demand());
  EXPECT_TRUE(resp.outputs(2).loaded_on_demand());
  for (int i = 0; i < 3; ++i) {
    const ExpertBatch& b = batches[static_cast<size_t>(i)];
    const std::vector<float> y = LocalExpert(1, b.expert, hidden, b.rows);
    EXPECT_TRUE(
        BitwiseEqual(y.data(), reinterpret_cast<const float*>(resp.outputs(i).output().data().data()), y.size()));
  }
  // Used prefetched experts are evicted too: nothing stays resident.
  EXPECT_EQ(node_->ResidentExperts(), 0);
  EXPECT_EQ(node_->device().memory_info().in_use, workspace);
  stats = Stats(/*reset=*/true);
  EXPECT_EQ(stats.loads(), 3u);
  EXPECT_EQ(stats.loads_on_demand(), 1u);
  EXPECT_EQ(stats.prefetches(), 2u);
  EXPECT_EQ(stats.evictions(), 3u);
  EXPECT_EQ(stats.experts_computed(), 3u);
  EXPECT_EQ(stats.rows_computed(), 8u);
  EXPECT_GT(stats.on_demand_load_ms_total(), 0.0);
  EXPECT_GE(stats.load_ms_total(), stats.on_demand_load_ms_total());
  // Reset zeroes the counters.
  stats = Stats();
  EXPECT_EQ(stats.loads(), 0u);
  EXPECT_EQ(stats.experts_computed(), 0u);
  EXPECT_EQ(stats.compute_ms_total(), 0.0);
  EXPECT_EQ(stats.memory().peak_bytes(), workspace);
  ExpectOnlyExpertTensorsRead();
}

TEST_F(WorkerNodeTest, PredictionsAreKeptForTheirPositionAndFreedWhenMainPassesThem) {
  // Requests with an id are tracked: a prefetched expert is for one (position, layer); main's request for
  // that layer takes it; once main has gone past it, an unused one is freed, and a prediction arriving late
  // loads nothing.
  StartWorker();
  const uint64_t workspace = node_->workspace_bytes();
  auto prefetch = [&](uint64_t request, int64_t position, int64_t layer, std::vector<int32_t> experts) {
    v1::PrefetchRequest req;
    FillGoodHeader(req.mutable_header());
    req.mutable_header()->set_request_id(request);
    req.set_layer(static_cast<int32_t>(layer));
    req.set_position(position);
    for (int32_t e : experts) req.add_experts(e);
    v1::PrefetchResponse resp;
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    const grpc::Status st = stub_->Prefetch(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp;
  };
  const int64_t n = 1;
  const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, 5);
  auto compute = [&](uint64_t request, int64_t position, int64_t layer, int32_t expert) {
    v1::ComputeExpertsRequest req = MakeRequest(layer, hidden, n, {{expert, {0}, {1.0f}}});
    req.mutable_header()->set_request_id(request);
    req.set_position(position);
    v1::ComputeExpertsResponse resp;
    const grpc::Status st = Compute(req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.outputs_size() == 1 && !resp.outputs(0).loaded_on_demand();  // true: it was resident
  };
  // Position 20: layers 0 and 1 predicted {1, 2} each; position 21, layer 0: {3}.
  EXPECT_EQ(prefetch(1, 20, 0, {1, 2}).accepted(), 2);
  EXPECT_EQ(prefetch(1, 20, 1, {1, 2}).accepted(), 2);
  EXPECT_EQ(prefetch(1, 21, 0, {1, 3}).accepted(), 2);
  EXPECT_EQ(node_->ResidentExperts(), 6);
  // Main at (20, 0) uses expert 1; expert 2 of (20, 0) stays until main goes past it.
  EXPECT_TRUE(compute(1, 20, 0, 1));
  EXPECT_EQ(node_->ResidentExperts(), 5);
  // Main at (20, 1): (20, 0)'s unused expert 2 is freed; this layer's own expert 2 is used.
  EXPECT_TRUE(compute(1, 20, 1, 2));
  EXPECT_EQ(node_->ResidentExperts(), 3);  // (20, 1, 1), (21, 0, 1), (21, 0, 3)
  // A prediction for (20, 0) now is late: nothing loads.
  v1::PrefetchResponse late = prefetch(1, 20, 0, {5});
  EXPECT_TRUE(late.late());
  EXPECT_EQ(late.accepted(), 0);
  // Main at (21, 0) takes the expert predicted for position 21, not 20's.
  EXPECT_TRUE(compute(1, 21, 0, 1));
  EXPECT_EQ(node_->ResidentExperts(), 1);  // (20, 1)'s expert 1 was freed as stale; (21, 0)'s expert 3 stays
  // Another request makes everything of the first stale.
  EXPECT_FALSE(compute(2, 16, 0, 4));
  EXPECT_EQ(node_->ResidentExperts(), 0);
  EXPECT_EQ(node_->device().memory_info().in_use, workspace);
  const v1::WorkerStats stats = Stats();
  EXPECT_EQ(stats.prefetches(), 6u);
  EXPECT_EQ(stats.prefetches_late(), 1u);
  EXPECT_EQ(stats.prefetches_unused(), 3u);  // (20,0,2), (20,1,1), (21,0,3)
  EXPECT_EQ(stats.loads_on_demand(), 1u);
  EXPECT_EQ(stats.loads(), stats.evictions());
}

TEST_F(WorkerNodeTest, BudgetIsKept) {
  StartWorker();
  const uint64_t workspace = node_->workspace_bytes();
  const uint64_t expert = node_->expert_bytes();
  // Room for the workspace and 8.5 experts.
  StartWorker("w0", workspace + 8 * expert + expert / 2);
  EXPECT_EQ(Stats().memory().capacity_bytes(), workspace + 8 * expert + expert / 2);
  v1::PrefetchResponse pre;
  grpc::Status s = Prefetch(0, {0, 1, 2, 3, 4, 5, 6, 7}, &pre);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(pre.accepted(), 8);
  // Two more do not fit: refused, naming the budget.
  s = Prefetch(1, {0, 1}, &pre);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("budget"), std::string::npos) << s.error_message();
  EXPECT_EQ(node_->ResidentExperts(), 8);

  // An on-demand load evicts the oldest idle prediction to make room, and computes correctly.
  const int64_t n = 3;
  const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, 3);
  const std::vector<ExpertBatch> batches = {{3, {0, 2}, {1.0f, 1.0f}}, {7, {1}, {1.0f}}};
  v1::ComputeExpertsResponse resp;
  s = Compute(MakeRequest(1, hidden, n, batches), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(resp.outputs_size(), 2);
  EXPECT_TRUE(resp.outputs(0).loaded_on_demand());
  const std::vector<float> y = LocalExpert(1, 3, hidden, {0, 2});
  EXPECT_TRUE(BitwiseEqual(y.data(), reinterpret_cast<const float*>(resp.outputs(0).output().data().data()), y.size()));
  EXPECT_LE(node_->device().memory_info().peak, node_->budget_bytes());
  EXPECT_EQ(node_->ResidentExperts(), 7);  // (layer 0, expert 0) was evicted
  EXPECT_EQ(Stats().evictions(), 3u);      // one prediction, two used experts

  // A resident expert of layer 0 is still used without a load.
  const std::vector<ExpertBatch> layer0 = {{7, {1}, {1.0f}}};
  s = Compute(MakeRequest(0, hidden, n, layer0), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(resp.outputs(0).loaded_on_demand());
  // The evicted one is loaded on demand again.
  const std::vector<ExpertBatch> evicted = {{0, {1}, {1.0f}}};
  s = Compute(MakeRequest(0, hidden, n, evicted), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.outputs(0).loaded_on_demand());
}

TEST_F(WorkerNodeTest, RefusesToStartWhenBudgetTooSmall) {
  StartWorker();
  const uint64_t too_small = node_->workspace_bytes() + node_->expert_bytes() - 1;
  StopWorker();
  NodeConfig self = *cluster_.Find("w0");
  self.gpu_budget_bytes = too_small;
  auto node = WorkerNode::Create(cluster_, self, model_dir_, DaemonDevice(self));
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(node.status().message().find("budget"), std::string::npos) << node.status();

  // The daemon makes its device before the worker (odmoe-worker's main.cc): a bad spec stops it there.
  self.device = "tpu";
  self.gpu_budget_bytes = 0;
  const absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(self.device, self.gpu_budget_bytes);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << device.status();
  node = WorkerNode::Create(cluster_, *cluster_.main(), model_dir_, DaemonDevice(*cluster_.main()));
  EXPECT_EQ(node.status().code(), absl::StatusCode::kInvalidArgument) << node.status();
}

TEST_F(WorkerNodeTest, MembershipAndServedLayers) {
  StartWorker("w1");
  v1::Membership m;
  grpc::ClientContext ctx;
  rpc::SetDeadline(ctx, kDeadlineMs);
  const grpc::Status s = stub_->GetMembership(&ctx, v1::MembershipRequest(), &m);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(m.epoch(), kEpoch);
  auto fingerprint = ModelFingerprint(model_dir_, *ref_checkpoint_);
  ASSERT_TRUE(fingerprint.ok()) << fingerprint.status();
  EXPECT_EQ(m.model_fingerprint(), *fingerprint);
  EXPECT_EQ(m.self(), "w1");
  ASSERT_EQ(m.nodes_size(), 3);
  EXPECT_EQ(m.nodes(0).name(), "main");
  EXPECT_EQ(m.nodes(0).role(), "main");
  EXPECT_EQ(m.nodes(2).name(), "w1");
  EXPECT_EQ(m.nodes(2).role(), "worker");
  EXPECT_EQ(m.nodes(2).device(), "mock-gpu");
  // Two groups of one: w1 serves sparse layer 1 (of 0, 1, 2).
  const v1::WorkerStats stats = Stats();
  ASSERT_EQ(stats.layers_size(), 1);
  EXPECT_EQ(stats.layers(0), 1);
  EXPECT_EQ(stats.memory().device().find("mock"), 0u) << stats.memory().device();
  StartWorker("w0");
  const v1::WorkerStats w0 = Stats();
  EXPECT_EQ(std::vector<int32_t>(w0.layers().begin(), w0.layers().end()), (std::vector<int32_t>{0, 2}));
}

TEST_F(WorkerNodeTest, BadInputIsRefusedAndTheWorkerKeepsServing) {
  WorkerOptions options;
  options.max_rows_per_call = 16;
  StartWorker("w0", 0, options);
  const uint64_t workspace = node_->workspace_bytes();
  const int64_t n = 3, layer = 2, h = config_.hidden_size;
  const std::vector<float> hidden = RandomHidden(n, h, 1);
  const std::vector<ExpertBatch> batches = {{1, {0, 2}, {1.0f, 1.0f}}, {6, {1, 2}, {1.0f, 1.0f}}};
  const v1::ComputeExpertsRequest good = MakeRequest(layer, hidden, n, batches);
  v1::ComputeExpertsResponse expected;
  ASSERT_TRUE(Compute(good, &expected).ok());
  int good_calls = 1;

  // After every refused call the worker still computes the good request, bit for bit as before.
  auto expect_still_serving = [&](const std::string& what) {
    v1::ComputeExpertsResponse resp;
    const grpc::Status s = Compute(good, &resp);
    ASSERT_TRUE(s.ok()) << "after " << what << ": " << s.error_message();
    ASSERT_EQ(resp.outputs_size(), 2) << what;
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(resp.outputs(i).output().data(), expected.outputs(i).output().data()) << what;
    }
    ++good_calls;
  };

  struct Case {
    std::string what;
    std::function<void(v1::ComputeExpertsRequest&)> mutate;
    grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  };
  const std::vector<Case> cases = {
      {"wrong epoch", [](auto& r) { r.mutable_header()->set_epoch(kEpoch + 1); },
       grpc::StatusCode::FAILED_PRECONDITION},
      {"no header", [](auto& r) { r.clear_header(); }, grpc::StatusCode::FAILED_PRECONDITION},
      {"wrong fingerprint", [](auto& r) { r.mutable_header()->set_model_fingerprint("0123456789abcdef"); },
       grpc::StatusCode::FAILED_PRECONDITION},
      {"negative layer", [](auto& r) { r.set_layer(-1); }},
      {"layer past the model", [](auto& r) { r.set_layer(3); }},
      {"expert -1", [](auto& r) { r.mutable_tasks(0)->set_expert(-1); }},
      {"expert 8 of 8", [](auto& r) { r.mutable_tasks(1)->set_expert(8); }},
      {"duplicate expert", [](auto& r) { r.mutable_tasks(1)->set_expert(1); }},
      {"no tasks", [](auto& r) { r.clear_tasks(); }},
      {"empty rows", [](auto& r) { r.mutable_tasks(0)->clear_rows(); }},
      {"row out of range", [](auto& r) { r.mutable_tasks(0)->set_rows(1, 3); }},
      {"negative row", [](auto& r) { r.mutable_tasks(0)->set_rows(0, -1); }},
      {"rows descending",
       [](auto& r) {
         r.mutable_tasks(1)->set_rows(0, 2);
         r.mutable_tasks(1)->set_rows(1, 1);
       }},
      {"duplicate row", [](auto& r) { r.mutable_tasks(1)->set_rows(0, 2); }},
      {"hidden dtype BF16", [](auto& r) { r.mutable_hidden()->set_dtype(v1::DTYPE_BF16); }},
      {"hidden dtype unset", [](auto& r) { r.mutable_hidden()->set_dtype(v1::DTYPE_UNSPECIFIED); }},
      {"hidden rank 1",
       [](auto& r) {
         r.mutable_hidden()->clear_shape();
         r.mutable_hidden()->add_shape(3 * 128);
       }},
      {"hidden size 127", [](auto& r) { r.mutable_hidden()->set_shape(1, 127); }},
      {"hidden bytes short", [](auto& r) { r.mutable_hidden()->mutable_data()->pop_back(); }},
      {"hidden shape larger than data", [](auto& r) { r.mutable_hidden()->set_shape(0, 4); }},
      {"hidden empty",
       [](auto& r) {
         r.mutable_hidden()->set_shape(0, 0);
         r.mutable_hidden()->clear_data();
       }},
      {"hidden missing", [](auto& r) { r.clear_hidden(); }},
      {"more rows than the worker takes",
       [h](auto& r) {
         const std::vector<float> big(static_cast<size_t>(17 * h), 0.5f);
         const int64_t shape[] = {17, h};
         rpc::EncodeF32(big, shape, r.mutable_hidden());
       }},
  };
  for (const Case& c : cases) {
    v1::ComputeExpertsRequest bad = good;
    c.mutate(bad);
    v1::ComputeExpertsResponse resp;
    const grpc::Status s = Compute(bad, &resp);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    EXPECT_FALSE(s.error_message().empty()) << c.what;
    expect_still_serving(c.what);
  }
  {
    v1::ComputeExpertsRequest bad = good;
    bad.mutable_hidden()->clear_shape();
    bad.mutable_hidden()->add_shape(17);
    bad.mutable_hidden()->add_shape(h);
    v1::ComputeExpertsResponse resp;
    const std::vector<float> big(static_cast<size_t>(17 * h), 0.5f);
    bad.mutable_hidden()->set_data(big.data(), big.size() * 4);
    const grpc::Status s = Compute(bad, &resp);
    EXPECT_NE(s.error_message().find("split"), std::string::npos) << s.error_message();
  }

  // Prefetch: header, layer, experts.
  const std::vector<std::pair<std::string, std::function<void(v1::PrefetchRequest&)>>> prefetch_cases = {
      {"wrong epoch", [](auto& r) { r.mutable_header()->set_epoch(99); }},
      {"wrong fingerprint", [](auto& r) { r.mutable_header()->set_model_fingerprint("x"); }},
      {"bad layer", [](auto& r) { r.set_layer(17); }},
      {"expert out of range", [](auto& r) { r.set_experts(0, 8); }},
      {"negative expert", [](auto& r) { r.set_experts(0, -3); }},
      {"duplicate expert", [](auto& r) { r.add_experts(r.experts(0)); }},
      {"no experts", [](auto& r) { r.clear_experts(); }},
  };
  for (const auto& [what, mutate] : prefetch_cases) {
    v1::PrefetchRequest req;
    FillGoodHeader(req.mutable_header());
    req.set_layer(0);
    req.add_experts(4);
    mutate(req);
    v1::PrefetchResponse resp;
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    const grpc::Status s = stub_->Prefetch(&ctx, req, &resp);
    EXPECT_FALSE(s.ok()) << "prefetch " << what;
    const bool header = what.starts_with("wrong");
    EXPECT_EQ(s.error_code(), header ? grpc::StatusCode::FAILED_PRECONDITION : grpc::StatusCode::INVALID_ARGUMENT)
        << what << ": " << s.error_message();
    expect_still_serving("prefetch " + what);
  }
  EXPECT_EQ(node_->ResidentExperts(), 0);

  // Oversized: a 66 MB message. Our own channel refuses to send it; a channel without limits gets it refused
  // by the server.
  {
    const int64_t rows = (int64_t{66} << 20) / (h * 4);
    const std::vector<float> big(static_cast<size_t>(rows * h), 0.25f);
    const int64_t shape[] = {rows, h};
    v1::ComputeExpertsRequest bad = good;
    rpc::EncodeF32(big, shape, bad.mutable_hidden());
    v1::ComputeExpertsResponse resp;
    grpc::Status s = Compute(bad, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    auto unlimited = v1::Worker::NewStub(grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    s = unlimited->ComputeExperts(&ctx, bad, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    expect_still_serving("an oversized message");
  }

  // Bytes that are no ComputeExpertsRequest at all, to every method.
  for (const std::string method : {"ComputeExperts", "Prefetch", "GetStats", "GetMembership"}) {
    grpc::GenericStub generic(rpc::MakeChannel(address_));
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    const std::string garbage = "\xff\xff\xff\xff\x0f not a protobuf";
    grpc::Slice slice(garbage);
    grpc::ByteBuffer request(&slice, 1), response;
    auto call = generic.PrepareUnaryCall(&ctx, "/odmoe.v1.Worker/" + method, request, &cq);
    call->StartCall();
    grpc::Status s;
    call->Finish(&response, &s, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_FALSE(s.ok()) << method;
    expect_still_serving("garbage bytes to " + method);
  }

  const v1::WorkerStats stats = Stats();
  EXPECT_EQ(stats.experts_computed(), static_cast<uint64_t>(2 * good_calls));
  EXPECT_EQ(stats.loads_on_demand(), static_cast<uint64_t>(2 * good_calls));
  EXPECT_EQ(stats.memory().in_use_bytes(), workspace);
  ExpectOnlyExpertTensorsRead();
}

TEST_F(WorkerNodeTest, ConcurrentCallsStayExact) {
  // Four clients at once (StartWorker gives the server enough handler threads that gRPC admits them all).
  StartWorker();
  const int64_t n = 6, layer = 0;
  const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, 21);
  const Routing routing = RandomRouting(n, config_.top_k, config_.num_experts, 21);
  const std::vector<ExpertBatch> batches = GroupByExpert(routing.ids, routing.weights, n, config_.top_k);
  const v1::ComputeExpertsRequest req = MakeRequest(layer, hidden, n, batches);
  const std::vector<float> local = LocalMoe(layer, hidden, n, routing);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto stub = v1::Worker::NewStub(rpc::MakeChannel(address_));
      for (int i = 0; i < 8; ++i) {
        if ((i + t) % 2 == 0) {
          v1::PrefetchRequest pre;
          FillGoodHeader(pre.mutable_header());
          pre.set_layer(static_cast<int32_t>(layer));
          for (const ExpertBatch& b : batches) pre.add_experts(b.expert);
          v1::PrefetchResponse pre_resp;
          grpc::ClientContext ctx;
          rpc::SetDeadline(ctx, kDeadlineMs);
          if (!stub->Prefetch(&ctx, pre, &pre_resp).ok()) ++failures;
        }
        v1::ComputeExpertsResponse resp;
        grpc::ClientContext ctx;
        rpc::SetDeadline(ctx, kDeadlineMs);
        const grpc::Status s = stub->ComputeExperts(&ctx, req, &resp);
        if (!s.ok()) {
          ADD_FAILURE() << s.error_code() << " " << s.error_message();
          ++failures;
          continue;
        }
        const std::vector<float> remote = SumOutputs(resp, batches, n);
        if (!BitwiseEqual(local.data(), remote.data(), local.size())) ++failures;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(node_->device().memory_info().in_use,
            node_->workspace_bytes() + static_cast<uint64_t>(node_->ResidentExperts()) * node_->expert_bytes());
  const v1::WorkerStats stats = Stats();
  EXPECT_EQ(stats.experts_computed(), 32 * batches.size());
  EXPECT_EQ(stats.loads(), stats.evictions() + static_cast<uint64_t>(node_->ResidentExperts()));
}

// ---- the host expert store (issue 7) --------------------------------------------------------------------------

// The (layer, expert) pairs worker `index` of `placement` serves: its decode layers' experts and, in prefill,
// expert e of every sparse layer when e mod N_W is its index.
std::set<std::pair<int64_t, int64_t>> ServedExperts(const ModelConfig& config, const Placement& placement,
                                                    int32_t index) {
  std::set<std::pair<int64_t, int64_t>> out;
  const std::vector<int64_t> sparse = config.SparseLayers();
  for (int64_t s : placement.DecodeLayersOf(index, static_cast<int64_t>(sparse.size()))) {
    for (int64_t e = 0; e < config.num_experts; ++e) out.emplace(sparse[static_cast<size_t>(s)], e);
  }
  for (int64_t l : sparse) {
    for (int64_t e = 0; e < config.num_experts; ++e) {
      if (placement.PrefillWorkerOf(static_cast<int32_t>(e)) == index) out.emplace(l, e);
    }
  }
  return out;
}

TEST_F(WorkerNodeTest, PrivateStorePacksServedExpertsAndLoadsEachWithOneCopy) {
  MockGpuDevice* gpu = nullptr;
  std::unique_ptr<WorkerNode> w = MakeWorker("w0", 0, /*share=*/false, &gpu);
  ASSERT_NE(w, nullptr);
  const Placement placement = *Placement::Create(2, 1);
  const auto served = ServedExperts(config_, placement, 0);
  v1::WorkerStats stats = w->Stats(false);
  EXPECT_FALSE(stats.host_experts_shared());
  EXPECT_TRUE(stats.host_packed_here());
  EXPECT_EQ(stats.host_experts_packed(), served.size());
  EXPECT_GT(stats.host_bytes_packed(), served.size() * w->expert_bytes() - 1);
  EXPECT_EQ(stats.host_bytes_pinned(), stats.host_bytes_packed());  // registered with the mock GPU
  EXPECT_TRUE(w->store().segment_path().empty());

  MockGpuDevice& mock = *gpu;
  const int64_t n = 2;
  const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, 11);
  // One served expert (layer 0 is w0's decode layer) and one it does not serve (layer 1 belongs to w1, and
  // expert 1 is w1's in prefill): one copy against three, and the unpacked one crosses the link at pageable speed.
  double busy_packed = 0, busy_unpacked = 0;
  for (const auto& [layer, e] : std::vector<std::pair<int64_t, int32_t>>{{0, 3}, {1, 1}}) {
    SCOPED_TRACE(StrCat("layer ", layer, " expert ", e));
    const bool is_served = served.contains({layer, e});
    EXPECT_EQ(is_served, layer == 0);
    const TransferStats before = mock.transfer_stats();
    const double busy_before = mock.stats().h2d_busy_s;
    v1::ComputeExpertsRequest req = MakeRequest(layer, hidden, n, {{e, {0, 1}, {1.0f, 1.0f}}});
    rpc::FillHeader(req.mutable_header(), kEpoch, w->fingerprint(), "test");
    v1::ComputeExpertsResponse resp;
    ASSERT_TRUE(w->Compute(req, &resp).ok());
    const TransferStats after = mock.transfer_stats();
    // Two uploads per call (hidden state, rows), then the expert.
    EXPECT_EQ(after.h2d_copies - before.h2d_copies, 2u + (is_served ? 1u : 3u));
    (is_served ? busy_packed : busy_unpacked) = mock.stats().h2d_busy_s - busy_before;
    const std::vector<float> y = LocalExpert(layer, e, hidden, {0, 1});
    ASSERT_EQ(resp.outputs_size(), 1);
    EXPECT_TRUE(BitwiseEqual(y.data(), reinterpret_cast<const float*>(resp.outputs(0).output().data().data()), y.size()));
  }
  EXPECT_LT(busy_packed, busy_unpacked);
}

TEST_F(WorkerNodeTest, DecodeLoadsFollowThePlacementAndTheBudgetIsKept) {
  // Two workers (group size 1): every decode token, each sparse layer's predicted experts are prefetched on the
  // layer's worker and its actual experts computed there. Each actual expert is loaded exactly once on the
  // right worker (prefetched when predicted, on demand otherwise) and evicted after compute; a wrong prediction
  // is freed unused. The budget holds the workspace and four experts (two stale predictions of the worker's
  // previous layer next to two new ones), and is never exceeded.
  std::unique_ptr<WorkerNode> probe = MakeWorker("w0");
  ASSERT_NE(probe, nullptr);
  const uint64_t budget = probe->workspace_bytes() + 4 * probe->expert_bytes();
  probe.reset();
  std::vector<std::unique_ptr<WorkerNode>> workers;
  workers.push_back(MakeWorker("w0", budget));
  workers.push_back(MakeWorker("w1", budget));
  ASSERT_NE(workers[0], nullptr);
  ASSERT_NE(workers[1], nullptr);
  const Placement placement = *Placement::Create(2, 1);
  const std::vector<int64_t> sparse = config_.SparseLayers();
  struct Expect {
    uint64_t loads = 0, on_demand = 0, prefetches = 0, unused = 0, computed = 0, calls = 0;
  };
  Expect expect[2];
  std::mt19937 rng(3);
  const uint64_t request_id = 9;
  for (int64_t position = 4; position < 12; ++position) {
    const std::vector<float> hidden = RandomHidden(1, config_.hidden_size, static_cast<uint32_t>(position));
    for (size_t s = 0; s < sparse.size(); ++s) {
      const int64_t layer = sparse[s];
      const Routing actual_r = RandomRouting(1, config_.top_k, config_.num_experts, rng());
      const Routing predicted_r = RandomRouting(1, config_.top_k, config_.num_experts, rng());
      std::vector<int32_t> actual = actual_r.ids, predicted = predicted_r.ids;
      if (position % 3 == 0) predicted = actual;  // some tokens predicted exactly
      std::sort(actual.begin(), actual.end());
      std::sort(predicted.begin(), predicted.end());
      const std::vector<Assignment> pre = placement.Assign(static_cast<int64_t>(s), predicted);
      const std::vector<Assignment> act = placement.Resolve(static_cast<int64_t>(s), predicted, actual);
      const int32_t worker = placement.WorkerOf(placement.GroupOf(static_cast<int64_t>(s)), 0);
      v1::PrefetchRequest preq;
      rpc::FillHeader(preq.mutable_header(), kEpoch, workers[0]->fingerprint(), "test");
      preq.mutable_header()->set_request_id(request_id);
      preq.set_layer(static_cast<int32_t>(layer));
      preq.set_position(position);
      for (const Assignment& a : pre) {
        EXPECT_EQ(a.worker, worker);
        preq.add_experts(a.expert);
      }
      absl::StatusOr<int32_t> accepted = workers[static_cast<size_t>(worker)]->DoPrefetch(preq);
      ASSERT_TRUE(accepted.ok()) << accepted.status();
      EXPECT_EQ(*accepted, static_cast<int32_t>(predicted.size()));
      std::vector<ExpertBatch> batches;
      for (const Assignment& a : act) {
        EXPECT_EQ(a.worker, worker);
        batches.push_back({a.expert, {0}, {1.0f}});
      }
      v1::ComputeExpertsRequest req = MakeRequest(layer, hidden, 1, batches);
      rpc::FillHeader(req.mutable_header(), kEpoch, workers[0]->fingerprint(), "test");
      req.mutable_header()->set_request_id(request_id);
      req.set_position(position);
      v1::ComputeExpertsResponse resp;
      const absl::Status st = workers[static_cast<size_t>(worker)]->Compute(req, &resp);
      ASSERT_TRUE(st.ok()) << st;
      for (int i = 0; i < resp.outputs_size(); ++i) {
        const bool was_predicted = std::binary_search(predicted.begin(), predicted.end(), resp.outputs(i).expert());
        EXPECT_EQ(resp.outputs(i).loaded_on_demand(), !was_predicted);
        const std::vector<float> y = LocalExpert(layer, resp.outputs(i).expert(), hidden, {0});
        EXPECT_TRUE(
            BitwiseEqual(y.data(), reinterpret_cast<const float*>(resp.outputs(i).output().data().data()), y.size()));
      }
      Expect& x = expect[worker];
      uint64_t hits = 0;
      for (int32_t e : actual) hits += std::binary_search(predicted.begin(), predicted.end(), e) ? 1 : 0;
      x.prefetches += predicted.size();
      x.on_demand += actual.size() - hits;
      x.loads += predicted.size() + actual.size() - hits;
      x.unused += predicted.size() - hits;  // freed when main moves on
      x.computed += actual.size();
      x.calls += 1;
      // After compute only the still-unused predictions of this layer may be resident.
      EXPECT_EQ(workers[static_cast<size_t>(worker)]->ResidentExperts(), static_cast<int64_t>(predicted.size() - hits));
    }
  }
  for (int w = 0; w < 2; ++w) {
    SCOPED_TRACE(StrCat("w", w));
    const v1::WorkerStats st = workers[static_cast<size_t>(w)]->Stats(false);
    const uint64_t pending = static_cast<uint64_t>(workers[static_cast<size_t>(w)]->ResidentExperts());
    EXPECT_EQ(st.loads(), expect[w].loads);
    EXPECT_EQ(st.loads_on_demand(), expect[w].on_demand);
    EXPECT_EQ(st.prefetches(), expect[w].prefetches);
    EXPECT_EQ(st.experts_computed(), expect[w].computed);
    EXPECT_EQ(st.prefetches_unused() + pending, expect[w].unused);
    EXPECT_EQ(st.evictions() + pending, st.loads());  // everything loaded is evicted (or still pending)
    EXPECT_LE(st.memory().peak_bytes(), budget);
    EXPECT_GT(st.memory().peak_bytes(), workers[static_cast<size_t>(w)]->workspace_bytes());
    // One host-to-device copy per expert load (besides the two uploads of every call).
    const TransferStats t = workers[static_cast<size_t>(w)]->device().transfer_stats();
    EXPECT_EQ(t.h2d_copies, st.loads() + 2 * expect[w].calls);
  }
}

// ---- prefill mini-batches -------------------------------------------------------------------------------------

// A mini-batch call: rows [begin, end) of `hidden` (sent as the call's own hidden state) for expert `e`.
struct MiniBatch {
  int32_t expert = 0;
  int64_t begin = 0, end = 0;
  int32_t calls = 1;  // how many calls compute this expert (ExpertTask.expert_calls)
};

class MiniBatchTest : public WorkerNodeTest {
 protected:
  static constexpr uint64_t kRequest = 21;
  static constexpr int64_t kLayer = 0;  // a sparse layer of w0 (even experts are w0's in prefill)

  // A worker whose mock GPU records its timeline and computes slowly (1 GFLOP/s), so that an expert's compute
  // takes longer than the small copies of this model, as the big experts of a real one do. `*gpu` (optional)
  // gets the mock GPU.
  std::unique_ptr<WorkerNode> MakeTimedWorker(uint64_t budget_bytes = 0, MockGpuDevice** gpu = nullptr) {
    NodeConfig self = *cluster_.Find("w0");
    self.gpu_budget_bytes = budget_bytes;
    WorkerOptions options;
    options.shm_dir = ShmDir();
    MockGpuOptions mock;
    mock.flops_per_s = 1e9;
    if (budget_bytes != 0) mock.capacity_bytes = std::min(budget_bytes, mock.capacity_bytes);
    mock.h2d_pageable_bytes_per_s = mock.h2d_bytes_per_s * MockGpuOptions::kPageableFraction;
    auto device = std::make_unique<MockGpuDevice>(mock);
    if (gpu != nullptr) *gpu = device.get();
    auto node = WorkerNode::Create(cluster_, self, model_dir_, std::move(device), options);
    EXPECT_TRUE(node.ok()) << node.status();
    return node.ok() ? std::move(node).value() : nullptr;
  }

  v1::ComputeExpertsRequest Request(const WorkerNode& node, const std::vector<float>& hidden, const MiniBatch& mb) {
    const int64_t h = config_.hidden_size;
    const std::vector<float> rows(hidden.begin() + mb.begin * h, hidden.begin() + mb.end * h);
    std::vector<int32_t> local;
    for (int64_t r = 0; r < mb.end - mb.begin; ++r) local.push_back(static_cast<int32_t>(r));
    v1::ComputeExpertsRequest req = MakeRequest(kLayer, rows, mb.end - mb.begin, {{mb.expert, local, {}}});
    rpc::FillHeader(req.mutable_header(), kEpoch, node.fingerprint(), "test");
    req.mutable_header()->set_request_id(kRequest);
    req.set_position(0);
    req.mutable_tasks(0)->set_expert_calls(mb.calls);
    return req;
  }

  // The response's one output equals expert(hidden[begin, end)) on the reference device, bit for bit.
  void ExpectExact(const v1::ComputeExpertsResponse& resp, const std::vector<float>& hidden, const MiniBatch& mb) {
    ASSERT_EQ(resp.outputs_size(), 1);
    std::vector<int32_t> rows;
    for (int64_t r = mb.begin; r < mb.end; ++r) rows.push_back(static_cast<int32_t>(r));
    const std::vector<float> want = LocalExpert(kLayer, mb.expert, hidden, rows);
    EXPECT_TRUE(BitwiseEqual(want.data(), reinterpret_cast<const float*>(resp.outputs(0).output().data().data()),
                             want.size()))
        << "expert " << mb.expert << " rows " << mb.begin << ".." << mb.end;
  }
};

// Timeline intervals [from, to) of `kind`.
std::vector<MockGpuInterval> Intervals(const std::vector<MockGpuInterval>& timeline, size_t from, size_t to,
                                       MockGpuWork kind) {
  std::vector<MockGpuInterval> out;
  for (size_t i = from; i < to && i < timeline.size(); ++i) {
    if (timeline[i].kind == kind) out.push_back(timeline[i]);
  }
  return out;
}
bool Overlap(const MockGpuInterval& a, const MockGpuInterval& b) { return a.start_s < b.end_s && b.start_s < a.end_s; }

TEST_F(MiniBatchTest, NextMiniBatchTravelsWhileTheCurrentOneComputes) {
  // Main keeps two calls in flight: the second arrives while the first computes. Staged then, its rows and its
  // expert are copied to the device during the first one's compute (virtual clock); computed one after the
  // other, they arrive too late for that, which shows the test can tell the two apart.
  const std::vector<float> hidden = RandomHidden(8, config_.hidden_size, 17);
  const MiniBatch first{0, 0, 4, /*calls=*/2}, second{2, 0, 8, 1}, last{0, 4, 8, 2};
  for (const bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "two calls in flight" : "one call at a time");
    MockGpuDevice* mock = nullptr;
    std::unique_ptr<WorkerNode> node = MakeTimedWorker(0, &mock);
    ASSERT_NE(node, nullptr);
    MockGpuDevice& gpu = *mock;
    const v1::ComputeExpertsRequest r1 = Request(*node, hidden, first), r2 = Request(*node, hidden, second),
                                    r3 = Request(*node, hidden, last);
    v1::ComputeExpertsResponse out1, out2, out3;
    gpu.ClearTimeline();
    size_t second_from = 0, second_to = 0, compute_from = 0, compute_to = 0;
    absl::StatusOr<WorkerNode::StagedCall> s1 = node->Stage(r1);
    ASSERT_TRUE(s1.ok()) << s1.status();
    if (pipelined) {
      second_from = gpu.timeline().size();
      absl::StatusOr<WorkerNode::StagedCall> s2 = node->Stage(r2);
      ASSERT_TRUE(s2.ok()) << s2.status();
      second_to = compute_from = gpu.timeline().size();
      ASSERT_TRUE(node->Finish(std::move(s1).value(), &out1).ok());
      compute_to = gpu.timeline().size();
      ASSERT_TRUE(node->Finish(std::move(s2).value(), &out2).ok());
    } else {
      compute_from = gpu.timeline().size();
      ASSERT_TRUE(node->Finish(std::move(s1).value(), &out1).ok());
      compute_to = second_from = gpu.timeline().size();
      ASSERT_TRUE(node->Compute(r2, &out2).ok());
      second_to = gpu.timeline().size();
    }
    ASSERT_TRUE(node->Compute(r3, &out3).ok());  // the rest of expert 0: still resident from the first call
    ExpectExact(out1, hidden, first);
    ExpectExact(out2, hidden, second);
    ExpectExact(out3, hidden, last);

    const std::vector<MockGpuInterval> timeline = gpu.timeline();
    const std::vector<MockGpuInterval> compute = Intervals(timeline, compute_from, compute_to, MockGpuWork::kCompute);
    const std::vector<MockGpuInterval> copies = Intervals(timeline, second_from, second_to, MockGpuWork::kH2D);
    ASSERT_FALSE(compute.empty());
    ASSERT_EQ(copies.size(), 3u);  // the second call's rows, its row indices and its expert
    const uint64_t expert_copy = node->store().Find(kLayer, 2)->copy_bytes;
    EXPECT_EQ(copies[2].bytes, expert_copy);
    for (const MockGpuInterval& copy : copies) {
      const bool overlaps = std::any_of(compute.begin(), compute.end(),
                                        [&](const MockGpuInterval& c) { return Overlap(copy, c); });
      EXPECT_EQ(overlaps, pipelined) << copy.bytes << " bytes at " << copy.start_s << ".." << copy.end_s
                                     << " s; the first call computes " << compute.front().start_s << ".."
                                     << compute.back().end_s << " s";
    }
    // Expert 0 was loaded once for its two mini-batches, expert 2 once; nothing stays resident.
    const v1::WorkerStats st = node->Stats(false);
    EXPECT_EQ(st.loads(), 2u);
    EXPECT_EQ(st.loads_on_demand(), 2u);
    EXPECT_EQ(st.experts_kept(), 1u);
    EXPECT_EQ(st.evictions(), 2u);
    EXPECT_EQ(st.experts_computed(), 3u);
    EXPECT_EQ(out3.outputs(0).loaded_on_demand(), false);
    EXPECT_EQ(node->ResidentExperts(), 0);
    EXPECT_EQ(st.loads_ahead(), 2u);  // every load here is started as its call is staged
  }
}

TEST_F(MiniBatchTest, MiniBatchesOfOneExpertInAnyOrderLoadItOnce) {
  // Two calls in flight may reach the computation in either order: the expert is still loaded once, kept until
  // both have computed, then freed.
  std::unique_ptr<WorkerNode> node = MakeTimedWorker();
  ASSERT_NE(node, nullptr);
  const std::vector<float> hidden = RandomHidden(9, config_.hidden_size, 29);
  const MiniBatch a{4, 0, 5, /*calls=*/3}, b{4, 5, 7, 3}, c{4, 7, 9, 3};
  for (const MiniBatch& mb : {c, a, b}) {
    v1::ComputeExpertsResponse out;
    ASSERT_TRUE(node->Compute(Request(*node, hidden, mb), &out).ok());
    ExpectExact(out, hidden, mb);
  }
  const v1::WorkerStats st = node->Stats(false);
  EXPECT_EQ(st.loads(), 1u);
  EXPECT_EQ(st.experts_kept(), 1u);
  EXPECT_EQ(st.evictions(), 1u);
  EXPECT_EQ(node->ResidentExperts(), 0);
}

TEST_F(MiniBatchTest, TightBudgetIsKeptAndResultsStayExact) {
  // A budget of the workspace and one expert: the second call's expert cannot be loaded ahead next to the
  // first one's, the kept expert is evicted for it, and reloaded for the last mini-batch. Results are exact and
  // the budget is never exceeded.
  std::unique_ptr<WorkerNode> probe = MakeTimedWorker();
  ASSERT_NE(probe, nullptr);
  const uint64_t budget = probe->workspace_bytes() + probe->expert_bytes() + probe->expert_bytes() / 2;
  probe.reset();
  std::unique_ptr<WorkerNode> node = MakeTimedWorker(budget);
  ASSERT_NE(node, nullptr);
  const std::vector<float> hidden = RandomHidden(8, config_.hidden_size, 19);
  const MiniBatch first{0, 0, 4, /*calls=*/2}, second{2, 0, 8, 1}, last{0, 4, 8, 2};
  const v1::ComputeExpertsRequest r1 = Request(*node, hidden, first), r2 = Request(*node, hidden, second),
                                  r3 = Request(*node, hidden, last);
  v1::ComputeExpertsResponse out1, out2, out3;
  absl::StatusOr<WorkerNode::StagedCall> s1 = node->Stage(r1);
  ASSERT_TRUE(s1.ok()) << s1.status();
  absl::StatusOr<WorkerNode::StagedCall> s2 = node->Stage(r2);
  ASSERT_TRUE(s2.ok()) << s2.status();
  ASSERT_TRUE(node->Finish(std::move(s1).value(), &out1).ok());
  ASSERT_TRUE(node->Finish(std::move(s2).value(), &out2).ok());
  ASSERT_TRUE(node->Compute(r3, &out3).ok());
  ExpectExact(out1, hidden, first);
  ExpectExact(out2, hidden, second);
  ExpectExact(out3, hidden, last);
  const v1::WorkerStats st = node->Stats(false);
  EXPECT_EQ(st.loads_ahead(), 2u);  // the first and the last call's: the second's did not fit next to expert 0
  EXPECT_EQ(st.loads(), 3u);        // expert 0 twice: evicted for expert 2 in between
  EXPECT_TRUE(out3.outputs(0).loaded_on_demand());
  EXPECT_LE(st.memory().peak_bytes(), budget);
  // The reloaded copy of expert 0 has served one of its two calls: it stays until main moves on.
  EXPECT_EQ(st.evictions(), 2u);
  EXPECT_EQ(node->ResidentExperts(), 1);
  v1::ComputeExpertsRequest next = Request(*node, hidden, {1, 0, 1, 1});
  next.set_layer(1);
  ASSERT_TRUE(node->Compute(next, &out1).ok());
  EXPECT_EQ(node->ResidentExperts(), 0);
  EXPECT_LE(node->Stats(false).memory().peak_bytes(), budget);
}

TEST_F(MiniBatchTest, RefusedOrAbandonedCallsLeaveNothingLoaded) {
  // A call refused by validation loads nothing; a staged call dropped without being computed frees the expert it
  // started loading and its staging slot.
  std::unique_ptr<WorkerNode> node = MakeTimedWorker();
  ASSERT_NE(node, nullptr);
  const std::vector<float> hidden = RandomHidden(4, config_.hidden_size, 23);
  v1::ComputeExpertsRequest bad = Request(*node, hidden, {0, 0, 4, 2});
  bad.mutable_tasks(0)->add_rows(99);
  v1::ComputeExpertsResponse out;
  EXPECT_EQ(node->Compute(bad, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(node->ResidentExperts(), 0);
  const v1::ComputeExpertsRequest good = Request(*node, hidden, {0, 0, 4, 2});
  for (int i = 0; i < 3; ++i) {  // more than the two slots: each one comes back
    absl::StatusOr<WorkerNode::StagedCall> staged = node->Stage(good);
    ASSERT_TRUE(staged.ok()) << staged.status();
    EXPECT_EQ(node->ResidentExperts(), 1);
  }
  EXPECT_EQ(node->ResidentExperts(), 0);
  ASSERT_TRUE(node->Compute(good, &out).ok());
  ExpectExact(out, hidden, {0, 0, 4, 2});
}

TEST_F(WorkerNodeTest, WithoutUsableSharedMemoryTheWorkerPacksPrivately) {
  // No shared segment can be made (here: its folder does not exist; in a container: a full /dev/shm): the
  // worker still starts, with a private store, and computes.
  NodeConfig self = *cluster_.Find("w0");
  WorkerOptions options;
  options.shm_dir = ShmDir() + "/does/not/exist";
  auto node = WorkerNode::Create(cluster_, self, model_dir_, DaemonDevice(self), options);
  ASSERT_TRUE(node.ok()) << node.status();
  const v1::WorkerStats s = (*node)->Stats(false);
  EXPECT_FALSE(s.host_experts_shared());
  EXPECT_GT(s.host_bytes_packed(), 0u);
  const std::vector<float> hidden = RandomHidden(1, config_.hidden_size, 4);
  v1::ComputeExpertsRequest req = MakeRequest(config_.SparseLayers()[0], hidden, 1, {{0, {0}, {1.0f}}});
  rpc::FillHeader(req.mutable_header(), kEpoch, (*node)->fingerprint(), "test");
  v1::ComputeExpertsResponse resp;
  const absl::Status st = (*node)->Compute(req, &resp);
  EXPECT_TRUE(st.ok()) << st;
}

// Failover (Operations 4/4): a worker takes the newest membership epoch of main's it has seen and refuses a
// message of an older one (a shadow's prefetch placed before it heard of a change); one without a view passes.
TEST_F(WorkerNodeTest, RefusesAMessageOfAnOlderMembershipEpoch) {
  std::unique_ptr<WorkerNode> node = MakeWorker("w0");
  ASSERT_NE(node, nullptr);
  const std::vector<float> hidden = RandomHidden(1, config_.hidden_size, 4);
  v1::ComputeExpertsRequest req = MakeRequest(config_.SparseLayers()[0], hidden, 1, {{0, {0}, {1.0f}}});
  v1::ComputeExpertsResponse resp;
  const MembershipView newer{20, {3}}, older{19, {}};
  rpc::FillHeader(req.mutable_header(), kEpoch, node->fingerprint(), "main", 0, &newer);
  ASSERT_TRUE(node->Compute(req, &resp).ok());
  rpc::FillHeader(req.mutable_header(), kEpoch, node->fingerprint(), "shadow", 0, &older);
  const absl::Status refused = node->Compute(req, &resp);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("membership epoch 19 of shadow is older than epoch 20"), std::string::npos)
      << refused;
  rpc::FillHeader(req.mutable_header(), kEpoch, node->fingerprint(), "test");
  EXPECT_TRUE(node->Compute(req, &resp).ok());
}

TEST_F(WorkerNodeTest, TwoWorkersOfOneHostShareOneSegment) {
  std::unique_ptr<WorkerNode> w0 = MakeWorker("w0");
  ASSERT_NE(w0, nullptr);
  const std::string segment = w0->store().segment_path();
  const std::string lock = w0->store().lock_path();
  EXPECT_EQ(segment, StrCat(ShmDir(), "/odmoe-worker-test-e7-", w0->fingerprint().substr(0, 8)));
  const size_t reads_w0 = w0->checkpoint().ReadNames().size();
  EXPECT_EQ(reads_w0, AllExpertTensors(config_).size());  // the creator packed every expert
  std::unique_ptr<WorkerNode> w1 = MakeWorker("w1");
  ASSERT_NE(w1, nullptr);
  EXPECT_EQ(w1->store().segment_path(), segment);
  const v1::WorkerStats s0 = w0->Stats(false), s1 = w1->Stats(false);
  EXPECT_TRUE(s0.host_experts_shared());
  EXPECT_TRUE(s1.host_experts_shared());
  EXPECT_TRUE(s0.host_packed_here());
  EXPECT_FALSE(s1.host_packed_here());  // mapped w0's segment
  EXPECT_EQ(s0.host_bytes_packed(), s1.host_bytes_packed());
  EXPECT_EQ(s1.host_bytes_pinned(), s1.host_bytes_packed());
  EXPECT_EQ(s1.host_experts_packed(), static_cast<uint64_t>(config_.SparseLayers().size() * config_.num_experts));
  EXPECT_TRUE(w1->checkpoint().ReadNames().empty());  // w1 read (and copied) nothing to pack

  // Both compute bit-exact results from the shared bytes, one copy per expert.
  const int64_t n = 3;
  const std::vector<float> hidden = RandomHidden(n, config_.hidden_size, 21);
  for (WorkerNode* w : {w0.get(), w1.get()}) {
    for (int64_t layer : config_.SparseLayers()) {
      const uint64_t copies = w->device().transfer_stats().h2d_copies;
      v1::ComputeExpertsRequest req = MakeRequest(layer, hidden, n, {{5, {0, 2}, {1.0f, 1.0f}}});
      rpc::FillHeader(req.mutable_header(), kEpoch, w->fingerprint(), "test");
      v1::ComputeExpertsResponse resp;
      ASSERT_TRUE(w->Compute(req, &resp).ok());
      EXPECT_EQ(w->device().transfer_stats().h2d_copies - copies, 3u);
      const std::vector<float> y = LocalExpert(layer, 5, hidden, {0, 2});
      ASSERT_EQ(resp.outputs_size(), 1);
      EXPECT_TRUE(
          BitwiseEqual(y.data(), reinterpret_cast<const float*>(resp.outputs(0).output().data().data()), y.size()));
    }
  }
  // The creator leaves first: the segment stays for w1; the last one removes it and its lock file.
  w0.reset();
  EXPECT_TRUE(std::filesystem::exists(segment));
  w1.reset();
  EXPECT_FALSE(std::filesystem::exists(segment));
  EXPECT_FALSE(std::filesystem::exists(lock));
}

TEST_F(WorkerNodeTest, LeftoverSegmentOfACrashedWorkerIsRebuilt) {
  // What a worker killed half-way through packing leaves: a segment of the right name with garbage (no ready
  // mark) and its lock file, held by nobody.
  std::unique_ptr<WorkerNode> probe = MakeWorker("w0");
  ASSERT_NE(probe, nullptr);
  const std::string segment = probe->store().segment_path();
  const std::string lock = probe->store().lock_path();
  const uint64_t size = probe->store().host_bytes();
  probe.reset();
  ASSERT_FALSE(std::filesystem::exists(segment));
  for (const uint64_t leftover_size : {uint64_t{100}, size}) {
    SCOPED_TRACE(StrCat("leftover of ", leftover_size, " bytes"));
    {
      std::FILE* f = std::fopen(segment.c_str(), "wb");
      ASSERT_NE(f, nullptr);
      std::vector<char> junk(leftover_size, 'x');
      std::fwrite(junk.data(), 1, junk.size(), f);
      std::fclose(f);
      f = std::fopen(lock.c_str(), "wb");
      ASSERT_NE(f, nullptr);
      std::fclose(f);
    }
    std::unique_ptr<WorkerNode> w1 = MakeWorker("w1");
    ASSERT_NE(w1, nullptr);
    EXPECT_TRUE(w1->Stats(false).host_packed_here());  // rebuilt, not trusted
    EXPECT_EQ(std::filesystem::file_size(segment), size);
    const std::vector<float> hidden = RandomHidden(1, config_.hidden_size, 2);
    v1::ComputeExpertsRequest req = MakeRequest(1, hidden, 1, {{6, {0}, {1.0f}}});
    rpc::FillHeader(req.mutable_header(), kEpoch, w1->fingerprint(), "test");
    v1::ComputeExpertsResponse resp;
    ASSERT_TRUE(w1->Compute(req, &resp).ok());
    const std::vector<float> y = LocalExpert(1, 6, hidden, {0});
    ASSERT_EQ(resp.outputs_size(), 1);
    EXPECT_TRUE(BitwiseEqual(y.data(), reinterpret_cast<const float*>(resp.outputs(0).output().data().data()), y.size()));
    w1.reset();
    EXPECT_FALSE(std::filesystem::exists(segment));
    EXPECT_FALSE(std::filesystem::exists(lock));
  }
}

// ---- the odmoe-worker program ----------------------------------------------------------------------------------

class WorkerDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveSharedModel(kModel)) GTEST_SKIP() << "needs ../shared: " << SharedModel(kModel) << " is missing";
    program_ = odmoe::testing::ProgramPath("odmoe-worker");
    if (access(program_.c_str(), X_OK) != 0) GTEST_SKIP() << "needs the program " << program_ << " (not built)";
  }
  std::string program_;
  odmoe::testing::TempDir dir_;
};

TEST_F(WorkerDaemonTest, BadFlagsExitWithUsage) {
  const std::string config = dir_.File("cluster.toml");
  odmoe::testing::WriteFile(config, ClusterToml(SharedModel(kModel)));
  auto r = odmoe::testing::RunProgram({program_, "--config", config, "--node", "main"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("odmoe-worker: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("role"), std::string::npos) << r.err;
  r = odmoe::testing::RunProgram({program_, "--config", config});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  r = odmoe::testing::RunProgram({program_, "--config", dir_.File("missing.toml"), "--node", "w0"});
  EXPECT_NE(r.exit_code, 0) << r.err;
}

TEST_F(WorkerDaemonTest, ServesUntilSigterm) {
  const int port = odmoe::testing::PickFreePorts(1)[0];
  ASSERT_GT(port, 0);
  const std::string config = dir_.File("cluster.toml");
  odmoe::testing::WriteFile(config, ClusterToml(SharedModel(kModel), port));
  const std::string log = dir_.File("worker.log");
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    dup2(fd, 1);
    execl(program_.c_str(), program_.c_str(), "--config", config.c_str(), "--node", "w0", nullptr);
    _exit(127);
  }
  const std::string address = StrCat("127.0.0.1:", port);
  auto channel = rpc::MakeChannel(address);
  auto health = grpc::health::v1::Health::NewStub(channel);
  bool serving = false;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!serving && std::chrono::steady_clock::now() < give_up) {
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, 1000);
    ctx.set_wait_for_ready(true);  // wait for the connection within the deadline instead of failing at once
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status s = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
    serving = s.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(serving) << odmoe::testing::ReadFile(log);
  if (serving) {
    auto stub = v1::Worker::NewStub(channel);
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, kDeadlineMs);
    v1::Membership m;
    const grpc::Status s = stub->GetMembership(&ctx, v1::MembershipRequest(), &m);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(m.self(), "w0");
    EXPECT_EQ(m.epoch(), kEpoch);
  }
  kill(pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << odmoe::testing::ReadFile(log);
  EXPECT_NE(odmoe::testing::ReadFile(log).find("serving"), std::string::npos) << odmoe::testing::ReadFile(log);
}

}  // namespace
}  // namespace odmoe
