#include "bench/bench_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "odmoe/v1/worker.grpc.pb.h"
#include "src/common/mapped_file.h"
#include "src/common/status.h"
#include "src/common/strings.h"
#include "src/rpc/rpc_util.h"

namespace odmoe::bench {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t i = rank < 1 ? 0 : std::min(v.size() - 1, static_cast<size_t>(rank) - 1);
  return v[i];
}

absl::StatusOr<double> MeasureCopyBandwidth(Device& device, size_t bytes, int iters) {
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> a, device.Allocate(bytes, "bench copy source"));
  ODMOE_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> b, device.Allocate(bytes, "bench copy destination"));
  {
    std::vector<uint8_t> host(bytes, 0x5a);
    device.CopyToDevice(a->data(), host.data(), bytes, nullptr);
    device.SynchronizeAll();
  }
  device.CopyOnDevice(b->data(), a->data(), bytes, nullptr);  // warm-up
  device.SynchronizeAll();
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < iters; ++i) {
    if (i % 2 == 0) {
      device.CopyOnDevice(b->data(), a->data(), bytes, nullptr);
    } else {
      device.CopyOnDevice(a->data(), b->data(), bytes, nullptr);
    }
  }
  device.SynchronizeAll();
  const double s = SecondsSince(start);
  return s > 0 ? 2.0 * static_cast<double>(bytes) * iters / s : 0.0;
}

std::vector<int32_t> SyntheticPrompt(const ModelConfig& config, int64_t length) {
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < length; ++i) {
    const bool bos = i == 0 && config.bos_token_id.has_value();
    prompt.push_back(static_cast<int32_t>(bos ? *config.bos_token_id : 3 + (i * 37) % (config.vocab_size - 3)));
  }
  return prompt;
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ParsePairs(const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    long long p = 0, n = 0;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%lldx%lld%c", &p, &n, &tail) != 2 || p < 1 || n < 1) {
      return absl::InvalidArgumentError(
          StrCat("--pairs: expected PROMPTxOUTPUT[,PROMPTxOUTPUT...] with positive numbers, got '", item, "'"));
    }
    out.emplace_back(p, n);
    pos = end + 1;
  }
  return out;
}

namespace {
std::FILE* json_file = nullptr;  // SetJsonFile's; lives until the process exits
}  // namespace

absl::Status SetJsonFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::InvalidArgumentError(StrCat("--json: cannot open ", path, " for writing"));
  if (json_file != nullptr) std::fclose(json_file);
  json_file = f;
  return absl::OkStatus();
}

void PrintJsonLine(const Json& j) {
  const std::string line = DumpJson(j);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  if (json_file != nullptr) {
    std::fprintf(json_file, "%s\n", line.c_str());
    std::fflush(json_file);
  }
}

// Runs `argv` with its stdout sent to our stderr (our stdout carries only JSON lines and the table).
absl::Status RunQuiet(const std::vector<std::string>& argv) {
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    dup2(2, 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::UnavailableError(StrCat("`", argv[0], " ", argv.size() > 1 ? argv[1] : "", " ",
                                         argv.size() > 2 ? argv[2] : "", " ...` failed (exit ",
                                         WIFEXITED(status) ? WEXITSTATUS(status) : -1, ")"));
  }
  return absl::OkStatus();
}

std::string OdmoeProgram() {
  std::error_code ec;
  return (std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "odmoe").string();
}

std::string DefaultRunDir(const std::string& bench) {
  return StrCat(std::filesystem::temp_directory_path().string(), "/odmoe-bench-", bench, "-", getpid());
}

absl::Status ClusterUp(const std::string& config, const std::string& run_dir, const std::string& model,
                       const std::vector<std::string>& extra) {
  std::vector<std::string> up = {OdmoeProgram(), "cluster", "up", "--config", config, "--run-dir", run_dir};
  if (!model.empty()) up.insert(up.end(), {"--model", model});
  up.insert(up.end(), extra.begin(), extra.end());
  return RunQuiet(up);
}

absl::Status ClusterDown(const std::string& config, const std::string& run_dir) {
  return RunQuiet({OdmoeProgram(), "cluster", "down", "--config", config, "--run-dir", run_dir});
}

absl::StatusOr<std::vector<std::string>> ReadPromptLines(const std::string& path) {
  ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line[0] != '#') lines.push_back(line);
    start = end + 1;
  }
  if (lines.empty()) return absl::InvalidArgumentError(StrCat("--prompt-text ", path, ": no text lines"));
  return lines;
}

absl::StatusOr<std::vector<Prompt>> ReadPromptsJson(const std::string& path) {
  ODMOE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ODMOE_ASSIGN_OR_RETURN(Json j, ParseJson(text, path));
  const Json* list = &j;
  if (j.is_object() && j.contains("prompts")) list = &j["prompts"];
  if (!list->is_array()) {
    return absl::InvalidArgumentError(
        StrCat(path, ": expected a list of prompts or an object with a \"prompts\" list"));
  }
  std::vector<Prompt> prompts;
  for (const Json& p : *list) {
    const std::string where = StrCat(path, ": prompt ", prompts.size());
    Prompt prompt;
    if (p.is_string()) {
      prompt.text = p.get<std::string>();
      if (prompt.text.empty()) return absl::InvalidArgumentError(StrCat(where, " is an empty string"));
    } else if (p.is_array() && !p.empty()) {
      for (const Json& id : p) {
        if (!id.is_number_integer()) return absl::InvalidArgumentError(StrCat(where, ": an id is not an integer"));
        prompt.ids.push_back(id.get<int32_t>());
      }
    } else {
      return absl::InvalidArgumentError(StrCat(where, " is neither a non-empty string nor a non-empty array of ids"));
    }
    prompts.push_back(std::move(prompt));
  }
  if (prompts.empty()) return absl::InvalidArgumentError(StrCat(path, ": no prompts"));
  return prompts;
}

absl::StatusOr<std::vector<v1::WorkerStats>> ReadWorkerStats(const ClusterConfig& cluster, bool reset) {
  std::vector<v1::WorkerStats> out;
  for (const NodeConfig* w : cluster.workers()) {
    v1::StatsRequest req;
    req.set_reset(reset);
    v1::WorkerStats st;
    grpc::ClientContext ctx;
    rpc::SetDeadline(ctx, 10000);
    const grpc::Status s = v1::Worker::NewStub(rpc::MakeChannel(w->address))->GetStats(&ctx, req, &st);
    if (!s.ok()) return rpc::FromGrpc(s, StrCat("GetStats of worker ", w->name, " at ", w->address));
    out.push_back(std::move(st));
  }
  return out;
}

}  // namespace odmoe::bench
