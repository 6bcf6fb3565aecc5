// The runtime's counts (simt/counters.h). The runtime and the scheduler call the Count* hooks; the checker hands
// over a checked launch's kernel accesses, which are added to the launch's site when the launch is counted.
#include "simt/counters.h"

#include <mutex>
#include <string>

#include "src/internal.h"

namespace simt {
namespace {

std::mutex counters_mu;
Counters counts;                     // guarded by counters_mu
detail::LaunchAccesses last_launch;  // the checked accesses of the launch being counted (guarded by counters_mu)

void AddWrite(const void* base, size_t size, uint64_t bytes) {
  AllocationWrites& w = counts.written[base];
  w.size = size;
  w.bytes += bytes;
}

}  // namespace

Counters ReadCounters() {
  std::lock_guard<std::mutex> lock(counters_mu);
  return counts;
}

void ResetCounters() {
  std::lock_guard<std::mutex> lock(counters_mu);
  counts = Counters{};
}

bool CountsKernelAccesses() { return detail::checked_mode; }

namespace detail {

void CountHostSync() {
  std::lock_guard<std::mutex> lock(counters_mu);
  ++counts.host_syncs;
}

void CountAllocation() {
  std::lock_guard<std::mutex> lock(counters_mu);
  ++counts.allocations;
}

void CountFree() {
  std::lock_guard<std::mutex> lock(counters_mu);
  ++counts.frees;
}

void CountCopy(void* dst, const void* src, size_t n, bool synchronous) {
  const AllocationView from = FindAllocation(src, n);
  const AllocationView to = FindAllocation(dst, n);
  const bool from_device = from.status == AllocationView::Status::kInside;
  const bool to_device = to.status == AllocationView::Status::kInside;
  const bool pageable_dst = !to_device && !IsPinnedHost(dst, n);
  std::lock_guard<std::mutex> lock(counters_mu);
  if (from_device) {
    counts.copy_bytes_from_device += n;
    if (!to_device) counts.copy_bytes_to_host += n;
    if (synchronous) {
      ++counts.host_syncs;
    } else if (pageable_dst) {
      ++counts.pageable_copies_to_host;
    }
  }
  if (to_device) AddWrite(to.base, to.size, n);
}

void CountMemset(void* dst, size_t n) {
  const AllocationView to = FindAllocation(dst, n);
  if (to.status != AllocationView::Status::kInside) return;
  std::lock_guard<std::mutex> lock(counters_mu);
  AddWrite(to.base, to.size, n);
}

void CountKernelAccesses(const LaunchAccesses& accesses) {
  std::vector<std::pair<AllocationView, uint64_t>> writes;
  writes.reserve(accesses.writes.size());
  for (const auto& [base, bytes] : accesses.writes) writes.emplace_back(FindAllocation(base, 1), bytes);
  std::lock_guard<std::mutex> lock(counters_mu);
  last_launch.bytes_read = accesses.bytes_read;
  last_launch.bytes_written = accesses.bytes_written;
  last_launch.ldg = accesses.ldg;
  counts.kernel_bytes_read += accesses.bytes_read;
  counts.kernel_bytes_written += accesses.bytes_written;
  for (const auto& [view, bytes] : writes) {
    if (view.status == AllocationView::Status::kInside) AddWrite(view.base, view.size, bytes);
  }
}

void CountLaunch(const LaunchSite& site, bool in_graph) {
  std::string key = std::string(site.kernel) + " " + site.file + ":" + std::to_string(site.line);
  std::lock_guard<std::mutex> lock(counters_mu);
  ++counts.launches;
  if (in_graph) ++counts.graph_kernel_launches;
  SiteCounts& s = counts.sites[key];
  ++s.launches;
  s.bytes_read += last_launch.bytes_read;
  s.bytes_written += last_launch.bytes_written;
  s.ldg.Add(last_launch.ldg);
  last_launch = LaunchAccesses{};
}

void CountGraphLaunch() {
  std::lock_guard<std::mutex> lock(counters_mu);
  ++counts.graph_launches;
}

}  // namespace detail
}  // namespace simt
