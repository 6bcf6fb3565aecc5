// The Prometheus text exposition of src/common/metrics.h: escaping, histogram buckets, label sets, collectors.
#include "src/common/metrics.h"

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace odmoe::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsTest, FormatsValuesAsPrometheusReadsThem) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(3), "3");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(-1.5), "-1.5");
  EXPECT_EQ(FormatValue(1e300), "1e+300");
  EXPECT_EQ(FormatValue(HUGE_VAL), "+Inf");
  EXPECT_EQ(FormatValue(-HUGE_VAL), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  EXPECT_EQ(std::stod(FormatValue(0.1 + 0.2)), 0.1 + 0.2);  // round-trips
}

TEST(MetricsTest, EscapesLabelValuesAndHelp) {
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeLabelValue("plain {x=1}"), "plain {x=1}");
  // HELP escapes backslash and newline, not the double quote.
  EXPECT_EQ(EscapeHelp("line 1\nC:\\dir \"q\""), "line 1\\nC:\\\\dir \"q\"");
}

TEST(MetricsTest, ChecksNames) {
  EXPECT_TRUE(IsValidMetricName("odmoe_requests_total"));
  EXPECT_TRUE(IsValidMetricName("vllm:ttft"));
  EXPECT_FALSE(IsValidMetricName("1abc"));
  EXPECT_FALSE(IsValidMetricName("a-b"));
  EXPECT_FALSE(IsValidMetricName(""));
  EXPECT_TRUE(IsValidLabelName("outcome"));
  EXPECT_FALSE(IsValidLabelName("a:b"));
  EXPECT_FALSE(IsValidLabelName("__reserved"));
  EXPECT_FALSE(IsValidLabelName("9x"));
}

TEST(MetricsTest, RendersCountersAndGaugesWithConstantAndOwnLabels) {
  Registry r(Labels{{"model", "demo \"kjv\""}, {"node", "w0"}});
  Family<Counter>& requests = r.AddCounter("odmoe_requests_total", "Requests by outcome.", {"outcome"});
  requests.With({"ok"}).Add();
  requests.With({"ok"}).Add(2);
  requests.With({"error"}).Add();
  r.AddGauge("odmoe_queue", "Waiting.\nNow.").With({}).Set(4);
  EXPECT_EQ(r.Render(),
            "# HELP odmoe_requests_total Requests by outcome.\n"
            "# TYPE odmoe_requests_total counter\n"
            "odmoe_requests_total{model=\"demo \\\"kjv\\\"\",node=\"w0\",outcome=\"error\"} 1\n"
            "odmoe_requests_total{model=\"demo \\\"kjv\\\"\",node=\"w0\",outcome=\"ok\"} 3\n"
            "# HELP odmoe_queue Waiting.\\nNow.\n"
            "# TYPE odmoe_queue gauge\n"
            "odmoe_queue{model=\"demo \\\"kjv\\\"\",node=\"w0\"} 4\n");
}

TEST(MetricsTest, AnUnlabelledFamilyRendersZeroBeforeAnyEvent) {
  Registry r;
  r.AddCounter("x_total", "X.");
  EXPECT_THAT(r.Render(), HasSubstr("\nx_total 0\n"));
}

TEST(MetricsTest, LabelledChildrenAreSeparateSeries) {
  Registry r;
  Family<Counter>& loads = r.AddCounter("loads_total", "Loads.", {"layer", "reason"});
  loads.With({"1", "prefetch"}).Add();
  loads.With({"1", "on_demand"}).Add(5);
  loads.With({"10", "prefetch"}).Add(2);
  EXPECT_EQ(&loads.With({"1", "prefetch"}), &loads.With({"1", "prefetch"}));  // the same child
  const std::string text = r.Render();
  EXPECT_THAT(text, HasSubstr("loads_total{layer=\"1\",reason=\"prefetch\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("loads_total{layer=\"1\",reason=\"on_demand\"} 5\n"));
  EXPECT_THAT(text, HasSubstr("loads_total{layer=\"10\",reason=\"prefetch\"} 2\n"));
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  Registry r(Labels{{"node", "m"}});
  Histogram& h = r.AddHistogram("ttft_seconds", "TTFT.", {0.1, 0.5, 1}).With({});
  for (double v : {0.05, 0.1, 0.3, 0.7, 2.0, 3.0}) h.Observe(v);
  EXPECT_EQ(r.Render(),
            "# HELP ttft_seconds TTFT.\n"
            "# TYPE ttft_seconds histogram\n"
            "ttft_seconds_bucket{node=\"m\",le=\"0.1\"} 2\n"  // 0.1 falls in le="0.1" (upper bound inclusive)
            "ttft_seconds_bucket{node=\"m\",le=\"0.5\"} 3\n"
            "ttft_seconds_bucket{node=\"m\",le=\"1\"} 4\n"
            "ttft_seconds_bucket{node=\"m\",le=\"+Inf\"} 6\n"
            "ttft_seconds_sum{node=\"m\"} 6.15\n"
            "ttft_seconds_count{node=\"m\"} 6\n");
}

TEST(MetricsTest, LabelledHistogramPutsLeLast) {
  Registry r;
  r.AddHistogram("load_seconds", "Loads.", {1}, {"reason"}).With({"a\"b"}).Observe(0.5);
  EXPECT_THAT(r.Render(), HasSubstr("load_seconds_bucket{reason=\"a\\\"b\",le=\"1\"} 1\n"));
  EXPECT_THAT(r.Render(), HasSubstr("load_seconds_count{reason=\"a\\\"b\"} 1\n"));
}

TEST(MetricsTest, NanGoesToTheInfBucketOnly) {
  Histogram h({1, 2});
  h.Observe(std::nan(""));
  Sample s;
  h.Snapshot(&s);
  ASSERT_EQ(s.buckets.size(), 3u);
  EXPECT_EQ(s.buckets[0].second, 0u);
  EXPECT_EQ(s.buckets[1].second, 0u);
  EXPECT_EQ(s.buckets[2].second, 1u);
  EXPECT_EQ(s.count, 1u);
}

TEST(MetricsTest, CollectorsAddFamiliesAtScrapeTime) {
  Registry r(Labels{{"node", "s"}});
  double seen = 1;
  r.AddCollector([&seen](std::vector<MetricFamily>* out) {
    out->push_back(SingleSample("bytes_total", "Bytes.", MetricType::kCounter, seen));
    MetricFamily lead{"lead_layers", "Lead.", MetricType::kSummary, {}};
    Sample s;
    s.sum = 7;
    s.count = 2;
    lead.samples.push_back(s);
    out->push_back(lead);
  });
  EXPECT_THAT(r.Render(), HasSubstr("bytes_total{node=\"s\"} 1\n"));
  seen = 42;
  const std::string text = r.Render();
  EXPECT_THAT(text, HasSubstr("bytes_total{node=\"s\"} 42\n"));
  EXPECT_THAT(
      text, HasSubstr("# TYPE lead_layers summary\nlead_layers_sum{node=\"s\"} 7\nlead_layers_count{node=\"s\"} 2\n"));
}

TEST(MetricsTest, FamiliesWithoutChildrenRenderOnlyTheirHeader) {
  Registry r;
  r.AddGauge("up", "Up.", {"worker"});
  EXPECT_EQ(r.Render(), "# HELP up Up.\n# TYPE up gauge\n");
  EXPECT_THAT(r.Render(), Not(HasSubstr("up{")));
}

TEST(MetricsTest, ConcurrentUpdatesAreAllCounted) {
  Registry r;
  Family<Counter>& c = r.AddCounter("n_total", "N.", {"t"});
  Histogram& h = r.AddHistogram("h_seconds", "H.", {0.5}).With({});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) {
        c.With({t % 2 == 0 ? "even" : "odd"}).Add();
        h.Observe(i % 2 == 0 ? 0.25 : 1.0);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.With({"even"}).value(), 20000);
  EXPECT_EQ(c.With({"odd"}).value(), 20000);
  Sample s;
  h.Snapshot(&s);
  EXPECT_EQ(s.count, 40000u);
  EXPECT_EQ(s.buckets[0].second, 20000u);
  EXPECT_DOUBLE_EQ(s.sum, 20000 * 0.25 + 20000 * 1.0);
}

TEST(MetricsDeathTest, RejectsNamesThatBreakTheConventions) {
  Registry r;
  EXPECT_DEATH(r.AddCounter("requests", "no _total"), "_total");
  EXPECT_DEATH(r.AddGauge("bad-name", "x"), "invalid metric name");
  EXPECT_DEATH(r.AddHistogram("h", "x", {1}, {"le"}), "le");
  EXPECT_DEATH(r.AddHistogram("h2", "x", {2, 1}), "CHECK failed");
  r.AddGauge("g", "x", {"a"});
  EXPECT_DEATH(r.AddGauge("g", "x"), "added twice");
  EXPECT_DEATH(r.AddGauge("g3", "x", {"a"}).With({"1", "2"}), "wrong number of label values");
  // A shared family is shared only with the same help, type and labels, and never with one added alone.
  r.SharedGauge("s", "x", {"a"});
  EXPECT_DEATH(r.SharedGauge("s", "y", {"a"}), "shared with another");
  EXPECT_DEATH(r.SharedGauge("s", "x", {"b"}), "shared with another");
  r.SharedGauge("t_total", "x", {"a"});
  EXPECT_DEATH(r.SharedCounter("t_total", "x", {"a"}), "shared with another");
  EXPECT_DEATH(r.SharedGauge("g", "x", {"a"}), "added twice");
  EXPECT_DEATH(r.AddGauge("s", "x", {"a"}), "added twice");
}

TEST(MetricsTest, SharedFamiliesRenderOnceWithEveryOwnersSeries) {
  Registry r(Labels{{"node", "main"}});
  r.SharedGauge("odmoe_http_connections", "Connections.", {"server"}).With({"api"}).Set(3);
  r.SharedGauge("odmoe_http_connections", "Connections.", {"server"}).With({"metrics"}).Set(1);
  r.SharedCounter("c_total", "C.", {"server"}).With({"api"}).Add(2);
  Family<Counter>& again = r.SharedCounter("c_total", "C.", {"server"});
  EXPECT_EQ(again.With({"api"}).value(), 2);
  const std::string text = r.Render();
  EXPECT_EQ(text.find("# TYPE odmoe_http_connections gauge"), text.rfind("# TYPE odmoe_http_connections gauge"));
  EXPECT_NE(text.find("odmoe_http_connections{node=\"main\",server=\"api\"} 3"), std::string::npos) << text;
  EXPECT_NE(text.find("odmoe_http_connections{node=\"main\",server=\"metrics\"} 1"), std::string::npos) << text;
}

}  // namespace
}  // namespace odmoe::metrics
