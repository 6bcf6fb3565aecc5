#include "src/model/fingerprint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "src/common/mapped_file.h"
#include "src/common/status.h"

namespace odmoe {
namespace {

void Mix(uint64_t& h, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
}

}  // namespace

absl::StatusOr<std::string> ModelFingerprint(const std::string& model_dir, const Checkpoint& checkpoint) {
  uint64_t h = 0xcbf29ce484222325ull;
  ODMOE_ASSIGN_OR_RETURN(std::string config, ReadFileToString(model_dir + "/config.json"));
  Mix(h, config.data(), config.size());
  std::vector<std::string> names = checkpoint.TensorNames();
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const TensorInfo* t = checkpoint.Find(name);
    Mix(h, name.data(), name.size() + 1);
    Mix(h, t->dtype_name.data(), t->dtype_name.size() + 1);
    for (int64_t d : t->shape) Mix(h, &d, sizeof(d));
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return std::string(hex);
}

absl::StatusOr<std::string> SyntheticFingerprint(const SyntheticSpec& spec) {
  ODMOE_ASSIGN_OR_RETURN(ModelConfig config, SyntheticModelConfig(spec));
  std::string path = spec.config_path;
  if (std::filesystem::is_directory(path)) path += "/config.json";
  ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  uint64_t h = 0xcbf29ce484222325ull;
  static constexpr char kTag[] = "odmoe synthetic weights v1";
  Mix(h, kTag, sizeof(kTag));
  Mix(h, text.data(), text.size());
  const int64_t layers = config.num_layers;
  Mix(h, &layers, sizeof(layers));
  Mix(h, &spec.seed, sizeof(spec.seed));
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return std::string(hex);
}

}  // namespace odmoe
