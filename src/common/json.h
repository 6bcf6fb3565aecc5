// JSON parsing and typed field access with errors that name the file and the field.
// nlohmann::json is the parser; its exceptions are caught here and nowhere else.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace odmoe {

using Json = nlohmann::json;
// Keeps objects' keys in the order of the text (where that order means something: a JSON Schema's properties).
using OrderedJson = nlohmann::ordered_json;

// Parses `text`. On failure: DataLoss "<where>: invalid JSON: <parser message>".
absl::StatusOr<Json> ParseJson(std::string_view text, std::string_view where);
absl::StatusOr<OrderedJson> ParseOrderedJson(std::string_view text, std::string_view where);

// Serialises compactly; invalid UTF-8 in strings is replaced by U+FFFD rather than failing.
std::string DumpJson(const Json& value);
std::string DumpOrderedJson(const OrderedJson& value);

// `f` as a JSON number that is written with the fewest digits that read back as the same float ("-0.16076528",
// not its double's "-0.16076527535915375"): read as a float, it is `f` exactly.
Json FloatJson(float f);

// Typed, checked reads of one JSON object's fields. `where` names the file (and object) in messages, e.g.
//   config.json: field 'hidden_size': expected an integer, got "128"
// A field that is absent or null takes the given default; the overloads without a default require it.
// Type errors are FailedPrecondition (the file is valid JSON but its content is wrong).
class JsonFields {
 public:
  JsonFields(const Json& object, std::string where);

  bool Has(std::string_view key) const;         // present and not null
  bool Contains(std::string_view key) const;    // present, possibly null
  const Json* Get(std::string_view key) const;  // nullptr when absent or null

  absl::StatusOr<int64_t> Int(std::string_view key) const;
  absl::StatusOr<int64_t> Int(std::string_view key, int64_t fallback) const;
  absl::StatusOr<double> Number(std::string_view key) const;
  absl::StatusOr<double> Number(std::string_view key, double fallback) const;
  absl::StatusOr<bool> Bool(std::string_view key, bool fallback) const;
  absl::StatusOr<std::string> String(std::string_view key) const;
  absl::StatusOr<std::string> String(std::string_view key, std::string_view fallback) const;
  // An integer, or a list of integers (e.g. eos_token_id); empty when absent.
  absl::StatusOr<std::vector<int64_t>> IntOrIntList(std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> IntList(std::string_view key) const;

  const Json& object() const { return object_; }
  const std::string& where() const { return where_; }
  absl::Status FieldError(std::string_view key, std::string_view problem) const;

 private:
  absl::StatusOr<int64_t> AsInt(std::string_view key, const Json& v) const;
  const Json& object_;
  std::string where_;
};

// A short description of a JSON value's type for messages ("string", "array", ...).
std::string_view JsonTypeName(const Json& v);
std::string_view JsonTypeName(const OrderedJson& v);

}  // namespace odmoe
