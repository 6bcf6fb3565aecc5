// Fuzzes the cluster file (TOML): ParseClusterConfig, then the lookups every daemon makes on a config it
// accepts (main, shadow, workers, Find by name). An accepted config must have exactly one main node and
// workers numbered 0..n-1 in file order.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "src/common/cluster_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<odmoe::ClusterConfig> config = odmoe::ParseClusterConfig(text, "fuzz.toml", "/fuzz/base");
  if (!config.ok()) return 0;
  if (config->main() == nullptr) std::abort();
  (void)config->shadow();
  const std::vector<const odmoe::NodeConfig*> workers = config->workers();
  for (size_t i = 0; i < workers.size(); ++i) {
    if (workers[i]->worker_index != static_cast<int32_t>(i)) std::abort();
  }
  for (const odmoe::NodeConfig& node : config->nodes) {
    if (config->Find(node.name) == nullptr) std::abort();
    (void)odmoe::NodeRoleName(node.role);
  }
  (void)config->Find("no such node");
  return 0;
}
