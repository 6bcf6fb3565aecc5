#include "src/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "spdlog/spdlog.h"
#include "src/backend/cpu_kernels.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

size_t F32Bytes(int64_t count) { return static_cast<size_t>(count) * sizeof(float); }

absl::Status Alloc(Device& device, std::unique_ptr<Buffer>& buf, size_t bytes, std::string_view tag) {
  ODMOE_ASSIGN_OR_RETURN(buf, device.Allocate(std::max<size_t>(bytes, 4), tag));
  return absl::OkStatus();
}

}  // namespace

// ---- ExpertExecutor ------------------------------------------------------------------------------------------

absl::Status ExpertExecutor::RunFromDeviceIds(int64_t layer, const float* h, int64_t n, const int32_t* ids,
                                              const float* weights, float* out, Stream* stream) {
  (void)layer, (void)h, (void)ids, (void)weights, (void)out, (void)stream;
  return absl::InternalError(StrCat("this expert executor reads the ids on the host (", n, " rows)"));
}

// ---- LocalExpertExecutor -------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LocalExpertExecutor>> LocalExpertExecutor::Create(Device& device,
                                                                                 const ModelWeights& weights,
                                                                                 int64_t max_tokens, Ids ids) {
  const ModelConfig& c = weights.config();
  std::unique_ptr<LocalExpertExecutor> ex(new LocalExpertExecutor(device, weights));
  ex->max_tokens_ = max_tokens;
  ODMOE_ASSIGN_OR_RETURN(ex->ws_,
                         MlpWorkspace::Create(device, max_tokens, std::max<int64_t>(1, c.expert_intermediate_size)));
  ODMOE_RETURN_IF_ERROR(Alloc(device, ex->xg_, F32Bytes(max_tokens * c.hidden_size), "expert inputs"));
  ODMOE_RETURN_IF_ERROR(Alloc(device, ex->yg_, F32Bytes(max_tokens * c.hidden_size), "expert outputs"));
  // Rows and scales of every (token, expert) pair of a chunk: 2 x [max_tokens * k] 4-byte values.
  ODMOE_RETURN_IF_ERROR(
      Alloc(device, ex->index_, 2 * F32Bytes(max_tokens * std::max<int64_t>(1, c.top_k)), "expert routing index"));
  if (ids == Ids::kDeviceWherePossible) ODMOE_RETURN_IF_ERROR(ex->PrepareDeviceIds());
  return ex;
}

absl::Status LocalExpertExecutor::PrepareDeviceIds() {
  const ModelConfig& c = weights_.config();
  const int64_t max_tokens = std::min(max_tokens_, device_.RoutedExpertsMaxTokens());
  if (max_tokens <= 0 || c.num_experts <= 0 || c.top_k <= 0 || c.expert_intermediate_size <= 0) return absl::OkStatus();
  // Every expert of every sparse layer held here, dense, of one dtype (the device checks the dtypes); the entries
  // of dense layers stay empty.
  std::vector<ExpertWeightRefs> table(static_cast<size_t>(c.num_layers * c.num_experts));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!weights_.layer(l).sparse) continue;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const MlpWeights* mlp = weights_.expert(l, e);
      if (mlp == nullptr || mlp->gate.quantized() || mlp->up.quantized() || mlp->down.quantized() ||
          mlp->intermediate != c.expert_intermediate_size) {
        return absl::OkStatus();  // Run alone
      }
      table[static_cast<size_t>(l * c.num_experts + e)] = ExpertWeightRefs{mlp->gate, mlp->up, mlp->down};
    }
  }
  ODMOE_ASSIGN_OR_RETURN(table_,
                         device_.CreateExpertTable(table, c.num_experts, c.hidden_size, c.expert_intermediate_size));
  const int64_t slots = max_tokens * c.top_k;
  ODMOE_RETURN_IF_ERROR(
      Alloc(device_, act_, F32Bytes(slots * c.expert_intermediate_size), "routed expert activations"));
  ODMOE_RETURN_IF_ERROR(Alloc(device_, slot_out_, F32Bytes(slots * c.hidden_size), "routed expert outputs"));
  device_ids_max_tokens_ = max_tokens;
  return absl::OkStatus();
}

absl::Status LocalExpertExecutor::RunFromDeviceIds(int64_t layer, const float* h, int64_t n, const int32_t* ids,
                                                   const float* weights, float* out, Stream* stream) {
  if (n <= 0 || n > device_ids_max_tokens_) {
    return absl::InternalError(
        StrCat("expert executor got ", n, " rows with device ids, more than its ", device_ids_max_tokens_));
  }
  device_.RoutedExperts(*table_, layer, h, n, weights_.config().top_k, ids, weights, act_->as<float>(),
                        slot_out_->as<float>(), out, stream);
  return absl::OkStatus();
}

absl::Status LocalExpertExecutor::Run(int64_t layer, const float* h, int64_t n, std::span<const int32_t> ids,
                                      std::span<const float> weights, float* out, Stream* stream) {
  const ModelConfig& c = weights_.config();
  if (n > max_tokens_) {
    return absl::InternalError(StrCat("expert executor got ", n, " tokens, more than its ", max_tokens_));
  }
  const std::vector<ExpertBatch> batches = GroupByExpert(ids, weights, n, c.top_k);
  // One upload for the whole layer: all rows, then all scales, batch after batch.
  PackRowsAndScales(batches, n, c.top_k, &packed_);
  device_.CopyToDevice(index_->data(), packed_.host.data(), packed_.host.size() * sizeof(int32_t), stream);
  const int32_t* dev_index = index_->as<int32_t>();
  ODMOE_RETURN_IF_ERROR(CombineExpertOutputs(
      device_, batches, packed_, dev_index, c.hidden_size,
      [&](size_t b) -> absl::StatusOr<const float*> {
        const MlpWeights* mlp = weights_.expert(layer, batches[b].expert);
        if (mlp == nullptr) {
          return absl::FailedPreconditionError(
              StrCat("expert ", batches[b].expert, " of layer ", layer, " is not held by this process"));
        }
        ComputeExpertRows(device_, *mlp, h, n, packed_.rows(dev_index, b), static_cast<int64_t>(batches[b].rows.size()),
                          c.hidden_size, xg_->as<float>(), *ws_, yg_->as<float>(), stream);
        return yg_->as<float>();
      },
      out, stream));
  // No synchronization: packed_ is rewritten only by the next Run, which the caller makes after synchronizing
  // `stream` (the contract of ExpertExecutor::Run).
  return absl::OkStatus();
}

// ---- Engine --------------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const ModelWeights& weights, Device& device,
                                                       ExpertExecutor* experts, EngineOptions options) {
  if (options.max_tokens_per_forward <= 0 || options.max_sequences_per_forward <= 0) {
    return absl::InvalidArgumentError("max_tokens_per_forward and max_sequences_per_forward must be positive");
  }
  std::unique_ptr<Engine> engine(new Engine(weights, device, experts, options));
  engine->stream_ = device.CreateStream();
  ODMOE_RETURN_IF_ERROR(engine->AllocateWorkspace());
  return engine;
}

absl::Status Engine::AllocateWorkspace() {
  const ModelConfig& c = config();
  const int64_t C = options_.max_tokens_per_forward;
  const int64_t k = std::max<int64_t>(1, c.top_k);
  Device& d = device_;
  ODMOE_RETURN_IF_ERROR(Alloc(d, rows_, F32Bytes(2 * C), "token ids and positions"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, x_, F32Bytes(C * c.hidden_size), "hidden state"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, h_, F32Bytes(C * c.hidden_size), "normed hidden state"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, attn_, F32Bytes(C * c.q_size()), "attention output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, o_, F32Bytes(C * c.hidden_size), "o_proj output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, moe_, F32Bytes(C * c.hidden_size), "mlp output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, qkv_, F32Bytes(C * (c.q_size() + 2 * c.kv_size())), "q, k and v"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, router_logits_, F32Bytes(C * std::max<int64_t>(1, c.num_experts)), "router logits"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, topk_, F32Bytes(2 * C * k), "top-k ids and weights"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, shared_out_, F32Bytes(C * c.hidden_size), "shared expert output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, shared_gate_, F32Bytes(C), "shared expert gate"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, iota_, F32Bytes(C), "row indices"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, zeros_, F32Bytes(C * c.hidden_size), "zeros"));
  const int64_t S = options_.max_sequences_per_forward;
  if (S * c.vocab_size > std::numeric_limits<int32_t>::max()) {  // logit changes address logits_ with int32 rows
    return absl::InvalidArgumentError(StrCat("max_sequences_per_forward (", S, ") x vocab_size (", c.vocab_size,
                                             ") logits do not fit in int32 indexes"));
  }
  ODMOE_RETURN_IF_ERROR(Alloc(d, last_, F32Bytes(S * c.hidden_size), "last hidden states"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, logits_, F32Bytes(S * c.vocab_size), "logits"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, choices_, static_cast<size_t>(S) * sizeof(TokenChoice), "token choices"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, tokens_, F32Bytes(S), "picked tokens"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, kv_row_, F32Bytes(2 * c.num_layers * c.kv_size()), "one position's K and V"));
  const int64_t max_inter = std::max({c.shared_expert_intermediate_size, c.dense_intermediate_size, int64_t{1}});
  ODMOE_ASSIGN_OR_RETURN(mlp_ws_, MlpWorkspace::Create(d, C, max_inter));

  std::vector<int32_t> iota(static_cast<size_t>(C));
  for (int64_t i = 0; i < C; ++i) iota[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  d.CopyToDevice(iota_->data(), iota.data(), iota.size() * sizeof(int32_t), stream_.get());
  std::vector<float> zeros(static_cast<size_t>(C * c.hidden_size), 0.0f);
  d.CopyToDevice(zeros_->data(), zeros.data(), zeros.size() * sizeof(float), stream_.get());
  d.Synchronize(stream_.get());
  ODMOE_ASSIGN_OR_RETURN(host_rows_, d.AllocateHost(F32Bytes(2 * C), "token ids and positions"));
  ODMOE_ASSIGN_OR_RETURN(host_topk_, d.AllocateHost(F32Bytes(2 * C * k), "top-k ids and weights"));
  ODMOE_ASSIGN_OR_RETURN(host_logits_, d.AllocateHost(F32Bytes(S * c.vocab_size), "logits"));
  ODMOE_ASSIGN_OR_RETURN(host_choices_, d.AllocateHost(static_cast<size_t>(S) * sizeof(TokenChoice), "token choices"));
  ODMOE_ASSIGN_OR_RETURN(host_tokens_, d.AllocateHost(F32Bytes(S), "picked tokens"));
  if (experts_->DeviceIdsMaxTokens() > 0) {
    ODMOE_ASSIGN_OR_RETURN(host_layer_ids_, d.AllocateHost(F32Bytes(c.num_layers * experts_->DeviceIdsMaxTokens() * k),
                                                           "top-k ids of every layer"));
  }
  // Decode steps as graphs: AttentionAt's workspace for a single new token at any position a sequence may have.
  if (options_.decode_graphs && d.SupportsGraphs() && experts_->DeviceIdsMaxTokens() > 0) {
    const size_t bytes = d.AttentionAtWorkspaceBytes(1, c.context_length() - 1, c.num_heads, c.head_dim);
    ODMOE_RETURN_IF_ERROR(Alloc(d, attn_workspace_, bytes, "decode attention workspace"));
  }
  return absl::OkStatus();
}

uint64_t Engine::KvCacheBytes(int64_t positions) const {
  return 2 * static_cast<uint64_t>(config().num_layers) * LayerCacheBytes(positions);
}

size_t Engine::LayerCacheBytes(int64_t positions) const {
  return static_cast<size_t>(positions * config().kv_size()) * DTypeSize(kv_dtype_);
}

absl::Status Engine::AllocateCache(Sequence& seq, int64_t capacity) {
  const ModelConfig& c = config();
  seq.k_cache_.clear();
  seq.v_cache_.clear();
  seq.capacity_ = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::unique_ptr<Buffer> kb, vb;
    const size_t bytes = LayerCacheBytes(capacity);
    ODMOE_RETURN_IF_ERROR(Alloc(device_, kb, bytes, StrCat("k cache, layer ", l)));
    ODMOE_RETURN_IF_ERROR(Alloc(device_, vb, bytes, StrCat("v cache, layer ", l)));
    seq.k_cache_.push_back(std::move(kb));
    seq.v_cache_.push_back(std::move(vb));
  }
  seq.capacity_ = capacity;
  seq.cache_id_ = next_cache_id_++;
  return absl::OkStatus();
}

void Engine::StoreKv(const float* src, int64_t count, Buffer& cache, int64_t at, Stream* stream) {
  if (kv_dtype_ == DType::kF32) {
    device_.CopyOnDevice(cache.as<float>() + at, src, F32Bytes(count), stream);
  } else {
    device_.Convert(src, DType::kF32, count, cache.as<uint8_t>() + at * DTypeSize(kv_dtype_), kv_dtype_, stream);
  }
}

void Engine::LoadKv(const Buffer& cache, int64_t at, int64_t count, float* dst, Stream* stream) {
  if (kv_dtype_ == DType::kF32) {
    device_.CopyOnDevice(dst, cache.as<float>() + at, F32Bytes(count), stream);
  } else {
    device_.Convert(cache.as<uint8_t>() + at * DTypeSize(kv_dtype_), kv_dtype_, count, dst, DType::kF32, stream);
  }
}

absl::StatusOr<std::unique_ptr<Sequence>> Engine::NewSequence(int64_t capacity, uint64_t tag) {
  if (capacity <= 0) return absl::InvalidArgumentError("a sequence needs room for at least one position");
  ODMOE_RETURN_IF_ERROR(CheckSequenceLength(config(), capacity));
  std::unique_ptr<Sequence> seq(new Sequence());
  seq->tag_ = tag;
  ODMOE_RETURN_IF_ERROR(AllocateCache(*seq, capacity));
  return seq;
}

absl::Status Engine::StartSequence(int64_t capacity) {
  if (capacity <= 0) return absl::InvalidArgumentError("a sequence needs room for at least one position");
  ODMOE_RETURN_IF_ERROR(CheckSequenceLength(config(), capacity));
  if (own_ == nullptr) own_.reset(new Sequence());
  own_->position_ = 0;
  if (capacity > own_->capacity_ || own_->k_cache_.empty()) ODMOE_RETURN_IF_ERROR(AllocateCache(*own_, capacity));
  return absl::OkStatus();
}

absl::Status Engine::Truncate(int64_t position) {
  if (own_ == nullptr) {
    if (position == 0) return absl::OkStatus();
    return absl::OutOfRangeError(StrCat("cannot truncate the sequence to position ", position, ": it has 0 positions"));
  }
  return Truncate(*own_, position);
}

absl::Status Engine::Truncate(Sequence& seq, int64_t position) {
  if (position < 0 || position > seq.position_) {
    return absl::OutOfRangeError(
        StrCat("cannot truncate the sequence to position ", position, ": it has ", seq.position_, " positions"));
  }
  seq.position_ = position;
  return absl::OkStatus();
}

absl::Status Engine::ReadKv(int64_t position, float* k, float* v) {
  if (own_ == nullptr) return absl::OutOfRangeError("KV requested before StartSequence");
  return ReadKv(*own_, position, k, v);
}

absl::Status Engine::ReadKv(const Sequence& seq, int64_t position, float* k, float* v) {
  if (position < 0 || position >= seq.position_) {
    return absl::OutOfRangeError(
        StrCat("KV of position ", position, " requested, but the sequence has ", seq.position_, " positions"));
  }
  const int64_t kv = config().kv_size();
  const int64_t layers = static_cast<int64_t>(seq.k_cache_.size());
  float* row = kv_row_->as<float>();
  for (int64_t l = 0; l < layers; ++l) {
    const size_t i = static_cast<size_t>(l);
    LoadKv(*seq.k_cache_[i], position * kv, kv, row + l * kv, stream_.get());
    LoadKv(*seq.v_cache_[i], position * kv, kv, row + (layers + l) * kv, stream_.get());
  }
  device_.CopyToHost(k, row, F32Bytes(layers * kv), stream_.get());
  device_.CopyToHost(v, row + layers * kv, F32Bytes(layers * kv), stream_.get());
  return absl::OkStatus();
}

absl::Status Engine::ReadKvRange(int64_t first, int64_t count, float* k, float* v) {
  if (own_ == nullptr) return absl::OutOfRangeError("KV requested before StartSequence");
  return ReadKvRange(*own_, first, count, k, v);
}

absl::Status Engine::ReadKvRange(const Sequence& seq, int64_t first, int64_t count, float* k, float* v) {
  if (first < 0 || count < 0 || first + count > seq.position_) {
    return absl::OutOfRangeError(StrCat("KV of positions ", first, "..", first + count - 1,
                                        " requested, but the sequence has ", seq.position_, " positions"));
  }
  const int64_t kv = config().kv_size();
  const int64_t layers = static_cast<int64_t>(seq.k_cache_.size());
  // The cache's bytes, then fp32 on the host (exact from F16 / BF16).
  const size_t elt = DTypeSize(kv_dtype_);
  std::vector<uint8_t> raw(static_cast<size_t>(count * kv) * elt);
  std::vector<float> tmp(static_cast<size_t>(count * kv));
  for (int64_t l = 0; l < layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      const size_t i = static_cast<size_t>(l);
      const Buffer& cache = which == 0 ? *seq.k_cache_[i] : *seq.v_cache_[i];
      float* out = which == 0 ? k : v;
      device_.CopyToHost(raw.data(), cache.as<uint8_t>() + static_cast<size_t>(first * kv) * elt, raw.size(),
                         stream_.get());
      cpu::Convert(raw.data(), kv_dtype_, count * kv, tmp.data(), DType::kF32);
      for (int64_t j = 0; j < count; ++j) {
        std::copy_n(tmp.data() + j * kv, kv, out + (j * layers + l) * kv);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::WriteKv(int64_t position, const float* k, const float* v) {
  if (own_ == nullptr)
    return absl::OutOfRangeError(StrCat("KV of position ", position, " written before StartSequence"));
  return WriteKv(*own_, position, k, v);
}

absl::Status Engine::WriteKv(Sequence& seq, int64_t position, const float* k, const float* v) {
  if (position < 0 || position >= seq.position_) {
    return absl::OutOfRangeError(
        StrCat("KV of position ", position, " written, but the sequence has ", seq.position_, " positions"));
  }
  const int64_t kv = config().kv_size();
  const int64_t layers = static_cast<int64_t>(seq.k_cache_.size());
  // Through kv_row_ ([2, layers, kv] fp32), into the caches in their dtype on the device: ReadKv's way back.
  float* row = kv_row_->as<float>();
  device_.CopyToDevice(row, k, F32Bytes(layers * kv), stream_.get());
  device_.CopyToDevice(row + layers * kv, v, F32Bytes(layers * kv), stream_.get());
  for (int64_t l = 0; l < layers; ++l) {
    const size_t i = static_cast<size_t>(l);
    StoreKv(row + l * kv, kv, *seq.k_cache_[i], position * kv, stream_.get());
    StoreKv(row + (layers + l) * kv, kv, *seq.v_cache_[i], position * kv, stream_.get());
  }
  device_.Synchronize(stream_.get());  // the host rows may die on return
  return absl::OkStatus();
}

absl::Status Engine::AppendKv(Sequence& seq, const float* k, const float* v) {
  if (seq.position_ >= seq.capacity_) {
    return absl::OutOfRangeError(
        StrCat("cannot append a position's K/V: the sequence holds all ", seq.capacity_, " positions it has room for"));
  }
  ++seq.position_;
  const absl::Status written = WriteKv(seq, seq.position_ - 1, k, v);
  if (!written.ok()) --seq.position_;
  return written;
}

absl::StatusOr<std::vector<float>> Engine::Forward(std::span<const int32_t> ids, std::vector<PositionRouting>* routing,
                                                   ForwardKind kind, const RowLogitsFn* row_logits) {
  std::vector<float> logits;
  ODMOE_RETURN_IF_ERROR(ForwardOwn(ids, routing, kind, &logits, nullptr, nullptr, row_logits));
  return logits;
}

absl::StatusOr<int32_t> Engine::ForwardAndSelect(std::span<const int32_t> ids, std::vector<PositionRouting>* routing,
                                                 ForwardKind kind, const TokenChoice& choice,
                                                 std::vector<float>* logits, const RowLogitsFn* row_logits,
                                                 std::span<const LogitDelta> deltas) {
  int32_t token = 0;
  ODMOE_RETURN_IF_ERROR(ForwardOwn(ids, routing, kind, logits, &choice, &token, row_logits, deltas));
  return token;
}

absl::Status Engine::ForwardOwn(std::span<const int32_t> ids, std::vector<PositionRouting>* routing, ForwardKind kind,
                                std::vector<float>* logits, const TokenChoice* choice, int32_t* token,
                                const RowLogitsFn* row_logits, std::span<const LogitDelta> deltas) {
  if (own_ == nullptr) return absl::FailedPreconditionError("Forward before StartSequence");
  if (ids.empty()) return absl::InvalidArgumentError("Forward needs at least one token");
  // The whole of `ids` is checked before its first chunk runs: on error the sequence does not advance.
  ODMOE_RETURN_IF_ERROR(CheckTokens(*own_, ids));
  const size_t chunk = static_cast<size_t>(options_.max_tokens_per_forward);
  for (size_t start = 0; start < ids.size(); start += chunk) {
    const size_t len = std::min(chunk, ids.size() - start);
    BatchInput input{own_.get(), ids.subspan(start, len), routing};
    if (start + len == ids.size()) {  // the outputs come from the last chunk
      input.logits = logits;
      input.choice = choice;
      input.token = token;
      input.deltas = deltas;
    }
    RowLogitsFn chunk_rows;  // row_logits with the rows counted from ids[0]
    if (row_logits != nullptr) {
      chunk_rows = [row_logits, start](int64_t row, std::span<const float> l) {
        (*row_logits)(static_cast<int64_t>(start) + row, l);
      };
      input.row_logits = &chunk_rows;
    }
    ODMOE_RETURN_IF_ERROR(ForwardBatch(std::span<const BatchInput>(&input, 1), kind));
  }
  return absl::OkStatus();
}

absl::Status Engine::CheckTokens(const Sequence& seq, std::span<const int32_t> ids) const {
  const int64_t vocab = config().vocab_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return absl::OutOfRangeError(
          StrCat("token id ", ids[i], " at index ", i, " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  const int64_t needed = seq.position_ + static_cast<int64_t>(ids.size());
  if (needed > seq.capacity_) {
    return absl::OutOfRangeError(
        StrCat("sequence of ", needed, " positions exceeds the room of ", seq.capacity_, " given to StartSequence"));
  }
  return absl::OkStatus();
}

absl::Status Engine::CheckBatch(std::span<const BatchInput> inputs, ForwardKind kind) const {
  if (inputs.empty()) return absl::InvalidArgumentError("a forward needs at least one sequence");
  if (static_cast<int64_t>(inputs.size()) > options_.max_sequences_per_forward) {
    return absl::InvalidArgumentError(StrCat("a forward of ", inputs.size(), " sequences exceeds the engine's ",
                                             options_.max_sequences_per_forward, " (max_sequences_per_forward)"));
  }
  int64_t rows = 0;
  for (size_t s = 0; s < inputs.size(); ++s) {
    const BatchInput& in = inputs[s];
    if (in.sequence == nullptr) return absl::InvalidArgumentError(StrCat("input ", s, " has no sequence"));
    if (in.sequence->k_cache_.empty()) return absl::FailedPreconditionError("Forward before StartSequence");
    if (in.ids.empty()) return absl::InvalidArgumentError("Forward needs at least one token");
    if (kind == ForwardKind::kDecode && in.ids.size() != 1) {
      return absl::InvalidArgumentError(StrCat("a decode step feeds one token, got ", in.ids.size()));
    }
    if ((in.choice == nullptr) != (in.token == nullptr)) {
      return absl::InvalidArgumentError(StrCat("input ", s, " has a token choice without a token or the reverse"));
    }
    if (!in.deltas.empty() && in.choice == nullptr) {
      return absl::InvalidArgumentError(StrCat("input ", s, " has logit changes but picks no token"));
    }
    for (const LogitDelta& d : in.deltas) {
      if (d.id < 0 || d.id >= config().vocab_size) {
        return absl::OutOfRangeError(StrCat("input ", s, ": logit change of token ", d.id,
                                            " outside the vocabulary [0, ", config().vocab_size, ")"));
      }
    }
    for (size_t t = 0; t < s; ++t) {
      if (inputs[t].sequence == in.sequence) {
        return absl::InvalidArgumentError(StrCat("inputs ", t, " and ", s, " are the same sequence"));
      }
    }
    ODMOE_RETURN_IF_ERROR(CheckTokens(*in.sequence, in.ids));
    rows += static_cast<int64_t>(in.ids.size());
  }
  if (rows > options_.max_tokens_per_forward) {
    return absl::InvalidArgumentError(StrCat("a forward of ", rows, " tokens exceeds the engine's ",
                                             options_.max_tokens_per_forward, " (max_tokens_per_forward)"));
  }
  return absl::OkStatus();
}

absl::Status Engine::ForwardBatch(std::span<const BatchInput> inputs, ForwardKind kind) {
  ODMOE_RETURN_IF_ERROR(CheckBatch(inputs, kind));
  return ForwardChunk(inputs, kind);
}

Engine::Chunk Engine::PlanChunk(std::span<const BatchInput> inputs, ForwardKind kind) {
  Chunk chunk;
  chunk.inputs = inputs;
  chunk.kind = kind;
  std::vector<ForwardSegment> segments;
  int64_t total = 0;
  for (const BatchInput& in : inputs) total += static_cast<int64_t>(in.ids.size());
  int32_t* ids = host_rows_->as<int32_t>();
  int32_t* positions = ids + total;
  for (const BatchInput& in : inputs) {
    const int64_t past = in.sequence->position_;
    chunk.first_row.push_back(chunk.rows);
    segments.push_back({in.sequence->tag_, past, static_cast<int64_t>(in.ids.size())});
    for (size_t i = 0; i < in.ids.size(); ++i) {
      ids[chunk.rows] = in.ids[i];
      positions[chunk.rows] = static_cast<int32_t>(past + static_cast<int64_t>(i));
      ++chunk.rows;
    }
  }
  experts_->BeginForward(segments, kind);
  chunk.resident = chunk.rows <= experts_->DeviceIdsMaxTokens();
  chunk.routing_base.assign(inputs.size(), 0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<PositionRouting>* r = inputs[i].routing;
    if (r == nullptr) continue;
    chunk.routing_base[i] = r->size();
    r->resize(r->size() + inputs[i].ids.size());
    chunk.wants_routing = true;
  }
  // Output row j is input wanted[j]'s last row; its sampling choice goes up with the inputs (rows that want only
  // logits pick greedily, unread).
  TokenChoice* choices = host_choices_->as<TokenChoice>();
  host_changes_.clear();
  const int64_t vocab = config().vocab_size;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].logits == nullptr && inputs[i].token == nullptr) continue;
    const int64_t j = static_cast<int64_t>(chunk.wanted.size());
    choices[j] = inputs[i].choice != nullptr ? *inputs[i].choice : TokenChoice{};
    if (inputs[i].token != nullptr) {
      for (const LogitDelta& d : inputs[i].deltas) {
        // j * vocab + id < S * vocab: checked at Create.
        host_changes_.push_back(
            {.index = static_cast<int32_t>(j * vocab + d.id), .penalty = d.penalty, .delta = d.delta});
      }
    }
    chunk.wanted.push_back(i);
    chunk.any_token = chunk.any_token || inputs[i].token != nullptr;
    chunk.every_logits = chunk.every_logits && inputs[i].logits != nullptr;
  }
  chunk.changes = static_cast<int64_t>(host_changes_.size());
  return chunk;
}

absl::Status Engine::ReserveChanges(const Chunk& chunk) {
  if (chunk.changes <= change_capacity_) return absl::OkStatus();
  const int64_t capacity = std::max(chunk.changes, 2 * change_capacity_);
  ODMOE_RETURN_IF_ERROR(Alloc(device_, changes_, static_cast<size_t>(capacity) * sizeof(LogitChange), "logit changes"));
  change_capacity_ = capacity;
  return absl::OkStatus();
}

std::optional<DecodeStepKey> Engine::GraphKey(const Chunk& chunk) const {
  if (attn_workspace_ == nullptr || chunk.kind != ForwardKind::kDecode || !chunk.resident) return std::nullopt;
  DecodeStepKey key;
  key.routing = chunk.wants_routing;
  for (const BatchInput& in : chunk.inputs) {
    // The logits come back, and change before a pick, only on the op-by-op path.
    if (in.logits != nullptr || in.row_logits != nullptr || !in.deltas.empty()) return std::nullopt;
    key.caches.push_back(in.sequence->cache_id_);
    key.tokens.push_back(in.token != nullptr);
  }
  return key;
}

absl::Status Engine::ForwardChunk(std::span<const BatchInput> inputs, ForwardKind kind) {
  const Chunk chunk = PlanChunk(inputs, kind);
  ODMOE_RETURN_IF_ERROR(ReserveChanges(chunk));
  Device& d = device_;
  Stream* s = stream_.get();
  // A resident decode step replays its graph, or records it the second time in a row its key comes.
  const Graph* graph = nullptr;
  if (const std::optional<DecodeStepKey> key = GraphKey(chunk)) {
    graph = graphs_.Find(*key);
    if (graph == nullptr && graphs_.ShouldCapture(*key)) {
      absl::StatusOr<std::unique_ptr<Graph>> captured =
          d.CaptureGraph(s, [&] { return EnqueueChunk(chunk, /*positions_on_device=*/true); });
      if (captured.ok()) {
        graph = graphs_.Insert(*key, *std::move(captured));
      } else {
        // Not recorded (the device refused, or the step failed to enqueue, which running it op by op reports
        // again): this step and every later one run op by op.
        spdlog::warn("recording a decode step as a graph failed ({}); decode steps run op by op from now on",
                     captured.status().ToString());
        graphs_.Clear();
        attn_workspace_.reset();
      }
    }
  }
  if (graph != nullptr) {
    d.LaunchGraph(*graph, s);
  } else {
    ODMOE_RETURN_IF_ERROR(EnqueueChunk(chunk, /*positions_on_device=*/false));
  }
  for (const BatchInput& in : inputs) in.sequence->position_ += static_cast<int64_t>(in.ids.size());
  CollectOutputs(chunk);
  CollectRowLogits(chunk);
  return absl::OkStatus();
}

absl::Status Engine::EnqueueChunk(const Chunk& chunk, bool positions_on_device) {
  const ModelConfig& c = config();
  Device& d = device_;
  Stream* s = stream_.get();
  const std::span<const BatchInput> inputs = chunk.inputs;
  const int64_t hidden = c.hidden_size;
  const int64_t k = c.top_k;
  const int64_t n = chunk.rows;

  d.CopyToDevice(rows_->data(), host_rows_->data(), F32Bytes(2 * n), s);
  const int32_t* dev_tokens = rows_->as<int32_t>();
  const int32_t* dev_pos = dev_tokens + n;
  // K and V rows into the caches in one launch, at the positions on the device, wherever the device has the op
  // (Device::WriteKvRows: the devices with graphs, the only ones a positions_on_device chunk runs on); elsewhere
  // one Convert or copy per cache at `past`. A chunk of one sequence (one pair of caches) writes them in its RoPE's
  // launch (Device::RopeWriteKv).
  const bool kv_rows_on_device = d.SupportsGraphs();
  const bool kv_with_rope = kv_rows_on_device && inputs.size() == 1;

  float* x = x_->as<float>();
  float* h = h_->as<float>();
  d.Embedding(dev_tokens, n, weights_.embed(), hidden, x, s);

  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = weights_.layer(l);
    const AttentionWeights& a = lw.attn;
    // ---- attention
    // (A later layer's input norm came with the previous layer's residual addition, below.)
    if (l == 0) d.RmsNorm(x, lw.input_norm, n, hidden, static_cast<float>(c.rms_norm_eps), h, s);
    // [n, q_size], then [n, kv_size] twice: with one token, [q | k | v] is one row of the stacked projection.
    float* q = qkv_->as<float>();
    float* kk = q + n * c.q_size();
    float* v = kk + n * c.kv_size();
    if (n == 1 && !a.qkv.empty()) {
      d.MatMul(h, a.qkv, a.qkv_bias, 1, hidden, c.q_size() + 2 * c.kv_size(), q, s);
    } else {
      d.MatMul(h, a.q, a.q_bias, n, hidden, c.q_size(), q, s);
      d.MatMul(h, a.k, a.k_bias, n, hidden, c.kv_size(), kk, s);
      d.MatMul(h, a.v, a.v_bias, n, hidden, c.kv_size(), v, s);
    }
    const bool head_norms = c.qk_norm == QkNorm::kPerHead;
    if (c.qk_norm == QkNorm::kFull) {
      d.RmsNorm(q, a.q_norm, n, c.q_size(), static_cast<float>(c.rms_norm_eps), q, s);
      d.RmsNorm(kk, a.k_norm, n, c.kv_size(), static_cast<float>(c.rms_norm_eps), kk, s);
    }
    if (kv_with_rope) {  // the rotation (after the per-head norms), and K and V into the caches
      Sequence& seq = *inputs[0].sequence;
      d.RopeWriteKv(q, kk, v, head_norms ? a.q_norm : WeightRef{}, head_norms ? a.k_norm : WeightRef{},
                    static_cast<float>(c.rms_norm_eps), dev_pos, n, c.num_heads, c.num_kv_heads, c.head_dim,
                    c.rope_theta, CacheRef(*seq.k_cache_[static_cast<size_t>(l)]),
                    CacheRef(*seq.v_cache_[static_cast<size_t>(l)]), seq.capacity_, s);
    } else if (head_norms) {  // the per-head norms and the rotation together
      d.HeadNormRope(q, kk, a.q_norm, a.k_norm, dev_pos, n, c.num_heads, c.num_kv_heads, c.head_dim,
                     static_cast<float>(c.rms_norm_eps), c.rope_theta, s);
    } else if (n == 1) {  // k's heads follow q's: one rotation for both
      d.Rope(q, dev_pos, 1, c.num_heads + c.num_kv_heads, c.head_dim, c.rope_theta, s);
    } else {
      d.Rope(q, dev_pos, n, c.num_heads, c.head_dim, c.rope_theta, s);
      d.Rope(kk, dev_pos, n, c.num_kv_heads, c.head_dim, c.rope_theta, s);
    }
    // Each sequence's rows into its own cache, and attention over that cache alone.
    for (size_t i = 0; i < inputs.size(); ++i) {
      Sequence& seq = *inputs[i].sequence;
      const int64_t past = seq.position_, rows = static_cast<int64_t>(inputs[i].ids.size());
      const int64_t row = chunk.first_row[i];
      Buffer& kc = *seq.k_cache_[static_cast<size_t>(l)];
      Buffer& vc = *seq.v_cache_[static_cast<size_t>(l)];
      float* out = attn_->as<float>() + row * c.q_size();
      if (!kv_rows_on_device) {
        StoreKv(kk + row * c.kv_size(), rows * c.kv_size(), kc, past * c.kv_size(), s);
        StoreKv(v + row * c.kv_size(), rows * c.kv_size(), vc, past * c.kv_size(), s);
      } else if (!kv_with_rope) {  // (with RoPE they are in already)
        d.WriteKvRows(kk + row * c.kv_size(), v + row * c.kv_size(), dev_pos + row, rows, c.kv_size(), CacheRef(kc),
                      CacheRef(vc), seq.capacity_, s);
      }
      if (positions_on_device) {  // a graph's step: the position is the row's, read when the work runs
        d.AttentionAt(q + row * c.q_size(), CacheRef(kc), CacheRef(vc), rows, dev_pos + row, seq.capacity_ - rows,
                      c.num_heads, c.num_kv_heads, c.head_dim, scale, attn_workspace_->data(), out, s);
      } else {
        d.Attention(q + row * c.q_size(), CacheRef(kc), CacheRef(vc), rows, past, c.num_heads, c.num_kv_heads,
                    c.head_dim, scale, out, s);
      }
    }
    d.MatMul(attn_->as<float>(), a.o, a.o_bias, n, c.q_size(), hidden, o_->as<float>(), s);
    // ---- MLP: x += the attention's output, h = the post-attention norm of x (and a sparse layer's router on h)
    float* moe = moe_->as<float>();
    if (lw.sparse) {
      int32_t* dev_ids = topk_->as<int32_t>();          // [n, k]
      float* dev_weights = topk_->as<float>() + n * k;  // [n, k]
      d.AddRmsNormRoute(o_->as<float>(), x, lw.post_norm, lw.router, n, hidden, static_cast<float>(c.rms_norm_eps),
                        c.num_experts, k, c.norm_topk_prob, h, router_logits_->as<float>(), dev_ids, dev_weights, s);
      if (chunk.resident) {
        // The experts read the router's ids on the device and write `moe` (no zeroing); the host waits for nothing
        // until the outputs.
        if (chunk.wants_routing) {
          d.CopyToHostAsync(host_layer_ids_->as<int32_t>() + l * n * k, dev_ids, F32Bytes(n * k), s);
        }
        ODMOE_RETURN_IF_ERROR(experts_->RunFromDeviceIds(l, h, n, dev_ids, dev_weights, moe, s));
      } else {
        // The host needs the router's choice to dispatch the experts: the layer's one synchronization. It also
        // completes every copy the previous Run made, as ExpertExecutor::Run requires. Run adds onto `moe`.
        d.CopyOnDevice(moe, zeros_->data(), F32Bytes(n * hidden), s);
        d.CopyToHost(host_topk_->data(), topk_->data(), F32Bytes(2 * n * k), s);
        const std::span<const int32_t> top_ids(host_topk_->as<int32_t>(), static_cast<size_t>(n * k));
        const std::span<const float> top_weights(host_topk_->as<float>() + n * k, static_cast<size_t>(n * k));
        AppendRouting(chunk, top_ids.data());
        ODMOE_RETURN_IF_ERROR(experts_->Run(l, h, n, top_ids, top_weights, moe, s));
      }
      if (lw.shared.present()) {
        RunMlp(d, lw.shared, h, n, hidden, *mlp_ws_, shared_out_->as<float>(), s);
        d.MatMul(h, lw.shared_gate, {}, n, hidden, 1, shared_gate_->as<float>(), s);
        d.ScatterAddScaled(shared_out_->as<float>(), iota_->as<int32_t>(), shared_gate_->as<float>(), n, hidden,
                           /*sigmoid_scale=*/true, moe, s);
      }
    } else {
      d.AddRmsNorm(o_->as<float>(), x, lw.post_norm, n, hidden, static_cast<float>(c.rms_norm_eps), h, s);
      RunMlp(d, lw.dense, h, n, hidden, *mlp_ws_, moe, s);
    }
    // x += the MLP's output; h = the next layer's input norm of x
    if (l + 1 < c.num_layers) {
      d.AddRmsNorm(moe, x, weights_.layer(l + 1).input_norm, n, hidden, static_cast<float>(c.rms_norm_eps), h, s);
    } else {
      d.Add(moe, n * hidden, x, s);
    }
  }
  EnqueueOutputs(chunk, x);
  return absl::OkStatus();
}

void Engine::AppendRouting(const Chunk& chunk, const int32_t* layer_ids) {
  const int64_t k = config().top_k;
  for (size_t i = 0; i < chunk.inputs.size(); ++i) {
    const BatchInput& in = chunk.inputs[i];
    if (in.routing == nullptr) continue;
    for (size_t t = 0; t < in.ids.size(); ++t) {
      const int32_t* first = layer_ids + (chunk.first_row[i] + static_cast<int64_t>(t)) * k;
      (*in.routing)[chunk.routing_base[i] + t].emplace_back(first, first + k);
    }
  }
}

void Engine::EnqueueOutputs(const Chunk& chunk, const float* x) {
  const ModelConfig& c = config();
  Device& d = device_;
  Stream* s = stream_.get();
  const int64_t hidden = c.hidden_size;
  const int64_t vocab = c.vocab_size;
  const int64_t b = static_cast<int64_t>(chunk.wanted.size());
  if (b == 0) return;
  for (int64_t j = 0; j < b; ++j) {
    const size_t i = chunk.wanted[static_cast<size_t>(j)];
    const int64_t last_row = chunk.first_row[i] + static_cast<int64_t>(chunk.inputs[i].ids.size()) - 1;
    d.CopyOnDevice(last_->as<float>() + j * hidden, x + last_row * hidden, F32Bytes(hidden), s);
  }
  EnqueueLmHead(b);
  // The logits only where asked for: all rows in one copy, or the rows one by one; the model's own, before any
  // change below (the stream's order keeps them so).
  if (chunk.every_logits) {
    d.CopyToHostAsync(host_logits_->data(), logits_->data(), F32Bytes(b * vocab), s);
  } else {
    for (int64_t j = 0; j < b; ++j) {
      if (chunk.inputs[chunk.wanted[static_cast<size_t>(j)]].logits == nullptr) continue;
      d.CopyToHostAsync(host_logits_->as<float>() + j * vocab, logits_->as<float>() + j * vocab, F32Bytes(vocab), s);
    }
  }
  // Repetition penalty, logit bias and penalties: logits[row j, id] changed as kernels::ChangedLogit says.
  if (chunk.changes > 0) {
    d.CopyToDevice(changes_->data(), host_changes_.data(), host_changes_.size() * sizeof(LogitChange), s);
    d.ChangeLogits(logits_->as<float>(), changes_->as<LogitChange>(), chunk.changes, s);
  }
  // The tokens are picked next to the logits; only the ids come back.
  if (chunk.any_token) {
    d.CopyToDevice(choices_->data(), host_choices_->data(), static_cast<size_t>(b) * sizeof(TokenChoice), s);
    d.SelectTokens(logits_->as<float>(), b, vocab, choices_->as<TokenChoice>(), tokens_->as<int32_t>(), s);
    d.CopyToHostAsync(host_tokens_->data(), tokens_->data(), F32Bytes(b), s);
  }
}

void Engine::EnqueueLmHead(int64_t rows) {
  const ModelConfig& c = config();
  device_.RmsNorm(last_->as<float>(), weights_.final_norm(), rows, c.hidden_size, static_cast<float>(c.rms_norm_eps),
                  last_->as<float>(), stream_.get());
  device_.MatMul(last_->as<float>(), weights_.lm_head(), {}, rows, c.hidden_size, c.vocab_size, logits_->as<float>(),
                 stream_.get());
}

void Engine::CollectRowLogits(const Chunk& chunk) {
  const ModelConfig& c = config();
  Device& d = device_;
  Stream* s = stream_.get();
  const int64_t hidden = c.hidden_size;
  const int64_t vocab = c.vocab_size;
  const int64_t group = options_.max_sequences_per_forward;  // the rows last_ and logits_ hold
  for (size_t i = 0; i < chunk.inputs.size(); ++i) {
    const BatchInput& in = chunk.inputs[i];
    if (in.row_logits == nullptr) continue;
    const int64_t rows = static_cast<int64_t>(in.ids.size());
    for (int64_t first = 0; first < rows; first += group) {
      const int64_t b = std::min(group, rows - first);
      d.CopyOnDevice(last_->as<float>(), x_->as<float>() + (chunk.first_row[i] + first) * hidden, F32Bytes(b * hidden),
                     s);
      EnqueueLmHead(b);
      d.CopyToHostAsync(host_logits_->data(), logits_->data(), F32Bytes(b * vocab), s);
      d.Synchronize(s);
      for (int64_t j = 0; j < b; ++j) {
        (*in.row_logits)(first + j,
                         std::span<const float>(host_logits_->as<float>() + j * vocab, static_cast<size_t>(vocab)));
      }
    }
  }
}

void Engine::CollectOutputs(const Chunk& chunk) {
  const ModelConfig& c = config();
  device_.Synchronize(stream_.get());  // the one wait
  const int64_t vocab = c.vocab_size;
  for (size_t j = 0; j < chunk.wanted.size(); ++j) {
    const BatchInput& in = chunk.inputs[chunk.wanted[j]];
    if (in.token != nullptr) *in.token = host_tokens_->as<int32_t>()[j];
    if (in.logits != nullptr) {
      const float* row = host_logits_->as<float>() + static_cast<int64_t>(j) * vocab;
      in.logits->assign(row, row + vocab);
    }
  }
  // The router's ids the resident layers copied back.
  if (!chunk.resident || !chunk.wants_routing) return;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (weights_.layer(l).sparse) AppendRouting(chunk, host_layer_ids_->as<int32_t>() + l * chunk.rows * c.top_k);
  }
}

}  // namespace odmoe
