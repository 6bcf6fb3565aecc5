// The forward pass of a decoder-only MoE transformer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on one Device:
// prefill and incremental decode over a KV cache. Routed experts are computed by an ExpertExecutor, so the same
// engine runs with every expert local (the single-process engine) or with experts on remote workers (main).
//
// Per layer: x += o_proj(attention(rope(qk_norm(q, k)), v)) on rms_norm(x); then on h = rms_norm(x):
// a sparse layer routes h (softmax, top-k) and adds sum_k w_k * expert_k(h) (+ sigmoid(h.g) * shared(h));
// a dense layer adds mlp(h). The final norm and lm_head give the logits of the last position, and
// Device::SelectTokens picks the next token from them on the device when the caller gives a TokenChoice.
// On a device with graphs (CUDA), a resident decode step's work is recorded once and replayed with one launch per
// token (decode_graphs.h); the results are those of running it op by op.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/common/limits.h"
#include "src/engine/decode_graphs.h"
#include "src/engine/model_weights.h"
#include "src/engine/moe_units.h"
#include "src/engine/sampler.h"
#include "src/model/model_config.h"

namespace odmoe {

// What one Engine::Forward is, decided once by its caller (Generate, the shadow) and passed down to the
// executor: the prompt (prefill, processed in chunks) or one decode step (a generated token fed back).
// Executors never guess it from the chunk size or their own state.
enum class ForwardKind { kPrefill, kDecode };

// A run of consecutive rows of one forward chunk that belong to one sequence (Engine::ForwardBatch).
struct ForwardSegment {
  uint64_t tag = 0;            // the sequence's tag (Sequence::tag(); main's request id, 0 for the engine's own)
  int64_t first_position = 0;  // the position of its first row
  int64_t n = 0;               // its rows
};

// Routed-expert computation of one sparse layer.
class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;
  // For every token i < n and each of its k experts: out[i] += weight * expert(h[i]). Experts are applied in
  // ascending id order and, within an expert, tokens in order, so results are bitwise reproducible wherever
  // the experts run. h, out: [n, hidden] device memory; ids, weights: [n, k] host memory (best first).
  // May return before its work on `stream` has finished, with host memory of its own still being copied from:
  // the caller synchronizes `stream` (any CopyToHost on it does) before its next Run and before reading `out`.
  virtual absl::Status Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                           std::span<const float> weights, float* out, Stream* stream) = 0;
  // Called by the engine before each forward chunk: the next Run calls (one per sparse layer, in layer order)
  // are for the chunk's rows, made of `segments` (in row order: each a run of rows of one sequence), of a
  // Forward of `kind` (kDecode: every segment has one row). Executors that place or predict per position (main's
  // remote executor, the shadow's) use it; the default ignores it.
  virtual void BeginForward(std::span<const ForwardSegment> segments, ForwardKind kind) {
    (void)segments;
    (void)kind;
  }
  // The most rows RunFromDeviceIds takes: chunks of up to this many rows may skip the host round trip of the
  // router's result (resident decode). 0 (the default): never; the executor needs the ids on the host (main's
  // remote executor places by them, the shadow's predicts from them).
  virtual int64_t DeviceIdsMaxTokens() const { return 0; }
  // Run with ids, weights: [n, k] in device memory, the router's result as enqueued on `stream` (the host need
  // not have seen it), and `out` written rather than added to: out = bitwise what Run adds onto a zeroed `out`
  // (the same sum in the same order), so the caller zeroes nothing. Enqueued on `stream`, and it leaves
  // no host memory in use, so the caller need not synchronize between calls; it waits for nothing and allocates
  // nothing, so a decode step that calls it can be recorded as a graph. REQUIRES: n <= DeviceIdsMaxTokens().
  virtual absl::Status RunFromDeviceIds(int64_t layer, const float* h, int64_t n, const int32_t* ids,
                                        const float* weights, float* out, Stream* stream);
};

// Computes routed experts from weights held on the engine's own device. Run groups the rows by expert on the
// host and computes one expert after another (moe_units.h). When the device has Device::RoutedExperts and this
// process holds every routed expert of the model, dense, it also computes a chunk of up to
// min(max_tokens, Device::RoutedExpertsMaxTokens()) rows from the router's ids on the device
// (RunFromDeviceIds: three launches per layer, the same bits); otherwise DeviceIdsMaxTokens() is 0.
class LocalExpertExecutor : public ExpertExecutor {
 public:
  // kHostOnly: never prepare RunFromDeviceIds (its expert table and scratch), for a caller that reads the ids on
  // the host anyway (the shadow's PredictingExecutor predicts from them).
  enum class Ids { kDeviceWherePossible, kHostOnly };
  static absl::StatusOr<std::unique_ptr<LocalExpertExecutor>> Create(Device& device, const ModelWeights& weights,
                                                                     int64_t max_tokens,
                                                                     Ids ids = Ids::kDeviceWherePossible);
  absl::Status Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                   std::span<const float> weights, float* out, Stream* stream) override;
  int64_t DeviceIdsMaxTokens() const override { return device_ids_max_tokens_; }
  absl::Status RunFromDeviceIds(int64_t layer, const float* h, int64_t n, const int32_t* ids, const float* weights,
                                float* out, Stream* stream) override;

 private:
  LocalExpertExecutor(Device& device, const ModelWeights& weights) : device_(device), weights_(weights) {}
  // Makes the device's expert table and the scratch of RunFromDeviceIds when the device and the weights allow.
  absl::Status PrepareDeviceIds();
  Device& device_;
  const ModelWeights& weights_;
  int64_t max_tokens_ = 0;
  std::unique_ptr<MlpWorkspace> ws_;
  std::unique_ptr<Buffer> xg_, yg_, index_;  // gathered inputs/outputs [max_tokens, hidden]; rows + scales
  PackedRouting packed_;                     // host side of index_
  // RunFromDeviceIds (absent when device_ids_max_tokens_ is 0), for M = device_ids_max_tokens_ rows:
  int64_t device_ids_max_tokens_ = 0;
  std::unique_ptr<ExpertTable> table_;      // every routed expert of the model
  std::unique_ptr<Buffer> act_, slot_out_;  // [M * k, expert_intermediate], [M * k, hidden] fp32
};

// The expert ids chosen at one position: [sparse layer][k], best first.
using PositionRouting = std::vector<std::vector<int32_t>>;

// Receives the logits ([vocab]) of the rows of a forward input one by one, in row order (BatchInput::row_logits):
// what each position predicts for the token after it (prompt logprobs). `row` counts from the input's first id.
using RowLogitsFn = std::function<void(int64_t row, std::span<const float> logits)>;

struct EngineOptions {
  int64_t max_tokens_per_forward = kMaxTokenRows;  // prefill is processed in chunks of at most this many tokens
  // The most sequences one ForwardBatch may carry (main: max_running); the logits of each are kept on the device.
  int64_t max_sequences_per_forward = 1;
  // Replay resident decode steps (every expert local, read from the router's ids on the device) as graphs where
  // the device has them (Device::SupportsGraphs: CUDA): one launch per step instead of one per op. The tokens are
  // the same either way; false runs every step op by op (for comparisons).
  bool decode_graphs = true;
};

// One sequence's KV cache and position (Engine::NewSequence): a request of a batch. Only the engine that made
// it reads or writes it, and it must not outlive that engine.
class Sequence {
 public:
  int64_t position() const { return position_; }  // the positions computed so far
  int64_t capacity() const { return capacity_; }
  uint64_t tag() const { return tag_; }

 private:
  friend class Engine;
  Sequence() = default;
  uint64_t tag_ = 0;
  int64_t position_ = 0;
  int64_t capacity_ = 0;
  uint64_t cache_id_ = 0;  // which caches these are (AllocateCache numbers them): a decode graph's key
  // Per layer: [capacity, kv_heads, head_dim] in the engine's KV dtype (Device::KvCacheDType).
  std::vector<std::unique_ptr<Buffer>> k_cache_, v_cache_;
};

// One sequence's rows in an Engine::ForwardBatch.
struct BatchInput {
  Sequence* sequence = nullptr;
  std::span<const int32_t> ids;                     // run at the sequence's next positions
  std::vector<PositionRouting>* routing = nullptr;  // optional: one PositionRouting appended per token
  std::vector<float>* logits = nullptr;             // optional out: the logits ([vocab]) of its last token
  // Optional, both or neither: the next token, picked by `*choice` from the logits of its last token on the device
  // (Device::SelectTokens), out in `*token`. Only the id comes back to the host (4 bytes), the logits too only when
  // `logits` is given.
  const TokenChoice* choice = nullptr;
  int32_t* token = nullptr;
  // With `choice`: applied to the logits before the pick (Sampler::Deltas: repetition penalty, logit bias,
  // penalties), after `logits` is copied (which are the model's own). Distinct ids in [0, vocab). A step with any
  // runs op by op.
  std::span<const LogitDelta> deltas;
  // Optional: called with the logits of every row of `ids`, after the chunk's outputs. Each row's are bitwise the
  // logits it gives as the last row of an input; they go through the final norm and lm_head in groups of
  // max_sequences_per_forward rows, with one wait on the device per group.
  const RowLogitsFn* row_logits = nullptr;
};

// Not thread-safe: one caller at a time (several sequences may be in flight between its calls).
class Engine {
 public:
  // `experts` must outlive the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const ModelWeights& weights, Device& device,
                                                        ExpertExecutor* experts, EngineOptions options = {});

  // A new sequence with room for `capacity` positions (its KV cache allocated on the device), tagged `tag` for
  // the executor (ForwardSegment::tag). OutOfRange when the capacity exceeds the model's positions.
  absl::StatusOr<std::unique_ptr<Sequence>> NewSequence(int64_t capacity, uint64_t tag);

  // Runs the rows of several sequences as one forward chunk (continuous batching): every input's ids at its
  // sequence's next positions, appended to its KV cache. The rows go through every layer together (one router
  // and one expert computation per layer for all of them) and attention reads each sequence's own cache.
  // Each row's result is the one it gets alone: every op is row-independent (a row's dot products, norms and
  // expert sums accumulate in the same order whatever the other rows), so batching never changes a token.
  // InvalidArgument for no input, an empty input, a sequence given twice, more than max_tokens_per_forward rows
  // or max_sequences_per_forward inputs, or a kDecode input of more than one token; OutOfRange for an id outside
  // the vocabulary or a sequence out of room. On error no sequence advances.
  absl::Status ForwardBatch(std::span<const BatchInput> inputs, ForwardKind kind);

  // The engine's own sequence (the single-request API below; tag 0).
  // The device bytes of a KV cache of `positions` positions (what NewSequence and StartSequence allocate).
  uint64_t KvCacheBytes(int64_t positions) const;
  // Starts a new sequence with room for `capacity` positions (allocates the KV cache). OutOfRange when the
  // capacity exceeds the model's positions.
  absl::Status StartSequence(int64_t capacity);
  // Runs `ids` at the next positions and appends them to the KV cache. Returns the logits ([vocab]) of the last
  // of them. When `routing` is given, appends one PositionRouting per token. `kind` is passed to the executor
  // (InvalidArgument for a kDecode of more than one token). `row_logits` (optional) gets the logits of every one
  // of `ids` (BatchInput::row_logits), rows counted from ids[0].
  absl::StatusOr<std::vector<float>> Forward(std::span<const int32_t> ids, std::vector<PositionRouting>* routing,
                                             ForwardKind kind = ForwardKind::kPrefill,
                                             const RowLogitsFn* row_logits = nullptr);
  // Forward, then the next token picked by `choice` from the logits of the last of `ids` on the device
  // (Device::SelectTokens): the host gets the id alone (a decode step's one wait, for 4 bytes), and the logits as
  // well when `logits` is given.
  // `row_logits` (optional) gets the logits of every one of `ids` (BatchInput::row_logits), rows counted from
  // ids[0]. `deltas` change the logits before the pick (BatchInput::deltas).
  absl::StatusOr<int32_t> ForwardAndSelect(std::span<const int32_t> ids, std::vector<PositionRouting>* routing,
                                           ForwardKind kind, const TokenChoice& choice,
                                           std::vector<float>* logits = nullptr,
                                           const RowLogitsFn* row_logits = nullptr,
                                           std::span<const LogitDelta> deltas = {});

  // Drops every position from `position` on (the next Forward runs at `position`): the shadow's roll back to
  // an aligned token. OutOfRange unless 0 <= position <= position().
  absl::Status Truncate(int64_t position);
  // The K and V cache rows of `position` (< position()) for every layer, to or from host memory:
  // k, v: [num_layers, kv_size] fp32 (kv_size = num_key_value_heads * head_dim, the post-norm, post-RoPE K as
  // attention reads it). OutOfRange for a position not yet computed. WriteKv is the shadow's KV alignment;
  // ReadKv gathers the rows on the device first, so main waits for two copies per step, not two per layer.
  absl::Status ReadKv(int64_t position, float* k, float* v);
  absl::Status WriteKv(int64_t position, const float* k, const float* v);
  // The K and V rows of positions [first, first + count) (all computed): k, v: [count, num_layers, kv_size],
  // one device-to-host copy per layer and tensor.
  absl::Status ReadKvRange(int64_t first, int64_t count, float* k, float* v);
  // The same of a batch's sequence (main's KV alignment of the request the shadow follows).
  absl::Status ReadKv(const Sequence& seq, int64_t position, float* k, float* v);
  absl::Status ReadKvRange(const Sequence& seq, int64_t first, int64_t count, float* k, float* v);
  // Truncate and WriteKv of a batch's sequence (the shadow's roll back and KV alignment of each request it
  // follows).
  absl::Status Truncate(Sequence& seq, int64_t position);
  absl::Status WriteKv(Sequence& seq, int64_t position, const float* k, const float* v);
  // Appends position seq.position() with the K and V rows `k`, `v` ([num_layers, kv_size] fp32, as WriteKv)
  // instead of running it: the shadow catching up with main on main's K/V. OutOfRange when the sequence is full.
  absl::Status AppendKv(Sequence& seq, const float* k, const float* v);

  int64_t position() const { return own_ != nullptr ? own_->position_ : 0; }
  int64_t capacity() const { return own_ != nullptr ? own_->capacity_ : 0; }
  const ModelConfig& config() const { return weights_.config(); }
  int64_t max_tokens_per_forward() const { return options_.max_tokens_per_forward; }
  int64_t max_sequences_per_forward() const { return options_.max_sequences_per_forward; }
  Device& device() { return device_; }
  // The graphs of resident decode steps (EngineOptions::decode_graphs): how many were recorded, how many are kept.
  const DecodeGraphs& decode_graphs() const { return graphs_; }

 private:
  Engine(const ModelWeights& weights, Device& device, ExpertExecutor* experts, EngineOptions options)
      : weights_(weights),
        device_(device),
        experts_(experts),
        options_(options),
        kv_dtype_(device.KvCacheDType(weights.layer(0).attn.k.dtype)) {}
  absl::Status AllocateWorkspace();
  // OutOfRange for an id outside the vocabulary, or when `ids` do not fit in `seq`'s room.
  absl::Status CheckTokens(const Sequence& seq, std::span<const int32_t> ids) const;
  absl::Status CheckBatch(std::span<const BatchInput> inputs, ForwardKind kind) const;
  // Forward and ForwardAndSelect on the engine's own sequence: `ids` in chunks, the last one with these outputs.
  absl::Status ForwardOwn(std::span<const int32_t> ids, std::vector<PositionRouting>* routing, ForwardKind kind,
                          std::vector<float>* logits, const TokenChoice* choice, int32_t* token,
                          const RowLogitsFn* row_logits = nullptr, std::span<const LogitDelta> deltas = {});
  // One chunk of checked inputs, worked out on the host before any of its device work: its rows (their ids and
  // positions written to host_rows_), where each input's routing goes, and which rows give
  // outputs (their sampling choices written to host_choices_, their logit changes to host_changes_).
  struct Chunk {
    std::span<const BatchInput> inputs;
    ForwardKind kind = ForwardKind::kPrefill;
    int64_t rows = 0;
    std::vector<int64_t> first_row;    // per input: its first row
    bool resident = false;             // the experts read the router's ids on the device (rows <= DeviceIdsMaxTokens)
    bool wants_routing = false;        // some input wants its routing
    std::vector<size_t> routing_base;  // per input: the index of its first token's PositionRouting
    std::vector<size_t> wanted;        // output row j is input wanted[j]'s last row (it wants logits or a token)
    bool any_token = false;            // some output row picks a token
    bool every_logits = true;          // every output row wants its logits
    int64_t changes = 0;               // logit changes before the picks, staged in host_changes_
  };
  Chunk PlanChunk(std::span<const BatchInput> inputs, ForwardKind kind);
  // Runs one chunk: its device work op by op, or a decode step's graph (graphs_), then the outputs.
  absl::Status ForwardChunk(std::span<const BatchInput> inputs, ForwardKind kind);
  // The key of the chunk's graph; nullopt when it runs op by op: not a resident decode step, an input wants its
  // logits or has logit changes, or this engine has no graphs (attn_workspace_ absent).
  std::optional<DecodeStepKey> GraphKey(const Chunk& chunk) const;
  // Enqueues the chunk's device work on stream_: the inputs up, every layer, the outputs back (EnqueueOutputs). A
  // chunk that is not resident waits on the host for each sparse layer's router. positions_on_device: the cache
  // writes and attention take the position from device memory when they run (a graph's step).
  absl::Status EnqueueChunk(const Chunk& chunk, bool positions_on_device);
  // Room on the device for the chunk's logit changes.
  absl::Status ReserveChanges(const Chunk& chunk);
  // After the chunk's layers (x: [rows, hidden] on the device): the final norm and lm_head of each output row, the
  // copies back of the logits the host wants, the logit changes, the tokens picked and their copy back.
  void EnqueueOutputs(const Chunk& chunk, const float* x);
  // The final norm and lm_head of the first `rows` rows of last_ into logits_: the one way every output row
  // gets its logits.
  void EnqueueLmHead(int64_t rows);
  // The chunk's one wait, then its tokens, logits and (resident) routing into the inputs.
  void CollectOutputs(const Chunk& chunk);
  // The logits of every row of the inputs that want them (BatchInput::row_logits), from the chunk's last hidden
  // states (x_), through last_ and logits_ in groups of their rows. After CollectOutputs.
  void CollectRowLogits(const Chunk& chunk);
  // Appends one layer's ids ([rows, k] host memory) to the routing of the inputs that want it.
  void AppendRouting(const Chunk& chunk, const int32_t* layer_ids);
  // Allocates the K and V caches of `seq` for `capacity` positions: 2 x num_layers buffers of LayerCacheBytes.
  absl::Status AllocateCache(Sequence& seq, int64_t capacity);
  size_t LayerCacheBytes(int64_t positions) const;
  // Cache rows <-> fp32 rows, both in device memory: `count` values from / to element `at` of `cache`.
  void StoreKv(const float* src, int64_t count, Buffer& cache, int64_t at, Stream* stream);
  void LoadKv(const Buffer& cache, int64_t at, int64_t count, float* dst, Stream* stream);
  KvCacheRef CacheRef(const Buffer& cache) const { return KvCacheRef{cache.data(), kv_dtype_}; }

  const ModelWeights& weights_;
  Device& device_;
  ExpertExecutor* experts_;
  EngineOptions options_;
  // The KV caches' dtype: the device's choice for the attention weights' dtype (Device::KvCacheDType).
  const DType kv_dtype_;
  std::unique_ptr<Stream> stream_;

  std::unique_ptr<Sequence> own_;  // StartSequence's (nullptr before the first)
  uint64_t next_cache_id_ = 1;     // AllocateCache's next Sequence::cache_id_
  DecodeGraphs graphs_;            // resident decode steps recorded as graphs

  // Workspace for one chunk of C = max_tokens_per_forward tokens.
  std::unique_ptr<Buffer> rows_;                    // a chunk of n rows: their token ids [n], then positions [n]
  std::unique_ptr<Buffer> x_, h_, attn_, o_, moe_;  // [C, hidden] / [C, q_size]
  std::unique_ptr<Buffer> qkv_;                     // n rows: q [n, q_size], k and v [n, kv_size]
  std::unique_ptr<Buffer> router_logits_;           // [C, num_experts]
  // A chunk of n rows: the ids [n, k] (int32), then the weights [n, k]: the router's result in one copy.
  std::unique_ptr<Buffer> topk_;                      // 2 * C * k values
  std::unique_ptr<Buffer> shared_out_, shared_gate_;  // [C, hidden], [C]
  std::unique_ptr<Buffer> iota_;                      // [C] int32: 0, 1, 2, ...
  std::unique_ptr<Buffer> zeros_;                     // [C, hidden] of 0.0f
  std::unique_ptr<Buffer> kv_row_;                    // [2, num_layers, kv_size]: ReadKv gathers here
  std::unique_ptr<Buffer> last_, logits_;             // [S, hidden], [S, vocab]: S = max_sequences_per_forward
  std::unique_ptr<Buffer> choices_, tokens_;          // [S] TokenChoice, [S] int32: SelectTokens' rows
  // The logit changes of a chunk (BatchInput::deltas) for Device::ChangeLogits over logits_, indexed j * vocab + id
  // (int32). Allocated by the first chunk that has any, grown when one has more (ReserveChanges); copied from
  // host_changes_.
  std::unique_ptr<Buffer> changes_;
  int64_t change_capacity_ = 0;
  std::vector<LogitChange> host_changes_;
  std::unique_ptr<MlpWorkspace> mlp_ws_;
  // Where rows_ and choices_ are copied from, and topk_, logits_ and tokens_ back to (page-locked on
  // CUDA: one DMA each, and what a graph's copies read and write at every launch).
  std::unique_ptr<HostBuffer> host_rows_;                   // as rows_ (int32): one copy up
  std::unique_ptr<HostBuffer> host_topk_;                   // as topk_
  std::unique_ptr<HostBuffer> host_logits_;                 // [S, vocab]
  std::unique_ptr<HostBuffer> host_choices_, host_tokens_;  // as choices_, tokens_
  // The router's ids of every layer of a chunk whose experts ran from the device ids (n <= the executor's
  // DeviceIdsMaxTokens()), copied here without waiting and read after the chunk's last synchronization when a
  // caller wants routing: [num_layers, DeviceIdsMaxTokens() * k] int32 (absent when that is 0).
  std::unique_ptr<HostBuffer> host_layer_ids_;
  // AttentionAt's workspace for a decode graph's step, at any position (absent: no graphs, every step op by op).
  std::unique_ptr<Buffer> attn_workspace_;
};

}  // namespace odmoe
