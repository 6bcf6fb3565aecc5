#include "src/worker_node/worker_counters.h"

#include <algorithm>

namespace odmoe {

void WorkerCounters::Add(const WorkerCounters& o) {
  experts_computed += o.experts_computed;
  rows_computed += o.rows_computed;
  loads += o.loads;
  loads_on_demand += o.loads_on_demand;
  loads_ahead += o.loads_ahead;
  prefetches += o.prefetches;
  hedge_loads += o.hedge_loads;
  bytes_loaded += o.bytes_loaded;
  load_ms_total += o.load_ms_total;
  on_demand_load_ms_total += o.on_demand_load_ms_total;
  compute_ms_total += o.compute_ms_total;
  evictions += o.evictions;
  prefetches_late += o.prefetches_late;
  prefetches_unused += o.prefetches_unused;
  experts_kept += o.experts_kept;
  calls_in_flight_peak = std::max(calls_in_flight_peak, o.calls_in_flight_peak);
}

void WorkerCounters::Add(const ResidencyCounts& r) {
  evictions += r.evictions;
  prefetches_late += r.prefetches_late;
  prefetches_unused += r.prefetches_unused;
  experts_kept += r.experts_kept;
}

void WorkerCounters::ToProto(v1::WorkerStats* s) const {
  s->set_experts_computed(experts_computed);
  s->set_rows_computed(rows_computed);
  s->set_loads(loads);
  s->set_loads_on_demand(loads_on_demand);
  s->set_loads_ahead(loads_ahead);
  s->set_prefetches(prefetches);
  s->set_hedge_loads(hedge_loads);
  s->set_bytes_loaded(bytes_loaded);
  s->set_load_ms_total(load_ms_total);
  s->set_on_demand_load_ms_total(on_demand_load_ms_total);
  s->set_compute_ms_total(compute_ms_total);
  s->set_evictions(evictions);
  s->set_prefetches_late(prefetches_late);
  s->set_prefetches_unused(prefetches_unused);
  s->set_experts_kept(experts_kept);
  s->set_calls_in_flight_peak(calls_in_flight_peak);
}

void WorkerCounterSet::Add(const WorkerCounters& delta) {
  absl::MutexLock lock(&mu_);
  counters_.Add(delta);
}

void WorkerCounterSet::CallStarted() {
  absl::MutexLock lock(&mu_);
  calls_in_flight_ += 1;
  counters_.calls_in_flight_peak = std::max(counters_.calls_in_flight_peak, static_cast<uint64_t>(calls_in_flight_));
}

void WorkerCounterSet::CallEnded() {
  absl::MutexLock lock(&mu_);
  calls_in_flight_ -= 1;
}

WorkerCounters WorkerCounterSet::Read(bool reset) {
  absl::MutexLock lock(&mu_);
  const WorkerCounters c = counters_;
  if (reset) {
    reset_.Add(counters_);
    counters_ = WorkerCounters{};
  }
  return c;
}

WorkerCounters WorkerCounterSet::Totals() {
  absl::MutexLock lock(&mu_);
  WorkerCounters c = reset_;
  c.Add(counters_);
  return c;
}

}  // namespace odmoe
