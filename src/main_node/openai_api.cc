#include "src/main_node/openai_api.h"

#include <cmath>
#include <initializer_list>
#include <limits>
#include <utility>

#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/common/utf8.h"
#include "src/engine/output_grammar.h"

namespace odmoe::openai {
namespace {

// Builds the 400 for `param` and returns the status that carries it.
absl::Status Fail(ApiError* error, std::string param, std::string message) {
  error->http_status = 400;
  error->type = "invalid_request_error";
  error->param = std::move(param);
  error->code = "";
  error->message = std::move(message);
  return absl::InvalidArgumentError(error->message);
}

// The field's value, nullptr when absent or null (null means "not set" for every optional field).
const Json* Field(const Json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string TypeError(std::string_view key, std::string_view expected, const Json& got) {
  return StrCat("'", key, "' must be ", expected, ", got ", JsonTypeName(got));
}

absl::Status ReadNumber(const Json& body, const char* key, double lo, double hi, ApiError* error,
                        std::optional<double>* out) {
  const Json* v = Field(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return Fail(error, key, TypeError(key, "a number", *v));
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi) {
    return Fail(error, key, StrCat("'", key, "' must be in [", lo, ", ", hi, "], got ", d));
  }
  *out = d;
  return absl::OkStatus();
}

// A JSON number that is a whole number in int64's range, written as an integer or as a float (16.0, from Python's
// division: vLLM's pydantic models take it too); nullopt for anything else (16.5, 1e30, 2^63, a string).
std::optional<int64_t> WholeNumber(const Json& v) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) != d || !(std::fabs(d) < 0x1p63)) return std::nullopt;
    return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

absl::Status ReadInt(const Json& body, const char* key, ApiError* error, std::optional<int64_t>* out) {
  const Json* v = Field(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return Fail(error, key, TypeError(key, "an integer", *v));
  *out = WholeNumber(*v);
  if (!out->has_value()) {
    if (v->is_number_unsigned()) return Fail(error, key, StrCat("'", key, "' is too large"));
    return Fail(error, key, StrCat("'", key, "' must be an integer, got ", v->dump()));
  }
  return absl::OkStatus();
}

absl::Status ReadBool(const Json& body, const char* key, ApiError* error, bool* out) {
  const Json* v = Field(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return Fail(error, key, TypeError(key, "a boolean", *v));
  *out = v->get<bool>();
  return absl::OkStatus();
}

// A token id of field `param` (`where`: the element, e.g. "prompt[3]"): a whole number (WholeNumber) in int32's
// range (the model's vocabulary is checked later).
absl::Status ReadTokenId(const Json& v, const char* param, const std::string& where, ApiError* error,
                         std::vector<int32_t>* out) {
  if (!v.is_number()) return Fail(error, param, TypeError(where, "a token id (integer)", v));
  const std::optional<int64_t> id = WholeNumber(v);
  if (!id.has_value() || *id < 0 || *id > std::numeric_limits<int32_t>::max()) {
    return Fail(error, param, StrCat("'", where, "' is not a token id: ", v.dump()));
  }
  out->push_back(static_cast<int32_t>(*id));
  return absl::OkStatus();
}

// A list of token ids of field `param`, each read by ReadTokenId.
absl::Status ReadTokenIdList(const Json& list, const char* param, ApiError* error, std::vector<int32_t>* out) {
  if (!list.is_array()) return Fail(error, param, TypeError(param, "a list of token ids", list));
  for (size_t i = 0; i < list.size(); ++i) {
    ODMOE_RETURN_IF_ERROR(ReadTokenId(list[i], param, StrCat(param, "[", i, "]"), error, out));
  }
  return absl::OkStatus();
}

// `prompt`: a string, a list of strings, a list of ids, or a list of lists of ids.
absl::Status ReadPrompts(const Json& body, ApiError* error, std::vector<Prompt>* out) {
  const Json* v = Field(body, "prompt");
  if (v == nullptr) return Fail(error, "prompt", "'prompt' is required");
  if (v->is_string()) {
    out->push_back(Prompt{true, v->get<std::string>(), {}});
    return absl::OkStatus();
  }
  const std::string expected = "a string, a list of strings, a list of token ids or a list of lists of token ids";
  if (!v->is_array()) return Fail(error, "prompt", TypeError("prompt", expected, *v));
  if (v->empty()) return Fail(error, "prompt", "'prompt' is an empty list");
  const Json& first = v->front();
  if (first.is_number()) {  // one prompt of ids
    Prompt p;
    for (size_t i = 0; i < v->size(); ++i) {
      ODMOE_RETURN_IF_ERROR(ReadTokenId((*v)[i], "prompt", StrCat("prompt[", i, "]"), error, &p.ids));
    }
    out->push_back(std::move(p));
    return absl::OkStatus();
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& item = (*v)[i];
    if (first.is_string()) {
      if (!item.is_string()) return Fail(error, "prompt", TypeError(StrCat("prompt[", i, "]"), "a string", item));
      out->push_back(Prompt{true, item.get<std::string>(), {}});
    } else if (first.is_array()) {
      if (!item.is_array()) {
        return Fail(error, "prompt", TypeError(StrCat("prompt[", i, "]"), "a list of token ids", item));
      }
      if (item.empty()) return Fail(error, "prompt", StrCat("'prompt[", i, "]' is an empty list"));
      Prompt p;
      for (size_t j = 0; j < item.size(); ++j) {
        ODMOE_RETURN_IF_ERROR(ReadTokenId(item[j], "prompt", StrCat("prompt[", i, "][", j, "]"), error, &p.ids));
      }
      out->push_back(std::move(p));
    } else {
      return Fail(error, "prompt", TypeError("prompt[0]", "a string, a token id or a list of token ids", first));
    }
  }
  return absl::OkStatus();
}

// A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined); null is "".
absl::Status ReadContent(const Json& message, size_t i, ApiError* error, std::string* out) {
  const std::string where = StrCat("messages[", i, "].content");
  const Json* c = Field(message, "content");
  if (c == nullptr) return absl::OkStatus();
  if (c->is_string()) {
    *out = c->get<std::string>();
    return absl::OkStatus();
  }
  if (!c->is_array()) return Fail(error, "messages", TypeError(where, "a string or a list of text parts", *c));
  for (size_t j = 0; j < c->size(); ++j) {
    const Json& part = (*c)[j];
    const std::string pwhere = StrCat(where, "[", j, "]");
    if (!part.is_object()) return Fail(error, "messages", TypeError(pwhere, "an object", part));
    const Json* type = Field(part, "type");
    const Json* text = Field(part, "text");
    if (type == nullptr || !type->is_string() || type->get<std::string>() != "text") {
      return Fail(error, "messages", StrCat("'", pwhere, "': only parts of type 'text' are supported"));
    }
    if (text == nullptr || !text->is_string()) {
      return Fail(error, "messages", StrCat("'", pwhere, ".text' must be a string"));
    }
    *out += text->get<std::string>();
  }
  return absl::OkStatus();
}

// An assistant message's `tool_calls` (messages[i]), each {"id", "type": "function", "function": {"name",
// "arguments"}} with its arguments a JSON object's text (or the object itself, which some clients send).
absl::Status ReadToolCalls(const Json& message, size_t i, ApiError* error, std::vector<ToolCall>* out) {
  const Json* v = Field(message, "tool_calls");
  if (v == nullptr) return absl::OkStatus();
  const std::string where = StrCat("messages[", i, "].tool_calls");
  if (!v->is_array()) return Fail(error, "messages", TypeError(where, "a list of calls", *v));
  for (size_t j = 0; j < v->size(); ++j) {
    const Json& call = (*v)[j];
    const std::string at = StrCat(where, "[", j, "]");
    const Json* function = call.is_object() ? Field(call, "function") : nullptr;
    const Json* name = function != nullptr && function->is_object() ? Field(*function, "name") : nullptr;
    if (name == nullptr || !name->is_string()) {
      return Fail(error, "messages", StrCat("'", at, "' must be an object with a 'function' that has a string 'name'"));
    }
    const Json* id = Field(call, "id");
    if (id != nullptr && !id->is_string()) {
      return Fail(error, "messages", TypeError(StrCat(at, ".id"), "a string", *id));
    }
    const Json* arguments = Field(*function, "arguments");
    std::string text = "{}";
    if (arguments != nullptr && arguments->is_object()) {
      text = DumpJson(*arguments);
    } else if (arguments != nullptr) {
      if (!arguments->is_string()) {
        return Fail(error, "messages", TypeError(StrCat(at, ".function.arguments"), "a string", *arguments));
      }
      text = arguments->get<std::string>();
      const absl::StatusOr<Json> parsed = ParseJson(text, "arguments");
      if (!parsed.ok() || !parsed->is_object()) {
        return Fail(error, "messages", StrCat("'", at, ".function.arguments' must be a JSON object's text"));
      }
    }
    out->push_back({id != nullptr ? id->get<std::string>() : "", name->get<std::string>(), std::move(text)});
  }
  return absl::OkStatus();
}

absl::Status ReadMessages(const Json& body, ApiError* error, std::vector<ChatMessage>* out) {
  const Json* v = Field(body, "messages");
  if (v == nullptr) return Fail(error, "messages", "'messages' is required");
  if (!v->is_array()) return Fail(error, "messages", TypeError("messages", "a list of messages", *v));
  if (v->empty()) return Fail(error, "messages", "'messages' is an empty list");
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& m = (*v)[i];
    if (!m.is_object()) return Fail(error, "messages", TypeError(StrCat("messages[", i, "]"), "an object", m));
    const Json* role = Field(m, "role");
    if (role == nullptr || !role->is_string()) {
      return Fail(error, "messages", StrCat("'messages[", i, "].role' must be a string"));
    }
    ChatMessage message;
    message.role = role->get<std::string>();
    if (message.role == "developer") message.role = "system";
    if (message.role != "system" && message.role != "user" && message.role != "assistant" && message.role != "tool") {
      return Fail(error, "messages",
                  StrCat("'messages[", i, "].role' is '", message.role,
                         "': supported roles are system, user, assistant and tool"));
    }
    ODMOE_RETURN_IF_ERROR(ReadContent(m, i, error, &message.content));
    if (message.role == "assistant") ODMOE_RETURN_IF_ERROR(ReadToolCalls(m, i, error, &message.tool_calls));
    if (message.role == "tool") {
      const Json* id = Field(m, "tool_call_id");
      if (id == nullptr || !id->is_string()) {
        return Fail(error, "messages", StrCat("'messages[", i, "].tool_call_id' must be a string (the call answered)"));
      }
      message.tool_call_id = id->get<std::string>();
    }
    out->push_back(std::move(message));
  }
  return absl::OkStatus();
}

absl::Status ReadStop(const Json& body, ApiError* error, std::vector<std::string>* out) {
  const Json* v = Field(body, "stop");
  if (v == nullptr) return absl::OkStatus();
  auto add = [&](const Json& s, const std::string& where) -> absl::Status {
    if (!s.is_string()) return Fail(error, "stop", TypeError(where, "a string", s));
    std::string text = s.get<std::string>();
    if (text.size() > kMaxStopBytes) {
      return Fail(error, "stop", StrCat("'", where, "' is longer than ", kMaxStopBytes, " bytes"));
    }
    if (!text.empty()) out->push_back(std::move(text));
    return absl::OkStatus();
  };
  if (v->is_string()) return add(*v, "stop");
  if (!v->is_array()) return Fail(error, "stop", TypeError("stop", "a string or a list of strings", *v));
  if (v->size() > kMaxStopStrings) {
    return Fail(error, "stop", StrCat("'stop' has ", v->size(), " strings, at most ", kMaxStopStrings));
  }
  for (size_t i = 0; i < v->size(); ++i) ODMOE_RETURN_IF_ERROR(add((*v)[i], StrCat("stop[", i, "]")));
  return absl::OkStatus();
}

// Options odmoe does not implement: refused only when set to a value that needs them.
absl::Status RefuseUnsupported(const Json& body, ApiError* error) {
  auto unsupported = [&](const char* key, const std::string& why) {
    return Fail(error, key, StrCat("'", key, "' ", why, " is not supported"));
  };
  std::optional<int64_t> best_of;
  ODMOE_RETURN_IF_ERROR(ReadInt(body, "best_of", error, &best_of));
  if (best_of && *best_of < 1) return Fail(error, "best_of", StrCat("'best_of' must be >= 1, got ", *best_of));
  if (best_of && *best_of > 1) return unsupported("best_of", StrCat("= ", *best_of, " (ranking candidates)"));
  if (const Json* v = Field(body, "suffix")) {
    if (!v->is_string()) return Fail(error, "suffix", TypeError("suffix", "a string", *v));
    if (!v->get<std::string>().empty()) return unsupported("suffix", "(insertion)");
  }
  // The legacy form of tools (chat's `tools` and `tool_choice` take their place: ReadTools).
  if (const Json* v = Field(body, "functions")) {
    if (!v->is_array()) return Fail(error, "functions", TypeError("functions", "a list", *v));
    if (!v->empty()) return unsupported("functions", "(the legacy form of 'tools')");
  }
  // "none" and "auto" leave the answer to the model (text, with no functions); "required" or a named function would
  // demand a call.
  if (const Json* v = Field(body, "function_call")) {
    if (!v->is_string() || (*v != "none" && *v != "auto")) {
      return unsupported("function_call", StrCat("= ", v->dump(), " (the legacy form of 'tool_choice')"));
    }
  }
  if (Field(body, "audio") != nullptr) return unsupported("audio", "(audio output)");
  if (const Json* v = Field(body, "modalities")) {
    if (!v->is_array()) return Fail(error, "modalities", TypeError("modalities", "a list", *v));
    for (const Json& m : *v) {
      if (m != "text") return unsupported("modalities", StrCat("with ", m.dump(), " (only text)"));
    }
  }
  // vLLM's structured output by a grammar (ReadConstraint takes the rest): ignored, it would leave the answer
  // unconstrained.
  if (Field(body, "guided_grammar") != nullptr) {
    return unsupported("guided_grammar", "(structured output other than guided_choice, guided_json and guided_regex)");
  }
  // vLLM's prompt logprobs: odmoe answers them to `echo` with `logprobs`.
  if (Field(body, "prompt_logprobs") != nullptr) {
    return unsupported("prompt_logprobs", "(vLLM's; /v1/completions gives them with echo and logprobs)");
  }
  // vLLM's sampling extension, at the value that changes nothing.
  bool beam_search = false;
  ODMOE_RETURN_IF_ERROR(ReadBool(body, "use_beam_search", error, &beam_search));
  if (beam_search) return unsupported("use_beam_search", "= true");
  return absl::OkStatus();
}

// A choice constraint's list of strings, `param` naming it in errors ("guided_choice", "structured_outputs").
absl::Status ReadChoices(const Json& list, const std::string& where, const char* param, ApiError* error,
                         OutputConstraint* out) {
  if (!list.is_array()) return Fail(error, param, TypeError(where, "a list of strings", list));
  if (list.empty() || list.size() > kMaxChoices) {
    return Fail(error, param, StrCat("'", where, "' must list 1..", kMaxChoices, " strings, got ", list.size()));
  }
  out->kind = OutputConstraint::Kind::kChoice;
  for (size_t i = 0; i < list.size(); ++i) {
    const Json& c = list[i];
    const std::string item = StrCat(where, "[", i, "]");
    if (!c.is_string()) return Fail(error, param, TypeError(item, "a string", c));
    const std::string& text = c.get_ref<const std::string&>();
    if (text.empty() || text.size() > kMaxChoiceBytes) {
      return Fail(error, param, StrCat("'", item, "' must have 1..", kMaxChoiceBytes, " bytes, got ", text.size()));
    }
    out->choices.push_back(text);
  }
  return absl::OkStatus();
}

// A regular expression the whole answer must match, `value` at `where` in the request, into `out`; `param` names the
// request field in errors. ReadConstraint compiles it.
absl::Status ReadRegex(const Json& value, const std::string& where, const char* param, ApiError* error,
                       OutputConstraint* out) {
  if (!value.is_string()) return Fail(error, param, TypeError(where, "a string", value));
  out->kind = OutputConstraint::Kind::kRegex;
  out->regex = value.get<std::string>();
  return absl::OkStatus();
}

// The JSON Schema at `path` in the request `body` (its text), into `out`: an object or boolean, or a string that
// holds one (vLLM's guided_json takes both). The body is read again keeping its objects' keys in the order the
// client wrote them (Json sorts them), since properties are generated in that order. `param` names the request
// field in errors; `where_out` is set to the path, dotted, for ReadConstraint's message when it does not compile.
absl::Status ReadSchema(std::string_view body, std::initializer_list<const char*> path, const char* param,
                        ApiError* error, OutputConstraint* out, std::string* where_out) {
  std::string& where = *where_out;
  where.clear();
  for (const char* key : path) where += StrCat(where.empty() ? "" : ".", key);
  absl::StatusOr<OrderedJson> ordered = ParseOrderedJson(body, "request body");
  if (!ordered.ok()) return Fail(error, param, std::string(ordered.status().message()));
  const OrderedJson* v = &*ordered;
  for (const char* key : path) {
    const auto it = v->find(key);
    if (it == v->end() || it->is_null()) return Fail(error, param, StrCat("'", where, "' is missing"));
    v = &*it;
  }
  std::string text;
  if (v->is_string()) {
    text = v->get<std::string>();
  } else if (v->is_object() || v->is_boolean()) {
    text = DumpOrderedJson(*v);
  } else {
    return Fail(error, param, StrCat("'", where, "' must be a JSON Schema (an object), got ", JsonTypeName(*v)));
  }
  out->kind = OutputConstraint::Kind::kJsonSchema;
  out->schema = std::move(text);
  return absl::OkStatus();
}

// Structured output, at most one of: OpenAI's `response_format` ({"type": "text"}, {"type": "json_object"} or
// {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; the answer is held to
// the schema whatever `strict` says), vLLM's `guided_choice` (a list of strings), `guided_json` (a schema),
// `guided_regex` (a regular expression the whole answer matches) and `structured_outputs` with `choice`, `json`,
// `regex` or `json_object: true` (its grammar and structural_tag are refused; `disable_any_whitespace` makes the
// JSON compact; its whitespace_pattern and fallback options are left to odmoe's grammar). `text` is the body `body`
// was read from.
absl::Status ReadConstraint(const Json& body, std::string_view text, ApiError* error, CompletionRequest* r) {
  OutputConstraint* out = &r->constraint;
  const char* asked = nullptr;  // the field that asked for a constraint
  std::string where;            // the schema's or expression's path in the request, for the compiler's message
  auto one = [&](const char* param) -> absl::Status {
    if (asked != nullptr) return Fail(error, param, StrCat("'", param, "' cannot be combined with '", asked, "'"));
    asked = param;
    r->constraint_param = param;
    return absl::OkStatus();
  };
  if (const Json* v = Field(body, "response_format")) {
    const Json* type = v->is_object() ? Field(*v, "type") : nullptr;
    if (type == nullptr || !type->is_string()) {
      return Fail(error, "response_format", "'response_format' must be an object with a string 'type'");
    }
    const std::string name = type->get<std::string>();
    if (name == "json_object") {
      ODMOE_RETURN_IF_ERROR(one("response_format"));
      out->kind = OutputConstraint::Kind::kJsonObject;
    } else if (name == "json_schema") {
      ODMOE_RETURN_IF_ERROR(one("response_format"));
      const Json* spec = Field(*v, "json_schema");
      if (spec == nullptr || !spec->is_object()) {
        return Fail(error, "response_format", "'response_format.json_schema' must be an object with a 'schema'");
      }
      ODMOE_RETURN_IF_ERROR(
          ReadSchema(text, {"response_format", "json_schema", "schema"}, "response_format", error, out, &where));
    } else if (name != "text") {
      return Fail(error, "response_format",
                  StrCat("'response_format' of type '", name,
                         "' is not supported (only 'text', 'json_object' and 'json_schema')"));
    }
  }
  if (const Json* v = Field(body, "guided_choice")) {
    ODMOE_RETURN_IF_ERROR(one("guided_choice"));
    ODMOE_RETURN_IF_ERROR(ReadChoices(*v, "guided_choice", "guided_choice", error, out));
  }
  if (Field(body, "guided_json") != nullptr) {
    ODMOE_RETURN_IF_ERROR(one("guided_json"));
    ODMOE_RETURN_IF_ERROR(ReadSchema(text, {"guided_json"}, "guided_json", error, out, &where));
  }
  if (const Json* v = Field(body, "guided_regex")) {
    ODMOE_RETURN_IF_ERROR(one("guided_regex"));
    where = "guided_regex";
    ODMOE_RETURN_IF_ERROR(ReadRegex(*v, where, "guided_regex", error, out));
  }
  if (const Json* v = Field(body, "structured_outputs")) {
    constexpr char kParam[] = "structured_outputs";
    if (!v->is_object()) return Fail(error, kParam, TypeError(kParam, "an object", *v));
    for (const char* key : {"grammar", "structural_tag"}) {
      if (Field(*v, key) != nullptr) {
        return Fail(error, kParam,
                    StrCat("'structured_outputs.", key,
                           "' is not supported (only 'choice', 'json', 'regex' and 'json_object')"));
      }
    }
    auto flag = [&](const char* key, bool* value) -> absl::Status {
      const Json* f = Field(*v, key);
      if (f != nullptr && !f->is_boolean()) {
        return Fail(error, kParam, TypeError(StrCat("structured_outputs.", key), "a boolean", *f));
      }
      *value = f != nullptr && f->get<bool>();
      return absl::OkStatus();
    };
    bool json_object = false;
    ODMOE_RETURN_IF_ERROR(flag("json_object", &json_object));
    ODMOE_RETURN_IF_ERROR(flag("disable_any_whitespace", &out->compact));
    const Json* choice = Field(*v, "choice");
    const Json* schema = Field(*v, "json");
    const Json* regex = Field(*v, "regex");
    if (static_cast<int>(json_object) + static_cast<int>(choice != nullptr) + static_cast<int>(schema != nullptr) +
            static_cast<int>(regex != nullptr) >
        1) {
      return Fail(error, kParam,
                  "'structured_outputs' asks for more than one of 'choice', 'json', 'regex' and 'json_object'");
    }
    if (json_object) {
      ODMOE_RETURN_IF_ERROR(one(kParam));
      out->kind = OutputConstraint::Kind::kJsonObject;
    } else if (choice != nullptr) {
      ODMOE_RETURN_IF_ERROR(one(kParam));
      ODMOE_RETURN_IF_ERROR(ReadChoices(*choice, "structured_outputs.choice", kParam, error, out));
    } else if (schema != nullptr) {
      ODMOE_RETURN_IF_ERROR(one(kParam));
      ODMOE_RETURN_IF_ERROR(ReadSchema(text, {"structured_outputs", "json"}, kParam, error, out, &where));
    } else if (regex != nullptr) {
      ODMOE_RETURN_IF_ERROR(one(kParam));
      where = "structured_outputs.regex";
      ODMOE_RETURN_IF_ERROR(ReadRegex(*regex, where, kParam, error, out));
    }
  }
  // Compiled once its whitespace is known, and then found compiled by the request's validation and sampling.
  if (out->kind == OutputConstraint::Kind::kJsonSchema || out->kind == OutputConstraint::Kind::kRegex) {
    if (const auto grammar = CompileGrammar(*out); !grammar.ok()) {
      return Fail(error, r->constraint_param, StrCat("'", where, "' ", grammar.status().message()));
    }
  }
  return absl::OkStatus();
}

// `tools`, into `out`: at most kMaxTools objects {"type": "function", "function": {"name", "description",
// "parameters"}}, names distinct and as OpenAI allows them ([A-Za-z0-9_-]{1,64}). `text` is the body `body` was
// read from: the tools are read again from it keeping their keys in the client's order, since the template shows
// them as sent and a schema's properties are generated in that order.
absl::Status ReadTools(const Json& body, std::string_view text, ApiError* error, std::vector<ToolDefinition>* out) {
  const Json* v = Field(body, "tools");
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_array()) return Fail(error, "tools", TypeError("tools", "a list of tools", *v));
  if (v->size() > kMaxTools) {
    return Fail(error, "tools", StrCat("'tools' has ", v->size(), " tools, at most ", kMaxTools));
  }
  if (v->empty()) return absl::OkStatus();
  absl::StatusOr<OrderedJson> ordered = ParseOrderedJson(text, "request body");
  if (!ordered.ok()) return Fail(error, "tools", std::string(ordered.status().message()));
  const OrderedJson& list = ordered->at("tools");
  for (size_t i = 0; i < list.size(); ++i) {
    const OrderedJson& tool = list[i];
    const std::string at = StrCat("tools[", i, "]");
    if (!tool.is_object()) return Fail(error, "tools", TypeError(at, "an object", tool));
    const auto type = tool.find("type");
    if (type == tool.end() || *type != "function") {
      return Fail(error, "tools", StrCat("'", at, ".type' must be 'function'"));
    }
    const auto function = tool.find("function");
    if (function == tool.end() || !function->is_object()) {
      return Fail(error, "tools", StrCat("'", at, ".function' must be an object"));
    }
    const auto name = function->find("name");
    const std::string name_text = name != function->end() && name->is_string() ? name->get<std::string>() : "";
    if (name_text.empty() || name_text.size() > 64 ||
        name_text.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-") !=
            std::string::npos) {
      return Fail(error, "tools",
                  StrCat("'", at, ".function.name' must be a string of 1 to 64 letters, digits, '_' or '-'"));
    }
    for (const ToolDefinition& earlier : *out) {
      if (earlier.name == name_text) {
        return Fail(error, "tools", StrCat("'", at, ".function.name' '", name_text, "' is given twice"));
      }
    }
    // No parameters: the function takes none (an empty object is its one call).
    ToolDefinition definition{
        name_text, {{"type", "object"}, {"properties", OrderedJson::object()}, {"additionalProperties", false}}, tool};
    if (const auto parameters = function->find("parameters"); parameters != function->end() && !parameters->is_null()) {
      if (!parameters->is_object()) {
        return Fail(error, "tools",
                    TypeError(StrCat(at, ".function.parameters"), "a JSON Schema (an object)", *parameters));
      }
      definition.parameters = *parameters;
    }
    out->push_back(std::move(definition));
  }
  return absl::OkStatus();
}

// Chat's `tool_choice` ("none", "auto", "required" or {"type": "function", "function": {"name"}}) over r->tools,
// and `parallel_tool_calls`; a tool_choice that demands a call holds the answer to it (ToolCallConstraint), so it
// cannot be combined with another constraint. Each tool whose parameters the answer may fill is compiled first, so
// a bad schema is named.
absl::Status ReadToolChoice(const Json& body, ApiError* error, CompletionRequest* r) {
  ToolCalling& calling = r->tool_calling;
  ODMOE_RETURN_IF_ERROR(ReadBool(body, "parallel_tool_calls", error, &calling.parallel));
  calling.choice = r->tools.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (const Json* v = Field(body, "tool_choice")) {
    const Json* function = v->is_object() ? Field(*v, "function") : nullptr;
    const Json* name = function != nullptr && function->is_object() ? Field(*function, "name") : nullptr;
    if (*v == "none") {
      calling.choice = ToolChoice::kNone;
    } else if (*v == "auto") {
      // as without it
    } else if (*v == "required") {
      calling.choice = ToolChoice::kRequired;
    } else if (name != nullptr && name->is_string()) {
      calling.choice = ToolChoice::kNamed;
      calling.function = name->get<std::string>();
    } else {
      return Fail(error, "tool_choice",
                  StrCat("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", ",
                         "\"function\": {\"name\": ...}}, got ", v->dump()));
    }
  }
  if (calling.choice != ToolChoice::kRequired && calling.choice != ToolChoice::kNamed) return absl::OkStatus();
  if (r->tools.empty()) return Fail(error, "tool_choice", "'tool_choice' demands a call, but 'tools' offers none");
  if (r->constraint.active()) {
    return Fail(error, "tool_choice",
                StrCat("'tool_choice' demands a call, which cannot be combined with '", r->constraint_param, "'"));
  }
  bool named_found = false;
  for (size_t i = 0; i < r->tools.size(); ++i) {
    if (calling.choice == ToolChoice::kNamed && r->tools[i].name != calling.function) continue;
    named_found = true;
    OutputConstraint parameters{.kind = OutputConstraint::Kind::kJsonSchema,
                                .schema = DumpOrderedJson(r->tools[i].parameters)};
    if (const auto grammar = CompileGrammar(parameters); !grammar.ok()) {
      return Fail(error, "tools", StrCat("'tools[", i, "].function.parameters' ", grammar.status().message()));
    }
  }
  if (!named_found) {
    return Fail(error, "tool_choice",
                StrCat("'tool_choice' names the function '", calling.function, "', which is not one of 'tools'"));
  }
  r->constraint = ToolCallConstraint(calling, r->tools);
  r->constraint_param = "tool_choice";
  if (const auto grammar = CompileGrammar(r->constraint); !grammar.ok()) {
    return Fail(error, "tool_choice", StrCat("'tool_choice' = required: ", grammar.status().message()));
  }
  return absl::OkStatus();
}

// vLLM's `chat_template_kwargs`: an object, whose `enable_thinking` (a boolean) odmoe's formats read.
absl::Status ReadTemplateArgs(const Json& body, ApiError* error, ChatTemplateArgs* out) {
  const Json* v = Field(body, "chat_template_kwargs");
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_object()) return Fail(error, "chat_template_kwargs", TypeError("chat_template_kwargs", "an object", *v));
  if (const Json* thinking = Field(*v, "enable_thinking")) {
    if (!thinking->is_boolean()) {
      return Fail(error, "chat_template_kwargs",
                  TypeError("chat_template_kwargs.enable_thinking", "a boolean", *thinking));
    }
    out->enable_thinking = thinking->get<bool>();
  }
  return absl::OkStatus();
}

// `logit_bias`: {"token id": bias in [-100, 100]}, at most kMaxLogitBias entries (ids checked against the model
// later, with the rest of the sampling options).
absl::Status ReadLogitBias(const Json& body, ApiError* error, std::vector<std::pair<int32_t, double>>* out) {
  const Json* v = Field(body, "logit_bias");
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_object()) return Fail(error, "logit_bias", TypeError("logit_bias", "an object", *v));
  if (v->size() > kMaxLogitBias) {
    return Fail(error, "logit_bias", StrCat("'logit_bias' has ", v->size(), " entries, at most ", kMaxLogitBias));
  }
  for (const auto& [key, bias] : v->items()) {
    int64_t id = 0;
    const bool digits = !key.empty() && key.size() <= 10 && key.find_first_not_of("0123456789") == std::string::npos;
    if (digits) id = std::stoll(key);
    if (!digits || id > std::numeric_limits<int32_t>::max()) {
      return Fail(error, "logit_bias", StrCat("'logit_bias' key '", key, "' is not a token id"));
    }
    if (!bias.is_number() || !std::isfinite(bias.get<double>()) || bias.get<double>() < -100 ||
        bias.get<double>() > 100) {
      return Fail(error, "logit_bias",
                  StrCat("'logit_bias[\"", key, "\"]' must be a number in [-100, 100], got ", bias.dump()));
    }
    out->emplace_back(static_cast<int32_t>(id), bias.get<double>());
  }
  return absl::OkStatus();
}

// Completions: `logprobs`, the alternatives per token (0..kMaxTopLogprobs). Chat: `logprobs` true, with
// `top_logprobs` alternatives (0..kMaxTopLogprobs, only with logprobs). -1 in *out when not asked for.
absl::Status ReadLogprobs(const Json& body, Endpoint endpoint, ApiError* error, int32_t* out) {
  auto in_range = [&](const char* key, int64_t n) -> absl::Status {
    if (n < 0 || n > kMaxTopLogprobs) {
      return Fail(error, key, StrCat("'", key, "' must be in [0, ", kMaxTopLogprobs, "], got ", n));
    }
    *out = static_cast<int32_t>(n);
    return absl::OkStatus();
  };
  if (endpoint == Endpoint::kCompletions) {
    std::optional<int64_t> n;
    ODMOE_RETURN_IF_ERROR(ReadInt(body, "logprobs", error, &n));
    return n ? in_range("logprobs", *n) : absl::OkStatus();
  }
  bool logprobs = false;
  ODMOE_RETURN_IF_ERROR(ReadBool(body, "logprobs", error, &logprobs));
  std::optional<int64_t> top;
  ODMOE_RETURN_IF_ERROR(ReadInt(body, "top_logprobs", error, &top));
  if (!logprobs) {
    if (top && *top != 0) return Fail(error, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    return absl::OkStatus();
  }
  return in_range("top_logprobs", top.value_or(0));
}

}  // namespace

std::string ErrorBody(const ApiError& e) {
  Json error = {{"message", e.message},
                {"type", e.type},
                {"param", e.param.empty() ? Json(nullptr) : Json(e.param)},
                {"code", e.code.empty() ? Json(nullptr) : Json(e.code)}};
  return DumpJson(Json{{"error", error}});
}

ApiError ErrorOfStatus(const absl::Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      e.http_status = 400;
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      break;
    case absl::StatusCode::kResourceExhausted:
      if (IsServerBusy(status)) {  // main's queue is full: come back in a second
        e.http_status = 429;
        e.type = "rate_limit_error";
        e.code = "server_busy";
        e.retry_after_s = 1;
      } else {  // a memory budget exceeded: the cluster cannot serve this now
        e.http_status = 503;
        e.type = "server_error";
      }
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "server_error";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "server_error";
      break;
    case absl::StatusCode::kCancelled:
      e.http_status = 499;
      e.type = "server_error";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

namespace {

// A request body: a JSON object whose `model`, where given and not null, is a string.
absl::StatusOr<Json> ReadBody(std::string_view body, ApiError* error, std::optional<std::string>* model_out) {
  absl::StatusOr<Json> parsed = ParseJson(body, "request body");
  if (!parsed.ok()) return Fail(error, "", std::string(parsed.status().message()));
  if (!parsed->is_object()) return Fail(error, "", TypeError("the request body", "a JSON object", *parsed));
  const Json* model = Field(*parsed, "model");
  if (model == nullptr) return parsed;  // absent or null
  if (!model->is_string()) return Fail(error, "model", TypeError("model", "a string", *model));
  *model_out = model->get<std::string>();
  return parsed;
}

}  // namespace

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(std::string_view body, ApiError* error) {
  TokenizeRequest r;
  ODMOE_ASSIGN_OR_RETURN(const Json j, ReadBody(body, error, &r.model));
  const Json* prompt = Field(j, "prompt");
  const bool has_messages = Field(j, "messages") != nullptr;
  if ((prompt != nullptr) == has_messages) return Fail(error, "prompt", "give either 'prompt' or 'messages'");
  if (prompt != nullptr) {
    if (!prompt->is_string()) return Fail(error, "prompt", TypeError("prompt", "a string", *prompt));
    r.prompt = prompt->get<std::string>();
    ODMOE_RETURN_IF_ERROR(ReadBool(j, "add_special_tokens", error, &r.add_special_tokens));
  } else {
    ODMOE_RETURN_IF_ERROR(ReadMessages(j, error, &r.messages));
    ODMOE_RETURN_IF_ERROR(ReadTools(j, body, error, &r.tools));
    ODMOE_RETURN_IF_ERROR(ReadTemplateArgs(j, error, &r.template_args));
  }
  return r;
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(std::string_view body, ApiError* error) {
  DetokenizeRequest r;
  ODMOE_ASSIGN_OR_RETURN(const Json j, ReadBody(body, error, &r.model));
  const Json* tokens = Field(j, "tokens");
  if (tokens == nullptr) return Fail(error, "tokens", "'tokens' is required");
  ODMOE_RETURN_IF_ERROR(ReadTokenIdList(*tokens, "tokens", error, &r.tokens));
  return r;
}

absl::StatusOr<SamplingDefaults> ReadSamplingDefaults(const Json& config, const std::string& path,
                                                      std::vector<std::string>* ignored) {
  const JsonFields f(config, path);
  SamplingDefaults d;
  ODMOE_ASSIGN_OR_RETURN(const double temperature, f.Number("temperature", d.temperature));
  ODMOE_ASSIGN_OR_RETURN(const double top_p, f.Number("top_p", d.top_p));
  ODMOE_ASSIGN_OR_RETURN(const int64_t top_k, f.Int("top_k", d.top_k));
  ODMOE_ASSIGN_OR_RETURN(const double min_p, f.Number("min_p", d.min_p));
  ODMOE_ASSIGN_OR_RETURN(const double repetition_penalty, f.Number("repetition_penalty", d.repetition_penalty));
  ODMOE_ASSIGN_OR_RETURN(const int64_t max_new_tokens, f.Int("max_new_tokens", 0));
  // A value no request may ask for is left out, as odmoe cannot follow it.
  auto follow = [ignored](const char* key, double value, bool in_range, std::string_view range, double* out) {
    if (in_range) {
      *out = value;
    } else {
      ignored->push_back(StrCat(key, " = ", value, " (outside ", range, ")"));
    }
  };
  follow("temperature", temperature, temperature >= 0 && temperature <= 2, "[0, 2]", &d.temperature);
  follow("top_p", top_p, top_p > 0 && top_p <= 1, "(0, 1]", &d.top_p);
  if (top_k >= -1) {
    d.top_k = std::max<int64_t>(top_k, 0);
  } else {
    ignored->push_back(StrCat("top_k = ", top_k, " (below -1)"));
  }
  follow("min_p", min_p, min_p >= 0 && min_p <= 1, "[0, 1]", &d.min_p);
  follow("repetition_penalty", repetition_penalty,
         repetition_penalty > 0 && repetition_penalty <= kMaxRepetitionPenalty,
         StrCat("(0, ", kMaxRepetitionPenalty, "]"), &d.repetition_penalty);
  if (max_new_tokens >= 1) {
    d.max_tokens = max_new_tokens;
  } else if (f.Has("max_new_tokens")) {
    ignored->push_back(StrCat("max_new_tokens = ", max_new_tokens, " (below 1)"));
  }
  return d;
}

absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body, Endpoint endpoint, ApiError* error,
                                                         const SamplingDefaults& defaults) {
  CompletionRequest r;
  r.endpoint = endpoint;
  r.temperature = defaults.temperature;
  r.top_p = defaults.top_p;
  r.top_k = defaults.top_k;
  r.min_p = defaults.min_p;
  r.repetition_penalty = defaults.repetition_penalty;
  r.default_max_tokens = defaults.max_tokens;
  ODMOE_ASSIGN_OR_RETURN(const Json j, ReadBody(body, error, &r.model));
  if (endpoint == Endpoint::kCompletions) {
    ODMOE_RETURN_IF_ERROR(ReadPrompts(j, error, &r.prompts));
  } else {
    ODMOE_RETURN_IF_ERROR(ReadMessages(j, error, &r.messages));
  }
  ODMOE_RETURN_IF_ERROR(RefuseUnsupported(j, error));
  ODMOE_RETURN_IF_ERROR(ReadConstraint(j, body, error, &r));
  if (endpoint == Endpoint::kChatCompletions) {
    ODMOE_RETURN_IF_ERROR(ReadTools(j, body, error, &r.tools));
    ODMOE_RETURN_IF_ERROR(ReadToolChoice(j, error, &r));
    ODMOE_RETURN_IF_ERROR(ReadTemplateArgs(j, error, &r.template_args));
  } else {
    for (const char* key : {"tools", "tool_choice"}) {  // chat options: refused where they would change anything
      const Json* v = Field(j, key);
      if (v != nullptr && !(v->is_array() && v->empty()) && *v != "none" && *v != "auto") {
        return Fail(error, key, StrCat("'", key, "' is a chat option (POST /v1/chat/completions)"));
      }
    }
  }
  std::optional<int64_t> choices;
  ODMOE_RETURN_IF_ERROR(ReadInt(j, "n", error, &choices));
  if (choices && (*choices < 1 || *choices > kMaxChoicesPerPrompt)) {
    return Fail(error, "n", StrCat("'n' must be in [1, ", kMaxChoicesPerPrompt, "], got ", *choices));
  }
  r.n = choices.value_or(1);
  if (const auto prompts = static_cast<int64_t>(r.prompts.size()); prompts * r.n > kMaxChoicesPerRequest) {
    return Fail(error, "prompt",
                StrCat("'prompt' has ", prompts, " prompts and 'n' is ", r.n, ": ", prompts * r.n,
                       " choices, more than the ", kMaxChoicesPerRequest, " a request may ask for"));
  }
  if (Field(j, "best_of") != nullptr && r.n > 1) {  // best_of is 1 here: fewer candidates than choices
    return Fail(error, "best_of", StrCat("'best_of' must be >= 'n' (", r.n, "), got 1"));
  }
  ODMOE_RETURN_IF_ERROR(ReadBool(j, "echo", error, &r.echo));
  if (r.echo && endpoint == Endpoint::kChatCompletions) {
    return Fail(error, "echo", "'echo' = true (a completions option) is not supported");
  }
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    std::optional<int64_t> n;
    ODMOE_RETURN_IF_ERROR(ReadInt(j, key, error, &n));
    if (!n) continue;
    // Nothing to generate is an answer only when the prompt comes back (scoring a text by its logprobs).
    if (*n < (r.echo ? 0 : 1)) {
      return Fail(error, key, StrCat("'", key, "' must be >= ", r.echo ? "0" : "1 (0 with 'echo')", ", got ", *n));
    }
    r.max_tokens = r.max_tokens ? std::min(*r.max_tokens, *n) : *n;
  }
  std::optional<double> temperature, top_p;
  ODMOE_RETURN_IF_ERROR(ReadNumber(j, "temperature", 0.0, 2.0, error, &temperature));
  ODMOE_RETURN_IF_ERROR(ReadNumber(j, "top_p", 0.0, 1.0, error, &top_p));
  if (temperature) r.temperature = *temperature;
  if (top_p) {
    if (*top_p == 0) return Fail(error, "top_p", "'top_p' must be in (0, 1], got 0");
    r.top_p = *top_p;
  }
  std::optional<int64_t> top_k;
  ODMOE_RETURN_IF_ERROR(ReadInt(j, "top_k", error, &top_k));
  if (top_k && *top_k < -1) return Fail(error, "top_k", StrCat("'top_k' must be -1, 0 (all) or >= 1, got ", *top_k));
  if (top_k) r.top_k = std::max<int64_t>(*top_k, 0);
  std::optional<double> min_p;
  ODMOE_RETURN_IF_ERROR(ReadNumber(j, "min_p", 0.0, 1.0, error, &min_p));
  if (min_p) r.min_p = *min_p;
  std::optional<double> repetition_penalty;
  ODMOE_RETURN_IF_ERROR(ReadNumber(j, "repetition_penalty", 0.0, kMaxRepetitionPenalty, error, &repetition_penalty));
  if (repetition_penalty) {
    if (*repetition_penalty == 0) {
      return Fail(error, "repetition_penalty",
                  StrCat("'repetition_penalty' must be in (0, ", kMaxRepetitionPenalty, "], got 0"));
    }
    r.repetition_penalty = *repetition_penalty;
  }
  std::optional<int64_t> seed;
  ODMOE_RETURN_IF_ERROR(ReadInt(j, "seed", error, &seed));
  if (seed) r.seed = static_cast<uint64_t>(*seed);
  std::optional<double> presence, frequency;
  ODMOE_RETURN_IF_ERROR(ReadNumber(j, "presence_penalty", -2.0, 2.0, error, &presence));
  ODMOE_RETURN_IF_ERROR(ReadNumber(j, "frequency_penalty", -2.0, 2.0, error, &frequency));
  r.presence_penalty = presence.value_or(0.0);
  r.frequency_penalty = frequency.value_or(0.0);
  ODMOE_RETURN_IF_ERROR(ReadLogitBias(j, error, &r.logit_bias));
  ODMOE_RETURN_IF_ERROR(ReadStop(j, error, &r.stop));
  ODMOE_RETURN_IF_ERROR(ReadBool(j, "stream", error, &r.stream));
  ODMOE_RETURN_IF_ERROR(ReadBool(j, "ignore_eos", error, &r.ignore_eos));
  std::optional<int64_t> min_tokens;
  ODMOE_RETURN_IF_ERROR(ReadInt(j, "min_tokens", error, &min_tokens));
  if (min_tokens && *min_tokens < 0) {
    return Fail(error, "min_tokens", StrCat("'min_tokens' must be >= 0, got ", *min_tokens));
  }
  r.min_tokens = min_tokens.value_or(0);
  if (const Json* ids = Field(j, "stop_token_ids")) {
    ODMOE_RETURN_IF_ERROR(ReadTokenIdList(*ids, "stop_token_ids", error, &r.stop_token_ids));
  }
  ODMOE_RETURN_IF_ERROR(ReadBool(j, "include_stop_str_in_output", error, &r.include_stop_str_in_output));
  ODMOE_RETURN_IF_ERROR(ReadLogprobs(j, endpoint, error, &r.logprobs));
  if (const Json* so = Field(j, "stream_options")) {
    if (!so->is_object()) return Fail(error, "stream_options", TypeError("stream_options", "an object", *so));
    ODMOE_RETURN_IF_ERROR(ReadBool(*so, "include_usage", error, &r.include_usage));
    ODMOE_RETURN_IF_ERROR(ReadBool(*so, "continuous_usage_stats", error, &r.continuous_usage));
    if (!r.stream) return Fail(error, "stream_options", "'stream_options' is only allowed with 'stream': true");
  }
  return r;
}

int64_t MaxTokens(const CompletionRequest& r, int64_t prompt_len, int64_t max_positions) {
  if (r.max_tokens) return *r.max_tokens;
  if (r.endpoint == Endpoint::kCompletions) return kDefaultCompletionMaxTokens;
  const int64_t rest = std::max<int64_t>(1, max_positions - prompt_len);
  return r.default_max_tokens ? std::min(rest, *r.default_max_tokens) : rest;
}

// ---- chat templates ----------------------------------------------------------------------------------------

std::string_view ChatFormatName(ChatFormat format) {
  switch (format) {
    case ChatFormat::kMistralInst:
      return "mistral-inst";
    case ChatFormat::kLlama2:
      return "llama2";
    case ChatFormat::kChatMl:
      return "chatml";
    case ChatFormat::kNone:
      break;
  }
  return "none";
}

namespace {

// tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (the "default" one).
std::string TemplateText(const Json& config) {
  if (!config.is_object()) return "";
  auto it = config.find("chat_template");
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const Json& t : *it) {
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string()) {
        return t["template"].get<std::string>();
      }
    }
  }
  return "";
}

// The system message a ChatML template writes when the request has none: the text of a string literal
// '<|im_start|>system\n...<|im_end|>\n' (Qwen2's "You are a helpful assistant."), its escapes undone; "" when
// the template has no such literal (Qwen3 writes a system turn only when the request has one).
std::string ChatMlDefaultSystem(std::string_view text) {
  for (const char quote : {'\'', '"'}) {
    const std::string open = StrCat(std::string(1, quote), "<|im_start|>system\\n");
    const std::string close = StrCat("<|im_end|>\\n", std::string(1, quote));
    for (size_t at = text.find(open); at != std::string_view::npos; at = text.find(open, at + 1)) {
      const size_t begin = at + open.size();
      std::string out;
      for (size_t i = begin; i < text.size() && text[i] != quote; ++i) {
        if (text.compare(i, close.size(), close) == 0) return out.empty() ? std::string() : out;
        if (text[i] == '\\' && i + 1 < text.size()) {
          const char e = text[++i];
          out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
        } else {
          out += text[i];
        }
      }
    }
  }
  return "";
}

}  // namespace

ChatTemplate ChooseChatTemplate(const Json& tokenizer_config, std::string_view architecture) {
  const std::string text = TemplateText(tokenizer_config);
  ChatTemplate chat;
  if (text.find("[INST]") != std::string::npos && text.find("[/INST]") != std::string::npos) {
    chat.format = text.find("<<SYS>>") != std::string::npos ? ChatFormat::kLlama2 : ChatFormat::kMistralInst;
  } else if (text.find("<|im_start|>") != std::string::npos && text.find("<|im_end|>") != std::string::npos) {
    chat.format = ChatFormat::kChatMl;
    chat.default_system = ChatMlDefaultSystem(text);
    chat.drop_reasoning = text.find("split('</think>')") != std::string::npos;
    chat.tools = text.find("<tools>") != std::string::npos && text.find("<tool_call>") != std::string::npos;
    chat.thinking_switch = text.find("enable_thinking") != std::string::npos;
  } else if (architecture == "MixtralForCausalLM") {
    chat.format = ChatFormat::kMistralInst;
  }
  return chat;
}

std::string ChatTemplateMismatch(const ChatTemplate& chat, const Tokenizer& tokenizer) {
  if (chat.format == ChatFormat::kChatMl) {
    for (const std::string_view marker : {"<|im_start|>", "<|im_end|>"}) {
      if (tokenizer.Encode(marker).size() != 1) {
        return StrCat("its ChatML template's marker ", marker, " is not one token of its tokenizer");
      }
    }
  } else if (chat.format != ChatFormat::kNone && (tokenizer.bos_id() < 0 || tokenizer.eos_id() < 0)) {
    return StrCat("its ", ChatFormatName(chat.format),
                  " template needs BOS and EOS tokens, which its tokenizer does not name");
  }
  return "";
}

namespace {

// Qwen's words for the tools in the system turn (Qwen2.5's and Qwen3's templates), around one line per tool.
constexpr std::string_view kToolsPreamble =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
constexpr std::string_view kToolsPostscript =
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>";

// An assistant message's content as the template writes it: `answer`, after `reasoning` when that is not empty.
struct AssistantTurn {
  std::string_view reasoning, answer;
  std::string Text() const {
    return reasoning.empty() ? std::string(answer) : StrCat("<think>\n", reasoning, "\n</think>\n\n", answer);
  }
};
// Qwen3's (drop_reasoning): the reasoning (up to "</think>") of a turn before the last query is dropped; a later
// turn's (one of a tool-calling run) is kept. Other templates write the content as it is.
AssistantTurn SplitAssistantContent(const ChatTemplate& chat, std::string_view content, bool after_last_query) {
  const size_t end = content.rfind("</think>");
  if (!chat.drop_reasoning || end == std::string_view::npos) return {{}, content};
  AssistantTurn turn;
  turn.answer = content.substr(end + std::string_view("</think>").size());
  while (!turn.answer.empty() && turn.answer.front() == '\n') turn.answer.remove_prefix(1);
  if (!after_last_query) return turn;
  std::string_view reasoning = content.substr(0, content.find("</think>"));
  if (const size_t open = reasoning.rfind("<think>"); open != std::string_view::npos) {
    reasoning.remove_prefix(open + std::string_view("<think>").size());
  }
  while (!reasoning.empty() && reasoning.front() == '\n') reasoning.remove_prefix(1);
  while (!reasoning.empty() && reasoning.back() == '\n') reasoning.remove_suffix(1);
  turn.reasoning = reasoning;
  return turn;
}

// The last query of a conversation, as Qwen3's template finds it: the last user message that is not a tool's
// response (<tool_response>...</tool_response>), else the last message.
size_t LastQuery(const std::vector<ChatMessage>& messages) {
  for (size_t i = messages.size(); i-- > 0;) {
    const std::string_view content = messages[i].content;
    if (messages[i].role == "user" &&
        !(content.starts_with("<tool_response>") && content.ends_with("</tool_response>"))) {
      return i;
    }
  }
  return messages.size() - 1;
}

absl::StatusOr<std::vector<PromptPiece>> RenderChatMl(const ChatTemplate& chat,
                                                      const std::vector<ChatMessage>& messages,
                                                      const std::vector<ToolDefinition>& tools,
                                                      const ChatTemplateArgs& args) {
  if (messages.empty() || (messages.back().role != "user" && messages.back().role != "tool")) {
    return absl::InvalidArgumentError(
        messages.empty() ? std::string("messages: at least one user message is needed")
                         : StrCat("messages[", messages.size() - 1,
                                  "]: the last message must be the user's or a tool's (the model answers it)"));
  }
  const size_t last_query = LastQuery(messages);
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (!chat.tools && (m.role == "tool" || !m.tool_calls.empty())) {
      return absl::InvalidArgumentError(StrCat(
          "messages[", i, "]: ", m.role == "tool" ? "a tool message" : "tool calls", ": ", ChatToolsMismatch(chat)));
    }
  }
  std::string text;
  size_t first = 0;
  if (!tools.empty()) {
    if (!chat.tools) return absl::InvalidArgumentError(StrCat("tools: ", ChatToolsMismatch(chat)));
    const bool own_system = messages[0].role == "system";
    const std::string& system = own_system ? messages[0].content : chat.default_system;
    first = own_system ? 1 : 0;
    text = StrCat("<|im_start|>system\n", system, system.empty() ? "" : "\n\n", kToolsPreamble);
    for (const ToolDefinition& tool : tools) text += StrCat("\n", TemplateJson(tool.tool));
    text += StrCat(kToolsPostscript, "<|im_end|>\n");
  } else if (!chat.default_system.empty() && messages[0].role != "system") {
    text = StrCat("<|im_start|>system\n", chat.default_system, "<|im_end|>\n");
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "tool") {  // a run of tool results is one user turn
      if (i == 0 || messages[i - 1].role != "tool") text += "<|im_start|>user";
      text += StrCat("\n<tool_response>\n", m.content, "\n</tool_response>");
      if (i + 1 == messages.size() || messages[i + 1].role != "tool") text += "<|im_end|>\n";
      continue;
    }
    if (m.role != "assistant") {
      text += StrCat("<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
      continue;
    }
    const AssistantTurn turn = SplitAssistantContent(chat, m.content, i > last_query);
    text += StrCat("<|im_start|>", m.role, "\n", turn.Text());
    for (size_t j = 0; j < m.tool_calls.size(); ++j) {
      const ToolCall& call = m.tool_calls[j];
      // The arguments as the template's tojson writes them (vLLM hands the template the parsed object).
      const absl::StatusOr<OrderedJson> arguments = ParseOrderedJson(call.arguments, "arguments");
      if (!arguments.ok()) {
        return absl::InvalidArgumentError(
            StrCat("messages[", i, "].tool_calls[", j, "]: ", arguments.status().message()));
      }
      text += StrCat(j > 0 || !turn.answer.empty() ? "\n" : "", "<tool_call>\n{\"name\": \"", call.name,
                     "\", \"arguments\": ", TemplateJson(*arguments), "}\n</tool_call>");
    }
    text += "<|im_end|>\n";
  }
  text += "<|im_start|>assistant\n";
  if (chat.thinking_switch && !args.enable_thinking) text += "<think>\n\n</think>\n\n";
  return std::vector<PromptPiece>{{PromptPiece::kText, std::move(text)}};
}

}  // namespace

std::string ChatToolsMismatch(const ChatTemplate& chat) {
  if (chat.tools) return "";
  if (chat.format == ChatFormat::kChatMl) {
    return "this model's chat template has no place for tools (it lists no <tools> and teaches no <tool_call>)";
  }
  return StrCat("this model's chat format (", ChatFormatName(chat.format), ") has no place for tools");
}

absl::StatusOr<std::vector<PromptPiece>> RenderChat(const ChatTemplate& chat, const std::vector<ChatMessage>& messages,
                                                    const std::vector<ToolDefinition>& tools,
                                                    const ChatTemplateArgs& args) {
  if (chat.format == ChatFormat::kChatMl) return RenderChatMl(chat, messages, tools, args);
  if (!tools.empty()) return absl::InvalidArgumentError(StrCat("tools: ", ChatToolsMismatch(chat)));
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role == "tool" || !messages[i].tool_calls.empty()) {
      return absl::InvalidArgumentError(StrCat("messages[", i, "]: ", ChatToolsMismatch(chat)));
    }
  }
  const ChatFormat format = chat.format;
  size_t first = 0;
  std::string system;
  if (!messages.empty() && messages[0].role == "system") {
    system = messages[0].content;
    first = 1;
  }
  if (first == messages.size()) {
    return absl::InvalidArgumentError("messages: at least one user message is needed");
  }
  std::vector<PromptPiece> pieces = {{PromptPiece::kBos, ""}};
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool user_turn = (i - first) % 2 == 0;
    if (m.role != (user_turn ? "user" : "assistant")) {
      return absl::InvalidArgumentError(
          StrCat("messages[", i, "]: role '", m.role, "' where '", user_turn ? "user" : "assistant",
                 "' was expected: after an optional system message, user and assistant alternate"));
    }
    if (user_turn) {
      std::string content = m.content;
      if (i == first && !system.empty()) {
        content = format == ChatFormat::kLlama2 ? StrCat("<<SYS>>\n", system, "\n<</SYS>>\n\n", content)
                                                : StrCat(system, "\n\n", content);
      }
      pieces.push_back({PromptPiece::kText, StrCat("[INST] ", content, " [/INST]")});
    } else {
      pieces.push_back({PromptPiece::kText, m.content});
      pieces.push_back({PromptPiece::kEos, ""});
      // Llama 2 opens every user turn with BOS; Mistral's template writes BOS once, at the start.
      if (format == ChatFormat::kLlama2) pieces.push_back({PromptPiece::kBos, ""});
    }
  }
  if (messages.back().role != "user") {
    return absl::InvalidArgumentError(
        StrCat("messages[", messages.size() - 1, "]: the last message must be the user's (the model answers it)"));
  }
  return pieces;
}

// ---- stop strings ------------------------------------------------------------------------------------------

StopMatcher::StopMatcher(std::vector<std::string> stops, bool include_stop) : include_stop_(include_stop) {
  for (std::string& s : stops) {
    if (s.empty()) continue;
    longest_ = std::max(longest_, s.size());
    stops_.push_back(std::move(s));
  }
}

std::string StopMatcher::Push(std::string_view piece, bool match) {
  if (stopped()) return "";
  const size_t old = window_.size();
  window_.append(piece);
  if (match) {
    // A match that ends in `piece`: it starts at most s.size() - 1 bytes before it. Of those found, the one that
    // ends first.
    size_t end = std::string::npos, start = 0;
    const std::string* found = nullptr;
    for (const std::string& s : stops_) {
      const size_t at = window_.find(s, old - std::min(old, s.size() - 1));
      if (at == std::string::npos) continue;
      if (found == nullptr || at + s.size() < end || (at + s.size() == end && at < start)) {
        found = &s;
        start = at;
        end = at + s.size();
      }
    }
    if (found != nullptr) {
      matched_ = *found;
      // Without include_stop no byte of the match was released: what was held back covers its start.
      const size_t cut = include_stop_ ? end : start;
      std::string out = cut > released_ ? window_.substr(released_, cut - released_) : "";
      window_.clear();
      released_ = 0;
      return out;
    }
  }
  // Hold back the longest suffix that is a proper prefix of some stop string (nothing with include_stop: the
  // match is released anyway).
  size_t keep = 0;
  for (const std::string& s : stops_) {
    if (include_stop_) break;
    for (size_t n = std::min(s.size() - 1, window_.size() - released_); n > keep; --n) {
      if (window_.compare(window_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
    }
  }
  std::string out = window_.substr(released_, window_.size() - keep - released_);
  released_ = window_.size() - keep;
  // Keep the bytes a later match may start in: the last longest_ - 1 (none without stop strings).
  const size_t tail = longest_ > 0 ? longest_ - 1 : 0;
  const size_t drop = std::min(released_, window_.size() - std::min(window_.size(), tail));
  window_.erase(0, drop);
  released_ -= drop;
  return out;
}

std::string StopMatcher::Finish() {
  std::string out = stopped() ? "" : window_.substr(released_);
  window_.clear();
  released_ = 0;
  return out;
}

// ---- responses ---------------------------------------------------------------------------------------------

ChoiceEnd ChoiceEndOf(std::string_view main_stop_reason, const std::vector<int32_t>& token_ids) {
  if (main_stop_reason == "length") return {"length"};
  if (main_stop_reason == "stop_token" && !token_ids.empty()) return {"stop", token_ids.back()};
  return {"stop"};
}

namespace {

Json UsageJson(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

Json Header(Endpoint endpoint, bool chunk, const std::string& id, int64_t created, const std::string& model) {
  const char* object = endpoint == Endpoint::kCompletions ? "text_completion"
                       : chunk                            ? "chat.completion.chunk"
                                                          : "chat.completion";
  return {{"id", id}, {"object", object}, {"created", created}, {"model", model}, {"system_fingerprint", nullptr}};
}

}  // namespace

TokenLogprobs LogprobsWithText(const PositionLogprobs& logprobs, const Tokenizer* tokenizer) {
  auto shown = [tokenizer](const TokenLogprob& t) {
    return LogprobToken{tokenizer != nullptr ? tokenizer->TokenText(t.id) : StrCat("token_id:", t.id), t.logprob};
  };
  TokenLogprobs out;
  out.token = shown(logprobs.token);
  out.top.reserve(logprobs.top.size());
  for (const TokenLogprob& t : logprobs.top) out.top.push_back(shown(t));
  return out;
}

Json LogprobsJson(Endpoint endpoint, const std::vector<TokenLogprobs>& tokens, int64_t* text_offset) {
  if (endpoint == Endpoint::kCompletions) {
    Json texts = Json::array(), logprobs = Json::array(), tops = Json::array(), offsets = Json::array();
    for (const TokenLogprobs& t : tokens) {
      std::string text = Utf8Lossy(t.token.bytes);
      offsets.push_back(*text_offset);
      *text_offset += static_cast<int64_t>(Utf8CodePoints(text));
      if (t.no_logprob) {
        logprobs.push_back(nullptr);
        tops.push_back(nullptr);
      } else {
        Json top = Json::object();
        // Two tokens of one text: the likelier's logprob.
        for (const LogprobToken& alt : t.top) top.emplace(Utf8Lossy(alt.bytes), FloatJson(alt.logprob));
        top.emplace(text, FloatJson(t.token.logprob));
        logprobs.push_back(FloatJson(t.token.logprob));
        tops.push_back(std::move(top));
      }
      texts.push_back(std::move(text));
    }
    return {{"tokens", std::move(texts)},
            {"token_logprobs", std::move(logprobs)},
            {"top_logprobs", std::move(tops)},
            {"text_offset", std::move(offsets)}};
  }
  auto entry = [](const LogprobToken& t) {
    Json bytes = Json::array();
    for (const char c : t.bytes) bytes.push_back(static_cast<int>(static_cast<unsigned char>(c)));
    return Json{{"token", Utf8Lossy(t.bytes)}, {"logprob", FloatJson(t.logprob)}, {"bytes", std::move(bytes)}};
  };
  Json content = Json::array();
  for (const TokenLogprobs& t : tokens) {
    Json e = entry(t.token);
    Json top = Json::array();
    for (const LogprobToken& alt : t.top) top.push_back(entry(alt));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", std::move(content)}, {"refusal", nullptr}};
}

std::string CompletionBody(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                           const std::vector<Choice>& choices, const Usage& usage) {
  Json out = Header(endpoint, false, id, created, model);
  Json list = Json::array();
  for (const Choice& c : choices) {
    int64_t text_offset = 0;
    Json choice = {{"index", c.index},
                   {"finish_reason", c.end.finish_reason},
                   {"stop_reason", c.end.stop_reason},
                   {"logprobs", c.has_logprobs ? LogprobsJson(endpoint, c.logprobs, &text_offset) : Json(nullptr)},
                   {"token_ids", c.token_ids}};
    if (endpoint == Endpoint::kCompletions) {
      choice["text"] = c.text;
    } else {
      Json message = {{"role", "assistant"},
                      {"content", c.text.empty() && !c.tool_calls.empty() ? Json(nullptr) : Json(c.text)}};
      if (c.shows_reasoning) message["reasoning_content"] = c.reasoning.empty() ? Json(nullptr) : Json(c.reasoning);
      for (const ToolCall& call : c.tool_calls) {
        message["tool_calls"].push_back({{"id", call.id},
                                         {"type", "function"},
                                         {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
      }
      choice["message"] = std::move(message);
    }
    list.push_back(std::move(choice));
  }
  out["choices"] = std::move(list);
  out["usage"] = UsageJson(usage);
  return DumpJson(out);
}

std::string SseEvent(const Json& data) { return StrCat("data: ", DumpJson(data), "\n\n"); }

Json StreamChunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model, int64_t index,
                 const ChunkDelta& piece, const std::vector<int32_t>& token_ids, const ChoiceEnd& end, bool first,
                 bool include_usage, Json logprobs, const Usage* usage_so_far) {
  const std::string& finish_reason = end.finish_reason;
  Json out = Header(endpoint, true, id, created, model);
  Json choice = {{"index", index},
                 {"finish_reason", finish_reason.empty() ? Json(nullptr) : Json(finish_reason)},
                 {"stop_reason", end.stop_reason},
                 {"logprobs", std::move(logprobs)},
                 {"token_ids", token_ids}};
  if (endpoint == Endpoint::kCompletions) {
    choice["text"] = std::string(piece.text);
  } else {
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    // An empty content only in a chunk that carries nothing else (the first, or one of no text).
    if (!piece.text.empty() || (finish_reason.empty() && piece.tool_calls.empty() && piece.reasoning.empty())) {
      delta["content"] = std::string(piece.text);
    }
    if (!piece.reasoning.empty()) delta["reasoning_content"] = std::string(piece.reasoning);
    for (const ToolCallDelta& call : piece.tool_calls) {
      Json part = {{"index", call.index}, {"function", {{"arguments", call.arguments}}}};
      if (!call.id.empty()) {
        part["id"] = call.id;
        part["type"] = "function";
        part["function"]["name"] = call.name;
      }
      delta["tool_calls"].push_back(std::move(part));
    }
    choice["delta"] = std::move(delta);
  }
  out["choices"] = Json::array({std::move(choice)});
  if (include_usage) out["usage"] = usage_so_far != nullptr ? UsageJson(*usage_so_far) : Json(nullptr);
  return out;
}

Json UsageChunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                const Usage& usage) {
  Json out = Header(endpoint, true, id, created, model);
  out["choices"] = Json::array();
  out["usage"] = UsageJson(usage);
  return out;
}

namespace {
Json ModelJson(const std::string& model, const std::string& root, int64_t created, int64_t max_model_len) {
  return {{"id", model},
          {"object", "model"},
          {"created", created},
          {"owned_by", "odmoe"},
          {"root", root},
          {"parent", nullptr},
          {"max_model_len", max_model_len}};
}
}  // namespace

std::string ModelsBody(const std::vector<std::string>& models, int64_t created, int64_t max_model_len) {
  ODMOE_CHECK(!models.empty());
  Json data = Json::array();
  for (const std::string& model : models) data.push_back(ModelJson(model, models.front(), created, max_model_len));
  return DumpJson(Json{{"object", "list"}, {"data", std::move(data)}});
}

std::string ModelBody(const std::string& model, const std::string& root, int64_t created, int64_t max_model_len) {
  return DumpJson(ModelJson(model, root, created, max_model_len));
}

std::string TokenizeBody(const std::vector<int32_t>& tokens, int64_t max_model_len) {
  return DumpJson(Json{{"count", tokens.size()}, {"max_model_len", max_model_len}, {"tokens", tokens}});
}

std::string DetokenizeBody(const std::string& text) { return DumpJson(Json{{"prompt", Utf8Lossy(text)}}); }

}  // namespace odmoe::openai
