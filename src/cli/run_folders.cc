#include "src/cli/run_folders.h"

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "src/common/strings.h"

namespace odmoe::cli {
namespace {

namespace fs = std::filesystem;

// The run folders under `runs` as (stamp, N), oldest first.
std::vector<std::pair<std::string, long>> ListRuns(const fs::path& runs) {
  std::vector<std::pair<std::string, long>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(runs, ec)) {
    const std::string name = e.path().filename().string();
    const size_t dash = name.rfind('-');
    if (!e.is_directory(ec) || dash == std::string::npos) continue;
    char* end = nullptr;
    const long n = std::strtol(name.c_str() + dash + 1, &end, 10);
    if (*end != '\0' || n < 1) continue;  // not a run folder
    out.emplace_back(name.substr(0, dash), n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

absl::StatusOr<std::string> NewRunFolder(const std::string& run_dir, size_t keep) {
  const fs::path runs = fs::path(run_dir) / "runs";
  std::error_code ec;
  fs::create_directories(runs, ec);
  if (ec) return absl::UnavailableError(StrCat("cannot create ", runs.string(), ": ", ec.message()));
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", &utc);
  long n = 1;
  for (const auto& [s, i] : ListRuns(runs)) {
    if (s == stamp) n = std::max(n, i + 1);
  }
  fs::path folder;
  for (;; ++n) {  // another `up` of the same second may take a number first
    folder = runs / StrCat(stamp, "-", n);
    if (fs::create_directory(folder, ec)) break;
    if (ec) return absl::UnavailableError(StrCat("cannot create ", folder.string(), ": ", ec.message()));
  }
  // `latest`: a new link renamed over the old one, so it is never missing.
  const fs::path latest = fs::path(run_dir) / "latest", next = fs::path(run_dir) / ".latest.new";
  fs::remove(next, ec);
  fs::create_directory_symlink(fs::path("runs") / folder.filename(), next, ec);
  if (!ec) fs::rename(next, latest, ec);
  const std::vector<std::pair<std::string, long>> existing = ListRuns(runs);
  for (size_t i = 0; i + std::max<size_t>(keep, 1) < existing.size(); ++i) {
    fs::remove_all(runs / StrCat(existing[i].first, "-", existing[i].second), ec);
  }
  return folder.string();
}

}  // namespace odmoe::cli
