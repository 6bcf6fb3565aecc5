// ParseHostPort and JoinHostPort: the one reading of a listening address.
#include "src/common/host_port.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace odmoe {
namespace {

using ::testing::HasSubstr;

TEST(HostPort, SplitsAtTheLastColon) {
  absl::StatusOr<HostPort> a = ParseHostPort("10.0.0.4:7190");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "10.0.0.4");
  EXPECT_EQ(a->port, 7190);

  a = ParseHostPort("[::1]:65535");  // an IPv6 literal loses its brackets
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->port, 65535);

  a = ParseHostPort(":0");  // every interface, a port the system picks
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "");
  EXPECT_EQ(a->port, 0);
}

TEST(HostPort, RefusesWhatIsNotAPortNamingTheAddress) {
  for (const char* bad : {"10.0.0.4", "10.0.0.4:", "host:http", "host:70000", "host:-1", "host:+80", "host:123456",
                          "host:80 ", "host:0x50"}) {
    const absl::StatusOr<HostPort> a = ParseHostPort(bad);
    ASSERT_FALSE(a.ok()) << bad << " read as port " << a->port;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(), HasSubstr(std::string("'") + bad + "'"));
  }
}

TEST(HostPort, JoinReadsBack) {
  EXPECT_EQ(JoinHostPort("10.0.0.4", 7190), "10.0.0.4:7190");
  EXPECT_EQ(JoinHostPort("::1", 80), "[::1]:80");
  for (const char* address : {"10.0.0.4:7190", "[fe80::1]:8000", "localhost:1"}) {
    const absl::StatusOr<HostPort> a = ParseHostPort(address);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(JoinHostPort(a->host, a->port), address);
  }
}

}  // namespace
}  // namespace odmoe
