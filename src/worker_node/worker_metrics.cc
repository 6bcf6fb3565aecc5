#include "src/worker_node/worker_metrics.h"

#include <string>
#include <utility>

#include "src/rpc/metrics_server.h"

namespace odmoe {
namespace {

using metrics::MetricType;
using metrics::SingleSample;

const char* ReasonName(LoadReason reason) { return reason == LoadReason::kPrefetch ? "prefetch" : "on_demand"; }

}  // namespace

WorkerMetrics::WorkerMetrics(metrics::Labels const_labels)
    : registry_(std::move(const_labels)),
      loads_(registry_.AddCounter("odmoe_worker_expert_loads_total",
                                  "Experts copied host-to-device, by model layer and reason (prefetch: predicted; "
                                  "on_demand: a computation needed it and it was not resident).",
                                  {"layer", "reason"})),
      compute_seconds_(registry_
                           .AddHistogram("odmoe_worker_expert_compute_seconds",
                                         "Time to compute one expert over its rows, outputs copied back included.",
                                         metrics::ShortLatencyBuckets())
                           .With({})) {
  metrics::Family<metrics::Histogram>& load_seconds =
      registry_.AddHistogram("odmoe_worker_expert_load_seconds", "Time to load one expert to the device, by reason.",
                             metrics::ShortLatencyBuckets(), {"reason"});
  for (LoadReason r : {LoadReason::kPrefetch, LoadReason::kOnDemand}) {
    load_seconds_[static_cast<int>(r)] = &load_seconds.With({ReasonName(r)});
  }
  rpc::AddBuildInfo(registry_);
}

void WorkerMetrics::Load(int64_t layer, LoadReason reason, std::optional<double> ms) {
  loads_.With({std::to_string(layer), ReasonName(reason)}).Add();
  if (ms.has_value()) LoadTime(reason, *ms);
}

void WorkerMetrics::LoadTime(LoadReason reason, double ms) {
  load_seconds_[static_cast<int>(reason)]->Observe(ms / 1e3);
}

void WorkerMetrics::Computed(double ms) { compute_seconds_.Observe(ms / 1e3); }

void AppendWorkerFamilies(const WorkerSnapshot& s, std::vector<metrics::MetricFamily>* out) {
  const WorkerCounters& c = s.counters;
  auto counter = [out](const char* name, const char* help, double value) {
    out->push_back(SingleSample(name, help, MetricType::kCounter, value));
  };
  counter("odmoe_worker_expert_bytes_loaded_total", "Expert bytes copied host-to-device.",
          static_cast<double>(c.bytes_loaded));
  counter("odmoe_worker_on_demand_loads_total",
          "Experts loaded because a computation needed them and they were not resident (not predicted, or late).",
          static_cast<double>(c.loads_on_demand));
  counter("odmoe_worker_expert_evictions_total",
          "Experts freed from the device (after use, stale, evicted for room, or dropped): no expert cache.",
          static_cast<double>(s.residency.evictions));
  counter("odmoe_worker_prefetches_unused_total", "Prefetched experts freed without a computation using them.",
          static_cast<double>(s.residency.prefetches_unused));
  counter("odmoe_worker_prefetches_late_total",
          "Predictions refused because main had already asked for their (position, layer).",
          static_cast<double>(s.residency.prefetches_late));
  counter("odmoe_worker_hedge_loads_total",
          "Prefetched experts that were hedges (the shadow's (k+1)-th choice within [shadow] hedge_margin).",
          static_cast<double>(c.hedge_loads));
  counter("odmoe_worker_experts_computed_total", "(expert, call) pairs computed.",
          static_cast<double>(c.experts_computed));
  counter("odmoe_worker_rows_computed_total", "(token, expert) rows computed.", static_cast<double>(c.rows_computed));
  out->push_back(SingleSample("odmoe_worker_resident_experts",
                              "Experts on the device now (loading, ready or being computed).", MetricType::kGauge,
                              static_cast<double>(s.resident_experts)));
  out->push_back(SingleSample("odmoe_worker_host_expert_bytes",
                              "Bytes of the packed host copy of the experts this worker maps.", MetricType::kGauge,
                              static_cast<double>(s.host_expert_bytes)));
  rpc::AppendDeviceMemoryFamilies(s.memory, s.budget_bytes, out);
}

}  // namespace odmoe
