#include "bench/bench_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "src/common/status.h"
#include "src/common/strings.h"

namespace odmoe::bench {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
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

}  // namespace odmoe::bench
