#include "src/common/cluster_config.h"

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "src/common/host_port.h"
#include "src/common/limits.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "toml++/toml.h"

namespace odmoe {
namespace {

absl::Status FieldError(const std::string& where, std::string_view scope, std::string_view field,
                        std::string_view problem) {
  return absl::InvalidArgumentError(
      StrCat(where, ": ", scope, scope.empty() ? "" : ": ", "field '", field, "': ", problem));
}

// The first entry of `list` that repeats an earlier one, as "'x' is given twice".
absl::Status CheckDistinct(const std::string& where, std::string_view scope, std::string_view field,
                           const std::vector<std::string>& list) {
  for (auto it = list.begin(); it != list.end(); ++it) {
    if (std::find(list.begin(), it, *it) != it) {
      return FieldError(where, scope, field, StrCat("'", *it, "' is given twice"));
    }
  }
  return absl::OkStatus();
}

// http_allowed_origins: "*" alone, or distinct origins as a browser sends them in its Origin header:
// http:// or https://, a host, an optional :port, nothing after (no path, no trailing '/').
absl::Status CheckOrigins(const std::string& where, std::string_view scope, const std::vector<std::string>& origins) {
  constexpr std::string_view kField = "http_allowed_origins";
  if (origins.empty()) return FieldError(where, scope, kField, "expected at least one origin (or \"*\" for any)");
  for (const std::string_view o : origins) {
    if (o == "*") {
      if (origins.size() > 1) return FieldError(where, scope, kField, "\"*\" (any origin) must be listed alone");
      continue;
    }
    const size_t host = o.starts_with("https://") ? 8 : o.starts_with("http://") ? 7 : 0;
    if (host == 0 || host == o.size() || o.find_first_of("/ \t\r\n?#", host) != std::string_view::npos) {
      return FieldError(where, scope, kField,
                        StrCat("'", o,
                               "' is not an origin (expected http:// or https://, a host and an optional "
                               ":port, nothing after)"));
    }
  }
  return CheckDistinct(where, scope, kField, origins);
}

// Typed reads of a TOML table that name the field on error.
class Fields {
 public:
  Fields(const toml::table& t, const std::string& where, std::string scope)
      : t_(t), where_(where), scope_(std::move(scope)) {}

  absl::StatusOr<std::optional<std::string>> String(std::string_view key) const {
    const toml::node* n = t_.get(key);
    if (n == nullptr) return std::optional<std::string>{};
    if (!n->is_string()) return FieldError(where_, scope_, key, "expected a string");
    return std::optional<std::string>{n->value<std::string>().value()};
  }
  absl::StatusOr<std::optional<int64_t>> Int(std::string_view key) const {
    const toml::node* n = t_.get(key);
    if (n == nullptr) return std::optional<int64_t>{};
    if (!n->is_integer()) return FieldError(where_, scope_, key, "expected an integer");
    return std::optional<int64_t>{n->value<int64_t>().value()};
  }
  absl::StatusOr<std::optional<bool>> Bool(std::string_view key) const {
    const toml::node* n = t_.get(key);
    if (n == nullptr) return std::optional<bool>{};
    if (!n->is_boolean()) return FieldError(where_, scope_, key, "expected true or false");
    return std::optional<bool>{n->value<bool>().value()};
  }
  // A string or a list of strings (a string alone: a list of one).
  absl::StatusOr<std::optional<std::vector<std::string>>> Strings(std::string_view key) const {
    const toml::node* n = t_.get(key);
    if (n == nullptr) return std::optional<std::vector<std::string>>{};
    if (n->is_string()) return std::optional<std::vector<std::string>>{{n->value<std::string>().value()}};
    const toml::array* a = n->as_array();
    if (a == nullptr) return FieldError(where_, scope_, key, "expected a string or a list of strings");
    std::vector<std::string> out;
    for (const toml::node& item : *a) {
      if (!item.is_string()) return FieldError(where_, scope_, key, "expected a string or a list of strings");
      out.push_back(item.value<std::string>().value());
    }
    return std::optional<std::vector<std::string>>{std::move(out)};
  }
  // A TOML float or integer.
  absl::StatusOr<std::optional<double>> Number(std::string_view key) const {
    const toml::node* n = t_.get(key);
    if (n == nullptr) return std::optional<double>{};
    if (!n->is_number()) return FieldError(where_, scope_, key, "expected a number");
    return std::optional<double>{n->value<double>().value()};
  }
  // Every key of the table must be one of `known`: a misspelt key is an error, not silently ignored.
  absl::Status OnlyKnown(const std::set<std::string>& known) const {
    for (const auto& [k, v] : t_) {
      if (known.count(std::string(k.str())) == 0) {
        return FieldError(where_, scope_, std::string(k.str()), "unknown field");
      }
    }
    return absl::OkStatus();
  }

 private:
  const toml::table& t_;
  const std::string& where_;
  std::string scope_;
};

// `field` ("address" or "metrics_address") of node `scope` must be host:port with a port in 1..65535.
absl::Status CheckAddress(const std::string& where, const std::string& scope, const std::string& address,
                          std::string_view field = "address") {
  const absl::StatusOr<HostPort> parsed = ParseHostPort(address);
  if (!parsed.ok() || parsed->host.empty() || parsed->port == 0) {
    return FieldError(where, scope, field, StrCat("expected host:port with a port in 1..65535, got '", address, "'"));
  }
  return absl::OkStatus();
}

// One [[device_profile]] table (device_profile.h); `where` is the file it is in, `ordinal` its position there.
absl::StatusOr<DeviceProfile> ParseProfileTable(const toml::node& entry, const std::string& where, size_t ordinal) {
  const std::string unnamed = StrCat("[[device_profile]] #", ordinal + 1);
  if (!entry.is_table()) return FieldError(where, "", "device_profile", "expected [[device_profile]] tables");
  const toml::table& t = *entry.as_table();
  DeviceProfile p;
  p.defined_in = where;
  ODMOE_ASSIGN_OR_RETURN(auto name, Fields(t, where, unnamed).String("name"));
  if (!name || name->empty() || name->find_first_of(": \t\n") != std::string::npos) {
    return FieldError(where, unnamed, "name", "missing or malformed (a name without ':' or spaces, e.g. \"rtx3090\")");
  }
  p.name = *name;
  const std::string scope = StrCat("device_profile '", p.name, "'");
  Fields f(t, where, scope);
  ODMOE_RETURN_IF_ERROR(
      f.OnlyKnown({"name", "memory_gib", "memory_gb_per_s", "h2d_pinned_gb_per_s", "h2d_pageable_gb_per_s",
                   "d2h_gb_per_s", "launch_latency_us", "copy_latency_us", "tflops"}));
  // A required number > 0 (and finite, below 1e9 of its unit), times `unit`.
  auto positive = [&](const Fields& fields, const std::string& in_scope, std::string_view key, double unit,
                      double* out) -> absl::Status {
    ODMOE_ASSIGN_OR_RETURN(auto v, fields.Number(key));
    if (!v) return FieldError(where, in_scope, key, "missing (every field of a device profile is required)");
    if (!(*v > 0.0 && *v < 1e9)) return FieldError(where, in_scope, key, StrCat("must be > 0, got ", *v));
    *out = *v * unit;
    return absl::OkStatus();
  };
  double memory_gib = 0;
  ODMOE_RETURN_IF_ERROR(positive(f, scope, "memory_gib", 1.0, &memory_gib));
  p.memory_bytes = static_cast<uint64_t>(memory_gib * 1024.0 * 1024.0 * 1024.0);
  ODMOE_RETURN_IF_ERROR(positive(f, scope, "memory_gb_per_s", 1e9, &p.memory_bytes_per_s));
  ODMOE_RETURN_IF_ERROR(positive(f, scope, "h2d_pinned_gb_per_s", 1e9, &p.h2d_pinned_bytes_per_s));
  ODMOE_RETURN_IF_ERROR(positive(f, scope, "h2d_pageable_gb_per_s", 1e9, &p.h2d_pageable_bytes_per_s));
  ODMOE_RETURN_IF_ERROR(positive(f, scope, "d2h_gb_per_s", 1e9, &p.d2h_bytes_per_s));
  ODMOE_RETURN_IF_ERROR(positive(f, scope, "launch_latency_us", 1e-6, &p.launch_latency_s));
  ODMOE_RETURN_IF_ERROR(positive(f, scope, "copy_latency_us", 1e-6, &p.copy_latency_s));
  const toml::node* tflops = t.get("tflops");
  if (tflops == nullptr || !tflops->is_table()) {
    return FieldError(where, scope, "tflops", "missing: a table { fp32 = ..., bf16 = ..., fp16 = ..., int8 = ... }");
  }
  const std::string tflops_scope = StrCat(scope, ": tflops");
  Fields rates(*tflops->as_table(), where, tflops_scope);
  ODMOE_RETURN_IF_ERROR(rates.OnlyKnown({"fp32", "bf16", "fp16", "int8"}));
  ODMOE_RETURN_IF_ERROR(positive(rates, tflops_scope, "fp32", 1e12, &p.fp32_flops_per_s));
  ODMOE_RETURN_IF_ERROR(positive(rates, tflops_scope, "bf16", 1e12, &p.bf16_flops_per_s));
  ODMOE_RETURN_IF_ERROR(positive(rates, tflops_scope, "fp16", 1e12, &p.fp16_flops_per_s));
  ODMOE_RETURN_IF_ERROR(positive(rates, tflops_scope, "int8", 1e12, &p.int8_ops_per_s));
  if (p.h2d_pageable_bytes_per_s > p.h2d_pinned_bytes_per_s) {
    return FieldError(where, scope, "h2d_pageable_gb_per_s",
                      StrCat(p.h2d_pageable_bytes_per_s / 1e9, " exceeds h2d_pinned_gb_per_s (",
                             p.h2d_pinned_bytes_per_s / 1e9, "): pageable copies are staged through pinned memory"));
  }
  return p;
}

// Appends the [[device_profile]] tables of `root` (a cluster file or a profile file named `where`) to `out`.
absl::Status AppendProfiles(const toml::table& root, const std::string& where, std::vector<DeviceProfile>* out) {
  const toml::node* profiles = root.get("device_profile");
  if (profiles == nullptr) return absl::OkStatus();
  if (!profiles->is_array_of_tables()) {
    return FieldError(where, "", "device_profile", "expected [[device_profile]] tables");
  }
  size_t ordinal = 0;
  for (const toml::node& entry : *profiles->as_array()) {
    ODMOE_ASSIGN_OR_RETURN(DeviceProfile p, ParseProfileTable(entry, where, ordinal++));
    for (const DeviceProfile& other : *out) {
      if (other.name == p.name) {
        return FieldError(where, StrCat("device_profile '", p.name, "'"), "name",
                          StrCat("already defined in ", other.defined_in));
      }
    }
    out->push_back(std::move(p));
  }
  return absl::OkStatus();
}

// Reads a profile file: [[device_profile]] tables and nothing else.
absl::Status LoadProfileFile(const std::string& path, const std::string& listed_in, std::vector<DeviceProfile>* out) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        StrCat(listed_in, ": [cluster]: field 'device_profiles': ", text.status().message()));
  }
  toml::table root;
  try {
    root = toml::parse(*text, path);
  } catch (const toml::parse_error& e) {
    return absl::DataLossError(StrCat(path, ":", e.source().begin.line, ":", e.source().begin.column,
                                      ": invalid TOML: ", std::string(e.description())));
  }
  for (const auto& [k, v] : root) {
    if (k.str() != "device_profile") {
      return FieldError(path, "", std::string(k.str()),
                        "unknown section (a profile file holds [[device_profile]] only)");
    }
  }
  if (root.get("device_profile") == nullptr) {
    return FieldError(path, "", "device_profile", "no [[device_profile]] table in this profile file");
  }
  return AppendProfiles(root, path, out);
}

}  // namespace

std::string_view NodeRoleName(NodeRole role) {
  switch (role) {
    case NodeRole::kMain:
      return "main";
    case NodeRole::kShadow:
      return "shadow";
    case NodeRole::kWorker:
      return "worker";
  }
  return "?";
}

std::string_view PredictionModeName(PredictionMode mode) {
  switch (mode) {
    case PredictionMode::kShadow:
      return "shadow";
    case PredictionMode::kRandom:
      return "random";
    case PredictionMode::kNone:
      return "none";
  }
  return "?";
}

std::string_view ShadowQuantName(ShadowQuant quant) {
  switch (quant) {
    case ShadowQuant::kFp16:
      return "fp16";
    case ShadowQuant::kInt8:
      return "int8";
    case ShadowQuant::kNf4:
      return "nf4";
    case ShadowQuant::kNone:
      return "none";
  }
  return "?";
}

absl::StatusOr<ShadowQuant> ParseShadowQuant(std::string_view text) {
  if (text == "fp16") return ShadowQuant::kFp16;
  if (text == "int8") return ShadowQuant::kInt8;
  if (text == "nf4") return ShadowQuant::kNf4;
  if (text == "none") return ShadowQuant::kNone;
  return absl::InvalidArgumentError(StrCat("shadow quantization '", text, "' (expected fp16, int8, nf4 or none)"));
}

absl::StatusOr<ReasoningParser> ParseReasoningParser(std::string_view name) {
  if (name == "qwen3") return ReasoningParser::kQwen3;
  if (name == "deepseek_r1") return ReasoningParser::kDeepSeekR1;
  return absl::InvalidArgumentError(StrCat("'", name, "' is not a reasoning parser (expected qwen3 or deepseek_r1)"));
}

absl::StatusOr<double> ParseHedgeMargin(std::string_view text) {
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || errno != 0 || !(v >= 0.0 && v <= 1.0)) {
    return absl::InvalidArgumentError(
        StrCat("hedge margin '", text, "' (expected a probability difference in [0, 1]; 0 = off)"));
  }
  return v;
}

absl::StatusOr<bool> ParseBool(std::string_view text) {
  if (text == "true") return true;
  if (text == "false") return false;
  return absl::InvalidArgumentError(StrCat("'", text, "' (expected true or false)"));
}

absl::Status ApplyAblationCase(int64_t ablation_case, ShadowSettings* settings) {
  const int64_t t = settings->align_token > 0 ? settings->align_token : 1;
  const int64_t kv = settings->align_kv > 0 ? settings->align_kv : 1;
  auto shadow = [settings](int64_t token, int64_t kv_period) {
    settings->mode = PredictionMode::kShadow;
    settings->align_token = token;
    settings->align_kv = kv_period;
  };
  switch (ablation_case) {
    case 1:
      shadow(t, kv);
      break;
    case 2:
      shadow(t, 0);
      break;
    case 3:
      shadow(0, kv);
      break;
    case 4:
      shadow(0, 0);
      break;
    case 5:
      settings->mode = PredictionMode::kRandom;
      break;
    case 6:
      settings->mode = PredictionMode::kNone;
      break;
    default:
      return absl::InvalidArgumentError(
          StrCat("--ablation-case must be 1..6 (OD-MoE section 4.2), got ", ablation_case));
  }
  return absl::OkStatus();
}

absl::Status ApplyShadowOverrides(const ShadowOverrides& o, bool has_shadow_node, ShadowSettings* settings) {
  auto integer = [](const std::optional<std::string>& text, const char* flag, int64_t min,
                    int64_t* out) -> absl::Status {
    if (!text) return absl::OkStatus();
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text->c_str(), &end, 10);
    if (text->empty() || *end != '\0' || errno != 0 || v < min || v > 1000000) {
      return absl::InvalidArgumentError(
          StrCat("--", flag, ": expected an integer in ", min, "..1000000, got '", *text, "'"));
    }
    *out = v;
    return absl::OkStatus();
  };
  if (o.ablation_case) {
    int64_t c = 0;
    ODMOE_RETURN_IF_ERROR(integer(o.ablation_case, "ablation-case", 1, &c));
    ODMOE_RETURN_IF_ERROR(ApplyAblationCase(c, settings));
  }
  if (o.prediction) {
    if (*o.prediction == "shadow") {
      settings->mode = PredictionMode::kShadow;
    } else if (*o.prediction == "random") {
      settings->mode = PredictionMode::kRandom;
    } else if (*o.prediction == "none") {
      settings->mode = PredictionMode::kNone;
    } else {
      return absl::InvalidArgumentError(
          StrCat("--prediction: '", *o.prediction, "' (expected shadow, random or none)"));
    }
  }
  if (o.shadow_quant) {
    absl::StatusOr<ShadowQuant> q = ParseShadowQuant(*o.shadow_quant);
    if (!q.ok()) return absl::InvalidArgumentError(StrCat("--shadow-quant: ", q.status().message()));
    settings->quant = *q;
  }
  ODMOE_RETURN_IF_ERROR(integer(o.align_token, "align-token", 0, &settings->align_token));
  ODMOE_RETURN_IF_ERROR(integer(o.align_kv, "align-kv", 0, &settings->align_kv));
  ODMOE_RETURN_IF_ERROR(integer(o.max_lead_tokens, "max-lead-tokens", 1, &settings->max_lead_tokens));
  for (auto [text, flag, out] : {std::tuple{&o.keep_router, "keep-router", &settings->keep_router},
                                 std::tuple{&o.keep_attention, "keep-attention", &settings->keep_attention}}) {
    if (!*text) continue;
    absl::StatusOr<bool> b = ParseBool(**text);
    if (!b.ok()) return absl::InvalidArgumentError(StrCat("--", flag, ": ", b.status().message()));
    *out = *b;
  }
  if (o.hedge_margin) {
    absl::StatusOr<double> t = ParseHedgeMargin(*o.hedge_margin);
    if (!t.ok()) return absl::InvalidArgumentError(StrCat("--hedge-margin: ", t.status().message()));
    settings->hedge_margin = *t;
  }
  if (settings->mode == PredictionMode::kShadow && !has_shadow_node) {
    return absl::InvalidArgumentError(
        "prediction by the shadow (ablation cases 1-4) needs a node with role = \"shadow\" in the cluster file");
  }
  return absl::OkStatus();
}

const NodeConfig* ClusterConfig::Find(std::string_view n) const {
  for (const NodeConfig& node : nodes) {
    if (node.name == n) return &node;
  }
  return nullptr;
}

const NodeConfig* ClusterConfig::main() const {
  for (const NodeConfig& node : nodes) {
    if (node.role == NodeRole::kMain) return &node;
  }
  return nullptr;
}

const NodeConfig* ClusterConfig::shadow() const {
  for (const NodeConfig& node : nodes) {
    if (node.role == NodeRole::kShadow) return &node;
  }
  return nullptr;
}

const DeviceProfile* ClusterConfig::FindProfile(std::string_view n) const {
  for (const DeviceProfile& p : device_profiles) {
    if (p.name == n) return &p;
  }
  return nullptr;
}

std::vector<const NodeConfig*> ClusterConfig::workers() const {
  std::vector<const NodeConfig*> out;
  for (const NodeConfig& node : nodes) {
    if (node.role == NodeRole::kWorker) out.push_back(&node);
  }
  return out;
}

absl::StatusOr<ClusterConfig> ParseClusterConfig(std::string_view text, const std::string& where,
                                                 const std::string& base_dir) {
  toml::table root;
  try {
    root = toml::parse(text, where);
  } catch (const toml::parse_error& e) {
    return absl::DataLossError(StrCat(where, ":", e.source().begin.line, ":", e.source().begin.column,
                                      ": invalid TOML: ", std::string(e.description())));
  }
  ClusterConfig c;
  c.file = where;
  for (const auto& [k, v] : root) {
    const std::string key(k.str());
    if (key != "cluster" && key != "model" && key != "node" && key != "shadow" && key != "tls" && key != "auth" &&
        key != "device_profile") {
      return FieldError(
          where, "", key,
          "unknown section (expected [cluster], [model], [shadow], [tls], [auth], [[node]] and [[device_profile]])");
    }
  }
  std::vector<std::string> profile_files;  // [cluster] device_profiles, as written
  std::optional<std::string> timing_model;
  if (const toml::node* cn = root.get("cluster")) {
    if (!cn->is_table()) return FieldError(where, "", "cluster", "expected a table");
    Fields f(*cn->as_table(), where, "[cluster]");
    ODMOE_RETURN_IF_ERROR(f.OnlyKnown({"name", "epoch", "group_size", "rpc_timeout_ms", "startup_timeout_ms",
                                       "share_host_experts", "prefill_minibatch_rows", "shutdown_timeout_ms",
                                       "max_queued", "max_running", "device_profiles", "timing_model", "time_scale"}));
    if (const toml::node* files = cn->as_table()->get("device_profiles")) {
      const toml::array* list = files->as_array();
      if (list == nullptr) {
        return FieldError(where, "[cluster]", "device_profiles", "expected a list of profile files");
      }
      for (const toml::node& file : *list) {
        if (!file.is_string() || file.value<std::string>()->empty()) {
          return FieldError(where, "[cluster]", "device_profiles",
                            "expected a list of profile file paths, e.g. [\"profiles/rtx3090.toml\"]");
        }
        profile_files.push_back(*file.value<std::string>());
      }
    }
    ODMOE_ASSIGN_OR_RETURN(timing_model, f.String("timing_model"));
    if (timing_model && timing_model->empty()) {
      return FieldError(where, "[cluster]", "timing_model", "expected a config.json path (or a folder holding one)");
    }
    ODMOE_ASSIGN_OR_RETURN(auto time_scale, f.Number("time_scale"));
    if (time_scale) {
      if (!(*time_scale > 0.0 && *time_scale <= 1e6)) {
        return FieldError(where, "[cluster]", "time_scale", StrCat("must be in (0, 1000000], got ", *time_scale));
      }
      c.time_scale = *time_scale;
    }
    ODMOE_ASSIGN_OR_RETURN(auto share, f.Bool("share_host_experts"));
    if (share) c.share_host_experts = *share;
    ODMOE_ASSIGN_OR_RETURN(auto name, f.String("name"));
    if (name) c.name = *name;
    if (c.name.empty() || c.name.find_first_of("/ \t\n") != std::string::npos) {
      return FieldError(where, "[cluster]", "name", "must be non-empty, without '/' or spaces");
    }
    ODMOE_ASSIGN_OR_RETURN(auto epoch, f.Int("epoch"));
    if (epoch) {
      if (*epoch < 1) return FieldError(where, "[cluster]", "epoch", "must be >= 1");
      c.epoch = static_cast<uint64_t>(*epoch);
    }
    ODMOE_ASSIGN_OR_RETURN(auto group, f.Int("group_size"));
    if (group) {
      if (*group < 0 || *group > 1024) return FieldError(where, "[cluster]", "group_size", "must be 0..1024");
      c.group_size = static_cast<int32_t>(*group);
    }
    ODMOE_ASSIGN_OR_RETURN(auto rpc, f.Int("rpc_timeout_ms"));
    if (rpc) {
      if (*rpc < 1) return FieldError(where, "[cluster]", "rpc_timeout_ms", "must be >= 1");
      c.rpc_timeout_ms = *rpc;
    }
    ODMOE_ASSIGN_OR_RETURN(auto minibatch, f.Int("prefill_minibatch_rows"));
    if (minibatch) {
      if (*minibatch < 0 || *minibatch > (int64_t{1} << 20)) {
        return FieldError(where, "[cluster]", "prefill_minibatch_rows", "must be 0 (no mini-batches) .. 1048576");
      }
      c.prefill_minibatch_rows = *minibatch;
    }
    ODMOE_ASSIGN_OR_RETURN(auto startup, f.Int("startup_timeout_ms"));
    if (startup) {
      if (*startup < 1) return FieldError(where, "[cluster]", "startup_timeout_ms", "must be >= 1");
      c.startup_timeout_ms = *startup;
    }
    ODMOE_ASSIGN_OR_RETURN(auto shutdown, f.Int("shutdown_timeout_ms"));
    if (shutdown) {
      if (*shutdown < 0 || *shutdown > 3600000) {
        return FieldError(where, "[cluster]", "shutdown_timeout_ms", "must be 0..3600000");
      }
      c.shutdown_timeout_ms = *shutdown;
    }
    ODMOE_ASSIGN_OR_RETURN(auto queued, f.Int("max_queued"));
    if (queued) {
      if (*queued < 0 || *queued > 4096) return FieldError(where, "[cluster]", "max_queued", "must be 0..4096");
      c.max_queued = static_cast<int32_t>(*queued);
    }
    ODMOE_ASSIGN_OR_RETURN(auto running, f.Int("max_running"));
    if (running) {
      if (*running < 1 || *running > kMaxTokenRows) {
        return FieldError(where, "[cluster]", "max_running", StrCat("must be 1..", kMaxTokenRows));
      }
      c.max_running = static_cast<int32_t>(*running);
    }
  }
  // Paths in the file are relative to its folder.
  auto resolve_path = [&](const std::string& relative) {
    std::filesystem::path p(relative);
    if (p.is_relative()) p = std::filesystem::path(base_dir) / p;
    return p.lexically_normal().string();
  };
  if (timing_model) c.timing_model = resolve_path(*timing_model);
  for (const std::string& file : profile_files) {
    ODMOE_RETURN_IF_ERROR(LoadProfileFile(resolve_path(file), where, &c.device_profiles));
  }
  ODMOE_RETURN_IF_ERROR(AppendProfiles(root, where, &c.device_profiles));
  for (const char* section : {"tls", "auth"}) {
    const toml::node* n = root.get(section);
    if (n == nullptr) continue;
    const std::string scope = StrCat("[", section, "]");
    if (!n->is_table()) return FieldError(where, "", section, "expected a table");
    Fields f(*n->as_table(), where, scope);
    const char* key = std::string_view(section) == "tls" ? "ca" : "token_file";
    ODMOE_RETURN_IF_ERROR(f.OnlyKnown({key}));
    ODMOE_ASSIGN_OR_RETURN(auto value, f.String(key));
    if (!value || value->empty()) return FieldError(where, scope, key, "missing (a file path)");
    (std::string_view(section) == "tls" ? c.tls_ca : c.token_file) = resolve_path(*value);
  }
  if (const toml::node* mn = root.get("model")) {
    if (!mn->is_table()) return FieldError(where, "", "model", "expected a table");
    Fields f(*mn->as_table(), where, "[model]");
    ODMOE_RETURN_IF_ERROR(
        f.OnlyKnown({"path", "synthetic", "layers", "seed", "served_model_name", "max_model_len", "reasoning_parser"}));
    auto resolve = [&](const std::string& relative) {
      std::filesystem::path p(relative);
      if (p.is_relative()) p = std::filesystem::path(base_dir) / p;
      return p.lexically_normal().string();
    };
    ODMOE_ASSIGN_OR_RETURN(auto path, f.String("path"));
    if (path && !path->empty()) c.model.path = resolve(*path);
    ODMOE_ASSIGN_OR_RETURN(auto synthetic, f.String("synthetic"));
    ODMOE_ASSIGN_OR_RETURN(auto layers, f.Int("layers"));
    ODMOE_ASSIGN_OR_RETURN(auto seed, f.Int("seed"));
    if (synthetic) {
      if (synthetic->empty()) return FieldError(where, "[model]", "synthetic", "expected a config.json path");
      if (path) return FieldError(where, "[model]", "synthetic", "give either path or synthetic, not both");
      c.model.synthetic = resolve(*synthetic);
    } else if (layers || seed) {
      return FieldError(where, "[model]", layers ? "layers" : "seed", "only goes with synthetic = \"config.json\"");
    }
    if (layers) {
      if (*layers < 0) return FieldError(where, "[model]", "layers", "must be >= 0 (0: the config's)");
      c.model.layers = *layers;
    }
    if (seed) {
      if (*seed < 0) return FieldError(where, "[model]", "seed", "must be >= 0");
      c.model.seed = static_cast<uint64_t>(*seed);
    }
    ODMOE_ASSIGN_OR_RETURN(auto max_model_len, f.Int("max_model_len"));
    if (max_model_len) {
      if (*max_model_len < 1) {
        return FieldError(
            where, "[model]", "max_model_len",
            StrCat("must be >= 1 (leave it out for the model's max_position_embeddings), got ", *max_model_len));
      }
      c.model.max_model_len = *max_model_len;
    }
    ODMOE_ASSIGN_OR_RETURN(auto reasoning, f.String("reasoning_parser"));
    if (reasoning) {
      absl::StatusOr<ReasoningParser> parser = ParseReasoningParser(*reasoning);
      if (!parser.ok()) return FieldError(where, "[model]", "reasoning_parser", std::string(parser.status().message()));
      c.model.reasoning_parser = *parser;
    }
    ODMOE_ASSIGN_OR_RETURN(auto served, f.Strings("served_model_name"));
    if (served) {
      if (served->empty()) return FieldError(where, "[model]", "served_model_name", "expected at least one name");
      for (const std::string& name : *served) {
        if (name.empty() || name.find_first_of(" \t\r\n") != std::string::npos) {
          return FieldError(where, "[model]", "served_model_name",
                            StrCat("'", name, "' is not a name (empty, or with white space)"));
        }
      }
      ODMOE_RETURN_IF_ERROR(CheckDistinct(where, "[model]", "served_model_name", *served));
      c.model.served_names = *std::move(served);
    }
  }
  std::optional<std::string> mode_text;
  if (const toml::node* sn = root.get("shadow")) {
    if (!sn->is_table()) return FieldError(where, "", "shadow", "expected a table");
    Fields f(*sn->as_table(), where, "[shadow]");
    ODMOE_RETURN_IF_ERROR(
        f.OnlyKnown({"mode", "quant", "align_token", "align_kv", "max_lead_tokens", "catch_up_lag", "finish_wait_ms",
                     "seed", "keep_router", "keep_attention", "hedge_margin", "early_departure"}));
    ShadowSettings& ss = c.shadow_settings;
    ODMOE_ASSIGN_OR_RETURN(mode_text, f.String("mode"));
    ODMOE_ASSIGN_OR_RETURN(auto quant, f.String("quant"));
    if (quant) {
      absl::StatusOr<ShadowQuant> q = ParseShadowQuant(*quant);
      if (!q.ok()) return FieldError(where, "[shadow]", "quant", std::string(q.status().message()));
      ss.quant = *q;
    }
    struct IntField {
      const char* key;
      int64_t* value;
      int64_t min;
    };
    for (const IntField& field :
         {IntField{"align_token", &ss.align_token, 0}, IntField{"align_kv", &ss.align_kv, 0},
          IntField{"max_lead_tokens", &ss.max_lead_tokens, 1}, IntField{"catch_up_lag", &ss.catch_up_lag, 0},
          IntField{"finish_wait_ms", &ss.finish_wait_ms, 0}}) {
      ODMOE_ASSIGN_OR_RETURN(auto v, f.Int(field.key));
      if (!v) continue;
      if (*v < field.min || *v > 1000000) {
        return FieldError(where, "[shadow]", field.key, StrCat("must be ", field.min, "..1000000, got ", *v));
      }
      *field.value = *v;
    }
    ODMOE_ASSIGN_OR_RETURN(auto seed, f.Int("seed"));
    if (seed) c.shadow_settings.seed = static_cast<uint64_t>(*seed);
    ODMOE_ASSIGN_OR_RETURN(auto keep_router, f.Bool("keep_router"));
    if (keep_router) ss.keep_router = *keep_router;
    ODMOE_ASSIGN_OR_RETURN(auto keep_attention, f.Bool("keep_attention"));
    if (keep_attention) ss.keep_attention = *keep_attention;
    ODMOE_ASSIGN_OR_RETURN(auto early_departure, f.Bool("early_departure"));
    if (early_departure) ss.early_departure = *early_departure;
    ODMOE_ASSIGN_OR_RETURN(auto margin, f.Number("hedge_margin"));
    if (margin) {
      if (!(*margin >= 0.0 && *margin <= 1.0)) {
        return FieldError(where, "[shadow]", "hedge_margin",
                          StrCat("must be a probability difference in [0, 1] (0 = off), got ", *margin));
      }
      ss.hedge_margin = *margin;
    }
  }
  const toml::node* nodes = root.get("node");
  if (nodes == nullptr || !nodes->is_array_of_tables()) {
    return FieldError(where, "", "node", "expected [[node]] entries");
  }
  std::set<std::string> names, addresses;
  int32_t next_worker = 0;
  for (const toml::node& entry : *nodes->as_array()) {
    const toml::table& t = *entry.as_table();
    NodeConfig node;
    Fields pre(t, where, "[[node]]");
    ODMOE_ASSIGN_OR_RETURN(auto name, pre.String("name"));
    if (!name || name->empty()) return FieldError(where, "[[node]]", "name", "missing");
    if (name->find_first_of("/ \t\n") != std::string::npos) {
      return FieldError(where, "[[node]]", "name", StrCat("'", *name, "' must not contain '/' or spaces"));
    }
    node.name = *name;
    const std::string scope = StrCat("node '", node.name, "'");
    if (!names.insert(node.name).second) return FieldError(where, scope, "name", "used by two nodes");
    Fields f(t, where, scope);
    ODMOE_RETURN_IF_ERROR(f.OnlyKnown({"name", "role", "address", "device", "gpu_budget_mb", "threads",
                                       "metrics_address", "http_address", "http_allowed_origins", "cert", "key"}));
    ODMOE_ASSIGN_OR_RETURN(auto role, f.String("role"));
    if (!role) return FieldError(where, scope, "role", "missing (main, shadow or worker)");
    if (*role == "main") {
      node.role = NodeRole::kMain;
    } else if (*role == "shadow") {
      node.role = NodeRole::kShadow;
    } else if (*role == "worker") {
      node.role = NodeRole::kWorker;
      node.worker_index = next_worker++;
    } else {
      return FieldError(where, scope, "role", StrCat("'", *role, "' (expected main, shadow or worker)"));
    }
    ODMOE_ASSIGN_OR_RETURN(auto address, f.String("address"));
    if (!address) return FieldError(where, scope, "address", "missing");
    node.address = *address;
    ODMOE_RETURN_IF_ERROR(CheckAddress(where, scope, node.address));
    if (!addresses.insert(node.address).second) return FieldError(where, scope, "address", "used by two nodes");
    ODMOE_ASSIGN_OR_RETURN(auto device, f.String("device"));
    if (device) node.device = *device;
    constexpr std::string_view kTimed = "timed:";
    if (std::string_view(node.device).starts_with(kTimed)) {
      const std::string profile = node.device.substr(kTimed.size());
      if (c.FindProfile(profile) == nullptr) {
        std::string known;
        for (const DeviceProfile& p : c.device_profiles) known += StrCat(known.empty() ? "" : ", ", p.name);
        return FieldError(where, scope, "device",
                          StrCat("'", node.device, "': no device profile named '", profile, "' (defined: ",
                                 known.empty() ? "none; list profile files in [cluster] device_profiles" : known, ")"));
      }
    }
    ODMOE_ASSIGN_OR_RETURN(auto budget, f.Int("gpu_budget_mb"));
    if (budget) {
      if (*budget < 1) return FieldError(where, scope, "gpu_budget_mb", "must be >= 1");
      node.gpu_budget_bytes = static_cast<uint64_t>(*budget) << 20;
    }
    ODMOE_ASSIGN_OR_RETURN(auto threads, f.Int("threads"));
    if (threads) {
      if (*threads < 1 || *threads > 64) return FieldError(where, scope, "threads", "must be 1..64");
      node.threads = static_cast<int32_t>(*threads);
    }
    ODMOE_ASSIGN_OR_RETURN(auto metrics_address, f.String("metrics_address"));
    if (metrics_address) {
      ODMOE_RETURN_IF_ERROR(CheckAddress(where, scope, *metrics_address, "metrics_address"));
      node.metrics_address = *metrics_address;
    }
    for (const char* key : {"cert", "key"}) {
      ODMOE_ASSIGN_OR_RETURN(auto file, f.String(key));
      if (file && !c.tls_ca.empty() && !file->empty()) {
        (std::string_view(key) == "cert" ? node.tls_cert : node.tls_key) = resolve_path(*file);
      } else if (file && c.tls_ca.empty()) {
        return FieldError(where, scope, key, "needs a [tls] section with the cluster's ca");
      } else if (!c.tls_ca.empty()) {
        return FieldError(where, scope, key, "missing: with [tls] every node needs cert and key (PEM files)");
      }
    }
    ODMOE_ASSIGN_OR_RETURN(auto http_address, f.String("http_address"));
    if (http_address) {
      ODMOE_RETURN_IF_ERROR(CheckAddress(where, scope, *http_address, "http_address"));
      if (node.role != NodeRole::kMain) {
        return FieldError(where, scope, "http_address", "only the main node serves the HTTP API");
      }
      node.http_address = *http_address;
    }
    ODMOE_ASSIGN_OR_RETURN(auto origins, f.Strings("http_allowed_origins"));
    if (origins) {
      if (node.http_address.empty()) {
        return FieldError(where, scope, "http_allowed_origins", "needs http_address (the HTTP API it opens)");
      }
      ODMOE_RETURN_IF_ERROR(CheckOrigins(where, scope, *origins));
      node.http_allowed_origins = *std::move(origins);
    }
    c.nodes.push_back(std::move(node));
  }
  // A metrics address may be no other node's metrics address nor any node's (gRPC) address.
  std::map<std::string, std::string> taken;  // address -> "node 'x' address"
  for (const NodeConfig& n : c.nodes) taken[n.address] = StrCat("node '", n.name, "' address");
  for (const NodeConfig& n : c.nodes) {
    if (n.metrics_address.empty()) continue;
    auto [it, fresh] = taken.emplace(n.metrics_address, StrCat("node '", n.name, "' metrics_address"));
    if (!fresh) {
      return FieldError(where, StrCat("node '", n.name, "'"), "metrics_address",
                        StrCat("'", n.metrics_address, "' is also ", it->second));
    }
  }
  // The HTTP API's address likewise, but it may be main's own metrics_address (one server serves both).
  for (const NodeConfig& n : c.nodes) {
    if (n.http_address.empty() || n.http_address == n.metrics_address) continue;
    auto [it, fresh] = taken.emplace(n.http_address, StrCat("node '", n.name, "' http_address"));
    if (!fresh) {
      return FieldError(where, StrCat("node '", n.name, "'"), "http_address",
                        StrCat("'", n.http_address, "' is also ", it->second));
    }
  }
  int mains = 0, shadows = 0;
  for (const NodeConfig& n : c.nodes) {
    mains += n.role == NodeRole::kMain;
    shadows += n.role == NodeRole::kShadow;
  }
  if (mains != 1) return FieldError(where, "", "node", StrCat("need exactly one main node, found ", mains));
  if (shadows > 1) return FieldError(where, "", "node", StrCat("at most one shadow node, found ", shadows));
  if (next_worker < 1) return FieldError(where, "", "node", "need at least one worker node");
  if (!mode_text) {
    c.shadow_settings.mode = shadows == 1 ? PredictionMode::kShadow : PredictionMode::kNone;
  } else if (*mode_text == "shadow") {
    if (shadows == 0) {
      return FieldError(where, "[shadow]", "mode", "'shadow' needs a node with role = \"shadow\" in the file");
    }
    c.shadow_settings.mode = PredictionMode::kShadow;
  } else if (*mode_text == "random") {
    c.shadow_settings.mode = PredictionMode::kRandom;
  } else if (*mode_text == "none") {
    c.shadow_settings.mode = PredictionMode::kNone;
  } else {
    return FieldError(where, "[shadow]", "mode", StrCat("'", *mode_text, "' (expected shadow, random or none)"));
  }
  if (c.group_size > next_worker || (c.group_size > 0 && next_worker % c.group_size != 0)) {
    return FieldError(where, "[cluster]", "group_size",
                      StrCat(c.group_size, " must divide the number of workers (", next_worker, ")"));
  }
  return c;
}

absl::StatusOr<ClusterConfig> LoadClusterConfig(const std::string& path) {
  ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  const std::string base = std::filesystem::path(path).parent_path().string();
  return ParseClusterConfig(text, path, base.empty() ? "." : base);
}

}  // namespace odmoe
