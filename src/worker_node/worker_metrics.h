// WorkerMetrics: what a worker exposes at /metrics (src/common/metrics.h, src/rpc/metrics_server.h).
//
// Per event (one call where it happens): each expert load by layer and reason, the time of each load and of each
// expert computation (histograms). At scrape time (AppendWorkerFamilies): the counters GetStats already keeps
// (WorkerCounters, ResidencyCounts, since start: a GetStats reset does not lower them) and the device memory
// against the budget, so nothing is counted twice.
//
// Thread safety: every method may be called from any thread (the instruments are atomics).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "src/backend/device.h"
#include "src/common/metrics.h"
#include "src/worker_node/residency.h"
#include "src/worker_node/worker_counters.h"

namespace odmoe {

// Why an expert is copied to the device: a prediction (Prefetch), or a computation that found it missing
// (on demand; loads started as the call was staged are on demand too).
enum class LoadReason { kPrefetch, kOnDemand };

class WorkerMetrics {
 public:
  // `const_labels`: rpc::DaemonMetricLabels (model, node).
  explicit WorkerMetrics(metrics::Labels const_labels);

  // A load of expert (`layer`, *) for `reason` started; `ms` is its whole time when already known (a
  // synchronous load), else it comes later through LoadTime.
  void Load(int64_t layer, LoadReason reason, std::optional<double> ms);
  void LoadTime(LoadReason reason, double ms);
  // One expert computed over its rows in `ms` (the copy of its outputs back included).
  void Computed(double ms);

  metrics::Registry& registry() { return registry_; }

 private:
  metrics::Registry registry_;
  metrics::Family<metrics::Counter>& loads_;  // {layer, reason}
  metrics::Histogram* load_seconds_[2];       // by LoadReason
  metrics::Histogram& compute_seconds_;
};

// What a worker knows at scrape time.
struct WorkerSnapshot {
  WorkerCounters counters;  // totals since start
  ResidencyCounts residency;
  int64_t resident_experts = 0;  // entries loading, ready or in use now
  MemoryInfo memory;             // the device's allocations now and at peak
  uint64_t budget_bytes = 0;     // the GPU budget (0: none)
  uint64_t host_expert_bytes = 0;
};
// The scrape-time families of a worker (odmoe_worker_*, and odmoe_gpu_memory_* as every daemon has them).
void AppendWorkerFamilies(const WorkerSnapshot& s, std::vector<metrics::MetricFamily>* out);

}  // namespace odmoe
