// Metrics in the Prometheus text exposition format (version 0.0.4): counters, gauges and histograms with
// labels, kept in a Registry that renders them for a scrape.
//
// Two ways to feed a registry:
//  - instruments, updated as events happen (Counter::Add, Gauge::Set, Histogram::Observe): lock-free atomics
//    on the hot path; a labelled family finds (or makes) its child under a short lock, so a caller that updates
//    one series often keeps the reference With() returns;
//  - collectors, called at every scrape, that read counters a daemon already keeps (its GetStats counters) and
//    emit them as families, so nothing is counted twice.
//
// Conventions (checked when a family is added, a programming error otherwise): names match
// [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]* and do not start with "__"; a counter's name ends
// in "_total"; a histogram has no label "le" and strictly increasing finite bucket bounds. Every sample of a
// registry carries its constant labels (e.g. model and node) before its own.
//
// Thread safety: everything here may be used from any thread; a registry, its families and their children live
// as long as the registry (references stay valid). Collectors run on the scraping thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace odmoe::metrics {

enum class MetricType { kCounter, kGauge, kHistogram, kSummary };
std::string_view MetricTypeName(MetricType type);  // "counter", "gauge", "histogram", "summary"

using Labels = std::vector<std::pair<std::string, std::string>>;  // (name, value), in rendering order

// One series of a family as it is rendered.
struct Sample {
  Labels labels;
  double value = 0;  // counter, gauge
  // Histogram: (upper bound, cumulative count) per bucket, ascending, the last one +Inf (its count = count).
  std::vector<std::pair<double, uint64_t>> buckets;
  double sum = 0;      // histogram, summary
  uint64_t count = 0;  // histogram, summary
};

// A family as it is rendered: one HELP, one TYPE, its samples.
struct MetricFamily {
  std::string name;
  std::string help;
  MetricType type = MetricType::kGauge;
  std::vector<Sample> samples;
};

// The text format of `families`, each sample's labels preceded by `const_labels`. Label values escape
// backslash, double quote and newline; HELP text escapes backslash and newline.
std::string RenderText(std::span<const MetricFamily> families, const Labels& const_labels = {});

// Formats a sample value: the shortest text that reads back as the same double; "+Inf", "-Inf", "NaN".
std::string FormatValue(double value);
std::string EscapeLabelValue(std::string_view value);
std::string EscapeHelp(std::string_view help);
bool IsValidMetricName(std::string_view name);
bool IsValidLabelName(std::string_view name);

class Counter {
 public:
  // REQUIRES: delta >= 0 (a counter only goes up).
  void Add(double delta = 1);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta) { value_.fetch_add(delta, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  // `bounds`: the buckets' upper bounds, strictly increasing and finite (+Inf is implied).
  explicit Histogram(std::vector<double> bounds);
  // Counts `value` in the first bucket whose bound is >= value (NaN in +Inf only) and adds it to the sum.
  void Observe(double value);
  // Buckets (cumulative), sum and count; count is the +Inf bucket's.
  void Snapshot(Sample* out) const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket (not cumulative); bounds_.size() + 1
  std::atomic<double> sum_{0};
};

// Bucket bounds for latencies in seconds, from 1 ms to 10 minutes.
std::vector<double> LatencyBuckets();
// Bucket bounds for short operations in seconds (an expert load or computation): 50 us to 10 s.
std::vector<double> ShortLatencyBuckets();

// A family of one kind of metric: its children, one per label value set.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type, std::vector<std::string> label_names);
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  // Whether it was added with this help, type and label names (what a shared family must match).
  bool Matches(std::string_view help, MetricType type, const std::vector<std::string>& label_names) const {
    return help == help_ && type == type_ && label_names == label_names_;
  }
  // The family with every child's sample, children in label-value order.
  virtual MetricFamily Collect() const = 0;

 protected:
  // The family without samples, and a sample's labels for child `values`.
  MetricFamily Header() const;
  Labels LabelsOf(const std::vector<std::string>& values) const;
  void CheckLabelCount(size_t n) const;  // aborts unless n == the number of label names

  const std::string name_, help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

// Fills a sample's value (or buckets) from an instrument.
void SampleOf(const Counter& c, Sample* out);
void SampleOf(const Gauge& g, Sample* out);
void SampleOf(const Histogram& h, Sample* out);

template <typename Metric>
class Family final : public FamilyBase {
 public:
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
         std::function<std::unique_ptr<Metric>()> make)
      : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)), make_(std::move(make)) {}
  // The child of these label values (in the order of the family's label names), made on first use.
  // REQUIRES: values.size() == the number of label names.
  Metric& With(const std::vector<std::string>& values) {
    CheckLabelCount(values.size());
    absl::MutexLock lock(&mu_);
    std::unique_ptr<Metric>& child = children_[values];
    if (child == nullptr) child = make_();
    return *child;
  }
  MetricFamily Collect() const override {
    MetricFamily f = Header();
    absl::MutexLock lock(&mu_);
    for (const auto& [values, child] : children_) {
      Sample s;
      s.labels = LabelsOf(values);
      SampleOf(*child, &s);
      f.samples.push_back(std::move(s));
    }
    return f;
  }

 private:
  const std::function<std::unique_ptr<Metric>()> make_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_ ABSL_GUARDED_BY(mu_);
};

class Registry {
 public:
  // `const_labels` go on every sample (before the sample's own labels).
  explicit Registry(Labels const_labels = {});
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Adds a family; with no label names its one child exists at once (rendered as 0 before any event).
  // REQUIRES: valid, unused names (see the file comment).
  Family<Counter>& AddCounter(const std::string& name, const std::string& help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help, std::vector<std::string> label_names = {});
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                  std::vector<std::string> label_names = {});
  // The family that an earlier call with the same arguments added, else a new one: for series that several
  // owners of one registry fill under one name, each with its own label values (e.g. each HTTP server of a
  // daemon, labelled by server). REQUIRES: `name` unused by any other family.
  Family<Counter>& SharedCounter(const std::string& name, const std::string& help,
                                 std::vector<std::string> label_names);
  Family<Gauge>& SharedGauge(const std::string& name, const std::string& help, std::vector<std::string> label_names);
  // `collect` appends families (read at scrape time) to its argument; their names must not clash with
  // another family's.
  void AddCollector(std::function<void(std::vector<MetricFamily>*)> collect);

  // Every family: the instruments in the order they were added, then each collector's.
  std::vector<MetricFamily> Collect() const;
  // Collect() in the text format.
  std::string Render() const;
  const Labels& const_labels() const { return const_labels_; }

 private:
  // `shared`: return a matching family of that name added before (SharedCounter, SharedGauge).
  template <typename Metric>
  Family<Metric>& Add(const std::string& name, const std::string& help, MetricType type,
                      std::vector<std::string> label_names, std::function<std::unique_ptr<Metric>()> make,
                      bool shared = false);

  const Labels const_labels_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> shared_names_ ABSL_GUARDED_BY(mu_);  // families added by SharedCounter/SharedGauge
  std::vector<std::function<void(std::vector<MetricFamily>*)>> collectors_ ABSL_GUARDED_BY(mu_);
};

// A collector's helper: a family of `type` with one unlabelled (or `labels`) sample of `value`.
MetricFamily SingleSample(std::string name, std::string help, MetricType type, double value, Labels labels = {});

}  // namespace odmoe::metrics
