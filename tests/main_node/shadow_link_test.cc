// ShadowLink against a fake shadow on loopback that stops reading its stream (a slow or stalled link): main's
// calls (Start, Step, SendKv, RoomForKv) never wait on it, the K/V queued for it stays bounded while K/V
// alignment pauses, every step still reaches the shadow in order once it reads again, and Finish gives up on a
// stalled shadow after its wait. And the alignment due at each step, against a shadow keeping up and one far
// behind.
#include "src/main_node/shadow_link.h"

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "odmoe/v1/shadow.grpc.pb.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

// Reads FollowStart, then reads nothing more until released; then records what arrives.
class StalledShadow final : public v1::Shadow::Service {
 public:
  grpc::Status Follow(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream) override {
    v1::FollowMessage m;
    if (!stream->Read(&m) || !m.has_start()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no start");
    started_.Notify();
    released_.WaitForNotification();
    while (stream->Read(&m)) {
      absl::MutexLock lock(&mu_);
      if (m.has_kv()) kv_positions_ += m.kv().k().shape(0);
      if (!m.has_step()) continue;
      positions_.push_back(m.step().position());
      kv_steps_ += m.step().has_k() ? 1 : 0;
    }
    return grpc::Status::OK;
  }

  void WaitStarted() { started_.WaitForNotification(); }
  void Release() {
    if (!released_.HasBeenNotified()) released_.Notify();
  }
  std::vector<int64_t> positions() const {
    absl::MutexLock lock(&mu_);
    return positions_;
  }
  int64_t kv_steps() const {
    absl::MutexLock lock(&mu_);
    return kv_steps_;
  }
  int64_t kv_positions() const {
    absl::MutexLock lock(&mu_);
    return kv_positions_;
  }

 private:
  absl::Notification started_, released_;
  mutable absl::Mutex mu_;
  std::vector<int64_t> positions_ ABSL_GUARDED_BY(mu_);
  int64_t kv_steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t kv_positions_ ABSL_GUARDED_BY(mu_) = 0;
};

// Mixtral-8x7B's K/V shape: 32 layers x 8 kv heads x 128, 256 KiB of K and V per position.
ModelConfig MixtralShape() {
  ModelConfig c;
  c.vocab_size = 32000;
  c.hidden_size = 4096;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.num_experts = 8;
  c.top_k = 2;
  return c;
}

GenerateOptions Options(int64_t max_new_tokens) {
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  return o;
}

class ShadowLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = rpc::Server::Start({"127.0.0.1:0", 2}, {&shadow_});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    channel_ = rpc::MakeChannel(StrCat("127.0.0.1:", server_->port()));
  }
  void TearDown() override {
    shadow_.Release();  // its handler must return before the server shuts down
    if (server_ != nullptr) server_->Shutdown(0);
  }

  // Runs `body` on a thread and waits up to a minute for it: a call that blocks on the stalled shadow shows as
  // a failure (the shadow is then released so that the thread ends), not as a hung test.
  void ExpectReturnsWhileStalled(const std::function<void()>& body) {
    absl::Notification done;
    std::thread t([&] {
      body();
      done.Notify();
    });
    const bool returned = done.WaitForNotificationWithTimeout(absl::Seconds(60));
    EXPECT_TRUE(returned) << "main's call waited on a shadow that does not read its stream";
    shadow_.Release();
    t.join();
  }

  const ModelConfig config_ = MixtralShape();
  StalledShadow shadow_;
  std::unique_ptr<rpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(ShadowLinkTest, AStalledShadowNeverHoldsUpMainAndItsKvBacklogStaysBounded) {
  constexpr int64_t kPrompt = 64, kSteps = 400;
  const size_t row = static_cast<size_t>(config_.num_layers * config_.kv_size());
  const int64_t step_kv_bytes = static_cast<int64_t>(2 * row * sizeof(float));  // 256 KiB
  testing::CapturedLog log;                                                     // before the link, whose threads log
  ShadowLinkOptions options;
  options.max_pending_kv_bytes = 4 << 20;
  ShadowLink link(channel_, config_, options);
  PredictionBoard board;
  ShadowSettings settings;
  settings.align_kv = 1;
  std::vector<int32_t> prompt(kPrompt, 7);
  std::vector<float> k(row, 0.5f), v(row, -0.5f);
  int64_t kv_sent = 0;
  ExpectReturnsWhileStalled([&] {
    ASSERT_TRUE(link.Start(1, "req-1", prompt, Options(kSteps), settings, &board));
    shadow_.WaitStarted();
    // The prompt's K/V (16 MiB, over the bound) goes whole: the queue holds no K/V yet.
    ASSERT_TRUE(link.RoomForKv());
    link.SendKv(0, kPrompt - 1, std::vector<float>(row * (kPrompt - 1), 1.0f),
                std::vector<float>(row * (kPrompt - 1), 2.0f));
    // 100 MiB of K/V due, far more than any HTTP/2 window holds.
    for (int64_t i = 0; i < kSteps; ++i) {
      const bool kv = link.RoomForKv();
      kv_sent += kv ? 1 : 0;
      link.Step(kPrompt + i, i + 1, std::nullopt, kv ? k.data() : nullptr, kv ? v.data() : nullptr);
    }
  });
  // The shadow reads again: once the backlog is out, K/V alignment resumes.
  for (int i = 0; i < 6000 && link.pending_kv_bytes() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(link.pending_kv_bytes(), 0);
  constexpr int64_t kMore = 10;
  for (int64_t i = kSteps; i < kSteps + kMore; ++i) {
    ASSERT_TRUE(link.RoomForKv());
    ++kv_sent;
    link.Step(kPrompt + i, i + 1, std::nullopt, k.data(), v.data());
  }
  for (int i = 0; i < 6000 && link.pending_kv_bytes() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(link.pending_kv_bytes(), 0);  // (Finish drops K/V still queued)
  link.Finish(/*wait_ms=*/60000);
  const AlignmentCounts counts = link.counts();
  EXPECT_EQ(counts.kv_skipped + kv_sent, static_cast<uint64_t>(kSteps + kMore));
  EXPECT_GT(counts.kv_skipped, 0u);
  EXPECT_GE(kv_sent, kMore);
  EXPECT_EQ(counts.kv, static_cast<uint64_t>(kv_sent));
  EXPECT_EQ(counts.prompt_positions, static_cast<uint64_t>(kPrompt - 1));
  EXPECT_EQ(counts.bytes, static_cast<uint64_t>((kPrompt - 1 + kv_sent) * step_kv_bytes));
  EXPECT_EQ(log.Count("the link to the shadow is behind by"), 1) << log.text();
  // Whatever main queued reached the shadow, in order: every step, the K/V it let through.
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < kSteps + kMore; ++i) expected.push_back(kPrompt + i);
  EXPECT_EQ(shadow_.positions(), expected);
  EXPECT_EQ(shadow_.kv_steps(), kv_sent);
  EXPECT_EQ(shadow_.kv_positions(), kPrompt - 1);
}

TEST_F(ShadowLinkTest, FinishGivesUpOnAStalledShadowAfterItsWait) {
  const size_t row = static_cast<size_t>(config_.num_layers * config_.kv_size());
  ShadowLink link(channel_, config_, ShadowLinkOptions{});
  PredictionBoard board;
  ShadowSettings settings;
  std::vector<int32_t> prompt(8, 7);
  std::vector<float> k(row, 0.5f), v(row, -0.5f);
  ASSERT_TRUE(link.Start(1, "req-2", prompt, Options(400), settings, &board));
  shadow_.WaitStarted();
  for (int64_t i = 0; i < 400; ++i) link.Step(8 + i, i + 1, std::nullopt, k.data(), v.data());  // 100 MiB
  // The shadow never reads again: Finish cancels the stream after its wait, with the writer mid-write.
  ExpectReturnsWhileStalled([&] { link.Finish(/*wait_ms=*/200); });
  EXPECT_FALSE(link.active());
  EXPECT_LT(link.counts().kv, 400u);
}

// A request that ends while its link is at its bound: its answer does not wait for the backlog of K/V, which can
// no longer help the shadow, but the steps still go (the shadow predicts the last positions from them).
TEST_F(ShadowLinkTest, FinishDropsTheKvStillQueuedButSendsEveryStep) {
  constexpr int64_t kSteps = 400;
  const size_t row = static_cast<size_t>(config_.num_layers * config_.kv_size());
  ShadowLinkOptions options;
  options.max_pending_kv_bytes = 4 << 20;
  ShadowLink link(channel_, config_, options);
  PredictionBoard board;
  std::vector<int32_t> prompt(8, 7);
  std::vector<float> k(row, 0.5f), v(row, -0.5f);
  ASSERT_TRUE(link.Start(1, "req-3", prompt, Options(kSteps), ShadowSettings{}, &board));
  shadow_.WaitStarted();
  // 100 MiB of K/V queued, without asking RoomForKv.
  for (int64_t i = 0; i < kSteps; ++i) link.Step(8 + i, i + 1, std::nullopt, k.data(), v.data());
  ExpectReturnsWhileStalled([&] {
    std::thread finish([&] { link.Finish(/*wait_ms=*/60000); });
    // Finish has dropped the queued K/V (the writer is stuck on the stalled stream with one step): the shadow
    // reads again.
    for (int i = 0; i < 6000 && link.pending_kv_bytes() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
    shadow_.Release();
    finish.join();
  });
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < kSteps; ++i) expected.push_back(8 + i);
  EXPECT_EQ(shadow_.positions(), expected);
  const AlignmentCounts counts = link.counts();
  EXPECT_LT(counts.kv, static_cast<uint64_t>(kSteps));
  EXPECT_EQ(static_cast<uint64_t>(shadow_.kv_steps()), counts.kv);
}

// Reads every message; while `predict` is set, answers each step at once with a prediction for its position
// (layer 0), as a shadow keeping up with main does.
class EchoShadow final : public v1::Shadow::Service {
 public:
  grpc::Status Follow(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::Prediction, v1::FollowMessage>* stream) override {
    v1::FollowMessage m;
    while (stream->Read(&m)) {
      if (!m.has_step() || !predict) continue;
      v1::Prediction p;
      p.set_position(m.step().position());
      p.set_layer(0);
      p.add_experts(0);
      p.add_experts(1);
      if (!stream->Write(p)) break;
    }
    return grpc::Status::OK;
  }
  std::atomic<bool> predict{true};
};

// The alignment each of main's steps carries: the periods' while the shadow keeps up; with catch_up_lag, token
// and K/V at every step once the shadow's predictions are that far behind (a shadow that predicts nothing here).
TEST_F(ShadowLinkTest, AShadowFarBehindGetsEveryStepsTokenAndKv) {
  constexpr int64_t kPrompt = 8, kSteps = 10;
  ShadowSettings settings;
  settings.align_token = 4;
  settings.align_kv = 2;
  settings.catch_up_lag = 3;
  std::vector<int32_t> prompt(kPrompt, 7);
  EchoShadow shadow;
  auto server = rpc::Server::Start({"127.0.0.1:0", 2}, {&shadow});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::shared_ptr<grpc::Channel> channel = rpc::MakeChannel(StrCat("127.0.0.1:", (*server)->port()));
  // The alignment due at each step of a request, against a shadow that predicts each position at once (before
  // main's next step) or not at all.
  auto due_at = [&](const ShadowSettings& s, bool keep_up) {
    shadow.predict = keep_up;
    ShadowLink link(channel, config_, ShadowLinkOptions{});
    PredictionBoard board;
    EXPECT_TRUE(link.Start(1, "req-4", prompt, Options(kSteps + 1), s, &board));
    EXPECT_EQ(link.shadow_position(), kPrompt - 1);
    std::vector<std::pair<bool, bool>> due;
    for (int64_t i = 0; i < kSteps; ++i) {
      const StepAlignment a = link.AlignmentDue(kPrompt + i);
      due.emplace_back(a.token, a.kv);
      link.Step(kPrompt + i, i + 1, std::nullopt, nullptr, nullptr);
      // A shadow keeping up has predicted the position before main's next step.
      for (int w = 0; keep_up && w < 1000 && link.shadow_position() < kPrompt + i; ++w) {
        absl::SleepFor(absl::Milliseconds(10));
      }
      EXPECT_EQ(link.shadow_position(), keep_up ? kPrompt + i : kPrompt - 1);
    }
    link.Finish(/*wait_ms=*/10000);
    return due;
  };
  std::vector<std::pair<bool, bool>> periodic, behind;
  for (int64_t i = 0; i < kSteps; ++i) {
    periodic.emplace_back(i % 4 == 0, i % 2 == 0);
    behind.emplace_back(i >= 3 || i % 4 == 0, i >= 3 || i % 2 == 0);  // main's position - (shadow's + 1) >= 3
  }
  EXPECT_EQ(due_at(settings, /*keep_up=*/true), periodic);
  EXPECT_EQ(due_at(settings, /*keep_up=*/false), behind);
  settings.catch_up_lag = 0;  // off: the periods only, however far behind
  EXPECT_EQ(due_at(settings, /*keep_up=*/false), periodic);
  (*server)->Shutdown(0);
}

}  // namespace
}  // namespace odmoe
