// The cluster file (TOML): every node with its role, address, device and GPU budget, the group size, the
// model, timeouts and the shadow's settings. Every daemon reads the same file and finds itself by name.
//
//   [cluster]
//   name = "local"            # names the run directory of `odmoe cluster up`
//   epoch = 1                 # membership epoch; nodes refuse requests of another epoch
//   group_size = 2            # workers per group; 0 or absent: the model's top-k
//   rpc_timeout_ms = 30000    # deadline of every RPC between nodes
//   startup_timeout_ms = 60000
//   [model]
//   path = "../models/demo-mixtral-kjv"   # relative to this file
//   [[node]]
//   name = "main"  role = "main"  address = "127.0.0.1:7100"  device = "cpu"
//   [[node]]
//   name = "w0"  role = "worker"  address = "127.0.0.1:7110"  device = "mock-gpu"  gpu_budget_mb = 1024
//
// Workers are numbered in the order they appear in the file (the placement's worker index).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace odmoe {

enum class NodeRole { kMain, kShadow, kWorker };
std::string_view NodeRoleName(NodeRole role);

struct NodeConfig {
  std::string name;
  NodeRole role = NodeRole::kWorker;
  std::string address;            // host:port the daemon listens on and peers dial
  std::string device = "cpu";     // a CreateDevice spec: cpu, mock-gpu, cuda
  uint64_t gpu_budget_bytes = 0;  // workers: device memory for weights, activations and workspace (0: none set)
  int32_t worker_index = -1;      // workers: position among the workers of the file
  int32_t threads = 2;            // RPC handler threads
};

struct ModelSource {
  std::string path;  // a Hugging Face checkpoint folder (absolute after loading)
};

struct ClusterConfig {
  std::string file;  // where it was read from
  std::string name = "odmoe";
  uint64_t epoch = 1;
  int32_t group_size = 0;  // 0: the model's top-k
  int64_t rpc_timeout_ms = 30000;
  int64_t startup_timeout_ms = 60000;
  ModelSource model;
  std::vector<NodeConfig> nodes;

  const NodeConfig* Find(std::string_view name) const;
  const NodeConfig* main() const;    // exactly one main node (checked when parsed)
  const NodeConfig* shadow() const;  // at most one; nullptr when there is none
  std::vector<const NodeConfig*> workers() const;  // in worker_index order
};

// Parses the file's text. `where` names it in every message ("configs/local.toml: node 'w3': field
// 'address': ..."); relative model paths are resolved against `base_dir`. InvalidArgument for bad content,
// DataLoss for malformed TOML.
absl::StatusOr<ClusterConfig> ParseClusterConfig(std::string_view text, const std::string& where,
                                                 const std::string& base_dir);
absl::StatusOr<ClusterConfig> LoadClusterConfig(const std::string& path);

}  // namespace odmoe
