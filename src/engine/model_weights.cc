#include "src/engine/model_weights.h"

#include <algorithm>
#include <cstring>
#include <map>

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

absl::StatusOr<WeightRef> ModelWeights::UploadBytes(Device& device, const void* data, size_t bytes, DType dtype,
                                                    const std::string& tag, bool sync) {
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> buf, device.Allocate(bytes, tag));
  device.CopyToDevice(buf->data(), data, bytes, nullptr);
  if (sync) device.Synchronize(nullptr);  // the host bytes may be reused or freed
  WeightRef ref{buf->data(), dtype};
  device_bytes_ += bytes;
  buffers_.push_back(std::move(buf));
  return ref;
}

absl::StatusOr<WeightRef> ModelWeights::Upload(TensorSource& source, Device& device, const TensorSpec& spec,
                                               WeightQuant quant) {
  ODMOE_ASSIGN_OR_RETURN(SourceTensor t, source.Read(spec));
  if (quant == WeightQuant::kNone || !IsDecoderLinear(spec)) {
    return UploadBytes(device, t.data, t.nbytes, t.dtype, spec.name, !source.stable());
  }
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        StrCat(spec.name, ": cannot quantize a tensor of dtype ", DTypeName(t.dtype), " (expected F32, F16 or BF16)"));
  }
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  const size_t count = static_cast<size_t>(rows * cols);
  if (quant == WeightQuant::kFp16) {
    std::vector<uint16_t> half(count);
    for (size_t i = 0; i < count; ++i) half[i] = F32ToF16(ElementToF32(t.data, t.dtype, i));
    return UploadBytes(device, half.data(), count * 2, DType::kF16, spec.name, /*sync=*/true);
  }
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  DType dtype;
  if (quant == WeightQuant::kInt8) {
    codes.resize(count);
    scales.resize(static_cast<size_t>(rows));
    QuantizeInt8Rows(t.data, t.dtype, rows, cols, reinterpret_cast<int8_t*>(codes.data()), scales.data());
    dtype = DType::kI8;
  } else {
    codes.resize(static_cast<size_t>(rows * Nf4RowBytes(cols)));
    scales.resize(static_cast<size_t>(rows * Nf4BlocksPerRow(cols)));
    QuantizeNf4(t.data, t.dtype, rows, cols, codes.data(), scales.data());
    dtype = DType::kU8;
  }
  ODMOE_ASSIGN_OR_RETURN(WeightRef ref, UploadBytes(device, codes.data(), codes.size(), dtype, spec.name, true));
  ODMOE_ASSIGN_OR_RETURN(WeightRef s, UploadBytes(device, scales.data(), scales.size() * sizeof(float), DType::kF32,
                                                  StrCat(spec.name, " (absmax)"), true));
  ref.scales = static_cast<const float*>(s.data);
  return ref;
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
    for (const TensorSpec& spec : specs) {
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
