#include "src/common/placement.h"

#include <algorithm>

#include "src/common/strings.h"

namespace odmoe {
namespace {

std::vector<int32_t> Sorted(std::span<const int32_t> v) {
  std::vector<int32_t> out(v.begin(), v.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

int32_t DefaultGroupSize(int32_t configured_group_size, int64_t top_k) {
  return configured_group_size > 0 ? configured_group_size : static_cast<int32_t>(std::max<int64_t>(1, top_k));
}

absl::StatusOr<Placement> Placement::ForCluster(std::string_view cluster_file, int32_t num_workers,
                                                int32_t configured_group_size, int64_t top_k) {
  const int32_t group_size = DefaultGroupSize(configured_group_size, top_k);
  absl::StatusOr<Placement> placement = Create(num_workers, group_size);
  if (!placement.ok()) {
    return absl::Status(placement.status().code(),
                        StrCat(cluster_file, ": group size ", group_size,
                               configured_group_size > 0 ? "" : " (the model's top-k)", ": ",
                               placement.status().message()));
  }
  return placement;
}

absl::StatusOr<Placement> Placement::Create(int32_t num_workers, int32_t group_size) {
  if (num_workers < 1) return absl::InvalidArgumentError(StrCat("need at least one worker, got ", num_workers));
  if (group_size < 1 || group_size > num_workers) {
    return absl::InvalidArgumentError(
        StrCat("group_size must be between 1 and the number of workers (", num_workers, "), got ", group_size));
  }
  if (num_workers % group_size != 0) {
    return absl::InvalidArgumentError(
        StrCat("group_size ", group_size, " does not divide the number of workers (", num_workers, ")"));
  }
  return Placement(num_workers, group_size);
}

int32_t Placement::GroupOf(int64_t sparse_index) const {
  return static_cast<int32_t>(sparse_index % num_groups());
}

bool Placement::ServesInDecode(int32_t worker, int64_t sparse_index) const {
  return worker / group_size_ == GroupOf(sparse_index);
}

std::vector<int64_t> Placement::DecodeLayersOf(int32_t worker, int64_t num_sparse) const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < num_sparse; ++s) {
    if (ServesInDecode(worker, s)) out.push_back(s);
  }
  return out;
}

std::vector<Assignment> Placement::Assign(int64_t sparse_index, std::span<const int32_t> experts,
                                          std::span<const int32_t> capacity) const {
  const int32_t group = GroupOf(sparse_index);
  std::vector<Assignment> out;
  std::vector<int32_t> taken(static_cast<size_t>(group_size_), 0);
  auto has_room = [&](int32_t slot) {
    const size_t i = static_cast<size_t>(slot);
    return capacity.empty() || (i < capacity.size() && taken[i] < capacity[i]);
  };
  int32_t next = 0;  // the round-robin cursor
  for (int32_t e : Sorted(experts)) {
    int32_t tried = 0;
    while (tried < group_size_ && !has_room(next)) {
      next = (next + 1) % group_size_;
      ++tried;
    }
    if (tried == group_size_) break;  // every worker of the group is full
    ++taken[static_cast<size_t>(next)];
    out.push_back({e, WorkerOf(group, next), true});
    next = (next + 1) % group_size_;
  }
  return out;
}

std::vector<Assignment> Placement::Resolve(int64_t sparse_index, std::span<const int32_t> predicted,
                                           std::span<const int32_t> actual) const {
  const std::vector<Assignment> planned = Assign(sparse_index, predicted);
  const std::vector<int32_t> want = Sorted(actual);
  std::vector<int32_t> unused_workers;  // workers whose predicted expert is not needed, in expert order
  for (const Assignment& a : planned) {
    if (!std::binary_search(want.begin(), want.end(), a.expert)) unused_workers.push_back(a.worker);
  }
  const int32_t group = GroupOf(sparse_index);
  std::vector<Assignment> out;
  size_t next_unused = 0, next_slot = 0;
  for (int32_t e : want) {
    auto hit = std::find_if(planned.begin(), planned.end(), [&](const Assignment& a) { return a.expert == e; });
    if (hit != planned.end()) {
      out.push_back(*hit);
    } else if (next_unused < unused_workers.size()) {
      out.push_back({e, unused_workers[next_unused++], false});
    } else {
      out.push_back({e, WorkerOf(group, static_cast<int32_t>(next_slot++ % static_cast<size_t>(group_size_))), false});
    }
  }
  return out;
}

}  // namespace odmoe
