// The run folders of `odmoe cluster up`: each `up` writes its nodes' logs to a folder of its own, so that the
// logs of a crash survive the restart that follows.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace odmoe::cli {

// How many run folders `up` keeps (the newest).
inline constexpr size_t kRunsKept = 10;

// Creates RUN_DIR/runs/YYYYmmddTHHMMSSZ-N (UTC; N is 1 + the largest N of that second so far, so names sort in
// creation order), points the symlink RUN_DIR/latest at it, removes the oldest run folders beyond the newest
// `keep` (keep >= 1), and returns the new folder's path. Unavailable naming the path when it cannot be created.
absl::StatusOr<std::string> NewRunFolder(const std::string& run_dir, size_t keep);

}  // namespace odmoe::cli
