#include "src/engine/json_schema.h"

#include <algorithm>
#include <bitset>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

using Kind = GrammarNode::Kind;
using JsonValues = GrammarNode::JsonValues;

// Keywords that assert something of a value that the program cannot hold the model to.
constexpr const char* kRefusedKeywords[] = {
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "multipleOf",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicRef",
    "$recursiveRef",
};

// The formats odmoe writes to the letter, as anchored patterns: RFC 3339's date, time and date-time (Pydantic's
// date, time and datetime; a time with its offset, as RFC 3339 asks; days up to 28 in February, so that every date
// is one in any year, and years from 1000), uuid (any version) and ipv4 (no leading zeros).
std::optional<std::string_view> FormatPattern(std::string_view format) {
  static const auto* const kFormats = [] {
    const std::string date =
        R"([1-9]\d{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|)"
        R"(02-(?:0[1-9]|1\d|2[0-8])))";
    const std::string time = R"((?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d))";
    const std::string octet = R"((?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))";
    return new std::map<std::string, std::string, std::less<>>{
        {"date", StrCat("^", date, "$")},
        {"time", StrCat("^", time, "$")},
        {"date-time", StrCat("^", date, "T", time, "$")},
        {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"},
        {"ipv4", StrCat("^(?:", octet, "\\.){3}", octet, "$")},
    };
  }();
  const auto it = kFormats->find(format);
  if (it == kFormats->end()) return std::nullopt;
  return it->second;
}

// Keywords that say what a value is; a $ref, anyOf or allOf beside one of them is refused rather than combined.
constexpr const char* kValueKeywords[] = {
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
};

constexpr const char* kTypes[] = {"object", "array", "string", "integer", "number", "boolean", "null"};

std::string PointerToken(std::string_view key) {
  std::string out;
  for (const char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Printable(uint8_t b) {
  if (b >= 0x20 && b < 0x7f) return std::string(1, static_cast<char>(b));
  constexpr char kHex[] = "0123456789abcdef";
  return std::string{'\\', 'x', kHex[b >> 4], kHex[b & 15]};
}

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const OrderedJson& root) : root_(root) {}

  absl::StatusOr<GrammarProgram> Run() {
    ODMOE_ASSIGN_OR_RETURN(const int32_t root, Compile(root_, "", 0));
    ODMOE_RETURN_IF_ERROR(ResolveAnyOf());
    ODMOE_RETURN_IF_ERROR(CheckUniqueItems());
    SetMinDepths();
    if (program_.nodes[root].min_depth > kMaxGrammarDepth) {
      return Error("", "no value of the schema nests at most ", kMaxGrammarDepth,
                   " objects and arrays deep (required properties or minItems recurse without end, or nest deeper)");
    }
    program_.root = root;
    return std::move(program_);
  }

 private:
  // A JSON pointer as messages show it: the root is "/".
  static std::string Where(const std::string& path) { return path.empty() ? "/" : path; }

  template <typename... Rest>
  static absl::Status Error(const std::string& path, const Rest&... rest) {
    return absl::InvalidArgumentError(StrCat("at '", Where(path), "': ", rest...));
  }

  absl::StatusOr<int32_t> Add(GrammarNode node) {
    if (program_.nodes.size() >= GrammarProgram::kMaxNodes) {
      return Error(node.path, "the schema needs more than ", GrammarProgram::kMaxNodes, " parts");
    }
    program_.nodes.push_back(std::move(node));
    return static_cast<int32_t>(program_.nodes.size() - 1);
  }

  // The node for `s`: a $ref's target, or a new one.
  absl::StatusOr<int32_t> Compile(const OrderedJson& s, const std::string& path, int nesting) {
    if (nesting > kMaxSchemaNesting) return Error(path, "schemas nest deeper than ", kMaxSchemaNesting);
    if (s.is_object() && s.contains("$ref")) {
      ODMOE_RETURN_IF_ERROR(RefuseBeside(s, "$ref", path));
      return Ref(s["$ref"], path, nesting);
    }
    ODMOE_ASSIGN_OR_RETURN(const int32_t slot, Add(GrammarNode{.path = path}));
    ODMOE_RETURN_IF_ERROR(CompileInto(s, path, nesting, slot));
    return slot;
  }

  absl::StatusOr<int32_t> Ref(const OrderedJson& ref, const std::string& path, int nesting) {
    if (!ref.is_string()) return Error(path, "'$ref' must be a string, got ", JsonTypeName(ref));
    const std::string& text = ref.get_ref<const std::string&>();
    if (!text.starts_with("#"))
      return Error(path, "'$ref' '", text, "' is outside the schema; only '#...' refs are taken");
    const std::string pointer = text.substr(1);
    if (const auto it = refs_.find(pointer); it != refs_.end()) return it->second;
    ODMOE_ASSIGN_OR_RETURN(const OrderedJson* target, Resolve(pointer, path));
    ODMOE_ASSIGN_OR_RETURN(const int32_t slot, Add(GrammarNode{.path = pointer}));
    refs_[pointer] = slot;
    ODMOE_RETURN_IF_ERROR(CompileInto(*target, pointer, nesting + 1, slot));
    return slot;
  }

  absl::StatusOr<const OrderedJson*> Resolve(const std::string& pointer, const std::string& path) const {
    const OrderedJson* at = &root_;
    if (pointer.empty()) return at;
    if (pointer[0] != '/') return Error(path, "'$ref' '#", pointer, "' is not a JSON pointer");
    size_t begin = 1;
    while (true) {
      const size_t end = std::min(pointer.find('/', begin), pointer.size());
      std::string token;
      for (size_t i = begin; i < end; ++i) {
        if (pointer[i] == '~' && i + 1 < end && (pointer[i + 1] == '0' || pointer[i + 1] == '1')) {
          token += pointer[++i] == '0' ? '~' : '/';
        } else {
          token += pointer[i];
        }
      }
      const OrderedJson* next = nullptr;
      if (at->is_object()) {
        const auto it = at->find(token);
        if (it != at->end()) next = &*it;
      } else if (at->is_array() && !token.empty() && token.size() < 8 &&
                 token.find_first_not_of("0123456789") == std::string::npos) {
        const size_t i = std::stoul(token);
        if (i < at->size()) next = &(*at)[i];
      }
      if (next == nullptr) return Error(path, "'$ref' '#", pointer, "' names nothing in the schema");
      at = next;
      if (end == pointer.size()) return at;
      begin = end + 1;
    }
  }

  // A $ref, anyOf, oneOf or allOf (`keyword`) may stand beside annotations only.
  static absl::Status RefuseBeside(const OrderedJson& s, const char* keyword, const std::string& path) {
    for (const char* other : kValueKeywords) {
      if (std::string_view(other) != keyword && s.contains(other)) {
        return Error(path, "'", keyword, "' beside '", other, "' is not supported; put them in one schema");
      }
    }
    return absl::OkStatus();
  }

  absl::Status CompileInto(const OrderedJson& s, const std::string& path, int nesting, int32_t slot) {
    if (nesting > kMaxSchemaNesting) return Error(path, "schemas nest deeper than ", kMaxSchemaNesting);
    if (s.is_boolean()) {
      if (!s.get<bool>()) return Error(path, "the schema false allows no value");
      program_.nodes[slot].kind = Kind::kJson;
      return absl::OkStatus();
    }
    if (!s.is_object()) return Error(path, "a schema must be an object or a boolean, got ", JsonTypeName(s));
    for (const char* keyword : kRefusedKeywords) {
      if (s.contains(keyword)) return Error(path, "'", keyword, "' is not supported");
    }
    if (const auto it = s.find("uniqueItems");
        it != s.end() && !(it->is_boolean() && !it->get<bool>()) && s.value("type", OrderedJson()) != "array") {
      return Error(path, "'uniqueItems' is supported beside \"type\": \"array\" only");
    }
    if (s.contains("$ref")) {
      ODMOE_RETURN_IF_ERROR(RefuseBeside(s, "$ref", path));
      ODMOE_ASSIGN_OR_RETURN(const int32_t target, Ref(s["$ref"], path, nesting));
      SetAnyOf(slot, {target});
      return absl::OkStatus();
    }
    if (s.contains("allOf")) {
      ODMOE_RETURN_IF_ERROR(RefuseBeside(s, "allOf", path));
      const OrderedJson& all = s["allOf"];
      if (!all.is_array() || all.size() != 1) return Error(path, "'allOf' is supported with one schema only");
      return CompileInto(all[0], path + "/allOf/0", nesting + 1, slot);
    }
    if (s.contains("anyOf") || s.contains("oneOf")) {
      const char* keyword = s.contains("anyOf") ? "anyOf" : "oneOf";
      ODMOE_RETURN_IF_ERROR(RefuseBeside(s, keyword, path));
      const OrderedJson& list = s[keyword];
      if (!list.is_array() || list.empty()) return Error(path, "'", keyword, "' must be a non-empty array");
      std::vector<int32_t> alternatives;
      for (size_t i = 0; i < list.size(); ++i) {
        ODMOE_ASSIGN_OR_RETURN(const int32_t alt, Compile(list[i], StrCat(path, "/", keyword, "/", i), nesting + 1));
        alternatives.push_back(alt);
      }
      SetAnyOf(slot, std::move(alternatives));
      return absl::OkStatus();
    }

    std::vector<std::string> types;
    if (const auto it = s.find("type"); it != s.end()) {
      if (it->is_string()) {
        types.push_back(it->get<std::string>());
      } else if (it->is_array() && !it->empty()) {
        for (const OrderedJson& t : *it) {
          if (!t.is_string()) return Error(path, "'type' must be a string or a list of strings");
          types.push_back(t.get<std::string>());
        }
      } else {
        return Error(path, "'type' must be a string or a non-empty list of strings");
      }
      for (const std::string& t : types) {
        if (std::find(std::begin(kTypes), std::end(kTypes), t) == std::end(kTypes)) {
          return Error(path, "'type' '", t, "' is not a JSON Schema type");
        }
      }
    }
    if (s.contains("const") || s.contains("enum")) return CompileLiterals(s, types, path, slot);
    if (types.empty()) types.push_back(InferredType(s));
    if (types.size() == 1) return CompileTyped(s, types[0], path, nesting, slot);
    std::vector<int32_t> alternatives;
    for (const std::string& t : types) {
      ODMOE_ASSIGN_OR_RETURN(const int32_t alt, Add(GrammarNode{.path = path}));
      ODMOE_RETURN_IF_ERROR(CompileTyped(s, t, path, nesting, alt));
      alternatives.push_back(alt);
    }
    SetAnyOf(slot, std::move(alternatives));
    return absl::OkStatus();
  }

  void SetAnyOf(int32_t slot, std::vector<int32_t> alternatives) {
    GrammarNode& n = program_.nodes[slot];
    n.kind = Kind::kAnyOf;
    n.alternatives = std::move(alternatives);
  }

  // The type a schema without "type" describes by its keywords; "" (any value) when none tells.
  static std::string InferredType(const OrderedJson& s) {
    for (const char* k : {"properties", "required", "additionalProperties"}) {
      if (s.contains(k)) return "object";
    }
    for (const char* k : {"items", "prefixItems", "minItems", "maxItems"}) {
      if (s.contains(k)) return "array";
    }
    for (const char* k : {"minLength", "maxLength", "pattern"}) {
      if (s.contains(k)) return "string";
    }
    for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
      if (s.contains(k)) return "number";
    }
    return "";
  }

  static bool OfType(const OrderedJson& v, const std::vector<std::string>& types) {
    if (types.empty()) return true;
    for (const std::string& t : types) {
      if ((t == "object" && v.is_object()) || (t == "array" && v.is_array()) || (t == "string" && v.is_string()) ||
          (t == "integer" &&
           (v.is_number_integer() || (v.is_number_float() && std::trunc(v.get<double>()) == v.get<double>()))) ||
          (t == "number" && v.is_number()) || (t == "boolean" && v.is_boolean()) || (t == "null" && v.is_null())) {
        return true;
      }
    }
    return false;
  }

  absl::Status CompileLiterals(const OrderedJson& s, const std::vector<std::string>& types, const std::string& path,
                               int32_t slot) {
    if (s.contains("const") && s.contains("enum")) return Error(path, "both 'const' and 'enum' are given");
    std::vector<OrderedJson> values;
    if (s.contains("const")) {
      values.push_back(s["const"]);
    } else {
      const OrderedJson& list = s["enum"];
      if (!list.is_array() || list.empty()) return Error(path, "'enum' must be a non-empty array");
      if (list.size() > kMaxChoices) return Error(path, "'enum' lists ", list.size(), " values, at most ", kMaxChoices);
      values.assign(list.begin(), list.end());
    }
    std::vector<std::string> texts;
    for (const OrderedJson& v : values) {
      if (!OfType(v, types)) continue;  // a value its own schema's type refuses is no answer
      std::string text = DumpOrderedJson(v);
      if (text.size() > kMaxChoiceBytes) {
        return Error(path, "a value of 'enum' or 'const' has ", text.size(), " bytes as JSON, at most ",
                     kMaxChoiceBytes);
      }
      texts.push_back(std::move(text));
    }
    if (texts.empty()) return Error(path, "no value of 'enum' or 'const' is of the schema's 'type'");
    std::sort(texts.begin(), texts.end());
    texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
    GrammarNode& n = program_.nodes[slot];
    n.kind = Kind::kLiterals;
    n.literals = std::move(texts);
    return absl::OkStatus();
  }

  // A keyword that must be a count (a non-negative integer); `fallback` when absent.
  static absl::StatusOr<uint32_t> Count(const OrderedJson& s, const char* key, uint32_t fallback,
                                        const std::string& path) {
    const auto it = s.find(key);
    if (it == s.end()) return fallback;
    if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0)) {
      return Error(path, "'", key, "' must be a non-negative integer, got ", it->dump());
    }
    return static_cast<uint32_t>(std::min<uint64_t>(it->get<uint64_t>(), GrammarNode::kUnbounded - 1));
  }

  absl::Status CompileCounts(const OrderedJson& s, const char* min_key, const char* max_key, const std::string& path,
                             GrammarNode* n) {
    ODMOE_ASSIGN_OR_RETURN(n->min_count, Count(s, min_key, 0, path));
    ODMOE_ASSIGN_OR_RETURN(n->max_count, Count(s, max_key, GrammarNode::kUnbounded, path));
    if (n->min_count > n->max_count) {
      return Error(path, "'", min_key, "' ", n->min_count, " is more than '", max_key, "' ", n->max_count);
    }
    return absl::OkStatus();
  }

  // An array: `items` for every position, or a tuple (draft 2020-12's prefixItems, then `items` for the rest;
  // draft 7's `items` as a list, then additionalItems), with minItems and maxItems. Past a tuple, no `items` (or
  // true) is any value, false is none.
  absl::Status CompileArray(const OrderedJson& s, const std::string& path, int nesting, GrammarNode* n) {
    ODMOE_RETURN_IF_ERROR(CompileCounts(s, "minItems", "maxItems", path, n));
    if (const auto unique = s.find("uniqueItems"); unique != s.end()) {
      if (!unique->is_boolean()) return Error(path, "'uniqueItems' must be a boolean, got ", JsonTypeName(*unique));
      n->unique_items = unique->get<bool>();  // CheckUniqueItems, once anyOfs are resolved, says where it is taken
    }
    // The tuple and what follows it: prefixItems and items (draft 2020-12), or items as a list and
    // additionalItems (draft 7); no tuple, and items.
    const char* tuple_key = nullptr;
    const char* rest_key = "items";
    if (s.contains("prefixItems")) {
      tuple_key = "prefixItems";
    } else if (s.contains("items") && s.at("items").is_array()) {
      tuple_key = "items";
      rest_key = "additionalItems";
    }
    const auto rest = s.find(rest_key);
    const bool any_rest = rest == s.end() || (rest->is_boolean() && rest->get<bool>());
    if (tuple_key == nullptr && any_rest && n->min_count == 0 && n->max_count == GrammarNode::kUnbounded &&
        !n->unique_items) {
      n->kind = Kind::kJson;
      n->json = JsonValues::kArrays;
      return absl::OkStatus();
    }
    n->kind = Kind::kArray;
    if (tuple_key != nullptr) {
      const OrderedJson& tuple = s.at(tuple_key);
      if (!tuple.is_array() || tuple.size() > GrammarNode::kMaxProperties) {
        return Error(path, "'", tuple_key, "' must be a list of at most ", GrammarNode::kMaxProperties, " schemas");
      }
      for (size_t i = 0; i < tuple.size(); ++i) {
        ODMOE_ASSIGN_OR_RETURN(const int32_t item,
                               Compile(tuple[i], StrCat(path, "/", tuple_key, "/", i), nesting + 1));
        n->prefix_items.push_back(item);
      }
    }
    if (rest != s.end() && rest->is_boolean() && !rest->get<bool>()) {  // nothing past the tuple
      const auto most = static_cast<uint32_t>(n->prefix_items.size());
      if (n->min_count > most) {
        return Error(path, "'minItems' ", n->min_count, " is more than the ", most, " items '", rest_key,
                     "' false allows");
      }
      n->max_count = std::min(n->max_count, most);
      return absl::OkStatus();
    }
    ODMOE_ASSIGN_OR_RETURN(n->item, any_rest ? Add(GrammarNode{.path = StrCat(path, "/", rest_key)})
                                             : Compile(*rest, StrCat(path, "/", rest_key), nesting + 1));
    return absl::OkStatus();
  }

  absl::Status CompileTyped(const OrderedJson& s, const std::string& type, const std::string& path, int nesting,
                            int32_t slot) {
    GrammarNode n{.path = path};
    if (type.empty()) {
      n.kind = Kind::kJson;
    } else if (type == "object") {
      ODMOE_RETURN_IF_ERROR(CompileObject(s, path, nesting, &n));
    } else if (type == "array") {
      ODMOE_RETURN_IF_ERROR(CompileArray(s, path, nesting, &n));
    } else if (type == "string") {
      n.kind = Kind::kString;
      ODMOE_RETURN_IF_ERROR(CompileCounts(s, "minLength", "maxLength", path, &n));
      ODMOE_RETURN_IF_ERROR(CompilePatternInto(s, path, &n));
      ODMOE_RETURN_IF_ERROR(CompileFormatInto(s, path, &n));
    } else if (type == "integer") {
      n.kind = Kind::kInteger;
      ODMOE_RETURN_IF_ERROR(CompileIntegerBounds(s, path, &n));
    } else if (type == "number") {
      ODMOE_RETURN_IF_ERROR(CompileNumber(s, path, &n));
    } else if (type == "boolean") {
      n.kind = Kind::kLiterals;
      n.literals = {"false", "true"};
    } else {  // "null"
      n.kind = Kind::kLiterals;
      n.literals = {"null"};
    }
    program_.nodes[slot] = std::move(n);
    return absl::OkStatus();
  }

  absl::Status CompileObject(const OrderedJson& s, const std::string& path, int nesting, GrammarNode* n) {
    const auto props = s.find("properties");
    if (props != s.end() && !props->is_object()) return Error(path, "'properties' must be an object");
    std::set<std::string> required;
    if (const auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) return Error(path, "'required' must be a list of strings");
      for (const OrderedJson& name : *it) {
        if (!name.is_string()) return Error(path, "'required' must be a list of strings");
        if (props == s.end() || !props->contains(name.get<std::string>())) {
          return Error(path, "'required' names '", name.get<std::string>(), "', which 'properties' does not list");
        }
        required.insert(name.get<std::string>());
      }
    }
    const auto extra = s.find("additionalProperties");
    const bool extra_false = extra != s.end() && extra->is_boolean() && !extra->get<bool>();
    const bool extra_any = extra == s.end() || (extra->is_boolean() && extra->get<bool>());
    if (props == s.end() || props->empty()) {
      if (extra_false) {
        n->kind = Kind::kObject;  // {} only
      } else if (extra_any) {
        n->kind = Kind::kJson;
        n->json = JsonValues::kObjects;
      } else {
        n->kind = Kind::kMap;
        ODMOE_ASSIGN_OR_RETURN(n->item, Compile(*extra, path + "/additionalProperties", nesting + 1));
      }
      return absl::OkStatus();
    }
    // Beside properties, additionalProperties true or a schema is taken as false, as when it is left out: the
    // answer holds the listed properties only, which the schema allows too.
    if (props->size() > GrammarNode::kMaxProperties) {
      return Error(path, "'properties' lists ", props->size(), ", at most ", GrammarNode::kMaxProperties);
    }
    n->kind = Kind::kObject;
    for (const auto& [name, sub] : props->items()) {
      GrammarNode::Property p{.key = DumpOrderedJson(OrderedJson(name)), .required = required.contains(name)};
      ODMOE_ASSIGN_OR_RETURN(p.node, Compile(sub, StrCat(path, "/properties/", PointerToken(name)), nesting + 1));
      n->properties.push_back(std::move(p));
    }
    return absl::OkStatus();
  }

  // A string's `pattern`, where it has one: a kPattern node. Its length bounds are refused beside it (the
  // pattern can say them).
  static absl::Status CompilePatternInto(const OrderedJson& s, const std::string& path, GrammarNode* n) {
    const auto it = s.find("pattern");
    if (it == s.end()) return absl::OkStatus();
    if (!it->is_string()) return Error(path, "'pattern' must be a string, got ", JsonTypeName(*it));
    if (n->min_count > 0 || n->max_count != GrammarNode::kUnbounded) {
      return Error(path, "'minLength' and 'maxLength' beside 'pattern' are not supported; put the length in the ",
                   "pattern (as {1,20})");
    }
    absl::StatusOr<PatternDfa> dfa = CompilePattern(it->get<std::string>(), PatternScope::kJsonString);
    if (!dfa.ok()) return Error(path, "'pattern' ", dfa.status().message());
    n->kind = Kind::kPattern;
    n->pattern = *std::move(dfa);
    return absl::OkStatus();
  }

  // A string's `format`, where odmoe writes it to the letter and nothing else bounds the string: a kPattern node
  // of its anchored pattern (FormatPattern). Other formats, and a format beside a pattern or length bounds, are
  // annotations.
  static absl::Status CompileFormatInto(const OrderedJson& s, const std::string& path, GrammarNode* n) {
    const auto it = s.find("format");
    if (it == s.end() || !it->is_string() || n->kind != Kind::kString || n->min_count > 0 ||
        n->max_count != GrammarNode::kUnbounded) {
      return absl::OkStatus();
    }
    const std::optional<std::string_view> pattern = FormatPattern(it->get<std::string>());
    if (!pattern.has_value()) return absl::OkStatus();
    absl::StatusOr<PatternDfa> dfa = CompilePattern(*pattern, PatternScope::kJsonString);
    if (!dfa.ok()) return Error(path, "'format' ", dfa.status().message());  // never: the patterns are ours
    n->kind = Kind::kPattern;
    n->pattern = *std::move(dfa);
    return absl::OkStatus();
  }

  // A schema's numeric bounds; draft 4's boolean exclusiveMinimum / exclusiveMaximum read as the later drafts'.
  struct Bounds {
    std::optional<double> minimum, maximum, exclusive_minimum, exclusive_maximum;
  };

  static absl::StatusOr<Bounds> ReadBounds(const OrderedJson& s, const std::string& path) {
    auto bound = [&](const char* key, std::optional<double>* out) -> absl::Status {
      const auto it = s.find(key);
      if (it == s.end() || it->is_boolean()) return absl::OkStatus();  // draft 4's exclusive flags: below
      if (!it->is_number() || !std::isfinite(it->get<double>())) {
        return Error(path, "'", key, "' must be a number, got ", it->dump());
      }
      *out = it->get<double>();
      return absl::OkStatus();
    };
    Bounds b;
    ODMOE_RETURN_IF_ERROR(bound("minimum", &b.minimum));
    ODMOE_RETURN_IF_ERROR(bound("maximum", &b.maximum));
    ODMOE_RETURN_IF_ERROR(bound("exclusiveMinimum", &b.exclusive_minimum));
    ODMOE_RETURN_IF_ERROR(bound("exclusiveMaximum", &b.exclusive_maximum));
    auto flag = [&](const char* key) {
      const auto it = s.find(key);
      return it != s.end() && it->is_boolean() && it->get<bool>();
    };
    if (flag("exclusiveMinimum") && b.minimum) std::swap(b.minimum, b.exclusive_minimum);
    if (flag("exclusiveMaximum") && b.maximum) std::swap(b.maximum, b.exclusive_maximum);
    return b;
  }

  absl::Status CompileIntegerBounds(const OrderedJson& s, const std::string& path, GrammarNode* n) {
    ODMOE_ASSIGN_OR_RETURN(const Bounds b, ReadBounds(s, path));
    const double limit = static_cast<double>(GrammarNode::kMaxIntegerMagnitude);
    double lo = -limit, hi = limit;
    if (b.minimum) lo = std::max(lo, std::ceil(*b.minimum));
    if (b.exclusive_minimum) lo = std::max(lo, std::floor(*b.exclusive_minimum) + 1);
    if (b.maximum) hi = std::min(hi, std::floor(*b.maximum));
    if (b.exclusive_maximum) hi = std::min(hi, std::ceil(*b.exclusive_maximum) - 1);
    if (lo > hi) return Error(path, "no integer of at most 18 digits meets its bounds");
    n->minimum = static_cast<int64_t>(lo);
    n->maximum = static_cast<int64_t>(hi);
    return absl::OkStatus();
  }

  // A number (kNumber), or with bounds a kBoundedNumber.
  absl::Status CompileNumber(const OrderedJson& s, const std::string& path, GrammarNode* n) {
    ODMOE_ASSIGN_OR_RETURN(const Bounds b, ReadBounds(s, path));
    if (!b.minimum && !b.maximum && !b.exclusive_minimum && !b.exclusive_maximum) {
      n->kind = Kind::kNumber;
      return absl::OkStatus();
    }
    n->kind = Kind::kBoundedNumber;
    n->number_minimum = -kFarScaled;
    n->number_maximum = kFarScaled;
    if (b.minimum) n->number_minimum = std::max(n->number_minimum, Scaled(*b.minimum, true));
    if (b.exclusive_minimum) n->number_minimum = std::max(n->number_minimum, Scaled(*b.exclusive_minimum, false) + 1);
    if (b.maximum) n->number_maximum = std::min(n->number_maximum, Scaled(*b.maximum, false));
    if (b.exclusive_maximum) n->number_maximum = std::min(n->number_maximum, Scaled(*b.exclusive_maximum, true) - 1);
    for (const char c : std::string_view("-0123456789")) {
      if (BoundedNumberCanBegin(*n, static_cast<uint8_t>(c))) return absl::OkStatus();
    }
    return Error(path, "no number of at most ", GrammarNode::kMaxNumberDigits,
                 " digits, written without an exponent, meets its bounds");
  }

  // Past every bounded number's value (below 10^33 units).
  static constexpr __int128 kFarScaled = static_cast<__int128>(1'000'000'000'000'000'000) * 10'000'000'000'000'000;

  // `v` in units of 10^-kNumberScale, rounded up (toward +infinity) or down; ±kFarScaled beyond it. Read exactly
  // from the shortest decimal text that is `v` (as nlohmann writes it), the text a client wrote in most schemas.
  static __int128 Scaled(double v, bool up) {
    const std::string text = DumpOrderedJson(OrderedJson(v));
    const bool negative = text[0] == '-';
    std::string digits;
    int exponent = 0;  // the digits' value is digits * 10^exponent
    bool point = false;
    size_t i = negative ? 1 : 0;
    for (; i < text.size() && (absl::ascii_isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'); ++i) {
      if (text[i] == '.') {
        point = true;
        continue;
      }
      if (!digits.empty() || text[i] != '0') digits += text[i];
      if (point) --exponent;
    }
    if (i < text.size()) exponent += std::stoi(text.substr(i + 1));  // after 'e': "+20", "-05"
    if (digits.empty()) return 0;
    const int power = exponent + GrammarNode::kNumberScale;
    if (static_cast<int>(digits.size()) + power > 34) return negative ? -kFarScaled : kFarScaled;
    __int128 mantissa = 0;
    for (const char c : digits) mantissa = mantissa * 10 + (c - '0');
    if (power >= 0) return (negative ? -mantissa : mantissa) * Pow10(power);
    const __int128 divisor = -power > 38 ? 0 : Pow10(-power);
    const __int128 whole = divisor == 0 ? 0 : mantissa / divisor;
    const bool inexact = divisor == 0 || mantissa % divisor != 0;
    if (!negative) return whole + (up && inexact ? 1 : 0);
    return -whole - (!up && inexact ? 1 : 0);
  }

  // ---- anyOf: each alternative told apart by its first byte --------------------------------------------------

  // The alternatives of `node`, nested anyOfs expanded. `seen` guards a cycle of anyOfs, which no byte would end.
  absl::Status Flatten(int32_t node, std::vector<int32_t>* seen, std::vector<int32_t>* out) const {
    const GrammarNode& n = program_.nodes[node];
    if (n.kind != Kind::kAnyOf) {
      if (std::find(out->begin(), out->end(), node) == out->end()) out->push_back(node);
      return absl::OkStatus();
    }
    if (std::find(seen->begin(), seen->end(), node) != seen->end()) {
      return Error(n.path, "the schema refers to itself before any byte of its value");
    }
    seen->push_back(node);
    for (const int32_t alt : n.alternatives) ODMOE_RETURN_IF_ERROR(Flatten(alt, seen, out));
    seen->pop_back();
    return absl::OkStatus();
  }

  std::bitset<256> FirstBytes(const GrammarNode& n) const {
    std::bitset<256> bytes;
    auto digits = [&] {
      for (char c = '0'; c <= '9'; ++c) bytes.set(static_cast<uint8_t>(c));
    };
    switch (n.kind) {
      case Kind::kJson:
        if (n.json != JsonValues::kArrays) bytes.set('{');
        if (n.json != JsonValues::kObjects) bytes.set('[');
        if (n.json == JsonValues::kAny) {
          for (const char c : std::string_view("\"-tfn")) bytes.set(static_cast<uint8_t>(c));
          digits();
        }
        break;
      case Kind::kObject:
      case Kind::kMap:
      case Kind::kObjectUnion:
        bytes.set('{');
        break;
      case Kind::kArray:
        bytes.set('[');
        break;
      case Kind::kString:
      case Kind::kPattern:
        bytes.set('"');
        break;
      case Kind::kNumber:
        bytes.set('-');
        digits();
        break;
      case Kind::kInteger:
        if (n.minimum <= 0) bytes.set('-');
        digits();
        break;
      case Kind::kBoundedNumber:
        for (const char c : std::string_view("-0123456789")) {
          if (BoundedNumberCanBegin(n, static_cast<uint8_t>(c))) bytes.set(static_cast<uint8_t>(c));
        }
        break;
      case Kind::kLiterals:
        for (const std::string& l : n.literals) bytes.set(static_cast<uint8_t>(l[0]));
        break;
      case Kind::kText:
        for (size_t b = 0; b < bytes.size(); ++b) {
          if (n.pattern.Step(n.pattern.start, static_cast<uint8_t>(b)) != PatternDfa::kNone) bytes.set(b);
        }
        break;
      case Kind::kAnyOf:
        break;
    }
    return bytes;
  }

  absl::Status ResolveAnyOf() {
    for (size_t i = 0; i < program_.nodes.size(); ++i) {
      if (program_.nodes[i].kind != Kind::kAnyOf) continue;
      std::vector<int32_t> seen, flat;
      ODMOE_RETURN_IF_ERROR(Flatten(static_cast<int32_t>(i), &seen, &flat));
      // Any value takes in every other; literals merge into one node; an integer beside a number is a number.
      std::vector<int32_t> kept;
      std::vector<int32_t> literal_nodes;
      std::vector<std::string> literals;
      // An integer is left out beside a number that takes all its values (a bounded one: its bounds hold the
      // integer's; an integer of more digits than a bounded number's is then not written).
      auto covered = [&](const GrammarNode& integer) {
        const __int128 unit = Pow10(GrammarNode::kNumberScale);
        for (const int32_t alt : flat) {
          const GrammarNode& n = program_.nodes[alt];
          if (n.kind == Kind::kNumber) return true;
          if (n.kind == Kind::kBoundedNumber && integer.minimum * unit >= n.number_minimum &&
              integer.maximum * unit <= n.number_maximum) {
            return true;
          }
        }
        return false;
      };
      for (const int32_t alt : flat) {
        const GrammarNode& n = program_.nodes[alt];
        if (n.kind == Kind::kJson && n.json == JsonValues::kAny) {
          kept = {alt};
          literal_nodes.clear();
          break;
        }
        if (n.kind == Kind::kLiterals) {
          literal_nodes.push_back(alt);
          literals.insert(literals.end(), n.literals.begin(), n.literals.end());
        } else if (!(n.kind == Kind::kInteger && covered(n))) {
          kept.push_back(alt);
        }
      }
      if (literal_nodes.size() == 1) {
        kept.push_back(literal_nodes[0]);
      } else if (literal_nodes.size() > 1) {  // one node, named after the first of them
        std::sort(literals.begin(), literals.end());
        literals.erase(std::unique(literals.begin(), literals.end()), literals.end());
        if (literals.size() > 0xffff) {  // a literal frame's range holds 16-bit indices
          return Error(program_.nodes[i].path, "its consts and enums hold ", literals.size(), " values, at most 65535");
        }
        ODMOE_ASSIGN_OR_RETURN(const int32_t merged, Add(GrammarNode{.kind = Kind::kLiterals,
                                                                     .path = program_.nodes[literal_nodes[0]].path,
                                                                     .literals = std::move(literals)}));
        kept.push_back(merged);
      }
      ODMOE_RETURN_IF_ERROR(MergeObjects(program_.nodes[i].path, &kept));
      GrammarNode& any = program_.nodes[i];
      any.alternatives = kept;
      any.by_first_byte.fill(-1);
      for (const int32_t alt : kept) {
        const std::bitset<256> bytes = FirstBytes(program_.nodes[alt]);
        for (int b = 0; b < 256; ++b) {
          if (!bytes.test(static_cast<size_t>(b))) continue;
          const int32_t other = any.by_first_byte[static_cast<size_t>(b)];
          if (other >= 0) {
            return Error(any.path, "its alternatives at '", Where(program_.nodes[other].path), "' and '",
                         Where(program_.nodes[alt].path), "' can both begin with '", Printable(static_cast<uint8_t>(b)),
                         "'; odmoe tells alternatives apart by their first byte");
          }
          program_.nodes[i].by_first_byte[static_cast<size_t>(b)] = alt;
        }
      }
    }
    return absl::OkStatus();
  }

  // The objects an object union chooses among.
  std::vector<int32_t> UnionObjects(const GrammarNode& u) const {
    std::vector<int32_t> objects;
    for (size_t k = 0; k < u.properties.size(); ++k) {
      if (u.alternatives[k] >= 0) {
        objects.push_back(u.alternatives[k]);
      } else {
        const std::vector<int32_t>& by_value = program_.nodes[u.properties[k].node].literal_objects;
        for (const int32_t o : by_value) {
          if (std::find(objects.begin(), objects.end(), o) == objects.end()) objects.push_back(o);
        }
      }
    }
    return objects;
  }

  // The JSON texts a schema allows when it is consts and enums only (through $refs and anyOfs, resolved yet or
  // not), each once; none when it allows anything else.
  std::vector<std::string> LiteralsOf(int32_t node) const {
    std::vector<int32_t> seen, flat;
    if (!Flatten(node, &seen, &flat).ok()) return {};
    std::vector<std::string> texts;
    for (const int32_t alt : flat) {
      const GrammarNode& n = program_.nodes[alt];
      if (n.kind != Kind::kLiterals) return {};
      texts.insert(texts.end(), n.literals.begin(), n.literals.end());
    }
    std::sort(texts.begin(), texts.end());
    texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
    return texts;
  }

  // Whether `objects` can be told apart by their first property: each begins with a required one, and those that
  // begin with the same key have a const or enum value there, no value in two.
  bool ToldApartByFirstProperty(const std::vector<int32_t>& objects) const {
    std::map<std::string, std::vector<int32_t>> by_key;
    for (const int32_t o : objects) {
      const GrammarNode& n = program_.nodes[o];
      if (n.properties.empty() || !n.properties[0].required) return false;
      by_key[n.properties[0].key].push_back(o);
    }
    for (const auto& [key, group] : by_key) {
      if (group.size() > 1 && !DisjointLiterals(group, &key)) return false;
    }
    return true;
  }

  // Whether every one of `objects` requires the property `key` and holds a const or enum value there, no value in
  // two.
  bool DisjointLiterals(const std::vector<int32_t>& objects, const std::string* key) const {
    std::vector<std::string> all;
    for (const int32_t o : objects) {
      const std::vector<GrammarNode::Property>& props = program_.nodes[o].properties;
      const auto it =
          std::find_if(props.begin(), props.end(), [&](const GrammarNode::Property& p) { return p.key == *key; });
      if (it == props.end() || !it->required) return false;
      std::vector<std::string> literals = LiteralsOf(it->node);
      if (literals.empty()) return false;
      all.insert(all.end(), literals.begin(), literals.end());
    }
    std::sort(all.begin(), all.end());
    return std::adjacent_find(all.begin(), all.end()) == all.end();
  }

  // Where the objects of a union are not told apart by their first properties, another property may do it, which
  // each object of the union is then generated with first, from a copy of its node (JSON objects are unordered; the
  // schema's other uses of an object keep the written order):
  //  - Pydantic's discriminated unions, and others like them: a property every object requires with a const or
  //    enum value, no value in two (the first such in the first object's order);
  //  - objects whose first properties have defaults: each object's first required property, where no two share
  //    its key.
  // Nothing changes where neither does.
  absl::Status PutDiscriminatorFirst(std::vector<int32_t>* objects) {
    if (ToldApartByFirstProperty(*objects)) return absl::OkStatus();
    std::vector<std::string> firsts;  // per object: the key to put first
    for (const GrammarNode::Property& candidate : program_.nodes[objects->front()].properties) {
      if (DisjointLiterals(*objects, &candidate.key)) {
        firsts.assign(objects->size(), candidate.key);
        break;
      }
    }
    if (firsts.empty()) {
      for (const int32_t o : *objects) {
        const std::vector<GrammarNode::Property>& props = program_.nodes[o].properties;
        const auto required =
            std::find_if(props.begin(), props.end(), [](const GrammarNode::Property& p) { return p.required; });
        if (required == props.end() || std::find(firsts.begin(), firsts.end(), required->key) != firsts.end()) {
          return absl::OkStatus();
        }
        firsts.push_back(required->key);
      }
    }
    for (size_t i = 0; i < objects->size(); ++i) {
      GrammarNode copy = program_.nodes[(*objects)[i]];
      const auto at = std::find_if(copy.properties.begin(), copy.properties.end(),
                                   [&](const GrammarNode::Property& p) { return p.key == firsts[i]; });
      std::rotate(copy.properties.begin(), at, at + 1);
      ODMOE_ASSIGN_OR_RETURN((*objects)[i], Add(std::move(copy)));
    }
    return absl::OkStatus();
  }

  // Where an anyOf's alternatives (`kept`) hold two or more objects (kObject, or an object union of an anyOf
  // within), they become one kObjectUnion, told apart by their first property: its key, or where several objects
  // begin with the same key, its value, which must then be a const or enum in each, no value in two; or where the
  // first properties do not tell them apart, by another property put first (PutDiscriminatorFirst).
  absl::Status MergeObjects(std::string path, std::vector<int32_t>* kept) {  // by value: Add moves the nodes
    std::vector<int32_t> objects, rest;
    auto add_object = [&objects](int32_t o) {
      if (std::find(objects.begin(), objects.end(), o) == objects.end()) objects.push_back(o);
    };
    for (const int32_t alt : *kept) {
      const GrammarNode& n = program_.nodes[alt];
      if (n.kind == Kind::kObject) {
        add_object(alt);
      } else if (n.kind == Kind::kObjectUnion) {
        for (const int32_t o : UnionObjects(n)) add_object(o);
      } else {
        rest.push_back(alt);
      }
    }
    if (objects.size() < 2) return absl::OkStatus();
    ODMOE_RETURN_IF_ERROR(PutDiscriminatorFirst(&objects));
    std::vector<std::string> keys;  // in the order the objects come
    std::vector<std::vector<int32_t>> by_key;
    for (const int32_t o : objects) {
      const GrammarNode& n = program_.nodes[o];
      if (n.properties.empty() || !n.properties[0].required) {
        return Error(n.path, "an object that is one of several in an anyOf must begin with a required property: ",
                     "odmoe tells the objects apart by it (its key, or its const or enum value), by a property ",
                     "they all require with a const or enum value, no value in two, or by each one's first required ",
                     "property where no two share its key");
      }
      const auto at = std::find(keys.begin(), keys.end(), n.properties[0].key);
      if (at == keys.end()) {
        keys.push_back(n.properties[0].key);
        by_key.push_back({o});
      } else {
        by_key[static_cast<size_t>(at - keys.begin())].push_back(o);
      }
    }
    if (keys.size() > GrammarNode::kMaxProperties) {
      return Error(path, "its objects begin with ", keys.size(), " different keys, at most ",
                   GrammarNode::kMaxProperties);
    }
    GrammarNode u{.kind = Kind::kObjectUnion, .path = path};
    for (size_t k = 0; k < keys.size(); ++k) {
      GrammarNode::Property first{.key = keys[k], .required = true};
      const std::vector<int32_t>& group = by_key[k];
      if (group.size() == 1) {
        first.node = program_.nodes[group[0]].properties[0].node;
        u.alternatives.push_back(group[0]);
        u.properties.push_back(std::move(first));
        continue;
      }
      std::vector<std::pair<std::string, int32_t>> values;  // each literal and the object it begins
      for (const int32_t o : group) {
        const int32_t value = program_.nodes[o].properties[0].node;
        std::vector<std::string> literals = LiteralsOf(value);
        if (literals.empty()) {
          return Error(program_.nodes[value].path, "objects of an anyOf that begin with the same property ", keys[k],
                       " are told apart by its value, which must be a 'const' or an 'enum'");
        }
        for (std::string& l : literals) values.emplace_back(std::move(l), o);
      }
      std::sort(values.begin(), values.end());
      for (size_t v = 1; v < values.size(); ++v) {
        if (values[v].first == values[v - 1].first) {
          return Error(path, "its objects at '", Where(program_.nodes[values[v - 1].second].path), "' and '",
                       Where(program_.nodes[values[v].second].path), "' both begin with ", keys[k], ": ",
                       values[v].first, "; odmoe tells objects apart by their first property");
        }
      }
      if (values.size() > 0xffff) {  // a literal frame's range holds 16-bit indices
        return Error(path, "the values of its objects' first property ", keys[k], " are ", values.size(),
                     ", at most 65535");
      }
      GrammarNode chooser{.kind = Kind::kLiterals,
                          .path = program_.nodes[program_.nodes[group[0]].properties[0].node].path};
      for (auto& [literal, object] : values) {
        chooser.literals.push_back(std::move(literal));
        chooser.literal_objects.push_back(object);
      }
      ODMOE_ASSIGN_OR_RETURN(first.node, Add(std::move(chooser)));
      u.alternatives.push_back(-1);
      u.properties.push_back(std::move(first));
    }
    ODMOE_ASSIGN_OR_RETURN(const int32_t merged, Add(std::move(u)));
    rest.push_back(merged);
    *kept = std::move(rest);
    return absl::OkStatus();
  }

  // uniqueItems is kept for an array of enum values (Pydantic's Set[Color], or of booleans) only: its frame
  // remembers the values taken in a 64-bit mask. Its `item` becomes that kLiterals node itself, and it holds at
  // most as many items as there are values.
  absl::Status CheckUniqueItems() {
    for (GrammarNode& n : program_.nodes) {
      if (n.kind != Kind::kArray || !n.unique_items) continue;
      int32_t item = n.item;
      while (item >= 0 && program_.nodes[item].kind == Kind::kAnyOf && program_.nodes[item].alternatives.size() == 1) {
        item = program_.nodes[item].alternatives[0];
      }
      if (!n.prefix_items.empty() || item < 0 || program_.nodes[item].kind != Kind::kLiterals ||
          program_.nodes[item].literals.size() > GrammarNode::kMaxUniqueLiterals) {
        return Error(n.path, "'uniqueItems' is supported for items of an 'enum' (or 'const's, or booleans) of at most ",
                     GrammarNode::kMaxUniqueLiterals, " values, without 'prefixItems'");
      }
      const auto values = static_cast<uint32_t>(program_.nodes[item].literals.size());
      if (n.min_count > values) {
        return Error(n.path, "'minItems' ", n.min_count, " is more than the ", values,
                     " different values of its items");
      }
      n.item = item;
      n.max_count = std::min(n.max_count, values);
    }
    return absl::OkStatus();
  }

  // GrammarNode::min_depth of every node: the least fixed point, from "no value" down (a node that needs itself
  // again, through required properties or minItems, keeps "no value": more than kMaxGrammarDepth).
  void SetMinDepths() {
    constexpr int32_t kNone = kMaxGrammarDepth + 1;
    std::vector<GrammarNode>& nodes = program_.nodes;
    for (GrammarNode& n : nodes) n.min_depth = kNone;
    for (bool changed = true; changed;) {
      changed = false;
      for (GrammarNode& n : nodes) {
        int32_t d = 1;
        switch (n.kind) {
          case Kind::kArray:
            // Every position up to minItems holds an item.
            for (size_t i = 0; i < std::min<size_t>(n.min_count, n.prefix_items.size() + 1); ++i) {
              d = std::max(d, 1 + nodes[n.ItemAt(i)].min_depth);
            }
            break;
          case Kind::kObject:
            for (const GrammarNode::Property& p : n.properties) {
              if (p.required) d = std::max(d, 1 + nodes[p.node].min_depth);
            }
            break;
          case Kind::kAnyOf:
            d = kNone;
            for (const int32_t alt : n.alternatives) d = std::min(d, nodes[alt].min_depth);
            break;
          case Kind::kObjectUnion:
            for (const int32_t o : UnionObjects(n)) d = std::max(d, nodes[o].min_depth);
            break;
          default:
            break;
        }
        d = std::min(d, kNone);
        if (d < n.min_depth) {
          n.min_depth = d;
          changed = true;
        }
      }
    }
  }

  const OrderedJson& root_;
  GrammarProgram program_;
  std::map<std::string, int32_t> refs_;  // a $ref's JSON pointer: its node
};

}  // namespace

absl::StatusOr<GrammarProgram> CompileJsonSchema(std::string_view schema) {
  if (schema.size() > kMaxSchemaBytes) {
    return absl::InvalidArgumentError(StrCat("has ", schema.size(), " bytes, at most ", kMaxSchemaBytes));
  }
  absl::StatusOr<OrderedJson> parsed = ParseOrderedJson(schema, "schema");
  if (!parsed.ok()) {  // "schema: invalid JSON: <the parser's words>"
    const std::string message(parsed.status().message());
    const size_t words = message.find("invalid JSON: ");
    return absl::InvalidArgumentError(
        StrCat("is not JSON: ", words == std::string::npos ? message : message.substr(words + 14)));
  }
  return SchemaCompiler(*parsed).Run();
}

}  // namespace odmoe
