// MainMetrics without a cluster: a request's timeline moves the queue gauges and fills the latency histograms
// once per event; outcomes by status; a peer nobody serves is unreachable.
#include "src/main_node/main_metrics.h"

#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace odmoe {
namespace {

// The value of the sample `line_prefix` (a name with its labels, e.g. `x_total{outcome="ok"}`) in `text`.
double ValueOf(const std::string& text, const std::string& line_prefix) {
  const size_t at = text.find("\n" + line_prefix + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + line_prefix.size() + 2));
}

TEST(MainMetricsTest, ARequestTimelineCountsEachEventOnce) {
  MainMetrics m(metrics::Labels{{"node", "main"}}, {});
  MainMetrics::Request r = m.Arrived();
  r.Queued();
  std::string text = m.registry().Render();
  EXPECT_EQ(ValueOf(text, "odmoe_num_requests_waiting{node=\"main\"}"), 1);
  r.Started(7);
  for (int i = 0; i < 4; ++i) r.Token();
  text = m.registry().Render();
  EXPECT_EQ(ValueOf(text, "odmoe_num_requests_waiting{node=\"main\"}"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_num_requests_running{node=\"main\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_prompt_tokens_total{node=\"main\"}"), 7);
  EXPECT_EQ(ValueOf(text, "odmoe_generation_tokens_total{node=\"main\"}"), 4);
  EXPECT_EQ(ValueOf(text, "odmoe_request_queue_time_seconds_count{node=\"main\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_time_to_first_token_seconds_count{node=\"main\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_inter_token_latency_seconds_count{node=\"main\"}"), 3);
  EXPECT_EQ(ValueOf(text, "odmoe_e2e_request_latency_seconds_count{node=\"main\"}"), 0);
  r.Finished(absl::OkStatus());
  text = m.registry().Render();
  EXPECT_EQ(ValueOf(text, "odmoe_num_requests_running{node=\"main\"}"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_requests_total{node=\"main\",outcome=\"ok\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_requests_total{node=\"main\",outcome=\"error\"}"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_e2e_request_latency_seconds_count{node=\"main\"}"), 1);
}

TEST(MainMetricsTest, ARefusedRequestCountsItsOutcomeOnly) {
  MainMetrics m({}, {});
  m.Arrived().Finished(absl::InvalidArgumentError("the prompt is empty"));
  MainMetrics::Request failed = m.Arrived();
  failed.Queued();
  failed.Started(3);
  failed.Token();
  failed.Finished(absl::UnavailableError("worker w3 unreachable"));
  const std::string text = m.registry().Render();
  EXPECT_EQ(ValueOf(text, "odmoe_requests_total{outcome=\"invalid\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_requests_total{outcome=\"error\"}"), 1);
  EXPECT_EQ(ValueOf(text, "odmoe_requests_total{outcome=\"ok\"}"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_num_requests_running"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_num_requests_waiting"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_e2e_request_latency_seconds_count"), 0);  // ok requests only
  EXPECT_EQ(ValueOf(text, "odmoe_prompt_tokens_total"), 3);
}

TEST(MainMetricsTest, OutcomeOfEachStatus) {
  EXPECT_EQ(RequestOutcome(absl::OkStatus()), "ok");
  EXPECT_EQ(RequestOutcome(absl::CancelledError("")), "cancelled");
  EXPECT_EQ(RequestOutcome(absl::InvalidArgumentError("")), "invalid");
  EXPECT_EQ(RequestOutcome(absl::OutOfRangeError("")), "invalid");
  EXPECT_EQ(RequestOutcome(absl::FailedPreconditionError("")), "invalid");
  EXPECT_EQ(RequestOutcome(absl::UnavailableError("")), "error");
  EXPECT_EQ(RequestOutcome(absl::DeadlineExceededError("")), "error");
}

TEST(MainMetricsTest, APeerNobodyServesIsUnreachable) {
  const int port = odmoe::testing::PickFreePorts(1)[0];  // free: nothing listens there
  MainMetrics m({}, {{"w0", "worker", "127.0.0.1:" + std::to_string(port)},
                     {"shadow", "shadow", "127.0.0.1:" + std::to_string(port)}});
  const std::string text = m.registry().Render();
  EXPECT_EQ(ValueOf(text, "odmoe_worker_reachable{worker=\"w0\"}"), 0);
  EXPECT_EQ(ValueOf(text, "odmoe_shadow_reachable"), 0);
}

}  // namespace
}  // namespace odmoe
