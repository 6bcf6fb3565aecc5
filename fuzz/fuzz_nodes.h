// Nodes for the request fuzzers, built once per process without a server: a worker of the shared mixtral-tiny
// model and a main node of the shared demo-mixtral-kjv model (it has a tokenizer), both on the CPU device, in a
// cluster of one main and two workers that nothing dials. Without ../shared they print why and exit 77, which
// ctest reports as skipped (SKIP_RETURN_CODE).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "src/backend/device_factory.h"
#include "src/common/cluster_config.h"
#include "src/main_node/main_node.h"
#include "src/rpc/daemon.h"
#include "src/shadow_node/shadow_node.h"
#include "src/worker_node/worker_node.h"

namespace odmoe::fuzz {

inline constexpr char kFuzzCluster[] = R"(
[cluster]
epoch = 7
group_size = 2
rpc_timeout_ms = 100
[model]
path = "model"
[[node]]
name = "main"
role = "main"
address = "127.0.0.1:1"
device = "cpu"
[[node]]
name = "w0"
role = "worker"
address = "127.0.0.1:2"
device = "cpu"
[[node]]
name = "w1"
role = "worker"
address = "127.0.0.1:3"
device = "cpu"
)";

// Exits the process (77: the shared model is missing; 1: it does not load).
[[noreturn]] inline void FuzzSetupFailed(const char* who, const std::string& why, int code) {
  std::fprintf(stderr, "%s: %s\n", who, why.c_str());
  std::exit(code);
}

inline std::string FuzzSharedModel(const char* who, const char* name) {
  const std::string dir = std::string(ODMOE_FUZZ_SHARED_DIR) + "/models/" + name;
  if (!std::filesystem::exists(dir + "/config.json")) {
    FuzzSetupFailed(who, "needs " + dir + " (the shared models folder); skipping", 77);
  }
  // Invalid UTF-8 in a request's string field makes protobuf log an error per input; only the result matters.
  google::protobuf::SetLogHandler(nullptr);
  return dir;
}

inline ClusterConfig FuzzClusterConfig(const char* who) {
  absl::StatusOr<ClusterConfig> cluster = ParseClusterConfig(kFuzzCluster, "fuzz.toml", "/");
  if (!cluster.ok()) FuzzSetupFailed(who, cluster.status().ToString(), 1);
  return *std::move(cluster);
}

// Worker w0 of mixtral-tiny, at most 8 rows per call (the fuzzers are after validation, not arithmetic). It lives
// as long as the process.
inline WorkerNode* FuzzWorker(const char* who) {
  const std::string dir = FuzzSharedModel(who, "mixtral-tiny");
  const ClusterConfig cluster = FuzzClusterConfig(who);
  WorkerOptions options;
  options.max_rows_per_call = 8;
  options.share_host_experts = false;  // no /dev/shm segment left behind by a fuzzing process
  const NodeConfig& self = *cluster.Find("w0");
  absl::StatusOr<std::unique_ptr<Device>> device = CreateDevice(self.device, self.gpu_budget_bytes);
  if (!device.ok()) FuzzSetupFailed(who, device.status().ToString(), 1);
  absl::StatusOr<std::unique_ptr<WorkerNode>> node =
      WorkerNode::Create(cluster, self, dir, std::move(device).value(), options);
  if (!node.ok()) FuzzSetupFailed(who, node.status().ToString(), 1);
  return node->release();
}

// The main node of demo-mixtral-kjv. It lives as long as the process.
inline MainNode* FuzzMain(const char* who) {
  rpc::DaemonArgs args;
  args.model_dir = FuzzSharedModel(who, "demo-mixtral-kjv");
  args.cluster = FuzzClusterConfig(who);
  args.self = *args.cluster.Find("main");
  absl::StatusOr<std::unique_ptr<MainNode>> node = MainNode::Create(args);
  if (!node.ok()) FuzzSetupFailed(who, node.status().ToString(), 1);
  return node->release();
}

// A shadow of mixtral-tiny with an INT8 replica (a cluster of main, shadow and two workers that nothing dials).
// It lives as long as the process.
inline ShadowNode* FuzzShadow(const char* who) {
  const std::string dir = FuzzSharedModel(who, "mixtral-tiny");
  const std::string toml = std::string(kFuzzCluster) +
                           "[[node]]\nname = \"shadow\"\nrole = \"shadow\"\naddress = \"127.0.0.1:4\"\n"
                           "device = \"cpu\"\n[shadow]\nquant = \"int8\"\n";
  absl::StatusOr<ClusterConfig> cluster = ParseClusterConfig(toml, "fuzz.toml", "/");
  if (!cluster.ok()) FuzzSetupFailed(who, cluster.status().ToString(), 1);
  absl::StatusOr<std::unique_ptr<ShadowNode>> node = ShadowNode::Create({*cluster, *cluster->shadow(), dir});
  if (!node.ok()) FuzzSetupFailed(who, node.status().ToString(), 1);
  return node->release();
}

}  // namespace odmoe::fuzz
