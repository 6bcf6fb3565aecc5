#include "src/engine/model_weights.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "src/backend/quantize.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/model/model_layout.h"

namespace odmoe {

namespace {

// The linear weights inside the decoder layers: what the shadow's quantization applies to.
bool IsDecoderLinear(const TensorSpec& spec) {
  if (spec.layer < 0 || spec.shape.size() != 2) return false;
  switch (spec.role) {
    case TensorRole::kQ:
    case TensorRole::kK:
    case TensorRole::kV:
    case TensorRole::kO:
    case TensorRole::kRouter:
    case TensorRole::kExpertGate:
    case TensorRole::kExpertUp:
    case TensorRole::kExpertDown:
    case TensorRole::kSharedGate:
    case TensorRole::kSharedUp:
    case TensorRole::kSharedDown:
    case TensorRole::kSharedExpertGate:
    case TensorRole::kDenseGate:
    case TensorRole::kDenseUp:
    case TensorRole::kDenseDown:
      return true;
    default:
      return false;
  }
}

// The dtype a decoder-layer weight is stored in under `quant` (not kNone).
DType QuantizedDType(WeightQuant quant) {
  return quant == WeightQuant::kFp16 ? DType::kF16 : quant == WeightQuant::kInt8 ? DType::kI8 : DType::kU8;
}

float ElementToF32(const uint8_t* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, data + i * 4, 4);
      return f;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, data + i * 2, 2);
      return F16ToF32(h);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, data + i * 2, 2);
      return Bf16ToF32(h);
    }
    default:
      return 0.0f;
  }
}

}  // namespace

WeightQuant WeightSelection::QuantOf(const TensorSpec& spec) const {
  if (keep_router && spec.role == TensorRole::kRouter) return WeightQuant::kNone;
  const bool attention = spec.role == TensorRole::kQ || spec.role == TensorRole::kK || spec.role == TensorRole::kV ||
                         spec.role == TensorRole::kO;
  if (keep_attention && attention) return WeightQuant::kNone;
  return quant;
}

struct ModelWeights::HostWeight {
  const void* data = nullptr;
  size_t bytes = 0;
  DType dtype = DType::kF32;
  std::vector<uint8_t> owned;  // data's storage when converted or copied; empty when data is the source's
  std::vector<float> scales;   // quantized: absmax per row (INT8) or per block (NF4)
};

absl::StatusOr<ModelWeights::HostWeight> ModelWeights::Encode(TensorSource& source, const TensorSpec& spec,
                                                              WeightQuant quant, bool own) {
  ODMOE_ASSIGN_OR_RETURN(SourceTensor t, source.Read(spec));
  HostWeight w;
  if (quant == WeightQuant::kNone || !IsDecoderLinear(spec)) {
    w.dtype = t.dtype;
    w.bytes = t.nbytes;
    if (own) {
      w.owned.assign(t.data, t.data + t.nbytes);
      w.data = w.owned.data();
    } else {
      w.data = t.data;
    }
    return w;
  }
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        StrCat(spec.name, ": cannot quantize a tensor of dtype ", DTypeName(t.dtype), " (expected F32, F16 or BF16)"));
  }
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  const size_t count = static_cast<size_t>(rows * cols);
  if (quant == WeightQuant::kFp16) {
    w.owned.resize(count * 2);
    auto* half = reinterpret_cast<uint16_t*>(w.owned.data());
    for (size_t i = 0; i < count; ++i) half[i] = F32ToF16(ElementToF32(t.data, t.dtype, i));
  } else if (quant == WeightQuant::kInt8) {
    w.owned.resize(count);
    w.scales.resize(static_cast<size_t>(rows));
    QuantizeInt8Rows(t.data, t.dtype, rows, cols, reinterpret_cast<int8_t*>(w.owned.data()), w.scales.data());
  } else {
    w.owned.resize(static_cast<size_t>(rows * Nf4RowBytes(cols)));
    w.scales.resize(static_cast<size_t>(rows * Nf4BlocksPerRow(cols)));
    QuantizeNf4(t.data, t.dtype, rows, cols, w.owned.data(), w.scales.data());
  }
  w.dtype = QuantizedDType(quant);
  w.data = w.owned.data();
  w.bytes = w.owned.size();
  return w;
}

absl::StatusOr<std::vector<WeightRef>> ModelWeights::UploadParts(Device& device, const std::vector<HostWeight>& parts,
                                                                 const std::string& tag, bool source_stable) {
  size_t bytes = 0, scale_count = 0;
  bool transient = !source_stable;  // some part's bytes die with `parts` or at the next Read
  for (const HostWeight& p : parts) {
    bytes += p.bytes;
    scale_count += p.scales.size();
    transient = transient || !p.owned.empty() || !p.scales.empty();
  }
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> buf, device.Allocate(bytes, tag));
  std::unique_ptr<Buffer> scale_buf;
  if (scale_count > 0) {
    ODMOE_ASSIGN_OR_RETURN(scale_buf, device.Allocate(scale_count * sizeof(float), StrCat(tag, " (absmax)")));
  }
  std::vector<WeightRef> refs;
  refs.push_back({buf->data(), parts.front().dtype, scale_buf ? scale_buf->as<float>() : nullptr});
  size_t at = 0, scale_at = 0;
  for (const HostWeight& p : parts) {
    auto* dst = static_cast<uint8_t*>(buf->data()) + at;
    device.CopyToDevice(dst, p.data, p.bytes, nullptr);
    WeightRef ref{dst, p.dtype};
    if (!p.scales.empty()) {
      float* scales = scale_buf->as<float>() + scale_at;
      device.CopyToDevice(scales, p.scales.data(), p.scales.size() * sizeof(float), nullptr);
      ref.scales = scales;
    }
    refs.push_back(ref);
    at += p.bytes;
    scale_at += p.scales.size();
  }
  if (transient) device.Synchronize(nullptr);  // the host bytes are freed or reused next
  device_bytes_ += bytes + scale_count * sizeof(float);
  buffers_.push_back(std::move(buf));
  if (scale_buf) buffers_.push_back(std::move(scale_buf));
  return refs;
}

absl::StatusOr<WeightRef> ModelWeights::Upload(TensorSource& source, Device& device, const TensorSpec& spec,
                                               WeightQuant quant) {
  std::vector<HostWeight> parts;
  ODMOE_ASSIGN_OR_RETURN(parts.emplace_back(), Encode(source, spec, quant, /*own=*/false));
  ODMOE_ASSIGN_OR_RETURN(std::vector<WeightRef> refs, UploadParts(device, parts, spec.name, source.stable()));
  return refs[1];
}

absl::StatusOr<bool> ModelWeights::Stackable(const TensorSource& source, const std::vector<const TensorSpec*>& specs,
                                             WeightQuant quant) {
  std::optional<DType> dtype;
  for (const TensorSpec* spec : specs) {
    ODMOE_ASSIGN_OR_RETURN(TensorMeta meta, source.Meta(*spec));
    if (quant != WeightQuant::kNone && IsDecoderLinear(*spec)) {
      // Rows of 16-byte multiples: FP16 rows of 8-element multiples, INT8 of 16; NF4 rows are 32-byte multiples.
      const int64_t cols = spec->shape[1];
      if ((quant == WeightQuant::kFp16 && cols % 8 != 0) || (quant == WeightQuant::kInt8 && cols % 16 != 0)) {
        return false;
      }
      meta.dtype = QuantizedDType(quant);
    } else if (meta.nbytes % 16 != 0) {
      return false;
    }
    if (dtype.has_value() && *dtype != meta.dtype) return false;
    dtype = meta.dtype;
  }
  return true;
}

absl::StatusOr<std::vector<WeightRef>> ModelWeights::UploadStacked(TensorSource& source, Device& device,
                                                                   const std::vector<const TensorSpec*>& specs,
                                                                   WeightQuant quant, const std::string& tag) {
  std::vector<HostWeight> parts;
  for (const TensorSpec* spec : specs) {
    ODMOE_ASSIGN_OR_RETURN(parts.emplace_back(), Encode(source, *spec, quant, /*own=*/!source.stable()));
  }
  return UploadParts(device, parts, tag, source.stable());
}

absl::Status ModelWeights::StackLayer(TensorSource& source, Device& device,
                                      const std::map<TensorRole, const TensorSpec*>& specs,
                                      const WeightSelection& selection, LayerWeights& lw,
                                      std::set<const TensorSpec*>& stacked) {
  // The specs of `roles`, or none unless the layer has all of them.
  const auto group = [&](std::initializer_list<TensorRole> roles) {
    std::vector<const TensorSpec*> g;
    for (TensorRole r : roles) {
      if (auto it = specs.find(r); it != specs.end()) g.push_back(it->second);
    }
    return g.size() == roles.size() ? g : std::vector<const TensorSpec*>{};
  };
  const std::vector<const TensorSpec*> qkv = group({TensorRole::kQ, TensorRole::kK, TensorRole::kV});
  const std::vector<const TensorSpec*> bias = group({TensorRole::kQBias, TensorRole::kKBias, TensorRole::kVBias});
  const bool has_bias = specs.contains(TensorRole::kQBias);
  if (!qkv.empty() && has_bias == !bias.empty()) {
    // Weights and biases both, or neither: a stacked matrix with biases apart would need three bias additions.
    const WeightQuant quant = selection.QuantOf(*qkv[0]);
    ODMOE_ASSIGN_OR_RETURN(bool stackable, Stackable(source, qkv, quant));
    if (stackable && has_bias) {
      ODMOE_ASSIGN_OR_RETURN(stackable, Stackable(source, bias, WeightQuant::kNone));
    }
    if (stackable) {
      const std::string tag = StrCat(qkv[0]->name, " (q, k, v)");
      ODMOE_ASSIGN_OR_RETURN(std::vector<WeightRef> w, UploadStacked(source, device, qkv, quant, tag));
      AttentionWeights& a = lw.attn;
      a.qkv = w[0], a.q = w[1], a.k = w[2], a.v = w[3];
      stacked.insert(qkv.begin(), qkv.end());
      if (has_bias) {
        ODMOE_ASSIGN_OR_RETURN(w, UploadStacked(source, device, bias, WeightQuant::kNone, StrCat(tag, " bias")));
        a.qkv_bias = w[0], a.q_bias = w[1], a.k_bias = w[2], a.v_bias = w[3];
        stacked.insert(bias.begin(), bias.end());
      }
    }
  }
  const struct {
    MlpWeights* mlp;
    TensorRole gate, up;
    int64_t intermediate;
  } mlps[] = {{&lw.shared, TensorRole::kSharedGate, TensorRole::kSharedUp, config_.shared_expert_intermediate_size},
              {&lw.dense, TensorRole::kDenseGate, TensorRole::kDenseUp, config_.dense_intermediate_size}};
  for (const auto& m : mlps) {
    const std::vector<const TensorSpec*> gate_up = group({m.gate, m.up});
    if (gate_up.empty()) continue;
    const WeightQuant quant = selection.QuantOf(*gate_up[0]);
    ODMOE_ASSIGN_OR_RETURN(bool stackable, Stackable(source, gate_up, quant));
    if (!stackable) continue;
    ODMOE_ASSIGN_OR_RETURN(std::vector<WeightRef> w,
                           UploadStacked(source, device, gate_up, quant, StrCat(gate_up[0]->name, " (gate, up)")));
    m.mlp->gate_up = w[0], m.mlp->gate = w[1], m.mlp->up = w[2];
    m.mlp->intermediate = m.intermediate;
    stacked.insert(gate_up.begin(), gate_up.end());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelWeights>> ModelWeights::Load(const ModelConfig& config, Checkpoint& checkpoint,
                                                                 Device& device, const WeightSelection& selection) {
  CheckpointSource source(checkpoint);
  return Load(config, source, device, selection);
}

absl::StatusOr<std::unique_ptr<ModelWeights>> ModelWeights::Load(const ModelConfig& config, TensorSource& source,
                                                                 Device& device, const WeightSelection& selection) {
  std::unique_ptr<ModelWeights> w(new ModelWeights(config));
  w->layers_.resize(static_cast<size_t>(config.num_layers));
  for (int64_t l = 0; l < config.num_layers; ++l) {
    LayerWeights& lw = w->layers_[static_cast<size_t>(l)];
    lw.sparse = config.IsSparseLayer(l);
    if (lw.sparse) lw.experts.resize(static_cast<size_t>(config.num_experts));
  }

  if (selection.non_expert) {
    // Validate everything first so that a bad source fails before any device memory is used.
    const std::vector<TensorSpec> specs = NonExpertTensors(config);
    ODMOE_RETURN_IF_ERROR(source.Validate(specs));
    // What one token's projection reads together is stored as one stack where it can be (StackLayer).
    std::vector<std::map<TensorRole, const TensorSpec*>> by_role(w->layers_.size());
    for (const TensorSpec& spec : specs) {
      if (spec.layer >= 0) by_role[static_cast<size_t>(spec.layer)][spec.role] = &spec;
    }
    std::set<const TensorSpec*> stacked;
    for (size_t l = 0; l < w->layers_.size(); ++l) {
      ODMOE_RETURN_IF_ERROR(w->StackLayer(source, device, by_role[l], selection, w->layers_[l], stacked));
    }
    for (const TensorSpec& spec : specs) {
      if (stacked.contains(&spec)) continue;
      ODMOE_ASSIGN_OR_RETURN(WeightRef ref, w->Upload(source, device, spec, selection.QuantOf(spec)));
      LayerWeights* lw = spec.layer >= 0 ? &w->layers_[static_cast<size_t>(spec.layer)] : nullptr;
      switch (spec.role) {
        case TensorRole::kEmbed: w->embed_ = ref; break;
        case TensorRole::kLmHead: w->lm_head_ = ref; break;
        case TensorRole::kFinalNorm: w->final_norm_ = ref; break;
        case TensorRole::kInputNorm: lw->input_norm = ref; break;
        case TensorRole::kPostNorm: lw->post_norm = ref; break;
        case TensorRole::kQ: lw->attn.q = ref; break;
        case TensorRole::kK: lw->attn.k = ref; break;
        case TensorRole::kV: lw->attn.v = ref; break;
        case TensorRole::kO: lw->attn.o = ref; break;
        case TensorRole::kQBias: lw->attn.q_bias = ref; break;
        case TensorRole::kKBias: lw->attn.k_bias = ref; break;
        case TensorRole::kVBias: lw->attn.v_bias = ref; break;
        case TensorRole::kOBias: lw->attn.o_bias = ref; break;
        case TensorRole::kQNorm: lw->attn.q_norm = ref; break;
        case TensorRole::kKNorm: lw->attn.k_norm = ref; break;
        case TensorRole::kRouter: lw->router = ref; break;
        case TensorRole::kSharedGate:
          lw->shared.gate = ref;
          lw->shared.intermediate = config.shared_expert_intermediate_size;
          break;
        case TensorRole::kSharedUp: lw->shared.up = ref; break;
        case TensorRole::kSharedDown: lw->shared.down = ref; break;
        case TensorRole::kSharedExpertGate: lw->shared_gate = ref; break;
        case TensorRole::kDenseGate:
          lw->dense.gate = ref;
          lw->dense.intermediate = config.dense_intermediate_size;
          break;
        case TensorRole::kDenseUp: lw->dense.up = ref; break;
        case TensorRole::kDenseDown: lw->dense.down = ref; break;
        case TensorRole::kExpertGate:
        case TensorRole::kExpertUp:
        case TensorRole::kExpertDown:
          return absl::InternalError(StrCat("expert tensor ", spec.name, " among the non-expert tensors"));
      }
    }
    if (config.tie_word_embeddings) w->lm_head_ = w->embed_;
  }

  std::vector<std::pair<int64_t, int64_t>> wanted;
  if (selection.experts == WeightSelection::Experts::kAll) {
    for (int64_t l : config.SparseLayers()) {
      for (int64_t e = 0; e < config.num_experts; ++e) wanted.emplace_back(l, e);
    }
  } else if (selection.experts == WeightSelection::Experts::kSome) {
    wanted = selection.some;
  }
  for (auto [l, e] : wanted) {
    if (l < 0 || l >= config.num_layers || !config.IsSparseLayer(l) || e < 0 || e >= config.num_experts) {
      return absl::InvalidArgumentError(StrCat("expert (layer ", l, ", expert ", e, ") does not exist in this model"));
    }
    const std::vector<TensorSpec> specs = ExpertTensors(config, l, e);
    ODMOE_RETURN_IF_ERROR(source.Validate(specs));
    MlpWeights& m = w->layers_[static_cast<size_t>(l)].experts[static_cast<size_t>(e)];
    ODMOE_ASSIGN_OR_RETURN(m.gate, w->Upload(source, device, specs[0], selection.QuantOf(specs[0])));
    ODMOE_ASSIGN_OR_RETURN(m.up, w->Upload(source, device, specs[1], selection.QuantOf(specs[1])));
    ODMOE_ASSIGN_OR_RETURN(m.down, w->Upload(source, device, specs[2], selection.QuantOf(specs[2])));
    m.intermediate = config.expert_intermediate_size;
  }
  device.SynchronizeAll();
  return w;
}

const MlpWeights* ModelWeights::expert(int64_t layer, int64_t e) const {
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size())) return nullptr;
  const LayerWeights& lw = layers_[static_cast<size_t>(layer)];
  if (e < 0 || e >= static_cast<int64_t>(lw.experts.size())) return nullptr;
  const MlpWeights& m = lw.experts[static_cast<size_t>(e)];
  return m.present() ? &m : nullptr;
}

}  // namespace odmoe
