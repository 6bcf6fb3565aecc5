// PrefetchSender's bounds against a worker that holds each Prefetch until the test lets it go: at most
// `max_in_flight` calls outstanding per worker, the rest sent in order as those complete, the oldest dropped
// from a full queue, the queue dropped behind an unanswered call (not behind a refused one), and Drain waiting
// for the queued calls too.
#include "src/rpc/prefetch_sender.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/common/placement.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"

namespace odmoe::rpc {
namespace {

// A worker whose Prefetch handlers wait until Release, then accept every expert (or fail with `code`).
class HeldWorker : public v1::Worker::Service {
 public:
  explicit HeldWorker(grpc::StatusCode code) : code_(code) {}

  grpc::Status Prefetch(grpc::ServerContext* /*context*/, const v1::PrefetchRequest* request,
                        v1::PrefetchResponse* response) override {
    absl::MutexLock lock(&mu_);
    layers_.push_back(request->layer());
    ++active_;
    max_active_ = std::max(max_active_, active_);
    mu_.Await(absl::Condition(&released_));
    --active_;
    if (code_ != grpc::StatusCode::OK) return grpc::Status(code_, "the test's worker fails");
    response->set_accepted(request->experts_size());
    return grpc::Status::OK;
  }

  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }
  // Whether `count` calls are being held within 10 s.
  bool AwaitActive(int count) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == count; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(10));
  }
  std::vector<int32_t> layers() const {
    absl::MutexLock lock(&mu_);
    return layers_;
  }
  int max_active() const {
    absl::MutexLock lock(&mu_);
    return max_active_;
  }

 private:
  const grpc::StatusCode code_;
  mutable absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  int max_active_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int32_t> layers_ ABSL_GUARDED_BY(mu_);  // in order of arrival
};

class PrefetchSenderTest : public ::testing::Test {
 protected:
  // One worker serving every layer, and a sender to it.
  std::unique_ptr<PrefetchSender> Start(grpc::StatusCode code, int max_in_flight, int max_queued) {
    worker_ = std::make_unique<HeldWorker>(code);
    auto server = Server::Start({"127.0.0.1:0", 4, "w0"}, {worker_.get()});
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    server_ = *std::move(server);
    auto placement = Placement::Create(1, 1);
    EXPECT_TRUE(placement.ok()) << placement.status();
    PrefetchSenderOptions options{.sender = "shadow", .max_in_flight = max_in_flight, .max_queued = max_queued};
    return std::make_unique<PrefetchSender>(std::vector<std::string>{StrCat("127.0.0.1:", server_->port())}, *placement,
                                            options);
  }
  // The prediction of layer `layer` (its sparse index too) at position 0 of request 1.
  static void Predict(PrefetchSender& sender, int64_t layer) {
    const std::vector<int32_t> experts = {0, 1};
    sender.Send(1, 0, layer, layer, experts);
  }

  // Layers 0..3 predicted to a worker answering `code`, one call at a time, the first held until all four are
  // sent; the sender's stats once drained.
  PrefetchSenderStats PredictFourOneAtATime(grpc::StatusCode code) {
    auto sender = Start(code, /*max_in_flight=*/1, /*max_queued=*/8);
    if (sender == nullptr) return {};
    for (int64_t layer = 0; layer < 4; ++layer) Predict(*sender, layer);
    EXPECT_TRUE(worker_->AwaitActive(1));
    worker_->Release();
    sender->Drain();
    return sender->stats();
  }

  std::unique_ptr<HeldWorker> worker_;  // outlives the server
  std::unique_ptr<Server> server_;
};

TEST_F(PrefetchSenderTest, BoundsCallsOutstandingAndSendsTheQueuedInOrder) {
  auto sender = Start(grpc::StatusCode::OK, /*max_in_flight=*/2, /*max_queued=*/32);
  ASSERT_NE(sender, nullptr);
  HeldWorker& worker = *worker_;
  for (int64_t layer = 0; layer < 10; ++layer) Predict(*sender, layer);
  ASSERT_TRUE(worker.AwaitActive(2));
  absl::SleepFor(absl::Milliseconds(200));  // a third call, were one sent, would arrive meanwhile
  // Two calls outstanding at once may arrive in either order; the queued ones start in order, as slots free.
  std::vector<int32_t> held = worker.layers();
  std::sort(held.begin(), held.end());
  EXPECT_EQ(held, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(sender->stats().calls, 2u);
  worker.Release();
  sender->Drain();
  std::vector<int32_t> all = worker.layers();
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(worker.max_active(), 2);
  const PrefetchSenderStats stats = sender->stats();
  EXPECT_EQ(stats.calls, 10u);
  EXPECT_EQ(stats.failures, 0u);
  EXPECT_EQ(stats.dropped, 0u);
}

TEST_F(PrefetchSenderTest, AFullQueueDropsItsOldestCall) {
  auto sender = Start(grpc::StatusCode::OK, /*max_in_flight=*/1, /*max_queued=*/3);
  ASSERT_NE(sender, nullptr);
  HeldWorker& worker = *worker_;
  for (int64_t layer = 0; layer < 8; ++layer) Predict(*sender, layer);  // 0 sent; 1..4 dropped as 4..7 queue
  ASSERT_TRUE(worker.AwaitActive(1));
  EXPECT_EQ(sender->stats().dropped, 4u);
  worker.Release();
  sender->Drain();
  EXPECT_EQ(worker.layers(), (std::vector<int32_t>{0, 5, 6, 7}));
  EXPECT_EQ(worker.max_active(), 1);
  EXPECT_EQ(sender->stats().calls, 4u);
}

TEST_F(PrefetchSenderTest, AnUnansweredCallDropsTheCallsQueuedBehindIt) {
  const PrefetchSenderStats stats = PredictFourOneAtATime(grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(worker_->layers(), (std::vector<int32_t>{0}));
  EXPECT_EQ(stats.calls, 1u);
  EXPECT_EQ(stats.failures, 1u);
  EXPECT_EQ(stats.dropped, 3u);
}

TEST_F(PrefetchSenderTest, ARefusedCallKeepsTheQueue) {
  // A worker out of room refuses a prediction; the next may fit once main has used the experts before it.
  const PrefetchSenderStats stats = PredictFourOneAtATime(grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(worker_->layers(), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(stats.calls, 4u);
  EXPECT_EQ(stats.failures, 4u);
  EXPECT_EQ(stats.dropped, 0u);
}

TEST_F(PrefetchSenderTest, DrainWaitsForTheQueuedCalls) {
  auto sender = Start(grpc::StatusCode::OK, /*max_in_flight=*/1, /*max_queued=*/8);
  ASSERT_NE(sender, nullptr);
  HeldWorker& worker = *worker_;
  for (int64_t layer = 0; layer < 3; ++layer) Predict(*sender, layer);
  ASSERT_TRUE(worker.AwaitActive(1));
  absl::Notification drained;
  std::thread drainer([&] {
    sender->Drain();
    drained.Notify();
  });
  EXPECT_FALSE(drained.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  worker.Release();
  drainer.join();
  EXPECT_EQ(worker.layers(), (std::vector<int32_t>{0, 1, 2}));
}

}  // namespace
}  // namespace odmoe::rpc
