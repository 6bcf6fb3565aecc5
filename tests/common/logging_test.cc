// The daemons' log formats (text and json), the request id on the lines about a request, JSON escaping of any
// bytes, --log-format parsing, and UTF-8 checking.
#include "src/common/logging.h"

#include <sstream>

#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "src/common/json.h"
#include "src/common/utf8.h"

namespace odmoe::logging {
namespace {

// A logger named `name` writing to `out` with `format`.
std::shared_ptr<spdlog::logger> CaptureLogger(std::ostringstream& out, LogFormat format, const std::string& name) {
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto logger = std::make_shared<spdlog::logger>(name, sink);
  logger->set_formatter(MakeFormatter(format));
  return logger;
}

TEST(LoggingTest, TextLinesCarryTheRequestIdInScope) {
  std::ostringstream out;
  auto logger = CaptureLogger(out, LogFormat::kText, "odmoe-main");
  logger->info("before");
  {
    ScopedRequestId scope("0123456789abcdef");
    logger->info("finished: outcome=ok");
    {
      ScopedRequestId inner("");
      logger->warn("no request here");
    }
    logger->info("still about it");
  }
  logger->info("after");
  std::istringstream lines(out.str());
  std::string l1, l2, l3, l4, l5;
  std::getline(lines, l1);
  std::getline(lines, l2);
  std::getline(lines, l3);
  std::getline(lines, l4);
  std::getline(lines, l5);
  EXPECT_NE(l1.find("[odmoe-main] [info] before"), std::string::npos) << l1;
  EXPECT_EQ(l1.find("request_id="), std::string::npos) << l1;
  EXPECT_NE(l2.find("[info] request_id=0123456789abcdef finished: outcome=ok"), std::string::npos) << l2;
  EXPECT_EQ(l3.find("request_id="), std::string::npos) << l3;
  EXPECT_NE(l3.find("[warning] no request here"), std::string::npos) << l3;
  EXPECT_NE(l4.find("request_id=0123456789abcdef still about it"), std::string::npos) << l4;
  EXPECT_EQ(l5.find("request_id="), std::string::npos) << l5;
}

TEST(LoggingTest, JsonLinesAreOneObjectEachWithEveryField) {
  std::ostringstream out;
  auto logger = CaptureLogger(out, LogFormat::kJson, "odmoe-worker");
  SetNode("worker3");
  logger->info("plain");
  {
    ScopedRequestId scope("req-1");
    // Quotes, backslashes, control characters, a newline, non-ASCII text and bytes that are not UTF-8.
    logger->error("a \"quoted\" \\path\\ \t tab\nnew line \x01 caf\xc3\xa9 bad \xff\xfe end");
  }
  SetNode("");
  std::istringstream lines(out.str());
  std::string line;
  std::vector<Json> objects;
  while (std::getline(lines, line)) {
    auto j = ParseJson(line, "log line");
    ASSERT_TRUE(j.ok()) << line << ": " << j.status();
    objects.push_back(*j);
  }
  ASSERT_EQ(objects.size(), 2u) << out.str();
  const Json& a = objects[0];
  EXPECT_EQ(a["level"], "info");
  EXPECT_EQ(a["logger"], "odmoe-worker");
  EXPECT_EQ(a["node"], "worker3");
  EXPECT_EQ(a["message"], "plain");
  EXPECT_FALSE(a.contains("request_id"));
  // 2026-11-25T11:48:45.123456Z
  const std::string time = a["time"].get<std::string>();
  ASSERT_EQ(time.size(), 27u) << time;
  EXPECT_EQ(time[10], 'T');
  EXPECT_EQ(time.back(), 'Z');
  const Json& b = objects[1];
  EXPECT_EQ(b["level"], "error");
  EXPECT_EQ(b["request_id"], "req-1");
  EXPECT_EQ(b["message"], "a \"quoted\" \\path\\ \t tab\nnew line \x01 caf\xc3\xa9 bad \xef\xbf\xbd\xef\xbf\xbd end");
}

TEST(LoggingTest, LogFormatFlag) {
  EXPECT_EQ(*LogFormatFromArgs({"--config", "c.toml"}), LogFormat::kText);
  EXPECT_EQ(*LogFormatFromArgs({"--log-format", "json", "--node", "w"}), LogFormat::kJson);
  EXPECT_EQ(*LogFormatFromArgs({"--log-format=json"}), LogFormat::kJson);
  EXPECT_EQ(*LogFormatFromArgs({"--log-format", "text"}), LogFormat::kText);
  const auto bad = LogFormatFromArgs({"--log-format", "xml"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--log-format"), std::string_view::npos);
  EXPECT_NE(bad.status().message().find("'xml'"), std::string_view::npos);
  EXPECT_FALSE(LogFormatFromArgs({"--log-format"}).ok());
}

TEST(Utf8Test, FindsTheFirstInvalidByte) {
  EXPECT_EQ(FirstInvalidUtf8(""), std::nullopt);
  EXPECT_EQ(FirstInvalidUtf8("plain ASCII"), std::nullopt);
  EXPECT_EQ(FirstInvalidUtf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), std::nullopt);  // 2-, 3- and 4-byte forms
  EXPECT_EQ(FirstInvalidUtf8("ab\xff"), 2u);
  EXPECT_EQ(FirstInvalidUtf8("\x80"), 0u);              // a lone continuation byte
  EXPECT_EQ(FirstInvalidUtf8("x\xc3"), 1u);             // truncated
  EXPECT_EQ(FirstInvalidUtf8("\xc0\xaf"), 0u);          // overlong '/'
  EXPECT_EQ(FirstInvalidUtf8("\xe0\x80\xaf"), 0u);      // overlong, 3 bytes
  EXPECT_EQ(FirstInvalidUtf8("ok\xed\xa0\x80"), 2u);    // a surrogate
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8("\xe2\x82 "), 0u);         // a continuation byte missing
  const absl::Status s = CheckUtf8("In the \xff beginning", "--prompt");
  ASSERT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("--prompt is not valid UTF-8: byte 0xff at offset 7"), std::string_view::npos)
      << s.message();
  EXPECT_TRUE(CheckUtf8("fine", "--prompt").ok());
}

TEST(Utf8Test, EncodesAndDecodesCodePoints) {
  for (const uint32_t cp : {0x0u, 0x41u, 0x7fu, 0x80u, 0xe9u, 0x7ffu, 0x800u, 0x20acu, 0xd7ffu, 0xe000u, 0xffffu,
                            0x10000u, 0x1f600u, 0x10ffffu}) {
    const std::string text = EncodeUtf8(cp);
    EXPECT_EQ(FirstInvalidUtf8(text), std::nullopt) << cp;
    std::vector<uint32_t> decoded;
    ASSERT_TRUE(DecodeUtf8(text, &decoded)) << cp;
    EXPECT_EQ(decoded, std::vector<uint32_t>{cp});
  }
  EXPECT_EQ(EncodeUtf8(0x20ac), "\xe2\x82\xac");
  std::vector<uint32_t> decoded;
  EXPECT_TRUE(DecodeUtf8("a\xc3\xa9\xf0\x9f\x98\x80", &decoded));
  EXPECT_EQ(decoded, (std::vector<uint32_t>{'a', 0xe9, 0x1f600}));
  EXPECT_FALSE(DecodeUtf8("ok\xed\xa0\x80", &decoded));  // a surrogate
}

}  // namespace
}  // namespace odmoe::logging
