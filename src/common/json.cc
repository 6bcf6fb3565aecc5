#include "src/common/json.h"

#include <charconv>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "src/common/strings.h"

namespace odmoe {

absl::StatusOr<Json> ParseJson(std::string_view text, std::string_view where) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::DataLossError(StrCat(where, ": invalid JSON: ", e.what()));
  }
}

absl::StatusOr<OrderedJson> ParseOrderedJson(std::string_view text, std::string_view where) {
  try {
    return OrderedJson::parse(text.begin(), text.end());
  } catch (const OrderedJson::exception& e) {
    return absl::DataLossError(StrCat(where, ": invalid JSON: ", e.what()));
  }
}

std::string DumpJson(const Json& value) { return value.dump(-1, ' ', false, Json::error_handler_t::replace); }
std::string DumpOrderedJson(const OrderedJson& value) {
  return value.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

Json FloatJson(float f) {
  char text[32];
  const std::to_chars_result written = std::to_chars(text, text + sizeof(text), f);
  double shortest = f;
  std::from_chars(text, written.ptr, shortest);
  return shortest;
}

namespace {
std::string_view TypeName(Json::value_t type) {
  switch (type) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::object:
      return "object";
    case Json::value_t::array:
      return "array";
    case Json::value_t::string:
      return "string";
    case Json::value_t::boolean:
      return "boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "integer";
    case Json::value_t::number_float:
      return "number";
    default:
      return "value";
  }
}
}  // namespace

std::string_view JsonTypeName(const Json& v) { return TypeName(v.type()); }
std::string_view JsonTypeName(const OrderedJson& v) { return TypeName(v.type()); }

JsonFields::JsonFields(const Json& object, std::string where) : object_(object), where_(std::move(where)) {}

const Json* JsonFields::Get(std::string_view key) const {
  if (!object_.is_object()) return nullptr;
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

bool JsonFields::Has(std::string_view key) const { return Get(key) != nullptr; }

bool JsonFields::Contains(std::string_view key) const { return object_.is_object() && object_.contains(key); }

absl::Status JsonFields::FieldError(std::string_view key, std::string_view problem) const {
  return absl::FailedPreconditionError(StrCat(where_, ": field '", key, "': ", problem));
}

absl::StatusOr<int64_t> JsonFields::AsInt(std::string_view key, const Json& v) const {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(key, "integer out of range");
    }
    return v.get<int64_t>();
  }
  if (v.is_number_float()) {  // 4096.0 is accepted; 4096.5 is not
    const double d = v.get<double>();
    if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
  }
  return FieldError(key, StrCat("expected an integer, got ", JsonTypeName(v), " ", v.dump()));
}

absl::StatusOr<int64_t> JsonFields::Int(std::string_view key) const {
  const Json* v = Get(key);
  if (v == nullptr) return FieldError(key, "required but missing");
  return AsInt(key, *v);
}

absl::StatusOr<int64_t> JsonFields::Int(std::string_view key, int64_t fallback) const {
  const Json* v = Get(key);
  if (v == nullptr) return fallback;
  return AsInt(key, *v);
}

absl::StatusOr<double> JsonFields::Number(std::string_view key) const {
  const Json* v = Get(key);
  if (v == nullptr) return FieldError(key, "required but missing");
  if (!v->is_number()) return FieldError(key, StrCat("expected a number, got ", JsonTypeName(*v)));
  return v->get<double>();
}

absl::StatusOr<double> JsonFields::Number(std::string_view key, double fallback) const {
  if (!Has(key)) return fallback;
  return Number(key);
}

absl::StatusOr<bool> JsonFields::Bool(std::string_view key, bool fallback) const {
  const Json* v = Get(key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) return FieldError(key, StrCat("expected true or false, got ", JsonTypeName(*v)));
  return v->get<bool>();
}

absl::StatusOr<std::string> JsonFields::String(std::string_view key) const {
  const Json* v = Get(key);
  if (v == nullptr) return FieldError(key, "required but missing");
  if (!v->is_string()) return FieldError(key, StrCat("expected a string, got ", JsonTypeName(*v)));
  return v->get<std::string>();
}

absl::StatusOr<std::string> JsonFields::String(std::string_view key, std::string_view fallback) const {
  if (!Has(key)) return std::string(fallback);
  return String(key);
}

absl::StatusOr<std::vector<int64_t>> JsonFields::IntOrIntList(std::string_view key) const {
  const Json* v = Get(key);
  if (v == nullptr) return std::vector<int64_t>{};
  if (!v->is_array()) {
    auto one = AsInt(key, *v);
    if (!one.ok()) return one.status();
    return std::vector<int64_t>{*one};
  }
  return IntList(key);
}

absl::StatusOr<std::vector<int64_t>> JsonFields::IntList(std::string_view key) const {
  const Json* v = Get(key);
  if (v == nullptr) return std::vector<int64_t>{};
  if (!v->is_array()) return FieldError(key, StrCat("expected a list of integers, got ", JsonTypeName(*v)));
  std::vector<int64_t> out;
  out.reserve(v->size());
  for (const Json& e : *v) {
    auto x = AsInt(key, e);
    if (!x.ok()) return x.status();
    out.push_back(*x);
  }
  return out;
}

}  // namespace odmoe
