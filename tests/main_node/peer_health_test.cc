// PeerHealth as bookkeeping on a fake clock: evidence to states, silence to down, one event per change in order,
// subscriptions; and PeerProber against real servers on loopback (an answering one, a closed port, one of
// another cluster).
#include "src/main_node/peer_health.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/common/strings.h"
#include "src/rpc/peer_version.h"
#include "src/rpc/rpc_util.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1000);
  PeerHealth::Clock Fn() {
    return [this] { return now; };
  }
};

std::vector<PeerHealth::Peer> TwoPeers() { return {{"w0", "10.0.0.1:7100"}, {"w1", "10.0.0.2:7100"}}; }

TEST(PeerHealthTest, EvidenceMakesStatesAndEachChangeIsOneEvent) {
  FakeClock clock;
  PeerHealth h(TwoPeers(), {}, clock.Fn());
  std::vector<PeerEvent> events;
  h.Subscribe([&](const PeerEvent& e) { events.push_back(e); });
  EXPECT_EQ(h.state(0), PeerState::kUnknown);
  EXPECT_TRUE(h.CheckReachable(0).ok()) << "unknown is not known to be down";

  h.ReportAlive(0, "answered");
  h.ReportAlive(0, "answered again");  // no change, no event
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].name, "w0");
  EXPECT_EQ(events[0].from, PeerState::kUnknown);
  EXPECT_EQ(events[0].to, PeerState::kUp);

  clock.now += absl::Milliseconds(300);
  h.ReportFailure(0, "connection refused");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].from, PeerState::kUp);
  EXPECT_EQ(events[1].to, PeerState::kDown);
  EXPECT_EQ(events[1].reason, "connection refused");
  EXPECT_EQ(events[1].silent, absl::Milliseconds(300));
  EXPECT_EQ(h.state(0), PeerState::kDown);

  clock.now += absl::Seconds(2);
  const absl::Status s = h.CheckReachable(0, "worker");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "worker w0 at 10.0.0.1:7100 is unreachable (down for 2.00 s: connection refused)");
  EXPECT_EQ(h.state(1), PeerState::kUnknown) << "the other peer is untouched";

  h.ReportAlive(0, "answered");
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2].to, PeerState::kUp);
  EXPECT_TRUE(h.CheckReachable(0).ok());
}

// A down peer found serving another cluster gets that reason (one event, kDown -> kDown); the same report again,
// or a later plain failure, changes nothing; after it comes back up, a foreign answer is a change again.
TEST(PeerHealthTest, AForeignAnswerGivesADownPeerItsReasonOnce) {
  FakeClock clock;
  PeerHealth h(TwoPeers(), {}, clock.Fn());
  std::vector<PeerEvent> events;
  h.Subscribe([&](const PeerEvent& e) { events.push_back(e); });
  h.ReportFailure(0, "connection refused");
  clock.now += absl::Seconds(3);
  h.ReportForeign(0, "serves another cluster");
  h.ReportForeign(0, "serves another cluster");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].from, PeerState::kDown);
  EXPECT_EQ(events[1].to, PeerState::kDown);
  EXPECT_EQ(events[1].reason, "serves another cluster");
  EXPECT_EQ(h.Get(0).reason, "serves another cluster");
  // That node stops in turn: the failure's reason comes back, once.
  h.ReportFailure(0, "connection refused");
  h.ReportFailure(0, "connection refused");
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2].from, PeerState::kDown);
  EXPECT_EQ(events[2].reason, "connection refused");
  EXPECT_EQ(h.Get(0).reason, "connection refused");
  h.ReportAlive(0, "answered");
  clock.now += absl::Seconds(3);
  h.ReportForeign(0, "serves another cluster");
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[4].from, PeerState::kUp);
  EXPECT_EQ(events[4].to, PeerState::kDown);
  EXPECT_EQ(events[4].silent, absl::ZeroDuration()) << "it answers, for another cluster";
  h.ReportForeign(1, "serves another cluster");  // never seen before: down at once
  ASSERT_EQ(events.size(), 6u);
  EXPECT_EQ(events[5].from, PeerState::kUnknown);
}

TEST(PeerHealthTest, SilenceLongerThanDownAfterIsDown) {
  FakeClock clock;
  PeerHealth h(TwoPeers(), PeerHealthOptions{absl::Milliseconds(1500)}, clock.Fn());
  h.ReportAlive(0, "answered");
  h.ReportFailure(1, "refused");
  clock.now += absl::Milliseconds(1500);
  h.CheckSilence();
  EXPECT_EQ(h.state(0), PeerState::kUp) << "exactly down_after is not yet silent";
  clock.now += absl::Milliseconds(1);
  std::vector<PeerEvent> events;
  h.Subscribe([&](const PeerEvent& e) { events.push_back(e); });
  h.CheckSilence();
  EXPECT_EQ(h.state(0), PeerState::kDown);
  ASSERT_EQ(events.size(), 1u) << "a peer already down changes nothing";
  EXPECT_EQ(events[0].silent, absl::Milliseconds(1501));
  EXPECT_NE(events[0].reason.find("no answer for 1.50 s"), std::string::npos) << events[0].reason;
  // An unknown peer is never silent: it has not answered yet.
  PeerHealth fresh(TwoPeers(), {}, clock.Fn());
  clock.now += absl::Hours(1);
  fresh.CheckSilence();
  EXPECT_EQ(fresh.state(0), PeerState::kUnknown);
}

TEST(PeerHealthTest, ListenersSeeChangesInOrderAndUnsubscribeStopsThem) {
  FakeClock clock;
  PeerHealth h(TwoPeers(), {}, clock.Fn());
  std::vector<std::string> seen;
  // A listener that reports evidence itself: its change is delivered after it returns, not inside it.
  bool inside = false;
  const int64_t a = h.Subscribe([&](const PeerEvent& e) {
    EXPECT_FALSE(inside);
    inside = true;
    seen.push_back(StrCat("a:", e.name, ":", PeerStateName(e.to)));
    if (e.peer == 0 && e.to == PeerState::kDown) h.ReportFailure(1, "its group is gone");
    inside = false;
  });
  const int64_t b =
      h.Subscribe([&](const PeerEvent& e) { seen.push_back(StrCat("b:", e.name, ":", PeerStateName(e.to))); });
  h.ReportFailure(0, "refused");
  EXPECT_EQ(seen, (std::vector<std::string>{"a:w0:down", "b:w0:down", "a:w1:down", "b:w1:down"}));
  h.Unsubscribe(a);
  seen.clear();
  h.ReportAlive(0, "back");
  EXPECT_EQ(seen, (std::vector<std::string>{"b:w0:up"}));
  h.Unsubscribe(b);
  seen.clear();
  h.ReportFailure(0, "again");
  EXPECT_TRUE(seen.empty());
}

TEST(PeerHealthTest, ConcurrentReportsKeepOneStatePerPeer) {
  PeerHealth h(TwoPeers());
  int ups = 0, downs = 0;
  h.Subscribe([&](const PeerEvent& e) { (e.to == PeerState::kUp ? ups : downs) += 1; });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&h, t] {
      for (int i = 0; i < 500; ++i) {
        if ((i + t) % 2 == 0) {
          h.ReportAlive(t % 2, "x");
        } else {
          h.ReportFailure(t % 2, "y");
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  // Changes alternate per peer, so the counts of each direction differ by at most one per peer.
  EXPECT_LE(std::abs(ups - downs), 2);
  EXPECT_GE(ups + downs, 2);
}

// A server (answering grpc.health.v1 for a service with no method implemented) and a closed port.
TEST(PeerProberTest, AnAnsweringPeerIsUpAndAClosedPortDown) {
  v1::Worker::Service unimplemented;
  auto server = rpc::Server::Start({"127.0.0.1:0", 1, "w0"}, {&unimplemented});
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->MarkServing(true);
  const int closed = odmoe::testing::PickFreePorts(1)[0];
  PeerHealth h({{"w0", StrCat("127.0.0.1:", (*server)->port())}, {"w1", StrCat("127.0.0.1:", closed)}});
  PeerProber prober(h, PeerProberOptions{absl::Milliseconds(20), absl::Milliseconds(500)});
  prober.Start();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((h.state(0) != PeerState::kUp || h.state(1) != PeerState::kDown) &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(h.state(0), PeerState::kUp) << h.Get(0).reason;
  EXPECT_EQ(h.state(1), PeerState::kDown);
  // Not ready: down, saying so.
  (*server)->MarkReady(false);
  while (h.state(0) != PeerState::kDown && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(h.state(0), PeerState::kDown);
  EXPECT_EQ(h.Get(0).reason, "answers but is not ready");
  prober.Stop();
  prober.Stop();  // idempotent
}

// A peer whose answers name another cluster (another cluster file or model) is down, for as long as it answers
// so; one whose answers name none (an older build) is up on its answer alone. w1 is first down (nothing
// listens), then restarted from another cluster file: its reason becomes that, with one more event.
TEST(PeerProberTest, APeerOfAnotherClusterIsDownForAsLongAsItSaysSo) {
  v1::Worker::Service unimplemented;
  const std::string ours = rpc::ClusterIdentity(7, "abc");
  const std::vector<std::string> identities = {ours, rpc::ClusterIdentity(8, "abc"), ""};
  const int w1_port = odmoe::testing::PickFreePorts(1)[0];
  std::vector<std::unique_ptr<rpc::Server>> servers;
  std::vector<PeerHealth::Peer> peers;
  auto start = [&](size_t i, const std::string& address) -> rpc::Server* {
    auto server = rpc::Server::Start(
        {.address = address, .threads = 1, .node = StrCat("w", i), .cluster = identities[i]}, {&unimplemented});
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    (*server)->MarkServing(true);
    servers.push_back(std::move(*server));
    return servers.back().get();
  };
  for (size_t i = 0; i < identities.size(); ++i) {
    if (i == 1) {
      peers.push_back({"w1", StrCat("127.0.0.1:", w1_port)});
      continue;
    }
    rpc::Server* s = start(i, "127.0.0.1:0");
    ASSERT_NE(s, nullptr);
    peers.push_back({StrCat("w", i), StrCat("127.0.0.1:", s->port())});
  }
  PeerHealth h(peers);
  std::atomic<int> w1_events{0};
  h.Subscribe([&](const PeerEvent& e) { w1_events += e.peer == 1; });
  PeerProber prober(
      h, PeerProberOptions{.period = absl::Milliseconds(20), .timeout = absl::Milliseconds(500), .cluster = ours});
  prober.Start();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((h.state(0) != PeerState::kUp || h.state(1) != PeerState::kDown || h.state(2) != PeerState::kUp) &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(h.state(0), PeerState::kUp) << h.Get(0).reason;
  EXPECT_EQ(h.state(2), PeerState::kUp) << h.Get(2).reason;
  ASSERT_EQ(h.state(1), PeerState::kDown);
  EXPECT_EQ(w1_events.load(), 1);
  const std::string foreign =
      "serves another cluster (epoch 8, model abc; this cluster: epoch 7, model abc): check its cluster file and "
      "model";
  EXPECT_NE(h.Get(1).reason, foreign);
  ASSERT_NE(start(1, peers[1].address), nullptr);
  while (h.Get(1).reason != foreign && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(h.Get(1).reason, foreign);
  // Ten more checks of each: w1 stays down, with no further event.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(h.state(1), PeerState::kDown);
  EXPECT_EQ(w1_events.load(), 2);
  prober.Stop();
}

}  // namespace
}  // namespace odmoe
