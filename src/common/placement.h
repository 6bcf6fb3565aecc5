// Which worker serves which expert: the one object that owns all placement arithmetic (OD-MoE section 3,
// ../shared/DESIGN.md). Every node calls this same code, so main, the shadow and the workers agree on where
// each expert is without asking each other.
//
// Workers are numbered 0..N_W-1 in the order of the cluster file and split into N_W/G groups of G consecutive
// workers. Decode: sparse layer s (the s-th layer with a router) is served by group (s mod N_W/G); inside the
// group the experts of a set are assigned in ascending id order, expert i of the sorted set to the group's worker
// i mod G: one-to-one for up to G experts (one request's top-k), round-robin for more (a request's top-k with its
// hedged experts, the union of several requests' experts), so that no worker gets more than ceil(n/G). Prefill:
// expert e of every layer is served by worker (e mod N_W).
//
// Failover (Operations 4/4): main takes unreachable workers out of the placement (src/main_node/membership.h)
// and every node places over the members left (Without). A worker's experts are computed by any worker that
// is handed them (it reads an expert it does not hold from its checkpoint: slower, the same result), so the
// rule only has to give every (layer, expert) one live owner, the same on every node:
//  - decode: sparse layer s goes to its home group (s mod N_G) while the group has a member, else to the next
//    group (home + 1, home + 2, ... mod N_G) that has one; inside the group the experts go round-robin over
//    the member slots only;
//  - prefill: expert e goes to worker (e mod N_W) while it is a member, else to the (e mod M)-th of the M
//    members in index order.
// With every worker a member this is the rule above, unchanged. With none, nothing can be served
// (servable() is false; the functions below then fall back to the full layout, and callers must not use it).
//
// Thread safety: immutable; safe to share.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace odmoe {

struct Assignment {
  int32_t expert = 0;
  int32_t worker = 0;           // global worker index
  bool predicted = true;        // false: a miss, loaded on demand by `worker`
};

// Main's view of which workers take work (v1::MembershipView on the wire; src/main_node/membership.h owns it).
// epoch 0: no view (a tool outside the live membership).
struct MembershipView {
  uint64_t epoch = 0;
  std::vector<int32_t> absent;  // worker indices out of the placement, ascending
  bool operator==(const MembershipView&) const = default;
};

// The group size G a cluster runs with: the cluster file's group_size when set (> 0), else the model's top-k
// (at least 1). Every node decides it with this one function, so they agree on the topology.
int32_t DefaultGroupSize(int32_t configured_group_size, int64_t top_k);

class Placement {
 public:
  // InvalidArgument unless num_workers >= 1, 1 <= group_size <= num_workers and group_size divides
  // num_workers.
  static absl::StatusOr<Placement> Create(int32_t num_workers, int32_t group_size);
  // The placement of a cluster: group size DefaultGroupSize(configured_group_size, top_k). Errors are Create's,
  // prefixed with the cluster file and the group size (and where it came from).
  static absl::StatusOr<Placement> ForCluster(std::string_view cluster_file, int32_t num_workers,
                                              int32_t configured_group_size, int64_t top_k);

  // This layout over every worker but `absent` (worker indices, any order; duplicates count once).
  // InvalidArgument for an index outside 0..num_workers()-1.
  absl::StatusOr<Placement> Without(std::span<const int32_t> absent) const;

  int32_t num_workers() const { return num_workers_; }
  int32_t group_size() const { return group_size_; }
  int32_t num_groups() const { return num_workers_ / group_size_; }
  // Whether worker `worker` takes work (is not absent).
  bool member(int32_t worker) const { return member_[static_cast<size_t>(worker)]; }
  int32_t num_members() const { return static_cast<int32_t>(members_.size()); }
  // The workers left out, ascending.
  std::vector<int32_t> absent() const;
  // At least one worker is a member: every (layer, expert) has an owner.
  bool servable() const { return !members_.empty(); }

  // The group serving sparse layer `sparse_index` in decode: its home group, or the next one with a member.
  int32_t GroupOf(int64_t sparse_index) const;
  // The home group of sparse layer `sparse_index` (s mod N_G), whoever is a member.
  int32_t HomeGroupOf(int64_t sparse_index) const;
  // Global index of worker `slot` (0..G-1) of group `group`.
  int32_t WorkerOf(int32_t group, int32_t slot) const { return group * group_size_ + slot; }
  // True if worker `worker` is a member of the group serving `sparse_index`.
  bool ServesInDecode(int32_t worker, int64_t sparse_index) const;
  // Sparse-layer indices (0..num_sparse-1) that `worker` serves in decode.
  std::vector<int64_t> DecodeLayersOf(int32_t worker, int64_t num_sparse) const;

  // The placement of an expert set (any order and size; duplicates count once) on the group of `sparse_index`,
  // the one rule for any number of experts: in ascending expert order, each to the next slot (round-robin from
  // slot 0) that has room. `capacity` (empty: unlimited; else one entry per slot 0..G-1): the most experts each
  // worker of the group may take (what its budget holds); a full slot (and a slot whose worker is not a member)
  // is skipped, and experts beyond the group's total room are left out of the result. Up to G experts with
  // every worker a member and room >= 1 everywhere go one-to-one, expert i to slot i. Deterministic. Result in
  // ascending expert order.
  std::vector<Assignment> Assign(int64_t sparse_index, std::span<const int32_t> experts,
                                 std::span<const int32_t> capacity = {}) const;

  // Where the actual experts run when `predicted` (top-k and hedges, or several requests' experts: any set) was
  // announced (and loaded, by Assign) before routing was known:
  // an actual expert that was predicted runs where Assign(predicted) put it; a missed one goes to the worker
  // of a predicted expert that turned out unused (in ascending order of both), or, when there are more misses
  // than unused predictions, round-robin over the group's member slots. Result in ascending expert order.
  std::vector<Assignment> Resolve(int64_t sparse_index, std::span<const int32_t> predicted,
                                  std::span<const int32_t> actual) const;

  // The worker computing expert `expert` (of any layer) during prefill.
  int32_t PrefillWorkerOf(int32_t expert) const;

 private:
  Placement(int32_t num_workers, int32_t group_size);
  // The member slots of `group`, ascending (every slot when none is a member).
  std::vector<int32_t> MemberSlots(int32_t group) const;

  int32_t num_workers_;
  int32_t group_size_;
  std::vector<bool> member_;     // per worker
  std::vector<int32_t> members_;  // the member workers, ascending
};

}  // namespace odmoe
