// WorkerMetrics without a worker: loads by layer and reason, their times, and the scrape-time families of the
// worker's counters.
#include "src/worker_node/worker_metrics.h"

#include "gtest/gtest.h"

namespace odmoe {
namespace {

double ValueOf(const std::string& text, const std::string& line_prefix) {
  const size_t at = text.find("\n" + line_prefix + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + line_prefix.size() + 2));
}

TEST(WorkerMetricsTest, LoadsByLayerAndReasonWithTheirTimes) {
  WorkerMetrics m(metrics::Labels{{"node", "w1"}});
  m.Load(3, LoadReason::kPrefetch, 2.0);
  m.Load(3, LoadReason::kPrefetch, 4.0);
  m.Load(5, LoadReason::kOnDemand, std::nullopt);  // staged: its time comes when it is used
  m.LoadTime(LoadReason::kOnDemand, 8.0);
  m.Computed(0.5);
  const std::string text = m.registry().Render();
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_loads_total{node=\"w1\",layer=\"3\",reason=\"prefetch\"}"), 2);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_loads_total{node=\"w1\",layer=\"5\",reason=\"on_demand\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_load_seconds_count{node=\"w1\",reason=\"prefetch\"}"), 2);
  EXPECT_DOUBLE_EQ(ValueOf(text, "odmoe_worker_expert_load_seconds_sum{node=\"w1\",reason=\"prefetch\"}"), 0.006);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_load_seconds_count{node=\"w1\",reason=\"on_demand\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_load_seconds_bucket{node=\"w1\",reason=\"on_demand\",le=\"0.005\"}"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_load_seconds_bucket{node=\"w1\",reason=\"on_demand\",le=\"0.01\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_compute_seconds_count{node=\"w1\"}"), 1);
}

TEST(WorkerMetricsTest, TheCountersAtScrapeTime) {
  WorkerSnapshot s;
  s.counters.bytes_loaded = 4096;
  s.counters.loads_on_demand = 3;
  s.counters.experts_computed = 9;
  s.counters.rows_computed = 20;
  s.residency.evictions = 8;
  s.residency.prefetches_late = 2;
  s.resident_experts = 1;
  s.memory = {.capacity = 0, .in_use = 100, .peak = 300};
  s.budget_bytes = 1000;
  std::vector<metrics::MetricFamily> families;
  AppendWorkerFamilies(s, &families);
  const std::string text = "\n" + metrics::RenderText(families);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_bytes_loaded_total"), 4096);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_on_demand_loads_total"), 3);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_experts_computed_total"), 9);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_rows_computed_total"), 20);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_expert_evictions_total"), 8);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_prefetches_late_total"), 2);
  EXPECT_EQ(ValueOf(text, "odmoe_worker_resident_experts"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_gpu_memory_used_bytes"), 100);
  EXPECT_EQ(ValueOf(text, "odmoe_gpu_memory_peak_bytes"), 300);
  EXPECT_EQ(ValueOf(text, "odmoe_gpu_memory_budget_bytes"), 1000);
}

TEST(WorkerMetricsTest, CountersKeepGoingUpAcrossAStatsReset) {
  WorkerCounterSet set;
  set.Add({.loads = 2, .bytes_loaded = 10});
  EXPECT_EQ(set.Read(/*reset=*/true).loads, 2u);
  set.Add({.loads = 1, .bytes_loaded = 5});
  EXPECT_EQ(set.Read(/*reset=*/false).loads, 1u);  // GetStats: since the reset
  const WorkerCounters totals = set.Totals();      // metrics: since start
  EXPECT_EQ(totals.loads, 3u);
  EXPECT_EQ(totals.bytes_loaded, 15u);
}

}  // namespace
}  // namespace odmoe
