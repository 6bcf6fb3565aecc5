// The cluster file (TOML): every node with its role, address, device and GPU budget, the group size, the
// model, timeouts and the shadow's settings. Every daemon reads the same file and finds itself by name.
//
//   [cluster]
//   name = "local"            # names the run directory of `odmoe cluster up`
//   epoch = 1                 # membership epoch; nodes refuse requests of another epoch
//   group_size = 2            # workers per group; 0 or absent: the model's top-k
//   rpc_timeout_ms = 30000    # deadline of every RPC between nodes
//   startup_timeout_ms = 60000
//   share_host_experts = true # workers of one host share one host copy of the experts (/dev/shm)
//   prefill_minibatch_rows = 32  # prefill: (token, expert) rows per call to a worker, pipelined (0: no split)
//   [model]
//   path = "../models/demo-mixtral-kjv"   # relative to this file
//   # or synthetic weights instead of path: synthetic = "config.json"  layers = 2  seed = 1
//   served_model_name = ["mixtral", "demo"]  # optional: the names the HTTP API answers to (default: the folder's)
//   reasoning_parser = "qwen3"  # optional: chat answers' reasoning as reasoning_content (qwen3 | deepseek_r1)
//   [shadow]
//   mode = "shadow"           # shadow | random | none (default: shadow when a shadow node exists, else none)
//   quant = "int8"            # fp16 | int8 | nf4 | none: the shadow's replica
//   align_token = 1           # T_tok: main sends the shadow each new token every N decode steps (0: never)
//   align_kv = 1              # T_kv: ... and that token's K/V of every layer every N steps (0: never)
//   max_lead_tokens = 1       # how far (positions) the shadow may run ahead of main
//   catch_up_lag = 0          # positions behind main at which the shadow catches up on main's K/V (0: never)
//   finish_wait_ms = 2000     # after a request's last token, how long main waits for the shadow's last predictions
//   [[node]]
//   name = "main"  role = "main"  address = "127.0.0.1:7100"  device = "cpu"
//   [[node]]
//   name = "w0"  role = "worker"  address = "127.0.0.1:7110"  device = "mock-gpu"  gpu_budget_mb = 1024
//   metrics_address = "127.0.0.1:7210"   # optional: Prometheus text at http://HOST:PORT/metrics
//   http_address = "127.0.0.1:7300"      # main only, optional: the OpenAI-compatible HTTP API
//   http_allowed_origins = ["https://app.example.com"]  # main only, optional: browser pages that may call it (CORS)
//   cert = "tls/w0.crt"  key = "tls/w0.key"  # with [tls]: this node's certificate and key
//   [tls]                     # optional: mutual TLS between nodes (src/rpc/security.h); every node needs cert+key
//   ca = "tls/ca.crt"
//   [auth]                    # optional: clients send "authorization: Bearer TOKEN" (src/rpc/client_token.h)
//   token_file = "token"
//   # [cluster] shutdown_timeout_ms = 10000: on SIGTERM, how long in-flight calls get to finish
//   # [cluster] max_queued = 32: requests that may wait for main's engine; more are refused (busy)
//   # [cluster] max_running = 8: requests main decodes together in one batch (continuous batching)
//   # Emulated hardware (src/backend/timed_device.h): a node with device = "timed:PROFILE" computes as the mock
//   # GPU does and waits, in wall time, as long as PROFILE's device would take:
//   # [cluster] device_profiles = ["profiles/rtx3090.toml"]   # files of [[device_profile]] tables (relative to
//   #                                                          # this file); or [[device_profile]] tables here
//   # [cluster] timing_model = "models/mixtral-8x7b/config.json"  # charge work at this model's shapes
//   # [cluster] time_scale = 1.0   # every modelled duration times this (link rates divided by it)
//   # (src/common/device_profile.h lists a profile's fields.)
//
// Workers are numbered in the order they appear in the file (the placement's worker index).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "src/common/device_profile.h"

namespace odmoe {

enum class NodeRole { kMain, kShadow, kWorker };
std::string_view NodeRoleName(NodeRole role);

struct NodeConfig {
  std::string name;
  NodeRole role = NodeRole::kWorker;
  std::string address;            // host:port the daemon listens on and peers dial
  std::string device = "cpu";     // a CreateDevice spec: cpu, mock-gpu, cuda, timed:PROFILE (a profile of the file)
  uint64_t gpu_budget_bytes = 0;  // workers: device memory for weights, activations and workspace (0: none set)
  int32_t worker_index = -1;      // workers: position among the workers of the file
  int32_t threads = 2;            // RPC handler threads
  // host:port where the daemon serves GET /metrics (Prometheus text); empty: no metrics server. Unique among
  // every node's address and metrics_address.
  std::string metrics_address;
  // With [tls]: PEM files of this node's certificate (its SAN names the node) and private key (absolute after
  // loading). Both present for every node when the file has [tls], absent otherwise.
  std::string tls_cert;
  std::string tls_key;
  // main only: host:port of the OpenAI-compatible HTTP API (src/main_node/http_server.h); empty: none. Unique
  // like metrics_address, except that it may equal main's own metrics_address (one server answers both).
  std::string http_address;
  // main only, with http_address: the origins ("https://app.example.com", scheme://host[:port]) whose web pages may
  // call the HTTP API from a browser (CORS), or just "*" for any; empty: none (vLLM's --allowed-origins).
  std::vector<std::string> http_allowed_origins;
};

// How chat answers' reasoning (a <think> ... </think> block) is told from their content (vLLM's --reasoning-parser):
// kNone, it is content; kQwen3, a block the answer opens with; kDeepSeekR1, everything up to </think> (the
// template opened the block). src/main_node/reasoning.h reads them.
enum class ReasoningParser { kNone, kQwen3, kDeepSeekR1 };
// "qwen3" and "deepseek_r1"; InvalidArgument listing them for another name.
absl::StatusOr<ReasoningParser> ParseReasoningParser(std::string_view name);

// [model]: a checkpoint (`path`), or synthetic weights (`synthetic`, `layers`, `seed`; src/model/synthetic.h),
// which every node generates for itself; the two are mutually exclusive.
struct ModelSource {
  std::string path;       // a Hugging Face checkpoint folder (absolute after loading)
  std::string synthetic;  // a config.json (or a folder holding one) for synthetic weights (absolute after loading)
  int64_t layers = 0;     // synthetic: > 0 replaces num_hidden_layers; 0: the config's
  uint64_t seed = 0;      // synthetic: the weights' seed
  // served_model_name (vLLM's --served-model-name): the names the HTTP API answers to, a string or a list; the
  // first is the one answers and metrics carry. Empty: the checkpoint folder's name. Distinct, no white space.
  std::vector<std::string> served_names;
  // max_model_len (vLLM's --max-model-len): the longest sequence (prompt plus answer) served, at most the model's
  // max_position_embeddings; 0: that. A request's KV cache is sized for its sequence, and a chat request without
  // max_tokens asks for the rest of the context, so a lower cap bounds each request's device memory.
  int64_t max_model_len = 0;
  ReasoningParser reasoning_parser = ReasoningParser::kNone;  // reasoning_parser
  bool is_synthetic() const { return !synthetic.empty(); }
};

// How experts get predicted, and the shadow's settings ([shadow] in the cluster file; `odmoe cluster up`
// overrides them with --shadow-quant, --align-token, --align-kv and --ablation-case).
enum class PredictionMode {
  kShadow,  // the shadow node predicts (needs a shadow node in the file)
  kRandom,  // no shadow: main prefetches k random experts per sparse layer (OD-MoE ablation case 5)
  kNone,    // no prediction: workers load after routing (case 6)
};
std::string_view PredictionModeName(PredictionMode mode);  // "shadow", "random", "none"

enum class ShadowQuant { kFp16, kInt8, kNf4, kNone };
std::string_view ShadowQuantName(ShadowQuant quant);  // "fp16", "int8", "nf4", "none"
// Parses "fp16", "int8", "nf4", "none" (no quantization: the full-precision model); InvalidArgument naming the value.
absl::StatusOr<ShadowQuant> ParseShadowQuant(std::string_view text);

struct ShadowSettings {
  PredictionMode mode = PredictionMode::kShadow;  // kNone when the file has no shadow node and sets no mode
  ShadowQuant quant = ShadowQuant::kInt8;
  // Alignment periods in decode steps: main sends the shadow the new token every align_token steps and that
  // step's K/V (of every layer) every align_kv steps; 0 = never.
  int64_t align_token = 1;
  int64_t align_kv = 1;
  // How many positions the shadow may run ahead of the position main is decoding (>= 1).
  int64_t max_lead_tokens = 1;
  // How many positions behind the position main is decoding the shadow must be before it takes main's token
  // and K/V for the positions main has left behind instead of running them (catch-up); main then sends both at
  // every step, whatever align_token and align_kv (ShadowLink::AlignmentDue). 0: never, every position is run
  // and its late predictions count for recall.
  int64_t catch_up_lag = 0;
  // After a request's last token, how long main waits for the shadow's last predictions (they count for recall)
  // before it answers; a shadow later than that has the rest counted missing. The request's running place goes
  // to the next one meanwhile. 0: answer at once.
  int64_t finish_wait_ms = 2000;
  // Where a token alignment is due, the shadow waits for main's token (false: OD-MoE's late departure), or runs
  // the position at once with its own guess and rolls back if main's token differs (true: early departure, so
  // that the first layers' predictions of a position are out before main has finished the one before).
  bool early_departure = false;
  uint64_t seed = 1;  // kRandom's predictions
  // Which linear weights of each decoder layer stay at the checkpoint's precision in the shadow's quantized
  // replica: the sparse layers' routers, the attention projections (q, k, v, o).
  bool keep_router = false;
  bool keep_attention = false;
  // Hedged prefetch: the shadow also prefetches its router's (k+1)-th expert when p_k - p_(k+1) < hedge_margin
  // (softmax over all experts); 0 = off. In [0, 1].
  double hedge_margin = 0;
};

// Parses a hedge margin ("0.05"): a number in [0, 1]. InvalidArgument naming the text otherwise.
absl::StatusOr<double> ParseHedgeMargin(std::string_view text);
// Parses "true" or "false". InvalidArgument naming the text otherwise.
absl::StatusOr<bool> ParseBool(std::string_view text);

// OD-MoE's ablation cases (section 4.2) as settings: 1 shadow with token and KV alignment (every step), 2 token
// alignment only, 3 KV alignment only, 4 no alignment, 5 no shadow with random prefetch, 6 no shadow, load after
// routing. Cases 1-4 keep the periods already set where they are nonzero (1 otherwise). InvalidArgument for a
// case outside 1..6.
absl::Status ApplyAblationCase(int64_t ablation_case, ShadowSettings* settings);

// The command-line overrides of [shadow] that `odmoe cluster up` passes on to every daemon: --ablation-case N
// first, then --prediction MODE, --shadow-quant Q, --align-token N, --align-kv N, --max-lead-tokens N,
// --keep-router B, --keep-attention B, --hedge-margin T. Each value is given as text (absent: keep). Errors name
// the flag. `has_shadow_node`: a shadow mode needs one.
struct ShadowOverrides {
  std::optional<std::string> ablation_case, prediction, shadow_quant, align_token, align_kv, max_lead_tokens;
  std::optional<std::string> keep_router, keep_attention, hedge_margin;
  bool any() const {
    return ablation_case || prediction || shadow_quant || align_token || align_kv || max_lead_tokens || keep_router ||
           keep_attention || hedge_margin;
  }
};
absl::Status ApplyShadowOverrides(const ShadowOverrides& overrides, bool has_shadow_node, ShadowSettings* settings);

struct ClusterConfig {
  std::string file;  // where it was read from
  std::string name = "odmoe";
  uint64_t epoch = 1;
  int32_t group_size = 0;  // 0: the model's top-k
  int64_t rpc_timeout_ms = 30000;
  int64_t startup_timeout_ms = 60000;
  bool share_host_experts = true;       // [cluster] share_host_experts
  int64_t prefill_minibatch_rows = 32;  // [cluster] prefill_minibatch_rows (0: no mini-batches)
  // [cluster] shutdown_timeout_ms: after SIGTERM, how long calls in flight may take to finish before the
  // daemon exits (systemd's TimeoutStopSec should exceed it).
  int64_t shutdown_timeout_ms = 10000;
  // [cluster] max_queued: requests that may wait (first come, first served) while max_running run; a request
  // arriving when that many wait is refused at once, busy (src/main_node/admission.h). 0..4096.
  int32_t max_queued = 32;
  // [cluster] max_running: requests main runs at once, decoded together in one batch (continuous batching); more
  // wait in the queue (max_queued). 1..256 (kMaxTokenRows: one decode step carries a row of each).
  int32_t max_running = 8;
  // Device profiles: the [[device_profile]] tables of the files [cluster] device_profiles lists, then those of the
  // cluster file itself; names are unique. Every node's "timed:NAME" names one of them.
  std::vector<DeviceProfile> device_profiles;
  // [cluster] timing_model: a config.json (or a folder holding one; absolute after loading) whose shapes timed
  // devices charge their work at, while they compute the cluster's model; empty: the model's own shapes.
  std::string timing_model;
  // [cluster] time_scale: every duration a timed device models is multiplied by it (> 0; 1: real time).
  double time_scale = 1.0;
  std::string tls_ca;      // [tls] ca: PEM file of the cluster's CA (absolute); empty: no TLS
  std::string token_file;  // [auth] token_file (absolute); empty: no client token
  ModelSource model;
  ShadowSettings shadow_settings;
  std::vector<NodeConfig> nodes;

  const NodeConfig* Find(std::string_view name) const;
  const NodeConfig* main() const;                                 // exactly one main node (checked when parsed)
  const NodeConfig* shadow() const;                               // at most one; nullptr when there is none
  std::vector<const NodeConfig*> workers() const;                 // in worker_index order
  const DeviceProfile* FindProfile(std::string_view name) const;  // nullptr when no profile has that name
};

// Parses the file's text. `where` names it in every message ("configs/local.toml: node 'w3': field
// 'address': ..."); relative paths are resolved against `base_dir`, and the profile files of [cluster]
// device_profiles are read from there. InvalidArgument for bad content, DataLoss for malformed TOML (of the
// file or a profile file), NotFound for a profile file that does not exist.
absl::StatusOr<ClusterConfig> ParseClusterConfig(std::string_view text, const std::string& where,
                                                 const std::string& base_dir);
absl::StatusOr<ClusterConfig> LoadClusterConfig(const std::string& path);

}  // namespace odmoe
