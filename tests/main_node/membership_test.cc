// Main's membership of the workers as bookkeeping: PeerHealth's verdicts to epochs (a member that goes down
// leaves, an absent worker that comes back rejoins, nothing else changes the epoch), the placement over the
// members, the counts per worker, waiting for a newer epoch; and the workers' side, rpc::EpochGate.
#include "src/main_node/membership.h"

#include <thread>

#include "gtest/gtest.h"
#include "src/rpc/rpc_util.h"

namespace odmoe {
namespace {

PeerHealth FourWorkersAndAShadow() {
  return PeerHealth(std::vector<PeerHealth::Peer>{
      {"w0", "a:1"}, {"w1", "a:2"}, {"w2", "a:3"}, {"w3", "a:4"}, {"shadow", "a:5"}});
}

TEST(MembershipTest, LeavesAndRejoinsFollowPeerHealthUnderNewEpochs) {
  PeerHealth health = FourWorkersAndAShadow();
  Membership m(Placement::Create(4, 2).value(), {"w0", "w1", "w2", "w3"}, &health, 100);
  EXPECT_EQ(m.Current().view, (MembershipView{100, {}}));
  // First verdicts "up", the shadow's changes and repeated verdicts change nothing.
  for (int32_t w = 0; w < 4; ++w) health.ReportAlive(w, "answered");
  health.ReportFailure(4, "shadow refused");
  EXPECT_EQ(m.Current().view.epoch, 100u);

  health.ReportFailure(2, "connection reset");
  Membership::Snapshot s = m.Current();
  EXPECT_EQ(s.view, (MembershipView{101, {2}}));
  EXPECT_FALSE(s.placement.member(2));
  EXPECT_EQ(s.placement.num_members(), 3);
  // Sparse layer 1's group {2, 3} keeps worker 3, which takes the whole set.
  for (const Assignment& a : s.placement.Assign(1, std::vector<int32_t>{0, 5})) EXPECT_EQ(a.worker, 3);
  health.ReportFailure(2, "still refused");  // down already: no new epoch
  health.ReportFailure(3, "deadline");
  s = m.Current();
  EXPECT_EQ(s.view, (MembershipView{102, {2, 3}}));
  EXPECT_EQ(s.placement.GroupOf(1), 0) << "group 1 is gone: its layers go to group 0";

  health.ReportAlive(2, "answered again");
  EXPECT_EQ(m.Current().view, (MembershipView{103, {3}}));
  const std::vector<Membership::Changes> changes = m.changes();
  EXPECT_EQ(changes[2].left, 1u);
  EXPECT_EQ(changes[2].joined, 1u);
  EXPECT_EQ(changes[3].left, 1u);
  EXPECT_EQ(changes[0].left + changes[0].joined, 0u);
  EXPECT_TRUE(m.CheckServable("layer 3").ok());
}

TEST(MembershipTest, NoWorkerLeftIsNotServableNamingEveryWorker) {
  PeerHealth health = FourWorkersAndAShadow();
  Membership m(Placement::Create(4, 2).value(), {"w0", "w1", "w2", "w3"}, &health, 7);
  for (int32_t w = 0; w < 4; ++w) health.ReportFailure(w, "refused " + std::to_string(w));
  // w2, down already, is found serving another cluster: its reason changes, the epoch does not.
  health.ReportForeign(2, "serves another cluster");
  EXPECT_FALSE(m.Current().placement.servable());
  const absl::Status s = m.CheckServable("layer 3");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(),
            "layer 3 cannot be served: every worker is out of the placement (membership epoch 11): w0 (refused 0); "
            "w1 (refused 1); w2 (serves another cluster); w3 (refused 3)");
}

TEST(MembershipTest, AwaitNewerWakesOnAChangeOrAtTheDeadline) {
  PeerHealth health = FourWorkersAndAShadow();
  Membership m(Placement::Create(4, 2).value(), {"w0", "w1", "w2", "w3"}, &health, 1);
  // No change: returns at the deadline with the same epoch.
  EXPECT_EQ(m.AwaitNewer(1, absl::Now() + absl::Milliseconds(20)).view.epoch, 1u);
  std::thread change([&] {
    absl::SleepFor(absl::Milliseconds(50));
    health.ReportFailure(1, "gone");
  });
  const Membership::Snapshot s = m.AwaitNewer(1, absl::Now() + absl::Seconds(30));
  change.join();
  EXPECT_EQ(s.view, (MembershipView{2, {1}}));
}

TEST(EpochGateTest, RefusesOlderEpochsAndGoesOnlyForward) {
  rpc::EpochGate gate;
  v1::RequestHeader h;
  h.set_sender("shadow");
  EXPECT_TRUE(gate.Admit(h).ok()) << "no view: a tool outside the membership";
  h.mutable_membership()->set_epoch(5);
  EXPECT_TRUE(gate.Admit(h).ok());
  EXPECT_EQ(gate.newest(), 5u);
  h.mutable_membership()->set_epoch(7);
  EXPECT_TRUE(gate.Admit(h).ok());
  h.mutable_membership()->set_epoch(6);
  const absl::Status s = gate.Admit(h);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("membership epoch 6 of shadow is older than epoch 7"), std::string::npos) << s;
  EXPECT_EQ(gate.newest(), 7u);
  h.clear_membership();
  EXPECT_TRUE(gate.Admit(h).ok());
}

TEST(MembershipViewTest, RoundTripsThroughTheWire) {
  const MembershipView view{42, {1, 6}};
  v1::MembershipView p;
  rpc::ToProto(view, &p);
  EXPECT_EQ(rpc::FromProto(p), view);
}

}  // namespace
}  // namespace odmoe
