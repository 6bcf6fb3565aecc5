// Helpers shared by the odmoe-bench benchmarks.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend/device.h"
#include "src/common/json.h"

namespace odmoe::bench {

using Clock = std::chrono::steady_clock;
inline double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double Median(std::vector<double> v);

// Device-to-device copy bandwidth in bytes/s, counting the bytes read and the bytes written (2 x size per
// copy): CopyOnDevice of a `bytes` buffer, timed over `iters` copies after one warm-up, SynchronizeAll at both
// ends (host steady clock). This is the memory bandwidth the kernels are compared with.
absl::StatusOr<double> MeasureCopyBandwidth(Device& device, size_t bytes, int iters);

// "16x64,128x256" -> {{16, 64}, {128, 256}}.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ParsePairs(const std::string& text);

// Prints `j` as one line on stdout and, after SetJsonFile, appends the same line to that file too.
void PrintJsonLine(const Json& j);
// Every later PrintJsonLine also goes to `path` (created or truncated now); InvalidArgument naming the path
// when it cannot be opened. `odmoe-bench ... --json FILE` calls it.
absl::Status SetJsonFile(const std::string& path);
// Runs `argv` (a program path first) with its stdout sent to our stderr, so that our stdout carries only JSON
// lines and the table; Unavailable when it does not exit 0.
absl::Status RunQuiet(const std::vector<std::string>& argv);

}  // namespace odmoe::bench
