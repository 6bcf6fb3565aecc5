// Mutual TLS and the client token (src/rpc/security.h, src/rpc/client_token.h), in one process: rpc::Servers
// and channels with certificates that scripts/make-certs.sh makes into a temp folder. Every bad peer is refused
// in both directions: a server refuses plaintext, another CA's, an expired and a non-member's (or wrong role's)
// certificate; a client refuses a plaintext server, another CA's, an expired certificate and the certificate
// of another node than the one at the address it dials.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "odmoe/v1/worker.grpc.pb.h"
#include "src/common/strings.h"
#include "src/rpc/client_token.h"
#include "src/rpc/rpc_util.h"
#include "src/rpc/security.h"
#include "tests/test_support.h"

namespace odmoe::rpc {
namespace {

using odmoe::testing::RunProgram;
using odmoe::testing::RunResult;
using odmoe::testing::TempDir;

// GetMembership is an internal call (main only, as ComputeExperts); GetStats a client's. Both admit through the
// process's Security, as the real nodes do.
class FakeWorker final : public v1::Worker::Service {
 public:
  grpc::Status GetMembership(grpc::ServerContext* context, const v1::MembershipRequest*,
                             v1::Membership* response) override {
    if (grpc::Status admitted = AdmitMember(context, {NodeRole::kMain}); !admitted.ok()) return admitted;
    response->set_self("worker0");
    return grpc::Status::OK;
  }
  grpc::Status GetStats(grpc::ServerContext* context, const v1::StatsRequest*, v1::WorkerStats*) override {
    return AdmitClient(context);
  }
};

// Certificates made once for the whole suite: CA "good" with main, worker0, worker1, operator and an expired
// main; CA "other" with its own main and worker0.
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const std::string script = odmoe::testing::SourceDir() + "/scripts/make-certs.sh";
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"--out", Good(""), "main", "worker0", "worker1", "operator"},
          std::vector<std::string>{"--out", Good("expired"), "--expired", "main", "worker0"},
          std::vector<std::string>{"--out", Other(""), "main", "worker0"}}) {
      std::vector<std::string> argv = {"/bin/bash", script};
      argv.insert(argv.end(), args.begin(), args.end());
      const RunResult r = RunProgram(argv);
      ASSERT_EQ(r.exit_code, 0) << r.err;
    }
    // The expired certificates are signed by the good CA.
    odmoe::testing::WriteFile(Good("expired") + "/ca.crt", odmoe::testing::ReadFile(Good("") + "/ca.crt"));
    odmoe::testing::WriteFile(dir_->File("token"), "s3cret-token\n");
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void TearDown() override { InstallProcessSecurity(Security::Insecure()); }

  static std::string Good(const std::string& sub) { return dir_->File("good") + (sub.empty() ? "" : "/" + sub); }
  static std::string Other(const std::string& sub) { return dir_->File("other") + (sub.empty() ? "" : "/" + sub); }
  // Files of `name` in `folder` (ca.crt of the same folder).
  static SecurityFiles Files(const std::string& folder, const std::string& name, bool token = false) {
    return {folder + "/ca.crt", name.empty() ? "" : folder + "/" + name + ".crt",
            name.empty() ? "" : folder + "/" + name + ".key", token ? dir_->File("token") : ""};
  }
  static const std::map<std::string, NodeRole>& Members() {
    static const auto* m = new std::map<std::string, NodeRole>{
        {"main", NodeRole::kMain}, {"worker0", NodeRole::kWorker}, {"worker1", NodeRole::kWorker}};
    return *m;
  }

  // Starts the fake worker with `files` (its credentials, also the process's for admission).
  void StartWorker(const SecurityFiles& files, bool require_client_cert = true) {
    absl::StatusOr<std::shared_ptr<const Security>> s = Security::Load(files, Members(), {}, require_client_cert);
    ASSERT_TRUE(s.ok()) << s.status();
    InstallProcessSecurity(*s);
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start({"127.0.0.1:0", 2, "worker0", *s}, {&service_});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    server_->MarkServing(true);
    address_ = StrCat("127.0.0.1:", server_->port());
  }
  // A client with `files` that expects node `peer` at the worker's address.
  std::unique_ptr<v1::Worker::Stub> Client(const SecurityFiles& files, const std::string& peer = "worker0") {
    absl::StatusOr<std::shared_ptr<const Security>> s = Security::Load(files, Members(), {{address_, peer}}, true);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return nullptr;
    return v1::Worker::NewStub(MakeChannel(address_, **s));
  }
  static grpc::Status Membership(v1::Worker::Stub& stub) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 5000);
    v1::Membership m;
    return stub.GetMembership(&ctx, {}, &m);
  }
  static grpc::Status Stats(v1::Worker::Stub& stub) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 5000);
    v1::WorkerStats st;
    return stub.GetStats(&ctx, {}, &st);
  }

  static TempDir* dir_;
  FakeWorker service_;
  std::unique_ptr<Server> server_;
  std::string address_;
};
TempDir* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, MembersTalkOverMutualTls) {
  StartWorker(Files(Good(""), "worker0"));
  auto main = Client(Files(Good(""), "main"));
  const grpc::Status st = Membership(*main);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(Stats(*main).ok());
}

TEST_F(TlsTest, ServerRefusesPlaintextOtherCaExpiredAndNonMemberCallers) {
  StartWorker(Files(Good(""), "worker0"));
  EXPECT_EQ(Membership(*v1::Worker::NewStub(MakeChannel(address_, *Security::Insecure()))).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // Another CA's "main" (trusting the good CA for the server): the server refuses its certificate.
  SecurityFiles other = Files(Other(""), "main");
  other.ca = Good("ca.crt");
  EXPECT_EQ(Membership(*Client(other)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Membership(*Client(Files(Good("expired"), "main"))).error_code(), grpc::StatusCode::UNAVAILABLE);
  // No certificate at all: a worker port requires one.
  EXPECT_EQ(Membership(*Client(Files(Good(""), ""))).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A CA-signed certificate of a non-member (operator) or of a member of the wrong role (worker1) may read
  // stats but not make an internal call.
  auto op = Client(Files(Good(""), "operator"));
  EXPECT_TRUE(Stats(*op).ok());
  const grpc::Status denied = Membership(*op);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(denied.error_message().find("cluster member (main)"), std::string::npos) << denied.error_message();
  EXPECT_EQ(Membership(*Client(Files(Good(""), "worker1"))).error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(TlsTest, ClientRefusesPlaintextOtherCaExpiredAndWrongNodeServers) {
  const SecurityFiles main = Files(Good(""), "main");
  {
    StartWorker({});  // plaintext
    EXPECT_EQ(Membership(*Client(main)).error_code(), grpc::StatusCode::UNAVAILABLE);
    server_.reset();
  }
  {
    SecurityFiles other = Files(Other(""), "worker0");
    other.ca = Good("ca.crt");  // the server trusts our main, but presents another CA's certificate
    StartWorker(other);
    EXPECT_EQ(Membership(*Client(main)).error_code(), grpc::StatusCode::UNAVAILABLE);
    server_.reset();
  }
  {
    StartWorker(Files(Good("expired"), "worker0"));
    EXPECT_EQ(Membership(*Client(main)).error_code(), grpc::StatusCode::UNAVAILABLE);
    server_.reset();
  }
  {
    // worker1's valid certificate at the address the cluster file gives worker0.
    StartWorker(Files(Good(""), "worker1"));
    EXPECT_EQ(Membership(*Client(main, "worker0")).error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_TRUE(Membership(*Client(main, "worker1")).ok());
  }
}

TEST_F(TlsTest, MainTakesClientsWithoutCertificateButNotAsMembers) {
  StartWorker(Files(Good(""), "worker0"), /*require_client_cert=*/false);
  auto anonymous = Client(Files(Good(""), ""));
  EXPECT_TRUE(Stats(*anonymous).ok());
  EXPECT_EQ(Membership(*anonymous).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // A certificate, when given, must still verify.
  EXPECT_EQ(Stats(*Client(Files(Good("expired"), "main"))).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, TokenIsRequiredOverTlsAndSentByTheChannel) {
  StartWorker(Files(Good(""), "worker0", /*token=*/true));
  EXPECT_EQ(Stats(*Client(Files(Good(""), "operator"))).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Stats(*Client(Files(Good(""), "operator", /*token=*/true))).ok());
  // Members are admitted by their certificate.
  EXPECT_TRUE(Membership(*Client(Files(Good(""), "main"))).ok());
}

TEST_F(TlsTest, TokenAloneGuardsEveryCallWithoutTls) {
  StartWorker({"", "", "", dir_->File("token")});
  auto bare = v1::Worker::NewStub(MakeChannel(address_, *Security::Insecure()));
  const grpc::Status missing = Stats(*bare);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Membership(*bare).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  odmoe::testing::WriteFile(dir_->File("wrong"), "s3cret-tokem\n");
  auto wrong = Client({"", "", "", dir_->File("wrong")});
  const grpc::Status refused = Stats(*wrong);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(refused.error_message().find("s3cret"), std::string::npos) << refused.error_message();
  auto right = Client({"", "", "", dir_->File("token")});
  EXPECT_TRUE(Stats(*right).ok());
  EXPECT_TRUE(Membership(*right).ok());
}

TEST_F(TlsTest, ClusterFileNamesTheMaterialRelativeToItself) {
  const std::string head =
      "[cluster]\nshutdown_timeout_ms = 1500\n[tls]\nca = \"tls/ca.crt\"\n[auth]\ntoken_file = \"tok\"\n";
  const std::string main_node = "[[node]]\nname = \"main\"\nrole = \"main\"\naddress = \"127.0.0.1:1\"\n";
  const std::string worker = "[[node]]\nname = \"w0\"\nrole = \"worker\"\naddress = \"127.0.0.1:2\"\n";
  const std::string certs = "cert = \"tls/n.crt\"\nkey = \"/abs/n.key\"\n";
  absl::StatusOr<ClusterConfig> c =
      ParseClusterConfig(head + main_node + certs + worker + certs, "c.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tls_ca, "/etc/odmoe/tls/ca.crt");
  EXPECT_EQ(c->token_file, "/etc/odmoe/tok");
  EXPECT_EQ(c->shutdown_timeout_ms, 1500);
  EXPECT_EQ(c->nodes[1].tls_cert, "/etc/odmoe/tls/n.crt");
  EXPECT_EQ(c->nodes[1].tls_key, "/abs/n.key");
  // With [tls], a node without its certificate is an error naming it; a certificate without [tls] too.
  c = ParseClusterConfig(head + main_node + certs + worker, "c.toml", "/etc/odmoe");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("node 'w0': field 'cert'"), std::string_view::npos) << c.status();
  c = ParseClusterConfig(main_node + certs + worker, "c.toml", "/etc/odmoe");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("needs a [tls] section"), std::string_view::npos) << c.status();
  // A daemon whose key cannot be read stops with the file named.
  c = ParseClusterConfig(head + main_node + certs + worker + certs, "c.toml", "/etc/odmoe");
  ASSERT_TRUE(c.ok());
  const absl::Status st = Security::ForNode(*c, c->nodes[0]).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(st.message().find("/etc/odmoe/tls/ca.crt"), std::string_view::npos) << st;
}

TEST(TokenGuardTest, ChecksTheBearerHeader) {
  const TokenGuard guard("abc123");
  EXPECT_TRUE(guard.Check("Bearer abc123").ok());
  EXPECT_TRUE(guard.Check("bearer abc123").ok());
  EXPECT_EQ(guard.HeaderValue(), "Bearer abc123");
  for (std::string_view bad :
       {"", "abc123", "Bearer", "Bearer ", "Bearer abc12", "Bearer abc1234", "Basic abc123", "Bearer ABC123"}) {
    const absl::Status st = guard.Check(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << bad;
    EXPECT_EQ(st.message().find("abc"), std::string_view::npos) << st.message();
  }
  EXPECT_EQ(guard.Check(nullptr).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(ConstantTimeEquals("x", "x"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_FALSE(ConstantTimeEquals("xy", "x"));
}

TEST(TokenGuardTest, TokenFilesAreCheckedAndNamed) {
  TempDir dir;
  odmoe::testing::WriteFile(dir.File("ok"), "tok\r\n");
  absl::StatusOr<std::string> ok = ReadTokenFile(dir.File("ok"));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, "tok");
  odmoe::testing::WriteFile(dir.File("empty"), "\n");
  EXPECT_EQ(ReadTokenFile(dir.File("empty")).status().code(), absl::StatusCode::kInvalidArgument);
  odmoe::testing::WriteFile(dir.File("two"), "a b\n");
  EXPECT_EQ(ReadTokenFile(dir.File("two")).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status missing = ReadTokenFile(dir.File("none")).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.message().find(dir.File("none")), std::string_view::npos);
}

}  // namespace
}  // namespace odmoe::rpc
