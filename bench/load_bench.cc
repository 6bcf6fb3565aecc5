// odmoe-bench load: a bounded loopback load test of main's streaming Generate API (issue "Client API 2/2").
//
// For each N of --clients, one after another: N client threads start together and each sends
// --requests-per-client R streaming Generate requests one after another (greedy, --max-new-tokens M, EOS
// ignored by default so that every request generates M tokens). Request r of client c is request
// i = c + r * N of the run and takes prompt i mod (number of prompts): the N requests in flight at once differ
// while N <= the number of prompts. A main that serves one request at a time queues the others (its admission
// queue; those past [cluster] max_queued are refused busy), so the figures hold for that main and for one
// that batches.
//
// Per request (client side): TTFT from just before the send to the first message that carries a token, the
// tokens, the total time, and main's final stats (queue_ms, its own TTFT). Per N, one JSON line and a table
// row: total tokens / wall time from the first send to the last answer, per-client tokens/s (mean and min),
// TTFT p50 / p99 (nearest rank, successful requests), failures (with the first error; busy refusals counted
// apart), main's queue time, the requests' recall and timely recall (weighted by their decode positions), and the
// experts the workers loaded (on demand + prefetched: WorkerStats.loads,
// summed over the workers before and after the run) per generated token. --per-request adds one JSON line per
// request. At the end, the ratio of total tokens/s at the largest N to N = 1 when both ran.
//
// --api http sends the same requests through main's OpenAI API instead (/v1/completions, "stream": true, greedy):
// TTFT at the first event that carries a token, the tokens from the events' token_ids. Its answers hold none of
// main's stats, so queue time and recall are n/a; the workers' loads are still read.
//
// The cluster: --config FILE alone starts it (`odmoe cluster up`, once for the whole run) and stops it at the
// end; --endpoint HOST:PORT uses a running main (its gRPC address, or with --api http its http_address; with
// --config too, the file only gives the workers' addresses; without, the expert loads are n/a). One unrecorded
// warm-up request runs first.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <latch>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/benchmarks.h"
#include "httplib.h"
#include "src/cluster/client.h"
#include "src/common/cluster_config.h"
#include "src/common/flags.h"
#include "src/common/json.h"
#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe::bench {
namespace {

constexpr int64_t kMaxClients = 256;
constexpr int64_t kMaxRequestsPerClient = 1000;
constexpr int64_t kRequestTimeoutMs = 3600 * 1000;
constexpr int64_t kWarmUpTokens = 4;

enum class Api { kGrpc, kHttp };

// What every request of the run shares; constant while clients run.
struct LoadOptions {
  Api api = Api::kGrpc;
  std::string endpoint;                    // main's gRPC address, or its http_address with Api::kHttp
  const ClusterConfig* cluster = nullptr;  // the workers' counters are read when set
  std::vector<Prompt> prompts;
  int64_t requests_per_client = 1;
  int64_t max_new_tokens = 64;
  bool ignore_eos = true;
};

// One request, client side, and main's final stats.
struct RequestRecord {
  int64_t client = 0, round = 0;  // round: the client's r
  size_t prompt = 0;
  Clock::time_point sent, done;
  std::optional<double> ttft_ms;  // none: no token arrived
  double total_ms = 0;
  uint64_t tokens = 0;
  absl::Status status;
  std::optional<v1::RequestStats> stats;  // main's, when status is ok (gRPC only)
};

// The workers' load counters, summed over the workers.
struct Loads {
  uint64_t loads = 0, on_demand = 0, prefetches = 0;
};

// The figures of one N.
struct RunFigures {
  int64_t clients = 0, requests = 0, completed = 0, failures = 0, busy = 0;
  std::string first_error;  // of the failures (busy refusals apart)
  uint64_t tokens = 0;
  double wall_s = 0, tokens_per_s = 0, client_tps_mean = 0, client_tps_min = 0;
  std::optional<double> ttft_p50, ttft_p99;
  // Main's stats over the completed requests that carry them (none over HTTP: n/a); recall weighted by each
  // request's decode positions.
  std::optional<double> queue_ms_mean, queue_ms_max;
  uint64_t decode_positions = 0;
  std::optional<double> recall, timely_recall;
  std::optional<Loads> loads;  // during the run; none: not read
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

v1::GenerateRequest MakeRequest(const Prompt& prompt, int64_t max_new_tokens, bool ignore_eos) {
  v1::GenerateRequest req;
  if (prompt.ids.empty()) {
    req.set_prompt(prompt.text);
  } else {
    req.mutable_prompt_ids()->Add(prompt.ids.begin(), prompt.ids.end());
  }
  req.set_max_new_tokens(max_new_tokens);
  req.set_ignore_eos(ignore_eos);  // sampling left unset: greedy
  return req;
}

// Sends one request through main's gRPC API into `rec` (its sent time to its done time, the tokens and stats).
void SendGrpc(const LoadOptions& o, const Prompt& prompt, int64_t max_new_tokens, bool ignore_eos, RequestRecord* rec) {
  const v1::GenerateRequest req = MakeRequest(prompt, max_new_tokens, ignore_eos);
  rec->sent = Clock::now();
  absl::StatusOr<RemoteResult> r =
      GenerateRemote(o.endpoint, req, kRequestTimeoutMs, [&](const v1::GenerateResponse& chunk) {
        if (!rec->ttft_ms && (chunk.tokens_size() > 0 || (chunk.done() && chunk.all_tokens_size() > 0))) {
          rec->ttft_ms = Ms(Clock::now() - rec->sent);
        }
      });
  rec->done = Clock::now();
  if (r.ok()) {
    rec->tokens = r->tokens.size();
    rec->stats = r->stats;
  } else {
    rec->status = r.status();
  }
}

// The error of an HTTP answer: OpenAI's error object's message (429 as the busy refusal gRPC gives).
absl::Status HttpError(int status, const std::string& body) {
  const Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  const std::string message =
      j.is_object() && j.contains("error") && j["error"].contains("message") && j["error"]["message"].is_string()
          ? j["error"]["message"].get<std::string>()
          : body.substr(0, 200);
  if (status == 429) return ServerBusyError(message);
  return absl::UnknownError(StrCat("HTTP ", status, ": ", message));
}

// Sends one request through main's OpenAI API (a streamed /v1/completions) into `rec`, as SendGrpc.
void SendHttp(const LoadOptions& o, const Prompt& prompt, int64_t max_new_tokens, bool ignore_eos, RequestRecord* rec) {
  Json body = {{"max_tokens", max_new_tokens},
               {"temperature", 0},
               {"ignore_eos", ignore_eos},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  body["prompt"] = prompt.ids.empty() ? Json(prompt.text) : Json(prompt.ids);
  httplib::Client client(StrCat("http://", o.endpoint));
  client.set_read_timeout(kRequestTimeoutMs / 1000);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = DumpJson(body);
  std::string pending, whole;  // event text not yet parsed; the first 4 KiB of the body, for an error
  bool done = false;
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    whole.append(data, std::min(len, size_t{4096} - std::min(whole.size(), size_t{4096})));
    pending.append(data, len);
    for (size_t end; (end = pending.find("\n\n")) != std::string::npos; pending.erase(0, end + 2)) {
      const std::string event = pending.substr(0, end);
      if (!event.starts_with("data: ")) continue;
      if (event == "data: [DONE]") {
        done = true;
        continue;
      }
      const Json j = Json::parse(event.substr(6), nullptr, /*allow_exceptions=*/false);
      if (j.contains("error")) {
        rec->status = HttpError(500, event.substr(6));
        continue;
      }
      if (!j.contains("choices") || j["choices"].empty()) continue;  // the usage event
      const size_t tokens = j["choices"][0].value("token_ids", Json::array()).size();
      if (tokens > 0 && !rec->ttft_ms) rec->ttft_ms = Ms(Clock::now() - rec->sent);
      rec->tokens += tokens;
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  rec->sent = Clock::now();
  const bool sent = client.send(req, res, error);
  rec->done = Clock::now();
  if (!sent) {
    rec->status = absl::UnavailableError(
        StrCat("HTTP to ", o.endpoint, ": ",
               error == httplib::Error::Connection ? "cannot connect" : httplib::to_string(error)));
  } else if (res.status != 200) {
    rec->status = HttpError(res.status, whole);
  } else if (rec->status.ok() && !done) {
    rec->status = absl::UnknownError("the event stream ended without [DONE]");
  }
}

RequestRecord SendOne(const LoadOptions& o, int64_t clients, int64_t client, int64_t round) {
  RequestRecord rec;
  rec.client = client;
  rec.round = round;
  rec.prompt = static_cast<size_t>(client + round * clients) % o.prompts.size();
  (o.api == Api::kHttp ? SendHttp : SendGrpc)(o, o.prompts[rec.prompt], o.max_new_tokens, o.ignore_eos, &rec);
  rec.total_ms = Ms(rec.done - rec.sent);
  if (!rec.status.ok()) {
    rec.tokens = 0;
    rec.ttft_ms.reset();
  }
  return rec;
}

// N client threads, started together; the records of every request, client by client.
std::vector<RequestRecord> RunClients(const LoadOptions& o, int64_t clients) {
  std::vector<std::vector<RequestRecord>> per_client(static_cast<size_t>(clients));
  std::latch go(1);
  std::vector<std::thread> threads;
  threads.reserve(per_client.size());
  for (int64_t c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      go.wait();
      for (int64_t r = 0; r < o.requests_per_client; ++r) {
        per_client[static_cast<size_t>(c)].push_back(SendOne(o, clients, c, r));
      }
    });
  }
  go.count_down();
  for (std::thread& t : threads) t.join();
  std::vector<RequestRecord> all;
  for (std::vector<RequestRecord>& records : per_client) {
    for (RequestRecord& r : records) all.push_back(std::move(r));
  }
  return all;
}

absl::StatusOr<Loads> ReadLoads(const ClusterConfig& cluster) {
  ODMOE_ASSIGN_OR_RETURN(std::vector<v1::WorkerStats> stats, ReadWorkerStats(cluster, /*reset=*/false));
  Loads sum;
  for (const v1::WorkerStats& s : stats) {
    sum.loads += s.loads();
    sum.on_demand += s.loads_on_demand();
    sum.prefetches += s.prefetches();
  }
  return sum;
}

// The workers' loads from `before` to now; none (with a note on stderr) when a worker does not answer.
std::optional<Loads> LoadsSince(const ClusterConfig& cluster, const absl::StatusOr<Loads>& before) {
  absl::StatusOr<Loads> after = ReadLoads(cluster);
  const absl::Status& failed = before.ok() ? after.status() : before.status();
  if (!failed.ok()) {
    std::fprintf(stderr, "odmoe-bench load: expert loads n/a: %s\n", std::string(failed.message()).c_str());
    return std::nullopt;
  }
  return Loads{after->loads - before->loads, after->on_demand - before->on_demand,
               after->prefetches - before->prefetches};
}

RunFigures Summarize(const std::vector<RequestRecord>& records, int64_t clients) {
  RunFigures f;
  f.clients = clients;
  f.requests = static_cast<int64_t>(records.size());
  if (records.empty()) return f;
  Clock::time_point first = records.front().sent, last = records.front().done;
  std::vector<double> ttft;
  std::vector<Clock::time_point> client_first(static_cast<size_t>(clients), Clock::time_point::max());
  std::vector<Clock::time_point> client_last(static_cast<size_t>(clients), Clock::time_point::min());
  std::vector<uint64_t> client_tokens(static_cast<size_t>(clients), 0);
  double queue_sum = 0, queue_max = 0, recall = 0, timely = 0;
  int64_t with_stats = 0;
  for (const RequestRecord& r : records) {
    first = std::min(first, r.sent);
    last = std::max(last, r.done);
    const size_t c = static_cast<size_t>(r.client);
    client_first[c] = std::min(client_first[c], r.sent);
    client_last[c] = std::max(client_last[c], r.done);
    if (!r.status.ok()) {
      if (IsServerBusy(r.status)) {
        ++f.busy;
      } else if (f.failures++ == 0) {
        f.first_error = std::string(r.status.message());
      }
      continue;
    }
    ++f.completed;
    f.tokens += r.tokens;
    client_tokens[c] += r.tokens;
    if (r.ttft_ms) ttft.push_back(*r.ttft_ms);
    if (!r.stats) continue;
    ++with_stats;
    queue_sum += r.stats->queue_ms();
    queue_max = std::max(queue_max, r.stats->queue_ms());
    const int positions = r.stats->recall_per_token_size();
    recall += r.stats->recall() * positions;
    timely += r.stats->timely_recall() * positions;
    f.decode_positions += static_cast<uint64_t>(positions);
  }
  if (with_stats > 0) {
    f.queue_ms_mean = queue_sum / static_cast<double>(with_stats);
    f.queue_ms_max = queue_max;
    const double positions = static_cast<double>(std::max<uint64_t>(f.decode_positions, 1));
    f.recall = recall / positions;
    f.timely_recall = timely / positions;
  }
  f.wall_s = Ms(last - first) / 1000;
  f.tokens_per_s = f.wall_s > 0 ? static_cast<double>(f.tokens) / f.wall_s : 0;
  f.client_tps_min = INFINITY;
  for (size_t c = 0; c < client_tokens.size(); ++c) {
    const double s = Ms(client_last[c] - client_first[c]) / 1000;
    const double tps = s > 0 ? static_cast<double>(client_tokens[c]) / s : 0;
    f.client_tps_mean += tps / static_cast<double>(clients);
    f.client_tps_min = std::min(f.client_tps_min, tps);
  }
  if (!ttft.empty()) {
    f.ttft_p50 = Percentile(ttft, 50);
    f.ttft_p99 = Percentile(ttft, 99);
  }
  return f;
}

Json OrNull(const std::optional<double>& v) { return v ? Json(*v) : Json(nullptr); }

void PrintRequestLines(const std::vector<RequestRecord>& records, int64_t clients) {
  Clock::time_point first = Clock::time_point::max();
  for (const RequestRecord& r : records) first = std::min(first, r.sent);
  for (const RequestRecord& r : records) {
    PrintJsonLine({{"bench", "load"},
                   {"kind", "request"},
                   {"clients", clients},
                   {"client", r.client},
                   {"round", r.round},
                   {"prompt", r.prompt},
                   {"sent_ms", Ms(r.sent - first)},
                   {"ttft_ms", OrNull(r.ttft_ms)},
                   {"total_ms", r.total_ms},
                   {"tokens", r.tokens},
                   {"ok", r.status.ok()},
                   {"busy", IsServerBusy(r.status)},
                   {"error", std::string(r.status.message())},
                   {"queue_ms", r.stats ? Json(r.stats->queue_ms()) : Json(nullptr)},
                   {"server_ttft_ms", r.stats ? Json(r.stats->ttft_ms()) : Json(nullptr)},
                   {"server_total_ms", r.stats ? Json(r.stats->total_ms()) : Json(nullptr)},
                   {"server_decode_tokens_per_s", r.stats ? Json(r.stats->decode_tokens_per_s()) : Json(nullptr)}});
  }
}

void PrintRunLine(const RunFigures& f, const LoadOptions& o) {
  Json loads = nullptr, loads_per_token = nullptr, on_demand_per_token = nullptr;
  if (f.loads) {
    loads = f.loads->loads;
    if (f.tokens > 0) {
      loads_per_token = static_cast<double>(f.loads->loads) / static_cast<double>(f.tokens);
      on_demand_per_token = static_cast<double>(f.loads->on_demand) / static_cast<double>(f.tokens);
    }
  }
  PrintJsonLine({{"bench", "load"},
                 {"kind", "run"},
                 {"api", o.api == Api::kHttp ? "http" : "grpc"},
                 {"endpoint", o.endpoint},
                 {"prompts", o.prompts.size()},
                 {"max_new_tokens", o.max_new_tokens},
                 {"ignore_eos", o.ignore_eos},
                 {"clients", f.clients},
                 {"requests_per_client", o.requests_per_client},
                 {"requests", f.requests},
                 {"completed", f.completed},
                 {"generated_tokens", f.tokens},
                 {"wall_s", f.wall_s},
                 {"tokens_per_s", f.tokens_per_s},
                 {"client_tokens_per_s_mean", f.client_tps_mean},
                 {"client_tokens_per_s_min", f.client_tps_min},
                 {"ttft_ms_p50", OrNull(f.ttft_p50)},
                 {"ttft_ms_p99", OrNull(f.ttft_p99)},
                 {"failures", f.failures},
                 {"first_error", f.first_error},
                 {"busy", f.busy},
                 {"queue_ms_mean", OrNull(f.queue_ms_mean)},
                 {"queue_ms_max", OrNull(f.queue_ms_max)},
                 {"recall", OrNull(f.recall)},
                 {"timely_recall", OrNull(f.timely_recall)},
                 {"expert_loads", loads},
                 {"expert_loads_per_token", loads_per_token},
                 {"loads_on_demand_per_token", on_demand_per_token}});
}

std::string Cell(const std::optional<double>& v, const char* format) {
  if (!v) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof(buf), format, *v);
  return buf;
}

void PrintTable(const std::vector<RunFigures>& runs) {
  std::printf("\n%7s %6s %5s %5s %5s %8s %8s %10s %12s %11s %10s %10s %10s %10s %7s %7s\n", "clients", "reqs", "ok",
              "fail", "busy", "tokens", "wall_s", "tok/s", "client_mean", "client_min", "ttft_p50", "ttft_p99",
              "queue_ms", "loads/tok", "recall", "timely");
  for (const RunFigures& f : runs) {
    std::optional<double> loads;
    if (f.loads && f.tokens > 0) loads = static_cast<double>(f.loads->loads) / static_cast<double>(f.tokens);
    std::printf("%7lld %6lld %5lld %5lld %5lld %8llu %8.2f %10.1f %12.1f %11.1f %10s %10s %10s %10s %7s %7s\n",
                static_cast<long long>(f.clients), static_cast<long long>(f.requests),
                static_cast<long long>(f.completed), static_cast<long long>(f.failures), static_cast<long long>(f.busy),
                static_cast<unsigned long long>(f.tokens), f.wall_s, f.tokens_per_s, f.client_tps_mean,
                f.client_tps_min, Cell(f.ttft_p50, "%.1f").c_str(), Cell(f.ttft_p99, "%.1f").c_str(),
                Cell(f.queue_ms_mean, "%.1f").c_str(), Cell(loads, "%.2f").c_str(), Cell(f.recall, "%.4f").c_str(),
                Cell(f.timely_recall, "%.4f").c_str());
  }
  for (const RunFigures& f : runs) {
    if (f.failures > 0) {
      std::printf("clients %lld: %lld failed, first: %s\n", static_cast<long long>(f.clients),
                  static_cast<long long>(f.failures), f.first_error.c_str());
    }
  }
  // Total tokens/s at the largest N against N = 1.
  const RunFigures* one = nullptr;
  const RunFigures* largest = nullptr;
  for (const RunFigures& f : runs) {
    if (f.clients == 1 && one == nullptr) one = &f;
    if (largest == nullptr || f.clients > largest->clients) largest = &f;
  }
  if (one != nullptr && largest != nullptr && largest->clients > 1 && one->tokens_per_s > 0) {
    const double ratio = largest->tokens_per_s / one->tokens_per_s;
    PrintJsonLine({{"bench", "load"},
                   {"kind", "scaling"},
                   {"clients", largest->clients},
                   {"tokens_per_s", largest->tokens_per_s},
                   {"tokens_per_s_at_1", one->tokens_per_s},
                   {"ratio", ratio}});
    std::printf("total tokens/s at %lld clients / at 1 client: %.2fx\n", static_cast<long long>(largest->clients),
                ratio);
  }
}

// The warm-up request, then every N; the cluster is up.
absl::StatusOr<std::vector<RunFigures>> RunAll(const LoadOptions& o, const std::vector<int64_t>& client_counts,
                                               bool per_request) {
  RequestRecord warm;
  (o.api == Api::kHttp ? SendHttp : SendGrpc)(o, o.prompts[0], std::min(kWarmUpTokens, o.max_new_tokens), true, &warm);
  if (!warm.status.ok()) {
    return absl::Status(warm.status.code(), StrCat("the warm-up request: ", warm.status.message()));
  }
  std::vector<RunFigures> runs;
  for (int64_t n : client_counts) {
    absl::StatusOr<Loads> before = absl::UnknownError("the workers are not known");
    if (o.cluster != nullptr) before = ReadLoads(*o.cluster);
    const std::vector<RequestRecord> records = RunClients(o, n);
    RunFigures f = Summarize(records, n);
    if (o.cluster != nullptr) f.loads = LoadsSince(*o.cluster, before);
    if (per_request) PrintRequestLines(records, n);
    PrintRunLine(f, o);
    runs.push_back(std::move(f));
  }
  return runs;
}

}  // namespace

absl::Status RunLoad(const std::vector<std::string>& args) {
  ODMOE_ASSIGN_OR_RETURN(
      Flags f, Flags::Parse(args,
                            {"config", "endpoint", "model", "clients", "prompts", "prompt-text", "max-new-tokens",
                             "requests-per-client", "ignore-eos", "run-dir", "api"},
                            {"per-request"}));
  if (!f.Has("config") && !f.Has("endpoint")) {
    return absl::InvalidArgumentError("give --config FILE (the bench starts the cluster) or --endpoint HOST:PORT");
  }
  const bool start_cluster = !f.Has("endpoint");
  if (!start_cluster && (f.Has("model") || f.Has("run-dir"))) {
    return absl::InvalidArgumentError("--model and --run-dir are for a cluster the bench starts (--config alone)");
  }
  if (f.Has("prompts") == f.Has("prompt-text")) {
    return absl::InvalidArgumentError("give exactly one of --prompts FILE (JSON) and --prompt-text FILE (lines)");
  }
  ODMOE_ASSIGN_OR_RETURN(std::vector<int64_t> client_counts, f.IntList("clients"));
  if (client_counts.empty()) client_counts = {1, 2, 4, 8};
  for (int64_t n : client_counts) {
    if (n < 1 || n > kMaxClients) {
      return absl::InvalidArgumentError(StrCat("--clients: each N must be 1..", kMaxClients, ", got ", n));
    }
  }
  LoadOptions o;
  if (const std::string api = f.Get("api").value_or("grpc"); api == "http") {
    o.api = Api::kHttp;
  } else if (api != "grpc") {
    return absl::InvalidArgumentError(StrCat("--api must be grpc or http, got '", api, "'"));
  }
  ODMOE_ASSIGN_OR_RETURN(o.requests_per_client, f.Int("requests-per-client", 1));
  ODMOE_ASSIGN_OR_RETURN(o.max_new_tokens, f.Int("max-new-tokens", 64));
  if (o.requests_per_client < 1 || o.requests_per_client > kMaxRequestsPerClient) {
    return absl::InvalidArgumentError(
        StrCat("--requests-per-client must be 1..", kMaxRequestsPerClient, ", got ", o.requests_per_client));
  }
  if (o.max_new_tokens < 1) return absl::InvalidArgumentError("--max-new-tokens must be >= 1");
  if (auto v = f.Get("ignore-eos")) {
    absl::StatusOr<bool> b = ParseBool(*v);
    if (!b.ok()) return absl::InvalidArgumentError(StrCat("--ignore-eos: ", b.status().message()));
    o.ignore_eos = *b;
  }
  if (f.Has("prompts")) {
    ODMOE_ASSIGN_OR_RETURN(o.prompts, ReadPromptsJson(*f.Get("prompts")));
  } else {
    ODMOE_ASSIGN_OR_RETURN(std::vector<std::string> lines, ReadPromptLines(*f.Get("prompt-text")));
    for (std::string& line : lines) o.prompts.push_back(Prompt{std::move(line), {}});
  }

  ClusterConfig cluster;
  if (f.Has("config")) {
    ODMOE_ASSIGN_OR_RETURN(cluster, LoadClusterConfig(*f.Get("config")));
    o.cluster = &cluster;
  }
  if (!f.Has("endpoint") && o.api == Api::kHttp && cluster.main()->http_address.empty()) {
    return absl::InvalidArgumentError(
        StrCat("--api http: main has no http_address in ", *f.Get("config"), " (or give --endpoint HOST:PORT)"));
  }
  o.endpoint = f.Get("endpoint")
                   .value_or(o.cluster == nullptr
                                 ? ""
                                 : (o.api == Api::kHttp ? cluster.main()->http_address : cluster.main()->address));

  const std::string config_path = f.Get("config").value_or("");
  const std::string run_dir = f.Get("run-dir").value_or(DefaultRunDir("load"));
  if (start_cluster) ODMOE_RETURN_IF_ERROR(ClusterUp(config_path, run_dir, f.Get("model").value_or("")));
  absl::StatusOr<std::vector<RunFigures>> runs = RunAll(o, client_counts, f.Has("per-request"));
  const absl::Status down = start_cluster ? ClusterDown(config_path, run_dir) : absl::OkStatus();
  ODMOE_RETURN_IF_ERROR(runs.status());
  ODMOE_RETURN_IF_ERROR(down);

  PrintTable(*runs);
  for (const RunFigures& r : *runs) {
    if (r.completed == 0) {
      return absl::UnavailableError(StrCat("with ", r.clients, " clients no request completed (", r.failures,
                                           " failed, ", r.busy, " busy)",
                                           r.first_error.empty() ? "" : StrCat(": ", r.first_error)));
    }
  }
  return absl::OkStatus();
}

}  // namespace odmoe::bench
