#include "src/model/synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "src/common/json.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// SplitMix64's output function.
inline uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint64_t TensorBase(uint64_t seed, uint64_t name_key) { return Mix(Mix(seed + kGolden) ^ name_key); }

// Irwin-Hall of four 16-bit uniforms, centred, unit variance.
inline float UnitNoise(uint64_t h) {
  const uint64_t s = (h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48);
  constexpr double kMean = 4 * 65535.0 / 2;
  constexpr double kInvStd = 1.0 / 37837.2;  // sqrt(4 * (65536^2 - 1) / 12)
  return static_cast<float>((static_cast<double>(s) - kMean) * kInvStd);
}

inline float ValueAt(uint64_t base, bool norm, uint64_t index) {
  const float v = kSyntheticStd * UnitNoise(Mix(base + (index + 1) * kGolden));
  return norm ? 1.0f + v : v;
}

void GenerateRange(uint64_t base, bool norm, DType dtype, uint64_t first, uint64_t count, uint8_t* out) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      for (uint64_t i = 0; i < count; ++i) o[i] = F32ToBf16(ValueAt(base, norm, first + i));
      return;
    }
    case DType::kF16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      for (uint64_t i = 0; i < count; ++i) o[i] = F32ToF16(ValueAt(base, norm, first + i));
      return;
    }
    case DType::kF32: {
      float* o = reinterpret_cast<float*>(out);
      for (uint64_t i = 0; i < count; ++i) o[i] = ValueAt(base, norm, first + i);
      return;
    }
    default:
      ODMOE_CHECK(false && "synthetic weights are F32, F16 or BF16");
  }
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += StrCat(i ? ", " : "", shape[i]);
  return s + "]";
}

}  // namespace

absl::StatusOr<ModelConfig> SyntheticModelConfig(const SyntheticSpec& spec) {
  if (spec.layers < 0) return absl::InvalidArgumentError(StrCat("--layers must be >= 1, got ", spec.layers));
  if (spec.config_path.empty()) return absl::InvalidArgumentError("--synthetic: expected a config.json");
  ModelConfig config;
  if (FileExists(spec.config_path + "/config.json")) {
    ODMOE_ASSIGN_OR_RETURN(config, LoadModelConfig(spec.config_path));
  } else {
    ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(spec.config_path));
    ODMOE_ASSIGN_OR_RETURN(Json json, ParseJson(text, spec.config_path));
    ODMOE_ASSIGN_OR_RETURN(config, ParseModelConfig(json, spec.config_path));
  }
  if (spec.layers > 0) config.num_layers = spec.layers;
  return config;
}

DType SyntheticDType(const ModelConfig& config) {
  if (config.torch_dtype == "float16") return DType::kF16;
  if (config.torch_dtype == "float32") return DType::kF32;
  return DType::kBF16;
}

uint64_t TensorNameKey(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

bool IsNormRole(TensorRole role) {
  switch (role) {
    case TensorRole::kFinalNorm:
    case TensorRole::kInputNorm:
    case TensorRole::kPostNorm:
    case TensorRole::kQNorm:
    case TensorRole::kKNorm:
      return true;
    default:
      return false;
  }
}

float SyntheticValue(uint64_t seed, uint64_t name_key, bool norm, uint64_t index) {
  return ValueAt(TensorBase(seed, name_key), norm, index);
}

void GenerateSyntheticTensor(uint64_t seed, const TensorSpec& spec, DType dtype, uint64_t first, uint64_t count,
                             void* out, unsigned threads) {
  const uint64_t base = TensorBase(seed, TensorNameKey(spec.name));
  const bool norm = IsNormRole(spec.role);
  uint8_t* o = static_cast<uint8_t*>(out);
  const size_t esize = DTypeSize(dtype);
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  constexpr uint64_t kPerThread = uint64_t{1} << 20;  // below this, threads cost more than they save
  const uint64_t n = std::min<uint64_t>(threads, std::max<uint64_t>(1, count / kPerThread));
  if (n <= 1) {
    GenerateRange(base, norm, dtype, first, count, o);
    return;
  }
  std::vector<std::thread> pool;
  const uint64_t chunk = (count + n - 1) / n;
  for (uint64_t t = 0; t < n; ++t) {
    const uint64_t begin = t * chunk;
    if (begin >= count) break;
    const uint64_t len = std::min(chunk, count - begin);
    pool.emplace_back(GenerateRange, base, norm, dtype, first + begin, len, o + begin * esize);
  }
  for (std::thread& th : pool) th.join();
}

SyntheticSource::SyntheticSource(const ModelConfig& config, uint64_t seed)
    : seed_(seed), dtype_(SyntheticDType(config)) {
  for (const TensorSpec& s : NonExpertTensors(config)) shapes_[s.name] = s.shape;
  for (const TensorSpec& s : AllExpertTensors(config)) shapes_[s.name] = s.shape;
}

absl::Status SyntheticSource::Check(const TensorSpec& spec) const {
  auto it = shapes_.find(spec.name);
  if (it == shapes_.end()) {
    return absl::NotFoundError(StrCat("tensor ", spec.name, " is not part of this model (", Describe(), ")"));
  }
  if (it->second != spec.shape) {
    return absl::FailedPreconditionError(StrCat("tensor ", spec.name, " has shape ", ShapeString(it->second), " in ",
                                                Describe(), ", expected ", ShapeString(spec.shape)));
  }
  return absl::OkStatus();
}

absl::Status SyntheticSource::Validate(const std::vector<TensorSpec>& specs) const {
  for (const TensorSpec& s : specs) ODMOE_RETURN_IF_ERROR(Check(s));
  return absl::OkStatus();
}

absl::StatusOr<TensorMeta> SyntheticSource::Meta(const TensorSpec& spec) const {
  ODMOE_RETURN_IF_ERROR(Check(spec));
  uint64_t count = 1;
  for (int64_t d : spec.shape) count *= static_cast<uint64_t>(d);
  return TensorMeta{dtype_, count * DTypeSize(dtype_)};
}

absl::StatusOr<SourceTensor> SyntheticSource::Read(const TensorSpec& spec) {
  ODMOE_ASSIGN_OR_RETURN(const TensorMeta meta, Meta(spec));
  const uint64_t count = meta.nbytes / DTypeSize(dtype_);
  const size_t nbytes = static_cast<size_t>(meta.nbytes);
  if (buffer_.size() < nbytes) {
    buffer_.clear();
    buffer_.shrink_to_fit();
    buffer_.resize(nbytes);
  }
  GenerateSyntheticTensor(seed_, spec, dtype_, 0, count, buffer_.data());
  elements_generated_ += count;
  return SourceTensor{buffer_.data(), nbytes, dtype_};
}

std::string SyntheticSource::Describe() const {
  return StrCat("synthetic weights, seed ", seed_, ", ", DTypeName(dtype_));
}

}  // namespace odmoe
