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
    return absl::Status(placement.status().code(), StrCat(cluster_file, ": group size ", group_size,
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

Placement::Placement(int32_t num_workers, int32_t group_size)
    : num_workers_(num_workers), group_size_(group_size), member_(static_cast<size_t>(num_workers), true) {
  for (int32_t w = 0; w < num_workers; ++w) members_.push_back(w);
}

absl::StatusOr<Placement> Placement::Without(std::span<const int32_t> absent) const {
  Placement out(num_workers_, group_size_);
  for (int32_t w : absent) {
    if (w < 0 || w >= num_workers_) {
      return absl::InvalidArgumentError(
          StrCat("absent worker ", w, " does not exist (the cluster has workers 0..", num_workers_ - 1, ")"));
    }
    out.member_[static_cast<size_t>(w)] = false;
  }
  out.members_.clear();
  for (int32_t w = 0; w < num_workers_; ++w) {
    if (out.member_[static_cast<size_t>(w)]) out.members_.push_back(w);
  }
  return out;
}

std::vector<int32_t> Placement::absent() const {
  std::vector<int32_t> out;
  for (int32_t w = 0; w < num_workers_; ++w) {
    if (!member(w)) out.push_back(w);
  }
  return out;
}

int32_t Placement::HomeGroupOf(int64_t sparse_index) const { return static_cast<int32_t>(sparse_index % num_groups()); }

int32_t Placement::GroupOf(int64_t sparse_index) const {
  const int32_t home = HomeGroupOf(sparse_index);
  for (int32_t i = 0; i < num_groups(); ++i) {
    const int32_t g = (home + i) % num_groups();
    for (int32_t slot = 0; slot < group_size_; ++slot) {
      if (member(WorkerOf(g, slot))) return g;
    }
  }
  return home;  // no member anywhere: not servable
}

std::vector<int32_t> Placement::MemberSlots(int32_t group) const {
  std::vector<int32_t> slots;
  for (int32_t slot = 0; slot < group_size_; ++slot) {
    if (member(WorkerOf(group, slot))) slots.push_back(slot);
  }
  if (slots.empty()) {
    for (int32_t slot = 0; slot < group_size_; ++slot) slots.push_back(slot);
  }
  return slots;
}

bool Placement::ServesInDecode(int32_t worker, int64_t sparse_index) const {
  return member(worker) && worker / group_size_ == GroupOf(sparse_index);
}

int32_t Placement::PrefillWorkerOf(int32_t expert) const {
  const int32_t home = expert % num_workers_;
  if (member(home) || members_.empty()) return home;
  return members_[static_cast<size_t>(expert) % members_.size()];
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
  const std::vector<int32_t> slots = MemberSlots(group);
  const size_t n = slots.size();
  std::vector<int32_t> taken(static_cast<size_t>(group_size_), 0);
  auto has_room = [&](size_t at) {
    const size_t i = static_cast<size_t>(slots[at]);
    return capacity.empty() || (i < capacity.size() && taken[i] < capacity[i]);
  };
  std::vector<Assignment> out;
  size_t next = 0;  // the round-robin cursor, over the member slots
  for (int32_t e : Sorted(experts)) {
    size_t tried = 0;
    while (tried < n && !has_room(next)) {
      next = (next + 1) % n;
      ++tried;
    }
    if (tried == n) break;  // every worker of the group is full
    ++taken[static_cast<size_t>(slots[next])];
    out.push_back({e, WorkerOf(group, slots[next]), true});
    next = (next + 1) % n;
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
  const std::vector<int32_t> slots = MemberSlots(group);
  std::vector<Assignment> out;
  size_t next_unused = 0, next_slot = 0;
  for (int32_t e : want) {
    auto hit = std::find_if(planned.begin(), planned.end(), [&](const Assignment& a) { return a.expert == e; });
    if (hit != planned.end()) {
      out.push_back(*hit);
    } else if (next_unused < unused_workers.size()) {
      out.push_back({e, unused_workers[next_unused++], false});
    } else {
      out.push_back({e, WorkerOf(group, slots[next_slot++ % slots.size()]), false});
    }
  }
  return out;
}

}  // namespace odmoe
