// ClientConnection: the server's socket of a connection found by its four addresses, and its client's close seen
// without reading from it.
#include "src/main_node/client_connection.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace odmoe {
namespace {

// A socket's own or its peer's port.
int PortOf(int fd, bool peer) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const int rc = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len)
                      : getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (rc != 0) return -1;
  return addr.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port)
                                   : ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
}

// A listening socket on a loopback address and the connections made to it: each a client's socket and the
// server's, accepted.
class Loopback {
 public:
  // `family`: AF_INET (127.0.0.1) or AF_INET6 (::1); ok() is false where the machine has no such loopback.
  explicit Loopback(int family) : family_(family) {
    listener_ = socket(family, SOCK_STREAM, 0);
    if (listener_ < 0) return;
    sockaddr_storage addr = Address(0);
    if (bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(listener_, 8) != 0) {
      close(listener_);
      listener_ = -1;
      return;
    }
    port_ = PortOf(listener_, false);
  }
  ~Loopback() {
    if (listener_ >= 0) close(listener_);
  }
  bool ok() const { return listener_ >= 0; }
  std::string host() const { return family_ == AF_INET ? "127.0.0.1" : "::1"; }

  struct Connection {
    int client = -1, server = -1;
    int client_port = -1;
  };
  Connection Connect() {
    Connection c;
    c.client = socket(family_, SOCK_STREAM, 0);
    sockaddr_storage addr = Address(port_);
    EXPECT_EQ(connect(c.client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    c.server = accept(listener_, nullptr, nullptr);
    EXPECT_GE(c.server, 0);
    c.client_port = PortOf(c.client, false);
    return c;
  }
  ClientConnection Find(const Connection& c) const {
    return ClientConnection::Find(host(), port_, host(), c.client_port);
  }

 private:
  sockaddr_storage Address(int port) const {
    sockaddr_storage addr{};
    if (family_ == AF_INET) {
      auto* in = reinterpret_cast<sockaddr_in*>(&addr);
      in->sin_family = AF_INET;
      in->sin_port = htons(static_cast<uint16_t>(port));
      in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    } else {
      auto* in6 = reinterpret_cast<sockaddr_in6*>(&addr);
      in6->sin6_family = AF_INET6;
      in6->sin6_port = htons(static_cast<uint16_t>(port));
      in6->sin6_addr = in6addr_loopback;
    }
    return addr;
  }

  int family_;
  int listener_ = -1;
  int port_ = -1;
};

// Gone() within a second (a close on loopback is seen at once; the margin is for a loaded machine).
bool GoneSoon(const ClientConnection& c) {
  for (int i = 0; i < 100; ++i) {
    if (c.Gone()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

void ExpectEachConnectionWatchedApart(int family) {
  Loopback loopback(family);
  if (!loopback.ok()) {
    ASSERT_NE(family, AF_INET) << "every machine has 127.0.0.1";
    GTEST_SKIP() << "no IPv6 loopback here";
  }
  Loopback::Connection a = loopback.Connect(), b = loopback.Connect();
  const ClientConnection watch_a = loopback.Find(a), watch_b = loopback.Find(b);
  ASSERT_TRUE(watch_a.found());
  ASSERT_TRUE(watch_b.found());
  EXPECT_FALSE(watch_a.Gone());
  // Bytes waiting to be read (a pipelined request) are not a close, and Gone() leaves them to be read.
  ASSERT_EQ(write(a.client, "GET", 3), 3);
  EXPECT_FALSE(watch_a.Gone());
  close(a.client);
  EXPECT_TRUE(GoneSoon(watch_a));
  EXPECT_FALSE(watch_b.Gone()) << "b's client is still there: each connection is found by its own addresses";
  char buf[4] = {};
  EXPECT_EQ(read(a.server, buf, sizeof(buf)), 3) << "the bytes sent before the close are still there";
  shutdown(b.client, SHUT_WR);  // a client that closes its side: gone too
  EXPECT_TRUE(GoneSoon(watch_b));
  close(a.server);
  close(b.server);
  close(b.client);
}

TEST(ClientConnectionTest, WatchesEachIpv4ConnectionApart) { ExpectEachConnectionWatchedApart(AF_INET); }

TEST(ClientConnectionTest, WatchesEachIpv6ConnectionApart) { ExpectEachConnectionWatchedApart(AF_INET6); }

TEST(ClientConnectionTest, NoSocketWithTheAddressesIsNeverGone) {
  Loopback loopback(AF_INET);
  ASSERT_TRUE(loopback.ok());
  Loopback::Connection c = loopback.Connect();
  // The right ports with another address, a port no connection has, and httplib's "unknown" (-1).
  for (const ClientConnection& none :
       {ClientConnection::Find("127.0.0.2", PortOf(c.server, false), "127.0.0.1", c.client_port),
        ClientConnection::Find("127.0.0.1", PortOf(c.server, false), "127.0.0.1", 1),
        ClientConnection::Find("127.0.0.1", -1, "127.0.0.1", c.client_port)}) {
    EXPECT_FALSE(none.found());
    EXPECT_FALSE(none.Gone());
  }
  close(c.client);
  close(c.server);
}

// Find reads every descriptor of the process, most of them other threads' (gRPC's sockets, files being read), which
// those threads may close at any moment. It asks only the socket calls that read nothing of the descriptor's state
// (getpeername, getsockname): ThreadSanitizer reports an fstat of a descriptor another thread closes as a race, and
// halts the daemon it runs in (a CI run of http_openai_sdk stopped so).
TEST(ClientConnectionTest, FindLeavesDescriptorsOtherThreadsCloseAlone) {
  Loopback loopback(AF_INET);
  ASSERT_TRUE(loopback.ok());
  Loopback::Connection c = loopback.Connect();
  std::atomic<bool> stop{false};
  std::atomic<int> closed{0};
  std::thread churn([&stop, &closed] {
    while (!stop.load()) {
      int pair[2];
      if (socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0) continue;
      close(pair[0]);
      close(pair[1]);
      ++closed;
    }
  });
  // Until the other thread has closed 500 pairs, so that the two overlap on any machine.
  for (int i = 0; i < 200 || closed.load() < 500; ++i) {
    ASSERT_TRUE(loopback.Find(c).found());
    // A connection no socket has: Find reads every descriptor, the churning ones too.
    ASSERT_FALSE(ClientConnection::Find("127.0.0.1", PortOf(c.server, false), "127.0.0.1", 1).found());
  }
  stop = true;
  churn.join();
  close(c.client);
  close(c.server);
}

}  // namespace
}  // namespace odmoe
