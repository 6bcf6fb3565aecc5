#include "src/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

// ---- LocalExpertExecutor -------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LocalExpertExecutor>> LocalExpertExecutor::Create(Device& device,
                                                                                 const ModelWeights& weights,
                                                                                 int64_t max_tokens) {
  const ModelConfig& c = weights.config();
  std::unique_ptr<LocalExpertExecutor> ex(new LocalExpertExecutor(device, weights));
  ex->max_tokens_ = max_tokens;
  ODMOE_ASSIGN_OR_RETURN(ex->ws_, MlpWorkspace::Create(device, max_tokens, std::max<int64_t>(1, c.expert_intermediate_size)));
  ODMOE_RETURN_IF_ERROR(Alloc(device, ex->xg_, F32Bytes(max_tokens * c.hidden_size), "expert inputs"));
  ODMOE_RETURN_IF_ERROR(Alloc(device, ex->yg_, F32Bytes(max_tokens * c.hidden_size), "expert outputs"));
  // Rows and scales of every (token, expert) pair of a chunk: 2 x [max_tokens * k] 4-byte values.
  ODMOE_RETURN_IF_ERROR(Alloc(device, ex->index_, 2 * F32Bytes(max_tokens * std::max<int64_t>(1, c.top_k)),
                              "expert routing index"));
  return ex;
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
  // packed_ must stay untouched until the copy is done.
  device_.Synchronize(stream);
  return absl::OkStatus();
}

// ---- Engine --------------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const ModelWeights& weights, Device& device,
                                                       ExpertExecutor* experts, EngineOptions options) {
  if (options.max_tokens_per_forward <= 0) {
    return absl::InvalidArgumentError("max_tokens_per_forward must be positive");
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
  ODMOE_RETURN_IF_ERROR(Alloc(d, ids_, F32Bytes(C), "token ids"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, positions_, F32Bytes(C), "positions"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, x_, F32Bytes(C * c.hidden_size), "hidden state"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, h_, F32Bytes(C * c.hidden_size), "normed hidden state"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, attn_, F32Bytes(C * c.q_size()), "attention output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, o_, F32Bytes(C * c.hidden_size), "o_proj output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, moe_, F32Bytes(C * c.hidden_size), "mlp output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, q_, F32Bytes(C * c.q_size()), "q"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, k_, F32Bytes(C * c.kv_size()), "k"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, v_, F32Bytes(C * c.kv_size()), "v"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, router_logits_, F32Bytes(C * std::max<int64_t>(1, c.num_experts)), "router logits"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, topk_ids_, F32Bytes(C * k), "top-k ids"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, topk_weights_, F32Bytes(C * k), "top-k weights"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, shared_out_, F32Bytes(C * c.hidden_size), "shared expert output"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, shared_gate_, F32Bytes(C), "shared expert gate"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, iota_, F32Bytes(C), "row indices"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, zeros_, F32Bytes(C * c.hidden_size), "zeros"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, last_, F32Bytes(c.hidden_size), "last hidden state"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, logits_, F32Bytes(c.vocab_size), "logits"));
  ODMOE_RETURN_IF_ERROR(Alloc(d, kv_row_, F32Bytes(2 * c.num_layers * c.kv_size()), "one position's K and V"));
  const int64_t max_inter = std::max({c.shared_expert_intermediate_size, c.dense_intermediate_size, int64_t{1}});
  ODMOE_ASSIGN_OR_RETURN(mlp_ws_, MlpWorkspace::Create(d, C, max_inter));

  std::vector<int32_t> iota(static_cast<size_t>(C));
  for (int64_t i = 0; i < C; ++i) iota[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  d.CopyToDevice(iota_->data(), iota.data(), iota.size() * sizeof(int32_t), stream_.get());
  std::vector<float> zeros(static_cast<size_t>(C * c.hidden_size), 0.0f);
  d.CopyToDevice(zeros_->data(), zeros.data(), zeros.size() * sizeof(float), stream_.get());
  d.Synchronize(stream_.get());
  host_ids_.resize(static_cast<size_t>(C * k));
  host_weights_.resize(static_cast<size_t>(C * k));
  host_logits_.resize(static_cast<size_t>(c.vocab_size));
  return absl::OkStatus();
}

absl::Status Engine::StartSequence(int64_t capacity) {
  const ModelConfig& c = config();
  if (capacity <= 0) return absl::InvalidArgumentError("a sequence needs room for at least one position");
  ODMOE_RETURN_IF_ERROR(CheckSequenceLength(c, capacity));
  position_ = 0;
  if (capacity > capacity_ || k_cache_.empty()) {
    k_cache_.clear();
    v_cache_.clear();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::unique_ptr<Buffer> kb, vb;
      ODMOE_RETURN_IF_ERROR(Alloc(device_, kb, F32Bytes(capacity * c.kv_size()), StrCat("k cache, layer ", l)));
      ODMOE_RETURN_IF_ERROR(Alloc(device_, vb, F32Bytes(capacity * c.kv_size()), StrCat("v cache, layer ", l)));
      k_cache_.push_back(std::move(kb));
      v_cache_.push_back(std::move(vb));
    }
    capacity_ = capacity;
  }
  return absl::OkStatus();
}

absl::Status Engine::Truncate(int64_t position) {
  if (position < 0 || position > position_) {
    return absl::OutOfRangeError(
        StrCat("cannot truncate the sequence to position ", position, ": it has ", position_, " positions"));
  }
  position_ = position;
  return absl::OkStatus();
}

absl::Status Engine::ReadKv(int64_t position, float* k, float* v) {
  if (position < 0 || position >= position_) {
    return absl::OutOfRangeError(
        StrCat("KV of position ", position, " requested, but the sequence has ", position_, " positions"));
  }
  const int64_t kv = config().kv_size();
  const int64_t layers = static_cast<int64_t>(k_cache_.size());
  float* row = kv_row_->as<float>();
  for (int64_t l = 0; l < layers; ++l) {
    const size_t i = static_cast<size_t>(l);
    device_.CopyOnDevice(row + l * kv, k_cache_[i]->as<float>() + position * kv, F32Bytes(kv), stream_.get());
    device_.CopyOnDevice(row + (layers + l) * kv, v_cache_[i]->as<float>() + position * kv, F32Bytes(kv),
                         stream_.get());
  }
  device_.CopyToHost(k, row, F32Bytes(layers * kv), stream_.get());
  device_.CopyToHost(v, row + layers * kv, F32Bytes(layers * kv), stream_.get());
  return absl::OkStatus();
}

absl::Status Engine::ReadKvRange(int64_t first, int64_t count, float* k, float* v) {
  if (first < 0 || count < 0 || first + count > position_) {
    return absl::OutOfRangeError(StrCat("KV of positions ", first, "..", first + count - 1,
                                        " requested, but the sequence has ", position_, " positions"));
  }
  const int64_t kv = config().kv_size();
  const int64_t layers = static_cast<int64_t>(k_cache_.size());
  std::vector<float> tmp(static_cast<size_t>(count * kv));
  for (int64_t l = 0; l < layers; ++l) {
    for (int which = 0; which < 2; ++which) {
      const Buffer& cache = which == 0 ? *k_cache_[static_cast<size_t>(l)] : *v_cache_[static_cast<size_t>(l)];
      float* out = which == 0 ? k : v;
      device_.CopyToHost(tmp.data(), cache.as<float>() + first * kv, F32Bytes(count * kv), stream_.get());
      for (int64_t i = 0; i < count; ++i) {
        std::copy_n(tmp.data() + i * kv, kv, out + (i * layers + l) * kv);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::WriteKv(int64_t position, const float* k, const float* v) {
  if (position < 0 || position >= position_) {
    return absl::OutOfRangeError(
        StrCat("KV of position ", position, " written, but the sequence has ", position_, " positions"));
  }
  const int64_t kv = config().kv_size();
  for (size_t l = 0; l < k_cache_.size(); ++l) {
    device_.CopyToDevice(k_cache_[l]->as<float>() + position * kv, k + static_cast<int64_t>(l) * kv, F32Bytes(kv),
                         stream_.get());
    device_.CopyToDevice(v_cache_[l]->as<float>() + position * kv, v + static_cast<int64_t>(l) * kv, F32Bytes(kv),
                         stream_.get());
  }
  device_.Synchronize(stream_.get());  // the host rows may die on return
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Engine::Forward(std::span<const int32_t> ids,
                                                   std::vector<PositionRouting>* routing, ForwardKind kind) {
  const ModelConfig& c = config();
  if (ids.empty()) return absl::InvalidArgumentError("Forward needs at least one token");
  if (kind == ForwardKind::kDecode && ids.size() != 1) {
    return absl::InvalidArgumentError(StrCat("a decode step feeds one token, got ", ids.size()));
  }
  if (k_cache_.empty()) return absl::FailedPreconditionError("Forward before StartSequence");
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= c.vocab_size) {
      return absl::OutOfRangeError(StrCat("token id ", ids[i], " at index ", i, " is outside the vocabulary [0, ",
                                          c.vocab_size, ")"));
    }
  }
  if (position_ + static_cast<int64_t>(ids.size()) > capacity_) {
    return absl::OutOfRangeError(StrCat("sequence of ", position_ + static_cast<int64_t>(ids.size()),
                                        " positions exceeds the room of ", capacity_, " given to StartSequence"));
  }
  const size_t chunk = static_cast<size_t>(options_.max_tokens_per_forward);
  for (size_t start = 0; start < ids.size(); start += chunk) {
    const size_t len = std::min(chunk, ids.size() - start);
    ODMOE_RETURN_IF_ERROR(ForwardChunk(ids.subspan(start, len), routing, kind, start + len == ids.size()));
  }
  return host_logits_;
}

absl::Status Engine::ForwardChunk(std::span<const int32_t> ids, std::vector<PositionRouting>* routing,
                                  ForwardKind kind, bool last_chunk) {
  const ModelConfig& c = config();
  Device& d = device_;
  Stream* s = stream_.get();
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t hidden = c.hidden_size, past = position_;
  const int64_t k = c.top_k;

  experts_->BeginForward(past, n, kind);
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(past + i);
  d.CopyToDevice(ids_->data(), ids.data(), ids.size() * sizeof(int32_t), s);
  d.CopyToDevice(positions_->data(), positions.data(), positions.size() * sizeof(int32_t), s);
  const int32_t* dev_pos = positions_->as<int32_t>();

  float* x = x_->as<float>();
  float* h = h_->as<float>();
  d.Embedding(ids_->as<int32_t>(), n, weights_.embed(), hidden, x, s);

  const size_t routing_base = routing != nullptr ? routing->size() : 0;
  if (routing != nullptr) routing->resize(routing_base + static_cast<size_t>(n));
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = weights_.layer(l);
    const AttentionWeights& a = lw.attn;
    // ---- attention
    d.RmsNorm(x, lw.input_norm, n, hidden, static_cast<float>(c.rms_norm_eps), h, s);
    float* q = q_->as<float>();
    float* kk = k_->as<float>();
    float* v = v_->as<float>();
    d.MatMul(h, a.q, a.q_bias, n, hidden, c.q_size(), q, s);
    d.MatMul(h, a.k, a.k_bias, n, hidden, c.kv_size(), kk, s);
    d.MatMul(h, a.v, a.v_bias, n, hidden, c.kv_size(), v, s);
    if (c.qk_norm == QkNorm::kPerHead) {
      d.RmsNorm(q, a.q_norm, n * c.num_heads, c.head_dim, static_cast<float>(c.rms_norm_eps), q, s);
      d.RmsNorm(kk, a.k_norm, n * c.num_kv_heads, c.head_dim, static_cast<float>(c.rms_norm_eps), kk, s);
    } else if (c.qk_norm == QkNorm::kFull) {
      d.RmsNorm(q, a.q_norm, n, c.q_size(), static_cast<float>(c.rms_norm_eps), q, s);
      d.RmsNorm(kk, a.k_norm, n, c.kv_size(), static_cast<float>(c.rms_norm_eps), kk, s);
    }
    d.Rope(q, dev_pos, n, c.num_heads, c.head_dim, c.rope_theta, s);
    d.Rope(kk, dev_pos, n, c.num_kv_heads, c.head_dim, c.rope_theta, s);
    float* kc = k_cache_[static_cast<size_t>(l)]->as<float>();
    float* vc = v_cache_[static_cast<size_t>(l)]->as<float>();
    d.CopyOnDevice(kc + past * c.kv_size(), kk, F32Bytes(n * c.kv_size()), s);
    d.CopyOnDevice(vc + past * c.kv_size(), v, F32Bytes(n * c.kv_size()), s);
    d.Attention(q, kc, vc, n, past, c.num_heads, c.num_kv_heads, c.head_dim, scale, attn_->as<float>(), s);
    d.MatMul(attn_->as<float>(), a.o, a.o_bias, n, c.q_size(), hidden, o_->as<float>(), s);
    d.Add(o_->as<float>(), n * hidden, x, s);

    // ---- MLP
    d.RmsNorm(x, lw.post_norm, n, hidden, static_cast<float>(c.rms_norm_eps), h, s);
    float* moe = moe_->as<float>();
    if (lw.sparse) {
      RunRouter(d, c, lw.router, h, n, router_logits_->as<float>(), topk_ids_->as<int32_t>(),
                topk_weights_->as<float>(), s);
      d.CopyToHost(host_ids_.data(), topk_ids_->data(), F32Bytes(n * k), s);
      d.CopyToHost(host_weights_.data(), topk_weights_->data(), F32Bytes(n * k), s);
      if (routing != nullptr) {
        for (int64_t i = 0; i < n; ++i) {
          auto first = host_ids_.begin() + i * k;
          (*routing)[routing_base + static_cast<size_t>(i)].emplace_back(first, first + k);
        }
      }
      d.CopyOnDevice(moe, zeros_->data(), F32Bytes(n * hidden), s);
      ODMOE_RETURN_IF_ERROR(experts_->Run(l, h, n, std::span<const int32_t>(host_ids_.data(), static_cast<size_t>(n * k)),
                                          std::span<const float>(host_weights_.data(), static_cast<size_t>(n * k)),
                                          moe, s));
      if (lw.shared.present()) {
        RunMlp(d, lw.shared, h, n, hidden, *mlp_ws_, shared_out_->as<float>(), s);
        d.MatMul(h, lw.shared_gate, {}, n, hidden, 1, shared_gate_->as<float>(), s);
        d.ScatterAddScaled(shared_out_->as<float>(), iota_->as<int32_t>(), shared_gate_->as<float>(), n, hidden,
                           /*sigmoid_scale=*/true, moe, s);
      }
    } else {
      RunMlp(d, lw.dense, h, n, hidden, *mlp_ws_, moe, s);
    }
    d.Add(moe, n * hidden, x, s);
  }
  position_ += n;

  if (last_chunk) {
    d.RmsNorm(x + (n - 1) * hidden, weights_.final_norm(), 1, hidden, static_cast<float>(c.rms_norm_eps),
              last_->as<float>(), s);
    d.MatMul(last_->as<float>(), weights_.lm_head(), {}, 1, hidden, c.vocab_size, logits_->as<float>(), s);
    d.CopyToHost(host_logits_.data(), logits_->data(), F32Bytes(c.vocab_size), s);
  } else {
    d.Synchronize(s);  // the host vectors of this chunk must outlive its copies
  }
  return absl::OkStatus();
}

}  // namespace odmoe
