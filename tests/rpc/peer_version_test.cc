// What every odmoe server and channel does about versions and health: servers answer with their build
// version, a peer's differing version is logged once per peer and version (both on the server and the client
// side), liveness and readiness are separate grpc.health.v1 services, and a taken port is refused.
#include "src/rpc/peer_version.h"

#include <memory>
#include <sstream>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "spdlog/spdlog.h"
#include "src/common/strings.h"
#include "src/common/version.h"
#include "src/rpc/rpc_util.h"
#include "tests/test_support.h"

namespace odmoe::rpc {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

using ::odmoe::testing::CapturedLog;

TEST(PeerVersionsTest, WarnsOncePerPeerAndVersion) {
  PeerVersions v("1.0+a");
  EXPECT_FALSE(v.ShouldWarn("ipv4:10.0.0.2", "1.0+a"));
  EXPECT_FALSE(v.ShouldWarn("ipv4:10.0.0.2", ""));
  EXPECT_TRUE(v.ShouldWarn("ipv4:10.0.0.2", "1.0+b"));
  EXPECT_FALSE(v.ShouldWarn("ipv4:10.0.0.2", "1.0+b"));
  EXPECT_TRUE(v.ShouldWarn("ipv4:10.0.0.3", "1.0+b"));
  EXPECT_TRUE(v.ShouldWarn("ipv4:10.0.0.2", "1.0+c"));
}

TEST(PeerVersionsTest, IsBounded) {
  PeerVersions v("1");
  for (size_t i = 0; i < PeerVersions::kMaxPeers; ++i) EXPECT_TRUE(v.ShouldWarn(StrCat("p", i), "2"));
  EXPECT_FALSE(v.ShouldWarn("one more", "2"));
}

TEST(PeerHostTest, DropsThePort) {
  EXPECT_EQ(PeerHost("ipv4:10.0.0.3:53412"), "ipv4:10.0.0.3");
  EXPECT_EQ(PeerHost("ipv6:[::1]:53412"), "ipv6:[::1]");
  EXPECT_EQ(PeerHost("unix:/tmp/sock"), "unix:/tmp/sock");
  EXPECT_EQ(PeerHost("10.0.0.3"), "10.0.0.3");
}

TEST(BuildVersionTest, StartsWithTheProjectVersion) {
  const std::string v(BuildVersion());
  ASSERT_FALSE(v.empty());
  EXPECT_TRUE(v[0] >= '0' && v[0] <= '9') << v;
  EXPECT_EQ(v.find_first_of(" \n\t"), std::string::npos) << v;
}

// A sync service for servers of the tests (a sync server needs one; its methods answer UNIMPLEMENTED).
v1::Worker::Service* AnyService() {
  static v1::Worker::Service* const service = new v1::Worker::Service();
  return service;
}

TEST(ServerHealthTest, LivenessAndReadinessAreSeparateAndCarryTheVersion) {
  auto server = Server::Start({"127.0.0.1:0", 2, "n0"}, {AnyService()});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = StrCat("127.0.0.1:", (*server)->port());
  auto h = CheckHealth(address, 5000);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(h->live);
  EXPECT_FALSE(h->ready);
  EXPECT_EQ(h->version, BuildVersion());
  EXPECT_EQ(h->cluster, "");  // started without one
  (*server)->MarkLive(true);
  h = CheckHealth(address, 5000);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->live);
  EXPECT_FALSE(h->ready);
  (*server)->MarkReady(true);
  EXPECT_TRUE(*CheckServing(address, 5000, kReadinessService));
  (*server)->MarkReady(false);
  EXPECT_FALSE(*CheckServing(address, 5000, kReadinessService));
  EXPECT_TRUE(*CheckServing(address, 5000));
  (*server)->Shutdown();
  (*server)->MarkReady(true);  // after shutdown: nothing happens
  EXPECT_FALSE(CheckHealth(address, 500).ok());
}

TEST(ServerHealthTest, EveryAnswerNamesTheClusterTheServerWasStartedFor) {
  EXPECT_EQ(ClusterIdentity(7, "3fa2"), "epoch 7, model 3fa2");
  auto server =
      Server::Start({.address = "127.0.0.1:0", .node = "n0", .cluster = ClusterIdentity(7, "3fa2")}, {AnyService()});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = StrCat("127.0.0.1:", (*server)->port());
  auto h = CheckHealth(address, 5000);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->cluster, "epoch 7, model 3fa2");
}

TEST(ServerHealthTest, ATakenPortIsRefusedNamingNodeAndAddress) {
  auto first = Server::Start({"127.0.0.1:0", 2, "first"}, {AnyService()});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = StrCat("127.0.0.1:", (*first)->port());
  v1::Worker::Service other;
  auto second = Server::Start({address, 2, "second"}, {&other});
  ASSERT_FALSE(second.ok()) << "a second server bound " << address;
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
  EXPECT_NE(second.status().message().find("node 'second'"), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find(address), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status();
  // The first still serves.
  (*first)->MarkServing(true);
  EXPECT_TRUE(*CheckServing(address, 5000));
}

TEST(VersionMetadataTest, TheServerWarnsOnceAboutACallersOtherVersion) {
  auto server = Server::Start({"127.0.0.1:0", 2, "n0"}, {AnyService()});
  ASSERT_TRUE(server.ok()) << server.status();
  // A raw channel (no odmoe interceptor), so the test chooses the version it sends.
  auto stub =
      Health::NewStub(grpc::CreateChannel(StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));
  CapturedLog log;
  auto call = [&](const std::string& version) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 5000);
    if (!version.empty()) ctx.AddMetadata(kVersionMetadataKey, version);
    HealthCheckResponse resp;
    EXPECT_TRUE(stub->Check(&ctx, HealthCheckRequest(), &resp).ok());
  };
  call("0.0.1+server-side-test");
  call("0.0.1+server-side-test");
  call(std::string(BuildVersion()));
  call("");
  EXPECT_EQ(log.Count("runs odmoe 0.0.1+server-side-test, this node runs " + std::string(BuildVersion())), 1)
      << log.text();
  EXPECT_EQ(log.Count("peer ipv4:127.0.0.1 "), 1) << log.text();
  call("0.0.2+server-side-test");
  EXPECT_EQ(log.Count("runs odmoe 0.0.2+server-side-test"), 1) << log.text();
}

// A health service answering with a version of its choice, on a plain gRPC server.
class FakeVersionHealth final : public Health::Service {
 public:
  grpc::Status Check(grpc::ServerContext* ctx, const HealthCheckRequest*, HealthCheckResponse* resp) override {
    ctx->AddInitialMetadata(kVersionMetadataKey, "9.9.9+client-side-test");
    resp->set_status(HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
};

TEST(VersionMetadataTest, AChannelWarnsOnceAboutTheAnsweringNodesOtherVersion) {
  FakeVersionHealth service;
  grpc::EnableDefaultHealthCheckService(false);  // this server's health service is the fake
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  grpc::EnableDefaultHealthCheckService(true);
  ASSERT_NE(server, nullptr);
  const std::string address = StrCat("127.0.0.1:", port);
  CapturedLog log;
  auto stub = Health::NewStub(MakeChannel(address));
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 5000);
    HealthCheckResponse resp;
    ASSERT_TRUE(stub->Check(&ctx, HealthCheckRequest(), &resp).ok());
  }
  EXPECT_EQ(log.Count(StrCat("peer ", address, " runs odmoe 9.9.9+client-side-test")), 1) << log.text();
  server->Shutdown();
}

}  // namespace
}  // namespace odmoe::rpc
