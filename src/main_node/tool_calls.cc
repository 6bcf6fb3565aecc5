#include "src/main_node/tool_calls.h"

#include <random>

#include "absl/strings/str_format.h"
#include "src/common/markers.h"
#include "src/common/strings.h"

namespace odmoe::openai {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

void AppendTemplateJson(const OrderedJson& v, std::string* out) {
  switch (v.type()) {
    case OrderedJson::value_t::object: {
      *out += '{';
      bool first = true;
      for (const auto& [key, value] : v.items()) {
        if (!first) *out += ", ";
        first = false;
        AppendTemplateJson(OrderedJson(key), out);
        *out += ": ";
        AppendTemplateJson(value, out);
      }
      *out += '}';
      return;
    }
    case OrderedJson::value_t::array: {
      *out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i > 0) *out += ", ";
        AppendTemplateJson(v[i], out);
      }
      *out += ']';
      return;
    }
    case OrderedJson::value_t::string: {
      *out += '"';
      for (const char c : v.get_ref<const std::string&>()) {
        switch (c) {
          case '"':
            *out += "\\\"";
            break;
          case '\\':
            *out += "\\\\";
            break;
          case '\n':
            *out += "\\n";
            break;
          case '\r':
            *out += "\\r";
            break;
          case '\t':
            *out += "\\t";
            break;
          case '\b':
            *out += "\\b";
            break;
          case '\f':
            *out += "\\f";
            break;
          default:
            if (static_cast<unsigned char>(c) < 0x20) {
              *out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
            } else {
              *out += c;  // non-ASCII as it is (ensure_ascii=False)
            }
        }
      }
      *out += '"';
      return;
    }
    default:  // numbers, booleans, null: as JSON writes them
      *out += v.dump();
  }
}

std::string_view Trim(std::string_view s) {
  const size_t first = s.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(" \t\r\n") - first + 1);
}

}  // namespace

std::string NewToolCallId() {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 random(std::random_device{}());
  std::uniform_int_distribution<size_t> pick(0, sizeof(kAlphabet) - 2);
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlphabet[pick(random)];
  return id;
}

std::string TemplateJson(const OrderedJson& value) {
  std::string out;
  AppendTemplateJson(value, &out);
  return out;
}

OutputConstraint ToolCallConstraint(const ToolCalling& calling, const std::vector<ToolDefinition>& tools) {
  OutputConstraint c;
  c.kind = OutputConstraint::Kind::kJsonSchema;
  if (calling.choice == ToolChoice::kNamed) {
    for (const ToolDefinition& tool : tools) {
      if (tool.name == calling.function) c.schema = DumpOrderedJson(tool.parameters);
    }
    return c;
  }
  OrderedJson calls = OrderedJson::array();
  for (const ToolDefinition& tool : tools) {
    OrderedJson call = {{"type", "object"},
                        {"properties", {{"name", {{"const", tool.name}}}, {"parameters", tool.parameters}}},
                        {"required", {"name", "parameters"}}};
    calls.push_back(std::move(call));
  }
  OrderedJson schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", std::move(calls)}}}};
  if (!calling.parallel) schema["maxItems"] = 1;
  c.schema = DumpOrderedJson(schema);
  return c;
}

ToolCallReader::ToolCallReader(ToolCalling calling) : calling_(std::move(calling)) {}

ToolCallReader::Out ToolCallReader::Push(std::string_view text) {
  Out out;
  if (finished_) return out;
  switch (calling_.choice) {
    case ToolChoice::kNone:
      out.content = std::string(text);
      return out;
    case ToolChoice::kNamed:
      if (text.empty()) return out;
      if (calls_.empty()) {
        calls_.push_back({NewToolCallId(), calling_.function, ""});
        out.calls.push_back({0, calls_[0].id, calls_[0].name, std::string(text)});
      } else {
        out.calls.push_back({0, "", "", std::string(text)});
      }
      calls_[0].arguments += text;
      return out;
    case ToolChoice::kRequired:
      pending_ += text;
      return out;
    case ToolChoice::kAuto:
      break;
  }
  pending_ += text;
  for (;;) {
    if (!in_block_ && !calling_.parallel && !calls_.empty()) {  // the one call was made: the rest is content
      Content(pending_, &out);
      pending_.clear();
      return out;
    }
    if (!in_block_) {
      const size_t open = pending_.find(kOpen);
      if (open == std::string::npos) {  // all but what may start a block
        const size_t release = pending_.size() - MarkerPrefixAtEnd(pending_, kOpen);
        Content(std::string_view(pending_).substr(0, release), &out);
        pending_.erase(0, release);
        return out;
      }
      Content(std::string_view(pending_).substr(0, open), &out);
      pending_.erase(0, open + kOpen.size());
      in_block_ = true;
    } else {
      const size_t close = pending_.find(kClose);
      if (close == std::string::npos) return out;
      const std::string_view block = std::string_view(pending_).substr(0, close);
      if (!AddHermesCall(block, &out)) Content(StrCat(kOpen, block, kClose), &out);
      pending_.erase(0, close + kClose.size());
      in_block_ = false;
    }
  }
}

ToolCallReader::Out ToolCallReader::Finish() {
  Out out;
  if (finished_) return out;
  finished_ = true;
  switch (calling_.choice) {
    case ToolChoice::kNone:
      return out;
    case ToolChoice::kNamed:
      if (calls_.empty()) {  // nothing was written: the call still answers the request, with no arguments
        calls_.push_back({NewToolCallId(), calling_.function, ""});
        out.calls.push_back({0, calls_[0].id, calls_[0].name, ""});
      }
      return out;
    case ToolChoice::kRequired: {
      // The grammar held the answer to a list of calls; one cut short (max_tokens) stays text.
      absl::StatusOr<OrderedJson> list = ParseOrderedJson(pending_, "tool calls");
      bool calls_ok = list.ok() && list->is_array() && !list->empty();
      if (calls_ok) {
        for (const OrderedJson& call : *list) {
          const auto name = call.is_object() ? call.find("name") : call.end();
          const auto parameters = call.is_object() ? call.find("parameters") : call.end();
          calls_ok = calls_ok && name != call.end() && name->is_string() && parameters != call.end() &&
                     parameters->is_object();
        }
      }
      if (!calls_ok) {
        out.content = std::move(pending_);
        pending_.clear();
        return out;
      }
      for (const OrderedJson& call : *list) {
        ToolCall made{NewToolCallId(), call["name"].get<std::string>(), DumpOrderedJson(call["parameters"])};
        out.calls.push_back({static_cast<int64_t>(calls_.size()), made.id, made.name, made.arguments});
        calls_.push_back(std::move(made));
      }
      pending_.clear();
      return out;
    }
    case ToolChoice::kAuto:
      break;
  }
  if (in_block_) {  // a block cut short: a call when what came of it is one (vLLM's parser takes it too)
    if (!AddHermesCall(pending_, &out)) Content(StrCat(kOpen, pending_), &out);
  } else {
    Content(pending_, &out);
  }
  pending_.clear();
  in_block_ = false;
  between_.clear();  // whitespace after the last call: not content
  return out;
}

bool ToolCallReader::AddHermesCall(std::string_view block, Out* out) {
  absl::StatusOr<OrderedJson> call = ParseOrderedJson(Trim(block), "tool call");
  if (!call.ok() || !call->is_object()) return false;
  const auto name = call->find("name");
  const auto arguments = call->find("arguments");
  if (name == call->end() || !name->is_string() || name->get_ref<const std::string&>().empty() ||
      arguments == call->end() || !arguments->is_object()) {
    return false;
  }
  ToolCall made{NewToolCallId(), name->get<std::string>(), DumpOrderedJson(*arguments)};
  out->calls.push_back({static_cast<int64_t>(calls_.size()), made.id, made.name, made.arguments});
  calls_.push_back(std::move(made));
  between_.clear();
  return true;
}

void ToolCallReader::Content(std::string_view text, Out* out) {
  if (calls_.empty()) {
    out->content += text;
    return;
  }
  between_ += text;
  if (between_.find_first_not_of(" \t\r\n") != std::string::npos) {
    out->content += between_;
    between_.clear();
  }
}

}  // namespace odmoe::openai
