#include "src/common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <set>

#include "src/common/status.h"

namespace odmoe::metrics {
namespace {

bool IsNameChar(char c, bool first, bool colon) {
  const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
  return letter || (!first && c >= '0' && c <= '9');
}

bool IsValidName(std::string_view name, bool colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!IsNameChar(name[i], i == 0, colon)) return false;
  }
  return true;
}

// Aborts with a message naming the metric: a bad name or label set is a programming error.
void Require(bool ok, std::string_view name, std::string_view problem) {
  if (ok) return;
  std::fprintf(stderr, "metric '%.*s': %.*s\n", static_cast<int>(name.size()), name.data(),
               static_cast<int>(problem.size()), problem.data());
  ODMOE_CHECK(ok);
}

void CheckFamily(const std::string& name, MetricType type, const std::vector<std::string>& label_names) {
  Require(IsValidMetricName(name), name, "invalid metric name");
  Require(type != MetricType::kCounter || (name.size() > 6 && name.ends_with("_total")), name,
          "a counter's name ends in _total");
  std::set<std::string> seen;
  for (const std::string& l : label_names) {
    Require(IsValidLabelName(l), name, "invalid label name");
    Require(seen.insert(l).second, name, "a label name given twice");
    Require(type != MetricType::kHistogram || l != "le", name, "a histogram cannot have a label 'le'");
    Require(type != MetricType::kSummary || l != "quantile", name, "a summary cannot have a label 'quantile'");
  }
}

void AppendLabels(const Labels& const_labels, const Labels& labels, const char* extra_name, const std::string& extra,
                  std::string* out) {
  if (const_labels.empty() && labels.empty() && extra_name == nullptr) return;
  out->push_back('{');
  bool first = true;
  auto one = [&](std::string_view name, std::string_view value) {
    if (!first) out->push_back(',');
    first = false;
    out->append(name);
    out->append("=\"");
    out->append(EscapeLabelValue(value));
    out->push_back('"');
  };
  for (const auto& [n, v] : const_labels) one(n, v);
  for (const auto& [n, v] : labels) one(n, v);
  if (extra_name != nullptr) one(extra_name, extra);
  out->push_back('}');
}

void AppendLine(std::string_view name, std::string_view suffix, const Labels& const_labels, const Labels& labels,
                const char* extra_name, const std::string& extra, double value, std::string* out) {
  out->append(name);
  out->append(suffix);
  AppendLabels(const_labels, labels, extra_name, extra, out);
  out->push_back(' ');
  out->append(FormatValue(value));
  out->push_back('\n');
}

}  // namespace

std::string_view MetricTypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
    case MetricType::kSummary:
      return "summary";
  }
  return "untyped";
}

bool IsValidMetricName(std::string_view name) { return IsValidName(name, /*colon=*/true); }

bool IsValidLabelName(std::string_view name) { return IsValidName(name, /*colon=*/false) && !name.starts_with("__"); }

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, r.ptr);
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::string RenderText(std::span<const MetricFamily> families, const Labels& const_labels) {
  std::string out;
  for (const MetricFamily& f : families) {
    out += "# HELP " + f.name + " " + EscapeHelp(f.help) + "\n";
    out += "# TYPE " + f.name + " " + std::string(MetricTypeName(f.type)) + "\n";
    for (const Sample& s : f.samples) {
      switch (f.type) {
        case MetricType::kCounter:
        case MetricType::kGauge:
          AppendLine(f.name, "", const_labels, s.labels, nullptr, "", s.value, &out);
          break;
        case MetricType::kHistogram:
          for (const auto& [bound, count] : s.buckets) {
            AppendLine(f.name, "_bucket", const_labels, s.labels, "le", FormatValue(bound), static_cast<double>(count),
                       &out);
          }
          [[fallthrough]];
        case MetricType::kSummary:
          AppendLine(f.name, "_sum", const_labels, s.labels, nullptr, "", s.sum, &out);
          AppendLine(f.name, "_count", const_labels, s.labels, nullptr, "", static_cast<double>(s.count), &out);
          break;
      }
    }
  }
  return out;
}

void Counter::Add(double delta) {
  ODMOE_CHECK(delta >= 0);
  value_.fetch_add(delta, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    ODMOE_CHECK(std::isfinite(bounds_[i]));
    ODMOE_CHECK(i == 0 || bounds_[i - 1] < bounds_[i]);
  }
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  const size_t bucket =
      std::isnan(value)
          ? bounds_.size()
          : static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

void Histogram::Snapshot(Sample* out) const {
  out->buckets.clear();
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    out->buckets.emplace_back(i < bounds_.size() ? bounds_[i] : HUGE_VAL, cumulative);
  }
  out->count = cumulative;
  out->sum = sum_.load(std::memory_order_relaxed);
}

std::vector<double> LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
          1,     2.5,    5,     7.5,  10,    20,   40,    80,  160,  320, 600};
}

std::vector<double> ShortLatencyBuckets() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10};
}

FamilyBase::FamilyBase(std::string name, std::string help, MetricType type, std::vector<std::string> label_names)
    : name_(std::move(name)), help_(std::move(help)), type_(type), label_names_(std::move(label_names)) {
  CheckFamily(name_, type_, label_names_);
}

MetricFamily FamilyBase::Header() const { return MetricFamily{name_, help_, type_, {}}; }

Labels FamilyBase::LabelsOf(const std::vector<std::string>& values) const {
  Labels labels;
  for (size_t i = 0; i < values.size(); ++i) labels.emplace_back(label_names_[i], values[i]);
  return labels;
}

void FamilyBase::CheckLabelCount(size_t n) const {
  Require(n == label_names_.size(), name_, "wrong number of label values");
}

void SampleOf(const Counter& c, Sample* out) { out->value = c.value(); }
void SampleOf(const Gauge& g, Sample* out) { out->value = g.value(); }
void SampleOf(const Histogram& h, Sample* out) { h.Snapshot(out); }

Registry::Registry(Labels const_labels) : const_labels_(std::move(const_labels)) {
  for (const auto& [name, value] : const_labels_) Require(IsValidLabelName(name), name, "invalid constant label");
}

template <typename Metric>
Family<Metric>& Registry::Add(const std::string& name, const std::string& help, MetricType type,
                              std::vector<std::string> label_names, std::function<std::unique_ptr<Metric>()> make,
                              bool shared) {
  const bool unlabelled = label_names.empty();
  auto family = std::make_unique<Family<Metric>>(name, help, type, label_names, std::move(make));
  Family<Metric>& ref = *family;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& f : families_) {
      if (f->name() != name) continue;
      Require(shared && shared_names_.contains(name), name, "added twice");
      Require(f->Matches(help, type, label_names), name, "shared with another help, type or labels");
      return static_cast<Family<Metric>&>(*f);  // the same type, so the same Metric
    }
    if (shared) shared_names_.insert(name);
    families_.push_back(std::move(family));
  }
  if (unlabelled) ref.With({});
  return ref;
}

Family<Counter>& Registry::AddCounter(const std::string& name, const std::string& help,
                                      std::vector<std::string> label_names) {
  return Add<Counter>(name, help, MetricType::kCounter, std::move(label_names),
                      [] { return std::make_unique<Counter>(); });
}

Family<Gauge>& Registry::AddGauge(const std::string& name, const std::string& help,
                                  std::vector<std::string> label_names) {
  return Add<Gauge>(name, help, MetricType::kGauge, std::move(label_names), [] { return std::make_unique<Gauge>(); });
}

Family<Counter>& Registry::SharedCounter(const std::string& name, const std::string& help,
                                         std::vector<std::string> label_names) {
  return Add<Counter>(
      name, help, MetricType::kCounter, std::move(label_names), [] { return std::make_unique<Counter>(); },
      /*shared=*/true);
}

Family<Gauge>& Registry::SharedGauge(const std::string& name, const std::string& help,
                                     std::vector<std::string> label_names) {
  return Add<Gauge>(
      name, help, MetricType::kGauge, std::move(label_names), [] { return std::make_unique<Gauge>(); },
      /*shared=*/true);
}

Family<Histogram>& Registry::AddHistogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                          std::vector<std::string> label_names) {
  Histogram check(bounds);  // the bounds are checked once, here
  return Add<Histogram>(name, help, MetricType::kHistogram, std::move(label_names),
                        [bounds = std::move(bounds)] { return std::make_unique<Histogram>(bounds); });
}

void Registry::AddCollector(std::function<void(std::vector<MetricFamily>*)> collect) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collect));
}

std::vector<MetricFamily> Registry::Collect() const {
  std::vector<MetricFamily> out;
  absl::MutexLock lock(&mu_);
  for (const auto& f : families_) out.push_back(f->Collect());
  const size_t instruments = out.size();
  for (const auto& collect : collectors_) collect(&out);
  std::set<std::string> names;
  for (size_t i = 0; i < out.size(); ++i) {
    const MetricFamily& f = out[i];
    Require(names.insert(f.name).second, f.name, "two families of this name");
    if (i < instruments) continue;
    std::vector<std::string> label_names;
    if (!f.samples.empty()) {
      for (const auto& [n, v] : f.samples.front().labels) label_names.push_back(n);
    }
    CheckFamily(f.name, f.type, label_names);
  }
  return out;
}

std::string Registry::Render() const {
  const std::vector<MetricFamily> families = Collect();
  return RenderText(families, const_labels_);
}

MetricFamily SingleSample(std::string name, std::string help, MetricType type, double value, Labels labels) {
  MetricFamily f{std::move(name), std::move(help), type, {}};
  Sample s;
  s.labels = std::move(labels);
  s.value = value;
  f.samples.push_back(std::move(s));
  return f;
}

}  // namespace odmoe::metrics
