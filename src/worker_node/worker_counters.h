// WorkerCounters: what a worker has done since it started (or since the last reset), as reported by GetStats.
// A plain struct that adds itself (Add, as leveldb's CompactionStats) and converts to its proto in one place;
// WorkerCounterSet is its thread-safe holder.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "odmoe/v1/worker.pb.h"
#include "src/worker_node/residency.h"

namespace odmoe {

struct WorkerCounters {
  uint64_t experts_computed = 0;  // (expert, call) pairs computed
  uint64_t rows_computed = 0;
  uint64_t loads = 0;            // experts copied host-to-device
  uint64_t loads_on_demand = 0;  // of which for a computation (not predicted)
  uint64_t loads_ahead = 0;      // of those, started as the call was staged
  uint64_t prefetches = 0;       // of `loads`, predicted
  uint64_t hedge_loads = 0;      // of `prefetches`, hedged experts (PrefetchRequest.hedge)
  uint64_t bytes_loaded = 0;
  double load_ms_total = 0;
  double on_demand_load_ms_total = 0;
  double compute_ms_total = 0;
  uint64_t evictions = 0;
  uint64_t prefetches_late = 0;
  uint64_t prefetches_unused = 0;
  uint64_t experts_kept = 0;
  uint64_t calls_in_flight_peak = 0;  // a peak: Add keeps the larger

  void Add(const WorkerCounters& other);
  void Add(const ResidencyCounts& residency);
  // Sets the counter fields of `stats` (the rest is the caller's).
  void ToProto(v1::WorkerStats* stats) const;
};

// WorkerCounters behind a mutex, and the number of calls in flight now.
class WorkerCounterSet {
 public:
  void Add(const WorkerCounters& delta);
  // A ComputeExperts call arrived / was answered (calls_in_flight_peak follows).
  void CallStarted();
  void CallEnded();
  // The counters; `reset` zeroes them after reading.
  WorkerCounters Read(bool reset);
  // The counters since start, whatever was reset (the metrics' counters only go up).
  WorkerCounters Totals();

 private:
  absl::Mutex mu_;
  WorkerCounters counters_ ABSL_GUARDED_BY(mu_);
  WorkerCounters reset_ ABSL_GUARDED_BY(mu_);  // what Read(true) zeroed, summed
  int64_t calls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace odmoe
