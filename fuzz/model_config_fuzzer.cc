// Fuzzes config.json: ParseJson, then ParseModelConfig, then the derived queries the loader and the engine make
// (sparse layers, sequence-length checks) on every config it accepts.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "src/common/json.h"
#include "src/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<odmoe::Json> json = odmoe::ParseJson(text, "config.json");
  if (!json.ok()) return 0;
  (void)odmoe::DumpJson(*json);
  absl::StatusOr<odmoe::ModelConfig> config = odmoe::ParseModelConfig(*json, "config.json");
  if (!config.ok()) return 0;
  // Bounded: a config may declare billions of layers; the per-layer queries look at the first few.
  const int64_t layers = config->num_layers < 64 ? config->num_layers : 64;
  for (int64_t layer = 0; layer < layers; ++layer) {
    (void)config->IsSparseLayer(layer);
    (void)config->SparseIndex(layer);
  }
  if (config->num_layers <= 4096) (void)config->SparseLayers();
  (void)config->q_size();
  (void)config->kv_size();
  for (int64_t total :
       {int64_t{1}, int64_t{4096}, config->max_position_embeddings, config->max_position_embeddings + 1}) {
    (void)odmoe::CheckSequenceLength(*config, total);
  }
  (void)odmoe::ArchitectureName(config->arch);
  return 0;
}
