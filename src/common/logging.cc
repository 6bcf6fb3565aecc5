#include "src/common/logging.h"

#include <cstdio>
#include <mutex>
#include <utility>

#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"

namespace odmoe::logging {
namespace {

thread_local std::string t_request_id;

// The node name, set once after the cluster file is read and read by every logging thread.
std::mutex g_node_mu;
std::string g_node;  // guarded by g_node_mu

std::string NodeName() {
  std::lock_guard<std::mutex> lock(g_node_mu);
  return g_node;
}

void AppendTo(spdlog::memory_buf_t& dest, std::string_view text) {
  dest.append(text.data(), text.data() + text.size());
}

// Text: "request_id=ID " before the message of a line about a request, nothing otherwise.
class TextRequestIdFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string& id = CurrentRequestId();
    if (id.empty()) return;
    AppendTo(dest, "request_id=");
    AppendTo(dest, id);
    AppendTo(dest, " ");
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<TextRequestIdFlag>(); }
};

// JSON: one string field's value, quoted and escaped. What it holds is chosen by `Part`.
enum class Part { kMessage, kLogger, kNode };
class JsonStringFlag final : public spdlog::custom_flag_formatter {
 public:
  explicit JsonStringFlag(Part part) : part_(part) {}
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    std::string out = "\"";
    switch (part_) {
      case Part::kMessage:
        AppendJsonEscaped(std::string_view(msg.payload.data(), msg.payload.size()), &out);
        break;
      case Part::kLogger:
        AppendJsonEscaped(std::string_view(msg.logger_name.data(), msg.logger_name.size()), &out);
        break;
      case Part::kNode:
        AppendJsonEscaped(NodeName(), &out);
        break;
    }
    out += '"';
    AppendTo(dest, out);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonStringFlag>(part_); }

 private:
  const Part part_;
};

// JSON: `,"request_id":"ID"` on a line about a request, nothing otherwise.
class JsonRequestIdFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string& id = CurrentRequestId();
    if (id.empty()) return;
    std::string out = ",\"request_id\":\"";
    AppendJsonEscaped(id, &out);
    out += '"';
    AppendTo(dest, out);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonRequestIdFlag>(); }
};

}  // namespace

absl::StatusOr<LogFormat> ParseLogFormat(std::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(StrCat("--log-format: expected text or json, got '", name, "'"));
}

absl::StatusOr<LogFormat> LogFormatFromArgs(const std::vector<std::string>& args) {
  static constexpr std::string_view kFlag = "--log-format";
  LogFormat format = LogFormat::kText;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a == kFlag) {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError("--log-format: expected a value (text or json)");
      auto f = ParseLogFormat(args[++i]);
      if (!f.ok()) return f.status();
      format = *f;
    } else if (a.size() > kFlag.size() && a.substr(0, kFlag.size()) == kFlag && a[kFlag.size()] == '=') {
      auto f = ParseLogFormat(a.substr(kFlag.size() + 1));
      if (!f.ok()) return f.status();
      format = *f;
    }
  }
  return format;
}

std::unique_ptr<spdlog::formatter> MakeFormatter(LogFormat format) {
  spdlog::pattern_formatter::custom_flags flags;
  std::string pattern;
  if (format == LogFormat::kText) {
    flags['Q'] = std::make_unique<TextRequestIdFlag>();
    pattern = "[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] %Q%v";
  } else {
    flags['j'] = std::make_unique<JsonStringFlag>(Part::kMessage);
    flags['k'] = std::make_unique<JsonStringFlag>(Part::kLogger);
    flags['N'] = std::make_unique<JsonStringFlag>(Part::kNode);
    flags['q'] = std::make_unique<JsonRequestIdFlag>();
    // Level names (%l: trace, debug, info, warning, error, critical) need no escaping.
    pattern = R"({"time":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","logger":%k,"node":%N,"message":%j%q})";
  }
  return std::make_unique<spdlog::pattern_formatter>(pattern, spdlog::pattern_time_type::utc,
                                                     spdlog::details::os::default_eol, std::move(flags));
}

void Setup(const std::string& program, LogFormat format) {
  spdlog::drop(program);
  auto logger = spdlog::stderr_logger_mt(program);
  logger->set_formatter(MakeFormatter(format));
  // Warnings and errors reach the file at once (a crash right after must not lose them).
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

void SetNode(const std::string& node) {
  std::lock_guard<std::mutex> lock(g_node_mu);
  g_node = node;
}

ScopedRequestId::ScopedRequestId(std::string request_id)
    : previous_(std::exchange(t_request_id, std::move(request_id))) {}

ScopedRequestId::~ScopedRequestId() { t_request_id = std::move(previous_); }

const std::string& CurrentRequestId() { return t_request_id; }

void AppendJsonEscaped(std::string_view text, std::string* out) {
  for (size_t at = 0; at < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[at]);
    const size_t n = Utf8SequenceLength(text, at);
    if (n == 0) {
      *out += "\\ufffd";
      ++at;
      continue;
    }
    if (n > 1) {
      out->append(text.substr(at, n));
    } else if (c == '"' || c == '\\') {
      *out += '\\';
      *out += static_cast<char>(c);
    } else if (c == '\n') {
      *out += "\\n";
    } else if (c == '\r') {
      *out += "\\r";
    } else if (c == '\t') {
      *out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      *out += buf;
    } else {
      *out += static_cast<char>(c);
    }
    at += n;
  }
}

}  // namespace odmoe::logging
