// The shadow (Scaled Emulative Prediction) with main and workers in one process on loopback: predictions reach
// main and the workers, recall is computed from them, alignment sends exactly what its periods say, and the
// tokens never change (they equal the single-process engine's whatever the shadow does). Needs
// ../shared/models/tiny-mixtral-kjv.
#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "src/backend/device_factory.h"
#include "src/cluster/client.h"
#include "src/common/json.h"
#include "src/common/limits.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/engine/generator.h"
#include "src/main_node/main_node.h"
#include "src/model/model_config.h"
#include "src/model/synthetic.h"
#include "src/model/tokenizer.h"
#include "src/rpc/rpc_util.h"
#include "src/rpc/sampling_proto.h"
#include "src/shadow_node/shadow_node.h"
#include "src/worker_node/worker_node.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

using ::odmoe::testing::HaveSharedModel;
using ::odmoe::testing::SharedModel;

constexpr char kModel[] = "tiny-mixtral-kjv";
constexpr int64_t kTimeoutMs = 120000;

struct ShadowSpec {
  std::string shadow_toml;   // the [shadow] section's body
  bool start_shadow = true;  // false: the shadow's address has nothing behind it
  int workers = 4;
  // The shadow's address serves HungShadow instead of a shadow (start_shadow is then not read).
  bool hung_shadow = false;
  std::string cluster_extra;  // more lines of the [cluster] table
};

// A greedy request of max_new_tokens tokens, past EOS.
GenerateOptions Greedy(int64_t max_new_tokens) {
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.ignore_eos = true;
  return o;
}

// A Shadow service that takes main's Follow messages and never predicts: it keeps each stream open until main
// cancels it (as a shadow far behind main would) or Stop ends it, and every later one.
class HungShadow final : public v1::Shadow::Service {
 public:
  grpc::Status Follow(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream) override {
    v1::FollowMessage message;
    while (stream->Read(&message)) {
    }
    while (!context->IsCancelled() && !stop_.WaitForNotificationWithTimeout(absl::Milliseconds(10))) {
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "gave up");
  }
  void Stop() {  // from the test's thread only
    if (!stop_.HasBeenNotified()) stop_.Notify();
  }

 private:
  absl::Notification stop_;
};

// main + shadow + workers, in this process.
class ShadowCluster {
 public:
  absl::Status Start(const ShadowSpec& spec) {
    const std::string model = SharedModel(kModel);
    // Workers first (from a config with placeholder addresses: they need only their index), then the shadow
    // (which dials the workers), then main (which dials both).
    std::vector<std::string> placeholders;
    for (int i = 0; i < spec.workers; ++i) placeholders.push_back(StrCat("127.0.0.1:", 10 + i));
    ODMOE_ASSIGN_OR_RETURN(ClusterConfig view, Parse(spec, "127.0.0.1:1", "127.0.0.1:2", placeholders));
    std::vector<std::string> workers;
    for (int i = 0; i < spec.workers; ++i) {
      const NodeConfig& self = *view.workers()[static_cast<size_t>(i)];
      ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateDevice(self.device, self.gpu_budget_bytes));
      ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<WorkerNode> w, WorkerNode::Create(view, self, model, std::move(device)));
      ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::Server> s, rpc::Server::Start({"127.0.0.1:0", 4}, {w.get()}));
      s->MarkServing(true);
      workers.push_back(StrCat("127.0.0.1:", s->port()));
      workers_.push_back(std::move(w));
      servers_.push_back(std::move(s));
    }
    std::string shadow_address = StrCat("127.0.0.1:", testing::PickFreePorts(1)[0]);
    if (spec.hung_shadow) {
      hung_shadow_ = std::make_unique<HungShadow>();
      ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::Server> s,
                             rpc::Server::Start({"127.0.0.1:0", 4}, {hung_shadow_.get()}));
      s->MarkServing(true);
      shadow_address = StrCat("127.0.0.1:", s->port());
      servers_.push_back(std::move(s));
    } else if (spec.start_shadow) {
      ODMOE_ASSIGN_OR_RETURN(ClusterConfig sc, Parse(spec, "127.0.0.1:1", shadow_address, workers));
      ODMOE_ASSIGN_OR_RETURN(shadow_, ShadowNode::Create({sc, *sc.shadow(), model}));
      ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::Server> s, rpc::Server::Start({"127.0.0.1:0", 2}, {shadow_.get()}));
      s->MarkServing(true);
      shadow_address = StrCat("127.0.0.1:", s->port());
      servers_.push_back(std::move(s));
      shadow_endpoint_ = shadow_address;
    }
    ODMOE_ASSIGN_OR_RETURN(cluster_, Parse(spec, "127.0.0.1:1", shadow_address, workers));
    ODMOE_ASSIGN_OR_RETURN(main_, MainNode::Create({cluster_, *cluster_.main(), model}));
    ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::Server> s, rpc::Server::Start({"127.0.0.1:0", 2}, {main_.get()}));
    s->MarkServing(true);
    endpoint_ = StrCat("127.0.0.1:", s->port());
    servers_.push_back(std::move(s));
    return absl::OkStatus();
  }
  ~ShadowCluster() {
    if (hung_shadow_ != nullptr) hung_shadow_->Stop();
    for (auto it = servers_.rbegin(); it != servers_.rend(); ++it) (*it)->Shutdown(0);
  }

  absl::StatusOr<RemoteResult> Generate(const std::vector<int32_t>& prompt, const GenerateOptions& options) {
    v1::GenerateRequest r;
    r.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
    rpc::OptionsToProto(options, &r);
    return GenerateRemote(endpoint_, r, kTimeoutMs);
  }
  absl::StatusOr<RemoteResult> Generate(const std::vector<int32_t>& prompt, int64_t max_new_tokens) {
    return Generate(prompt, Greedy(max_new_tokens));
  }
  MainNode& main() { return *main_; }
  const std::string& endpoint() const { return endpoint_; }
  ShadowNode* shadow() { return shadow_.get(); }
  const std::string& shadow_endpoint() const { return shadow_endpoint_; }
  // With ShadowSpec::hung_shadow: its streams end now, with no prediction.
  void EndHungShadowStreams() { hung_shadow_->Stop(); }
  WorkerNode& worker(int i) { return *workers_[static_cast<size_t>(i)]; }
  const ClusterConfig& cluster() const { return cluster_; }

 private:
  static absl::StatusOr<ClusterConfig> Parse(const ShadowSpec& spec, const std::string& main_address,
                                             const std::string& shadow_address,
                                             const std::vector<std::string>& workers) {
    std::string t = StrCat("[cluster]\nname = \"shadowtest\"\nepoch = 3\ngroup_size = 2\nrpc_timeout_ms = 60000\n",
                           spec.cluster_extra, "\n[shadow]\n", spec.shadow_toml,
                           "\n[[node]]\nname = \"main\"\nrole = \"main\"\naddress = \"", main_address,
                           "\"\n[[node]]\nname = \"shadow\"\nrole = \"shadow\"\naddress = \"", shadow_address, "\"\n");
    for (size_t i = 0; i < workers.size(); ++i) {
      t += StrCat("[[node]]\nname = \"w", i, "\"\nrole = \"worker\"\naddress = \"", workers[i],
                  "\"\ndevice = \"mock-gpu\"\ngpu_budget_mb = 64\n");
    }
    return ParseClusterConfig(t, "shadow_test.toml", "/");
  }

  ClusterConfig cluster_;
  std::vector<std::unique_ptr<WorkerNode>> workers_;
  std::unique_ptr<ShadowNode> shadow_;
  std::unique_ptr<HungShadow> hung_shadow_;
  std::unique_ptr<MainNode> main_;
  std::vector<std::unique_ptr<rpc::Server>> servers_;
  std::string endpoint_;
  std::string shadow_endpoint_;
};

std::vector<std::vector<int32_t>> RecallPrompts(size_t count) {
  const std::string path = SharedModel(kModel) + "/recall_prompts.json";
  absl::StatusOr<Json> j = ParseJson(testing::ReadFile(path), path);
  EXPECT_TRUE(j.ok()) << j.status();
  std::vector<std::vector<int32_t>> out;
  for (const Json& p : (*j)["prompts"]) {
    if (out.size() == count) break;
    out.push_back(p.get<std::vector<int32_t>>());
  }
  return out;
}

std::vector<int32_t> LocalTokens(const std::vector<int32_t>& prompt, const GenerateOptions& options) {
  static std::unique_ptr<LocalModel> local = [] {
    auto m = LocalModel::Open(SharedModel(kModel), *CreateDevice("cpu"));
    EXPECT_TRUE(m.ok()) << m.status();
    return std::move(m).value();
  }();
  auto r = odmoe::Generate(local->engine(), prompt, options);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->tokens : std::vector<int32_t>{};
}
std::vector<int32_t> LocalTokens(const std::vector<int32_t>& prompt, int64_t max_new_tokens) {
  return LocalTokens(prompt, Greedy(max_new_tokens));
}

class ShadowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveSharedModel(kModel)) GTEST_SKIP() << "needs " << SharedModel(kModel);
  }
};

// Runs `prompts` through a cluster with the given [shadow] settings; checks the tokens against the engine and
// returns the recall over all of them (from main's cumulative stats, which must agree with the per-request ones).
struct RunFigures {
  double recall = 0, timely = 0;
  uint64_t missing = 0, tokens_aligned = 0, kv_aligned = 0, alignment_bytes = 0, requests = 0;
  uint64_t hedge_loads = 0, hedges_used = 0;  // summed over the requests' stats
  uint64_t worker_hedge_loads = 0;            // summed over the workers' counters
  bool within_budget = true;                  // every worker's peak within its budget
  v1::ShadowStats shadow;
  v1::MainStats main;
};
RunFigures RunPrompts(const std::string& shadow_toml, const std::vector<std::vector<int32_t>>& prompts,
                      int64_t max_new_tokens) {
  ShadowCluster c;
  const absl::Status started = c.Start({shadow_toml});
  EXPECT_TRUE(started.ok()) << started;
  RunFigures f;
  if (!started.ok()) return f;
  for (const std::vector<int32_t>& prompt : prompts) {
    absl::StatusOr<RemoteResult> r = c.Generate(prompt, max_new_tokens);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) continue;
    EXPECT_EQ(r->tokens, LocalTokens(prompt, max_new_tokens)) << "the shadow must never change main's tokens";
    const v1::RequestStats& s = r->stats;
    EXPECT_EQ(s.recall_per_token_size(), max_new_tokens - 1);
    f.tokens_aligned += s.tokens_aligned();
    f.kv_aligned += s.kv_aligned();
    f.alignment_bytes += s.alignment_bytes();
    f.missing += s.predictions_missing();
    f.hedge_loads += s.hedge_loads();
    f.hedges_used += s.hedges_used();
    ++f.requests;
  }
  for (int i = 0; i < 4; ++i) {
    const v1::WorkerStats w = c.worker(i).Stats(false);
    f.worker_hedge_loads += w.hedge_loads();
    f.within_budget = f.within_budget && w.memory().peak_bytes() <= c.worker(i).budget_bytes();
  }
  f.main = c.main().Stats(false);
  f.recall = f.main.recall();
  f.timely = f.main.timely_recall();
  if (c.shadow() != nullptr) f.shadow = c.shadow()->Stats(false);
  return f;
}

TEST_F(ShadowTest, FullPrecisionShadowPredictsEveryExpert) {
  // Unquantized, the replica computes exactly what main computes (same ops, same order): with token and KV
  // alignment every prediction is right, so recall is exactly 1.
  const RunFigures f = RunPrompts("quant = \"none\"\nalign_token = 1\nalign_kv = 1\n", RecallPrompts(2), 24);
  EXPECT_EQ(f.recall, 1.0);
  EXPECT_EQ(f.missing, 0u);
  EXPECT_GT(f.timely, 0.0);
  EXPECT_LE(f.timely, f.recall);
  EXPECT_EQ(f.shadow.predictions(), f.main.decode_layers());  // no roll back: one prediction per (position, layer)
  EXPECT_EQ(f.shadow.rollbacks(), 0u);
}

TEST_F(ShadowTest, ConcurrentRequestsAreEachPredictedInOneBatch) {
  // Continuous batching: four requests of different prompts and lengths run at once. The shadow follows each of
  // them, runs them together (its decode forwards carry several rows) and prefetches the union of their experts
  // per step and layer; unquantized and aligned every step, each request's own predictions are all right.
  ShadowCluster c;
  ASSERT_TRUE(c.Start({"quant = \"none\"\nalign_token = 1\nalign_kv = 1\n"}).ok());
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts(4);
  const std::vector<int64_t> lengths = {24, 17, 30, 12};
  std::vector<absl::StatusOr<RemoteResult>> results(prompts.size(), absl::UnknownError("not run"));
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] { results[i] = c.Generate(prompts[i], lengths[i]); });
  }
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << "request " << i << ": " << results[i].status();
    EXPECT_EQ(results[i]->tokens, LocalTokens(prompts[i], lengths[i])) << "request " << i;
    const v1::RequestStats& s = results[i]->stats;
    EXPECT_EQ(s.recall_per_token_size(), lengths[i] - 1) << "request " << i;
    EXPECT_EQ(s.recall(), 1.0) << "request " << i;
    EXPECT_EQ(s.predictions_missing(), 0u) << "request " << i;
    EXPECT_EQ(s.tokens_aligned(), static_cast<uint64_t>(lengths[i] - 1)) << "request " << i;
  }
  const v1::MainStats main = c.main().Stats(false);
  const v1::ShadowStats shadow = c.shadow()->Stats(false);
  std::cout << "[4 concurrent requests] main: " << main.decode_rows() << " rows in " << main.decode_steps()
            << " decode steps; shadow: " << shadow.batch_rows() << " rows in " << shadow.batch_forwards()
            << " forwards; recall " << main.recall() << ", timely " << main.timely_recall() << "\n";
  EXPECT_GT(main.decode_rows(), main.decode_steps()) << "the requests never decoded together";
  EXPECT_EQ(shadow.requests(), prompts.size());
  EXPECT_GT(shadow.batch_rows(), shadow.batch_forwards()) << "the shadow never ran two requests together";
  EXPECT_EQ(shadow.positions_decoded(), shadow.batch_rows());
  EXPECT_EQ(shadow.rollbacks(), 0u);
  // Whether any prediction came in time is a matter of speed: four requests on a sanitizer build of a loaded
  // machine can leave the shadow late for every layer (ASan in CI, once). Asserted on the plain build.
  if (kBuildSlowdown == 1) {
    EXPECT_GT(main.timely_recall(), 0.0);
  }
}

TEST_F(ShadowTest, EarlyDepartureRunsAheadOnItsGuessAndRollsBackOnAMiss) {
  // With early_departure the shadow does not wait for main's token at a due position: it runs its own guess and
  // rolls back where main's token differs (an INT8 replica's guesses miss now and then). Tokens never change
  // (RunPrompts checks them); the predictions of the positions it guessed right stand, those it re-ran are
  // re-sent.
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts(3);
  const RunFigures late = RunPrompts("quant = \"int8\"\nalign_token = 1\nalign_kv = 1\n", prompts, 32);
  const RunFigures early =
      RunPrompts("quant = \"int8\"\nalign_token = 1\nalign_kv = 1\nearly_departure = true\n", prompts, 32);
  std::cout << "[INT8, T1 KV1, 3 prompts x 31 steps] late departure: recall " << late.recall << ", timely "
            << late.timely << ", rollbacks " << late.shadow.rollbacks() << "; early: recall " << early.recall
            << ", timely " << early.timely << ", rollbacks " << early.shadow.rollbacks() << "\n";
  EXPECT_EQ(late.shadow.rollbacks(), 0u);  // it always waited for the token
  // How often the guess ran before main's token came depends on timing (a slow shadow finds the token there):
  // each decode position goes through the replica once, plus once per rollback (run, or taken on main's K/V
  // by a shadow that fell far behind).
  EXPECT_EQ(early.shadow.positions_decoded() + early.shadow.positions_adopted(),
            late.shadow.positions_decoded() + late.shadow.positions_adopted() + early.shadow.rollbacks());
  EXPECT_GT(early.recall, 0.9);
  EXPECT_EQ(early.missing, 0u);
}

TEST_F(ShadowTest, AnUnalignedShadowReplaysMainsPicksOfASampledPenalizedRequest) {
  // With no alignment the shadow runs on its own guesses from the prompt on. Unquantized, its logits are main's,
  // and it picks each guess by main's rule for the request (FollowStart.pick: the seeded draws, penalties and
  // bias), so it runs main's very tokens and every prediction is right. A greedy guess would leave the request's
  // path at the first token main drew other than the likeliest.
  ShadowCluster c;
  ASSERT_TRUE(c.Start({"quant = \"none\"\nalign_token = 0\nalign_kv = 0\n"}).ok());
  GenerateOptions o = Greedy(24);
  o.sampling.temperature = 1.0;
  o.sampling.top_p = 0.95;
  o.sampling.repetition_penalty = 1.2;
  o.sampling.frequency_penalty = 0.5;
  o.sampling.logit_bias = {{262, -2.0}};
  for (const std::vector<int32_t>& prompt : RecallPrompts(2)) {
    o.sampling.seed += 7;
    absl::StatusOr<RemoteResult> r = c.Generate(prompt, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens, LocalTokens(prompt, o)) << "the shadow must never change main's tokens";
    EXPECT_NE(r->tokens, LocalTokens(prompt, o.max_new_tokens)) << "the request never left the greedy path";
    EXPECT_EQ(r->stats.recall(), 1.0);
    EXPECT_EQ(r->stats.predictions_missing(), 0u);
    EXPECT_EQ(r->stats.tokens_aligned(), 0u);
  }
  EXPECT_EQ(c.shadow()->Stats(false).rollbacks(), 0u);
}

TEST_F(ShadowTest, AnUnalignedShadowHoldsItsGuessesToTheRequestsGrammar) {
  // Structured output: the shadow has the model's tokens too and bans what main bans (FollowStart.pick carries
  // the constraint), so an unquantized replica with no alignment still runs main's very tokens. A shadow that
  // guessed without the grammar would leave the request's path where the model would rather not write JSON.
  ShadowCluster c;
  ASSERT_TRUE(c.Start({"quant = \"none\"\nalign_token = 0\nalign_kv = 0\n"}).ok());
  auto tokenizer = Tokenizer::Load(SharedModel(kModel));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  GenerateOptions o = Greedy(24);
  o.ignore_eos = false;  // an answer held to a grammar stops where it ends
  o.sampling.temperature = 0.9;
  o.constraint.kind = OutputConstraint::Kind::kJsonObject;
  auto config = LoadModelConfig(SharedModel(kModel));
  ASSERT_TRUE(config.ok()) << config.status();
  o.vocabulary = TokenVocabulary::FromTokenizer(**tokenizer, config->vocab_size);
  for (const std::vector<int32_t>& prompt : RecallPrompts(2)) {
    o.sampling.seed += 3;
    absl::StatusOr<RemoteResult> r = c.Generate(prompt, o);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<int32_t> local = LocalTokens(prompt, o);
    EXPECT_EQ(r->tokens, local) << "the shadow must never change main's tokens";
    std::string text;
    for (const int32_t id : local) text += o.vocabulary->bytes(id);
    EXPECT_NE(text.find('{'), std::string::npos) << "the request's answer never reached its object: " << text;
    EXPECT_EQ(r->stats.recall(), 1.0);
    EXPECT_EQ(r->stats.predictions_missing(), 0u);
  }
  EXPECT_EQ(c.shadow()->Stats(false).rollbacks(), 0u);
}

TEST_F(ShadowTest, APickRuleMainWouldRefuseIsRefusedNamingTheField) {
  ShadowCluster c;
  ASSERT_TRUE(c.Start({"quant = \"none\"\n"}).ok());
  const auto stub = v1::Shadow::NewStub(rpc::MakeChannel(c.shadow_endpoint()));
  grpc::ClientContext context;
  const auto stream = stub->Follow(&context);
  v1::FollowMessage start;
  rpc::FillHeader(start.mutable_start()->mutable_header(), c.cluster().epoch, c.shadow()->fingerprint(), "main", 9);
  start.mutable_start()->add_prompt_ids(1);
  start.mutable_start()->set_max_new_tokens(4);
  start.mutable_start()->set_max_lead_tokens(1);
  start.mutable_start()->mutable_pick()->mutable_sampling()->set_temperature(-1);
  EXPECT_TRUE(stream->Write(start));
  stream->WritesDone();
  const grpc::Status refused = stream->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("FollowStart.pick: "), std::string::npos) << refused.error_message();
  EXPECT_NE(refused.error_message().find("temperature"), std::string::npos) << refused.error_message();
}

TEST_F(ShadowTest, QuantizationMovesRecall) {
  // Recall comes from the replica's real predictions: a coarser quantization predicts worse. Without
  // alignment the replica drifts on its own tokens, so the differences show within a few prompts.
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts(3);
  const RunFigures fp16 = RunPrompts("quant = \"fp16\"\nalign_token = 1\nalign_kv = 1\n", prompts, 32);
  const RunFigures int8 = RunPrompts("quant = \"int8\"\nalign_token = 1\nalign_kv = 1\n", prompts, 32);
  const RunFigures nf4 = RunPrompts("quant = \"nf4\"\nalign_token = 1\nalign_kv = 1\n", prompts, 32);
  std::cout << "[recall T1 KV1, 3 prompts x 31 steps] fp16 " << fp16.recall << " int8 " << int8.recall << " nf4 "
            << nf4.recall << "\n";
  EXPECT_GT(fp16.recall, 0.97);
  EXPECT_GT(int8.recall, 0.9);
  EXPECT_GT(nf4.recall, 0.8);
  EXPECT_LT(nf4.recall, fp16.recall);
  EXPECT_NE(nf4.recall, int8.recall);
  EXPECT_EQ(std::string(fp16.shadow.quant()), "fp16");
  EXPECT_EQ(std::string(nf4.shadow.quant()), "nf4");
}

TEST_F(ShadowTest, AlignmentPeriodsSendExactlyWhatTheySay) {
  const int64_t n =
      20;  // steps i = 0..18 feed a position; the token is sent when i % T_tok == 0, KV when i % T_kv == 0
  const RunFigures f = RunPrompts("quant = \"int8\"\nalign_token = 3\nalign_kv = 4\n", RecallPrompts(1), n);
  auto count = [&](int64_t period) { return static_cast<uint64_t>((n - 2) / period + 1); };
  EXPECT_EQ(f.tokens_aligned, count(3));
  EXPECT_EQ(f.kv_aligned, count(4));
  auto config = LoadModelConfig(SharedModel(kModel));
  ASSERT_TRUE(config.ok());
  const uint64_t kv_bytes = 2 * static_cast<uint64_t>(config->num_layers * config->kv_size()) * sizeof(float);
  // KV alignment also sends the prompt's K/V once (all but its last position, which the first step carries).
  const uint64_t prompt_kv = (RecallPrompts(1)[0].size() - 1) * kv_bytes;
  EXPECT_EQ(f.alignment_bytes, count(4) * kv_bytes + prompt_kv);
  // The shadow received the same.
  EXPECT_EQ(f.shadow.tokens_aligned(), count(3));
  EXPECT_EQ(f.shadow.kv_aligned(), count(4));
  EXPECT_EQ(f.shadow.alignment_bytes(), count(4) * kv_bytes + prompt_kv);
  EXPECT_GT(f.recall, 0.5);

  // No alignment at all: nothing is sent but the steps (positions), and the shadow runs on its own tokens.
  const RunFigures none = RunPrompts("quant = \"int8\"\nalign_token = 0\nalign_kv = 0\n", RecallPrompts(1), n);
  EXPECT_EQ(none.tokens_aligned, 0u);
  EXPECT_EQ(none.kv_aligned, 0u);
  EXPECT_EQ(none.shadow.tokens_aligned(), 0u);
  EXPECT_EQ(none.shadow.rollbacks(), 0u);
  EXPECT_GT(none.recall, 0.0);
}

// The test as main, on one Follow stream to the shadow: main's tokens and K/V of one request (from the engine),
// sent as main sends them (token and KV alignment every step). Collects the shadow's last prediction per
// (position, layer).
class FollowAsMain {
 public:
  // `align`: the periods FollowStart gives (T_tok = T_kv); every step carries its token and K/V regardless, as
  // main's steps do while the shadow is catch_up_lag behind (ShadowLink::AlignmentDue).
  FollowAsMain(const std::string& shadow, const ClusterConfig& cluster, const std::string& fingerprint,
               const std::vector<int32_t>& prompt, int64_t max_new_tokens, int64_t align = 1)
      : stub_(v1::Shadow::NewStub(rpc::MakeChannel(shadow))), prompt_(prompt), max_new_tokens_(max_new_tokens) {
    // Main's run: the tokens fed at each decode position and the K/V of every position.
    auto local = LocalModel::Open(SharedModel(kModel), *CreateDevice("cpu"));
    EXPECT_TRUE(local.ok()) << local.status();
    auto r = odmoe::Generate((*local)->engine(), prompt, Greedy(max_new_tokens));
    EXPECT_TRUE(r.ok()) << r.status();
    tokens_ = r->tokens;
    const ModelConfig& c = (*local)->engine().config();
    row_ = static_cast<size_t>(c.num_layers * c.kv_size());
    const int64_t positions = prompt_len() + max_new_tokens - 1;  // the last token is never fed back
    k_.resize(row_ * static_cast<size_t>(positions));
    v_.resize(k_.size());
    for (int64_t p = 0; p < positions; ++p) {
      const absl::Status read = (*local)->engine().ReadKv(p, k_.data() + p * row_, v_.data() + p * row_);
      EXPECT_TRUE(read.ok()) << read;
    }
    stream_ = stub_->Follow(&context_);
    v1::FollowMessage start;
    rpc::FillHeader(start.mutable_start()->mutable_header(), cluster.epoch, fingerprint, "main", 1);
    start.mutable_start()->mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
    start.mutable_start()->set_max_new_tokens(max_new_tokens);
    start.mutable_start()->set_align_token(align);
    start.mutable_start()->set_align_kv(align);
    start.mutable_start()->set_max_lead_tokens(1);
    EXPECT_TRUE(stream_->Write(start));
    v1::FollowMessage kv;  // the prompt's K/V but its last position's, which the first step carries
    kv.mutable_kv()->set_first_position(0);
    const int64_t shape[] = {prompt_len() - 1, c.num_layers, c.kv_size()};
    const size_t n = row_ * static_cast<size_t>(prompt_len() - 1);
    rpc::EncodeF32(std::span<const float>(k_.data(), n), shape, kv.mutable_kv()->mutable_k());
    rpc::EncodeF32(std::span<const float>(v_.data(), n), shape, kv.mutable_kv()->mutable_v());
    EXPECT_TRUE(stream_->Write(kv));
    num_layers_ = c.num_layers;
    kv_size_ = c.kv_size();
  }

  int64_t prompt_len() const { return static_cast<int64_t>(prompt_.size()); }
  int64_t last() const { return LastDecodePosition(prompt_len(), max_new_tokens_); }

  // Main starts decoding `p`: its token there and the K/V of p - 1.
  void Step(int64_t p) {
    v1::FollowMessage m;
    v1::FollowStep* step = m.mutable_step();
    step->set_position(p);
    step->set_batch_step(p - prompt_len() + 1);
    step->set_has_token(true);
    step->set_token(tokens_[static_cast<size_t>(p - prompt_len())]);
    const int64_t shape[] = {num_layers_, kv_size_};
    const size_t at = row_ * static_cast<size_t>(p - 1);
    rpc::EncodeF32(std::span<const float>(k_.data() + at, row_), shape, step->mutable_k());
    rpc::EncodeF32(std::span<const float>(v_.data() + at, row_), shape, step->mutable_v());
    EXPECT_TRUE(stream_->Write(m));
  }
  // Reads predictions until one for (position, layer) has come; false when the stream ended first.
  bool ReadUntil(int64_t position, int32_t layer) {
    v1::Prediction p;
    while (stream_->Read(&p)) {
      if (p.summary()) continue;
      predictions_[{p.position(), p.layer()}] = std::vector<int32_t>(p.experts().begin(), p.experts().end());
      if (p.position() == position && p.layer() == layer) return true;
    }
    return false;
  }
  // Closes main's side and reads the rest.
  absl::Status End() {
    stream_->WritesDone();
    ReadUntil(-1, -1);
    return rpc::FromGrpc(stream_->Finish(), "the shadow's stream");
  }
  const std::map<std::pair<int64_t, int32_t>, std::vector<int32_t>>& predictions() const { return predictions_; }

 private:
  std::unique_ptr<v1::Shadow::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::FollowMessage, v1::Prediction>> stream_;
  std::vector<int32_t> prompt_, tokens_;
  int64_t max_new_tokens_;
  size_t row_ = 0;
  int64_t num_layers_ = 0, kv_size_ = 0;
  std::vector<float> k_, v_;
  std::map<std::pair<int64_t, int32_t>, std::vector<int32_t>> predictions_;
};

// A shadow that has fallen far behind main catches up: the positions main has left behind, whose tokens and K/V
// have come, it takes on main's K/V instead of running them, and predicts main's position as it does having run
// every position in step with main (with KV alignment, its cache holds main's K/V either way). Main sends them
// at every step while the shadow is that far behind, whatever the alignment periods: the behind request's are 4.
TEST_F(ShadowTest, ABehindShadowTakesMainsKvForThePositionsMainHasLeftAndPredictsTheSame) {
  ShadowCluster c;
  const absl::Status started = c.Start({"align_token = 1\nalign_kv = 1\ncatch_up_lag = 8\n"});
  ASSERT_TRUE(started.ok()) << started;
  const std::vector<int32_t> prompt = RecallPrompts(1)[0];
  constexpr int64_t kNew = 16;  // main 14 positions ahead in the second run: over catch_up_lag
  const int32_t last_layer = static_cast<int32_t>(c.main().config().SparseLayers().back());

  // In step: each position sent once the shadow has predicted the one before, as a shadow keeping up sees them.
  FollowAsMain in_step(c.shadow_endpoint(), c.cluster(), c.shadow()->fingerprint(), prompt, kNew);
  for (int64_t p = in_step.prompt_len(); p <= in_step.last(); ++p) {
    in_step.Step(p);
    ASSERT_TRUE(in_step.ReadUntil(p, last_layer)) << "position " << p;
  }
  ASSERT_TRUE(in_step.End().ok());
  const v1::ShadowStats kept_up = c.shadow()->Stats(/*reset=*/true);
  EXPECT_EQ(kept_up.positions_decoded(), static_cast<uint64_t>(kNew - 1));
  EXPECT_EQ(kept_up.positions_adopted(), 0u);

  // Behind: main is at its last position before the shadow can run its first (the steps come last first, and
  // the first position waits for main's token).
  FollowAsMain behind(c.shadow_endpoint(), c.cluster(), c.shadow()->fingerprint(), prompt, kNew, /*align=*/4);
  for (int64_t p = behind.last(); p >= behind.prompt_len(); --p) behind.Step(p);
  ASSERT_TRUE(behind.End().ok());
  const v1::ShadowStats caught_up = c.shadow()->Stats(/*reset=*/true);
  EXPECT_EQ(caught_up.positions_adopted(), static_cast<uint64_t>(kNew - 2));
  EXPECT_EQ(caught_up.positions_decoded(), 1u);
  // Its predictions: main's position only, each layer the same as the in-step shadow's.
  const int64_t last = behind.last();
  int64_t compared = 0;
  for (const auto& [key, experts] : behind.predictions()) {
    EXPECT_EQ(key.first, last) << "a prediction for a position main had left behind";
    auto it = in_step.predictions().find(key);
    ASSERT_NE(it, in_step.predictions().end());
    EXPECT_EQ(experts, it->second) << "layer " << key.second;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(c.main().config().SparseLayers().size()));
}

TEST_F(ShadowTest, WithoutTheShadowRequestsStillSucceed) {
  // The shadow's address has nothing behind it: main decodes without predictions (load after routing).
  ShadowCluster c;
  ShadowSpec spec{"quant = \"int8\"\n", /*start_shadow=*/false};
  ASSERT_TRUE(c.Start(spec).ok());
  const std::vector<int32_t> prompt = RecallPrompts(1)[0];
  absl::StatusOr<RemoteResult> r = c.Generate(prompt, 8);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, LocalTokens(prompt, 8));
  EXPECT_EQ(r->stats.recall(), 0.0);
  EXPECT_EQ(r->stats.predictions_received(), 0u);
  EXPECT_EQ(r->stats.predictions_missing(), static_cast<uint64_t>(7 * c.main().config().SparseLayers().size()));
}

// A request that has its tokens waits a while for the shadow's last predictions (they count for its recall), but
// the next request in the queue runs meanwhile: the running place is given back as the batch loop lets the request
// go. (It was held through the wait, so a shadow that lagged held up every request behind each one by 2 s.)
TEST_F(ShadowTest, TheNextRequestRunsWhileOneWaitsForTheShadowsLastPredictions) {
  ShadowCluster c;
  // A's wait for the hung shadow ends when the test ends its streams, once B has its first token (or after a
  // minute, when B's token does not come while A waits): the order below does not hang on how fast B's prefill
  // is (under TSan it has taken longer than the default wait).
  ShadowSpec spec{"quant = \"int8\"\nfinish_wait_ms = 600000\n"};
  spec.hung_shadow = true;
  spec.cluster_extra = "max_running = 1\nmax_queued = 1";
  ASSERT_TRUE(c.Start(spec).ok());
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts(2);
  absl::Mutex mu;
  std::vector<std::string> events;  // in the order the clients saw them
  auto generate = [&](const std::string& name, const std::vector<int32_t>& prompt) {
    v1::GenerateRequest r;
    r.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
    r.set_max_new_tokens(3);
    r.set_ignore_eos(true);
    bool first = true;
    absl::StatusOr<RemoteResult> result =
        GenerateRemote(c.endpoint(), r, kTimeoutMs, [&](const v1::GenerateResponse& m) {
          if (m.tokens_size() == 0 || !first) return;
          first = false;
          absl::MutexLock lock(&mu);
          events.push_back(name + " token");
        });
    absl::MutexLock lock(&mu);
    events.push_back(name + " answered");
    return result;
  };
  absl::StatusOr<RemoteResult> a = absl::UnknownError("not run"), b = absl::UnknownError("not run");
  std::thread first([&] { a = generate("A", prompts[0]); });
  {
    absl::MutexLock lock(&mu);  // B arrives while A runs: it queues behind it
    auto a_runs = [&events]() { return !events.empty(); };
    mu.Await(absl::Condition(&a_runs));
  }
  std::thread second([&] { b = generate("B", prompts[1]); });
  {
    absl::MutexLock lock(&mu);
    auto b_has_a_token = [&events]() { return std::ranges::find(events, "B token") != events.end(); };
    mu.AwaitWithTimeout(absl::Condition(&b_has_a_token), absl::Minutes(1));
  }
  c.EndHungShadowStreams();
  first.join();
  second.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->tokens, LocalTokens(prompts[0], 3));
  EXPECT_EQ(b->tokens, LocalTokens(prompts[1], 3));
  // A's link was up (it aligned the shadow) and no prediction came back.
  EXPECT_GT(a->stats.tokens_aligned(), 0u);
  EXPECT_EQ(a->stats.predictions_received(), 0u);
  EXPECT_EQ(events, (std::vector<std::string>{"A token", "B token", "A answered", "B answered"}));
}

TEST_F(ShadowTest, RandomPredictionHitsAboutKOfE) {
  // Ablation case 5: main predicts k random experts of E per layer and prefetches them; recall is near k/E.
  ShadowCluster c;
  ASSERT_TRUE(c.Start({"mode = \"random\"\n"}).ok());
  ASSERT_EQ(c.shadow()->has_replica(), false);  // no shadow prediction: the replica is not loaded
  const std::vector<int32_t> prompt = RecallPrompts(1)[0];
  absl::StatusOr<RemoteResult> r = c.Generate(prompt, 32);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, LocalTokens(prompt, 32));
  const ModelConfig& config = c.main().config();
  const double expected = static_cast<double>(config.top_k) / static_cast<double>(config.num_experts);
  EXPECT_NEAR(r->stats.recall(), expected, 0.1);
  EXPECT_EQ(r->stats.prediction(), "random");
  EXPECT_EQ(r->stats.predictions_missing(), 0u);
}

TEST(SyntheticClusterTest, EveryNodeGeneratesItsOwnWeightsAndTokensMatchTheEngine) {
  // [model] synthetic: main generates the non-expert tensors, each worker its experts, the shadow all of them
  // (quantized); nobody reads a checkpoint, and the tokens are the single-process engine's on the same spec.
  const std::string config = testing::SourceDir() + "/tests/data/tiny-mixtral/config.json";
  const SyntheticSpec spec{config, 3, 11};
  auto toml = [&](const std::string& shadow, const std::vector<std::string>& workers) {
    std::string t = StrCat("[cluster]\nname = \"synth\"\nepoch = 2\ngroup_size = 2\nshare_host_experts = false\n",
                           "[model]\nsynthetic = \"", config, "\"\nlayers = 3\nseed = 11\n[shadow]\nquant = \"int8\"\n",
                           "[[node]]\nname = \"main\"\nrole = \"main\"\naddress = \"127.0.0.1:1\"\n",
                           "[[node]]\nname = \"shadow\"\nrole = \"shadow\"\naddress = \"", shadow, "\"\n");
    for (size_t i = 0; i < workers.size(); ++i) {
      t += StrCat("[[node]]\nname = \"w", i, "\"\nrole = \"worker\"\naddress = \"", workers[i],
                  "\"\ndevice = \"mock-gpu\"\ngpu_budget_mb = 16\n");
    }
    auto c = ParseClusterConfig(t, "synth.toml", "/");
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  };
  std::vector<std::unique_ptr<rpc::Server>> servers;
  std::vector<std::unique_ptr<WorkerNode>> workers;
  std::vector<std::string> addresses;
  const ClusterConfig view = toml("127.0.0.1:2", {"127.0.0.1:10", "127.0.0.1:11"});
  for (int i = 0; i < 2; ++i) {
    const NodeConfig& self = *view.workers()[static_cast<size_t>(i)];
    auto w = WorkerNode::Create(view, self, "", *CreateDevice(self.device, self.gpu_budget_bytes));
    ASSERT_TRUE(w.ok()) << w.status();
    auto s = rpc::Server::Start({"127.0.0.1:0", 4}, {w->get()});
    ASSERT_TRUE(s.ok());
    (*s)->MarkServing(true);
    addresses.push_back(StrCat("127.0.0.1:", (*s)->port()));
    workers.push_back(std::move(w).value());
    servers.push_back(std::move(s).value());
  }
  const ClusterConfig shadow_view = toml("127.0.0.1:2", addresses);
  auto shadow = ShadowNode::Create({shadow_view, *shadow_view.shadow(), ""});
  ASSERT_TRUE(shadow.ok()) << shadow.status();
  auto shadow_server = rpc::Server::Start({"127.0.0.1:0", 2}, {shadow->get()});
  ASSERT_TRUE(shadow_server.ok());
  (*shadow_server)->MarkServing(true);
  const ClusterConfig full = toml(StrCat("127.0.0.1:", (*shadow_server)->port()), addresses);
  auto main = MainNode::Create({full, *full.main(), ""});
  ASSERT_TRUE(main.ok()) << main.status();
  EXPECT_FALSE((*main)->has_tokenizer());
  EXPECT_EQ((*main)->fingerprint(), workers[0]->fingerprint());
  EXPECT_EQ((*main)->fingerprint(), (*shadow)->fingerprint());
  auto main_server = rpc::Server::Start({"127.0.0.1:0", 2}, {main->get()});
  ASSERT_TRUE(main_server.ok());
  (*main_server)->MarkServing(true);

  auto local = LocalModel::OpenSynthetic(spec, *CreateDevice("cpu"));
  ASSERT_TRUE(local.ok()) << local.status();
  const std::vector<int32_t> prompt = {1, 17, 40, 3, 99, 42};
  GenerateOptions o;
  o.max_new_tokens = 12;
  o.ignore_eos = true;
  auto expected = odmoe::Generate((*local)->engine(), prompt, o);
  ASSERT_TRUE(expected.ok());
  v1::GenerateRequest r;
  r.mutable_prompt_ids()->Add(prompt.begin(), prompt.end());
  r.set_max_new_tokens(12);
  r.set_ignore_eos(true);
  auto got = GenerateRemote(StrCat("127.0.0.1:", (*main_server)->port()), r, kTimeoutMs);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tokens, expected->tokens);
  EXPECT_GT(got->stats.recall(), 0.5);  // the INT8 replica of synthetic weights predicts too
  (*main_server)->Shutdown(0);
  (*shadow_server)->Shutdown(0);
  for (auto& s : servers) s->Shutdown(0);
}

// OD-MoE's six ablation cases (section 4.2): whatever predicts, main's tokens are the single-process engine's.
class AblationCaseTest : public ShadowTest, public ::testing::WithParamInterface<int> {};

TEST_P(AblationCaseTest, TokensIdenticalToTheSingleProcessEngine) {
  ShadowSettings settings;
  ASSERT_TRUE(ApplyAblationCase(GetParam(), &settings).ok());
  const std::string toml =
      StrCat("mode = \"", PredictionModeName(settings.mode),
             "\"\nquant = \"int8\"\nalign_token = ", settings.align_token, "\nalign_kv = ", settings.align_kv, "\n");
  ShadowCluster c;
  const absl::Status started = c.Start({toml});
  ASSERT_TRUE(started.ok()) << started;
  const int64_t n = 24;
  for (const std::vector<int32_t>& prompt : RecallPrompts(2)) {
    absl::StatusOr<RemoteResult> r = c.Generate(prompt, n);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens, LocalTokens(prompt, n)) << "case " << GetParam();
    const v1::RequestStats& st = r->stats;
    EXPECT_EQ(st.prediction(), std::string(PredictionModeName(settings.mode)));
    if (GetParam() == 6) {
      EXPECT_EQ(st.predictions_received(), 0u);
      EXPECT_EQ(st.recall(), 0.0);
    } else {
      EXPECT_GT(st.recall(), 0.0);
    }
    // Alignment traffic follows the case: token alignment in 1 and 2, KV in 1 and 3, none otherwise.
    EXPECT_EQ(st.tokens_aligned() > 0, GetParam() == 1 || GetParam() == 2);
    EXPECT_EQ(st.kv_aligned() > 0, GetParam() == 1 || GetParam() == 3);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AblationCaseTest, ::testing::Values(1, 2, 3, 4, 5, 6),
                         [](const auto& p) { return StrCat("case", p.param); });

TEST_F(ShadowTest, HedgingLoadsTheRunnerUpWithoutChangingTokens) {
  // An NF4 replica without alignment drifts, and a wide margin hedges often: the workers load the hedges (counted
  // apart, and equal to what each request's stats report), main's tokens stay the engine's, every worker stays
  // within its budget, and a hedge that turns out used counts for recall.
  const std::vector<std::vector<int32_t>> prompts = RecallPrompts(2);
  const RunFigures off = RunPrompts("quant = \"nf4\"\nalign_token = 0\nalign_kv = 0\n", prompts, 24);
  const RunFigures on = RunPrompts("quant = \"nf4\"\nalign_token = 0\nalign_kv = 0\nhedge_margin = 0.2\n", prompts, 24);
  EXPECT_EQ(off.hedge_loads, 0u);
  EXPECT_EQ(off.worker_hedge_loads, 0u);
  // The shadow hedges; how many of those the workers load depends on timing (a prefetch that arrives after
  // main's call for its layer is late and loads nothing: under a sanitizer on two cores the shadow can lag main
  // all along), so the loads are checked for agreement, not for a count.
  EXPECT_GT(on.shadow.hedges(), 0u);
  EXPECT_EQ(on.hedge_loads, on.worker_hedge_loads);
  EXPECT_EQ(on.main.hedge_loads(), on.hedge_loads);
  EXPECT_EQ(on.main.hedges_used(), on.hedges_used);
  EXPECT_GE(on.shadow.hedges(), on.hedge_loads);
  EXPECT_EQ(on.shadow.hedge_loads(), on.hedge_loads);
  EXPECT_TRUE(off.within_budget);
  EXPECT_TRUE(on.within_budget);
  // The same replica predicts the same top-k: hedges only add.
  EXPECT_GE(on.recall, off.recall);
  EXPECT_GT(on.hedges_used, 0u);
}

}  // namespace
}  // namespace odmoe
