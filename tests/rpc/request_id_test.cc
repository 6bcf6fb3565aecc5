// Request ids (rpc/request_id.h) and the routing of libprotobuf's and gRPC's own log lines into spdlog.
#include "src/rpc/request_id.h"

#include <set>
#include <sstream>

#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "src/common/logging.h"
#include "src/rpc/library_logs.h"

namespace odmoe::rpc {
namespace {

TEST(RequestIdTest, NewIdsAreSixteenLowercaseHexCharactersAndDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = NewRequestId();
    ASSERT_EQ(id.size(), 16u) << id;
    for (char c : id) ASSERT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << id;
    EXPECT_TRUE(ValidateRequestId(id).ok());
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
}

TEST(RequestIdTest, ClientIdsAreChecked) {
  EXPECT_TRUE(ValidateRequestId("9b2f6a4e-7c1d-4e8a-b0f3-2d5c6e7f8a9b").ok());
  EXPECT_TRUE(ValidateRequestId("job_17.step:3").ok());
  EXPECT_FALSE(ValidateRequestId("").ok());
  EXPECT_FALSE(ValidateRequestId(std::string(kMaxRequestIdLength + 1, 'a')).ok());
  const absl::Status s = ValidateRequestId("two words");
  ASSERT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("x-request-id"), std::string_view::npos) << s.message();
  EXPECT_NE(s.message().find("character 3"), std::string_view::npos) << s.message();
  EXPECT_FALSE(ValidateRequestId("a\nrequest_id=forged").ok());
}

TEST(RequestIdTest, RecentIdsReportEachRequestOnce) {
  RecentRequestIds recent(2);
  EXPECT_TRUE(recent.Insert("a"));
  EXPECT_FALSE(recent.Insert("a"));
  EXPECT_TRUE(recent.Insert("b"));
  EXPECT_FALSE(recent.Insert("a"));
  EXPECT_TRUE(recent.Insert("c"));  // evicts "a"
  EXPECT_TRUE(recent.Insert("a"));
  EXPECT_FALSE(recent.Insert(""));
}

TEST(LibraryLogsTest, ProtobufAndGrpcLinesGoThroughTheDefaultLogger) {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>("odmoe-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  logger->set_formatter(logging::MakeFormatter(logging::LogFormat::kJson));
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(logger);
  RouteLibraryLogsToSpdlog();
  gpr_log_verbosity_init();  // as grpc_init does (GRPC_VERBOSITY, default ERROR)
  {
    logging::ScopedRequestId scope("abc");
    GOOGLE_LOG(ERROR) << "String field 'x' contains invalid UTF-8 data";
    gpr_log(GPR_ERROR, "a grpc error %d", 42);
  }
  google::protobuf::SetLogHandler(nullptr);          // discard from here on
  gpr_set_log_function(+[](gpr_log_func_args*) {});  // gRPC does not export its default writer
  spdlog::set_default_logger(previous);
  const std::string text = out.str();
  EXPECT_NE(text.find(R"("level":"error")"), std::string::npos) << text;
  EXPECT_NE(text.find(R"x("message":"libprotobuf: String field 'x' contains invalid UTF-8 data (request_id_test.cc:)x"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(R"x("message":"grpc: a grpc error 42 (request_id_test.cc:)x"), std::string::npos) << text;
  EXPECT_NE(text.find(R"("request_id":"abc")"), std::string::npos) << text;
}

}  // namespace
}  // namespace odmoe::rpc
