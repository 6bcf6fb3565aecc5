// Residency: which experts a worker holds on its device, and why. Pure bookkeeping: no device, no proto; what
// an entry holds once loaded (the device copy of the expert) is an opaque ResidentPayload that Residency owns
// and frees, always outside its lock.
//
// An entry is keyed by (layer, expert, position): predictions of one expert for several decode positions may be
// resident at once. Its states and the one method that makes each transition:
//
//   absent  --Reserve-->  loading   a Prefetch will copy it (no payload yet)
//   loading --Fill----->  ready     the Prefetch's copy is done
//   loading --Abandon-->  absent    the Prefetch's copy failed
//   absent  --Insert--->  ready     loaded ahead as a call was staged
//   absent  --KeepOrFree> ready     loaded on demand and kept for the other calls of its (request, position,
//                                   layer) (prefill mini-batches)
//   ready   --Take----->  in use    a computation uses it (Take waits while the entry is loading or in use)
//   in use  --Release-->  ready     used by fewer calls than its expert_calls: kept for the next one
//                      |  absent    otherwise: freed (no expert cache)
//   ready   --Advance / EvictIdle / Drop-->  absent
//
// Main's progress: the (request, position, layer) of its latest computation with a request id (0: untracked,
// never stale). A prediction for a (position, layer) main has reached or passed is late, and ready entries of
// such (position, layer)s, or of another request, are stale: Advance frees them (the current layer's own entries
// stay: the call being computed takes them).
//
// Eviction order (EvictIdle): ready entries not among the experts the caller still needs first, then oldest
// first (`sequence`, renewed when an entry becomes ready or is kept).
//
// Thread safety: every method may be called concurrently; one mutex (`mu_`) guards all state, and a condition
// variable wakes Take when an entry becomes ready or goes. Lock order: `mu_` may be held while Reserve's `fits`
// runs (it may take a leaf lock such as GpuBudget's); nothing else is called under it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace odmoe {

// What a ready entry holds. Destroyed outside Residency's lock.
class ResidentPayload {
 public:
  virtual ~ResidentPayload() = default;
};

using ExpertKey = std::pair<int64_t, int64_t>;              // (layer, expert)
using ResidentKey = std::tuple<int64_t, int64_t, int64_t>;  // (layer, expert, position)

// Why an entry is resident: predicted (Prefetch), loaded as its call was staged, or kept for the next call.
enum class ResidentOrigin { kPrefetch, kStaged, kKept };

// Counters of the transitions Residency makes.
struct ResidencyCounts {
  uint64_t evictions = 0;          // entries freed (used up, stale, evicted for room, or dropped)
  uint64_t prefetches_unused = 0;  // prefetched entries freed without a computation using them
  uint64_t prefetches_late = 0;    // predictions refused because main had reached their (position, layer)
  uint64_t experts_kept = 0;       // entries kept resident for another call
  void Add(const ResidencyCounts& o) {
    evictions += o.evictions;
    prefetches_unused += o.prefetches_unused;
    prefetches_late += o.prefetches_late;
    experts_kept += o.experts_kept;
  }
};

class Residency {
 public:
  // ---- Prefetch ------------------------------------------------------------------------------------------------
  enum class ReserveOutcome { kReserved, kLate, kNoRoom };
  struct Reservation {
    ReserveOutcome outcome = ReserveOutcome::kReserved;
    // The experts with no entry at the position, in order: kReserved, now loading; kNoRoom, what did not fit.
    std::vector<ResidentKey> keys;
  };
  // A prediction of `experts` for (request_id, position, layer). kLate (counted) when main has reached or
  // passed that (position, layer); otherwise the experts with no entry at `position` are reserved as loading,
  // all or none: kNoRoom (nothing reserved) when `fits(count)` says they do not fit. `fits` runs under the lock
  // and must not call into Residency.
  Reservation Reserve(uint64_t request_id, int64_t position, int64_t layer, const std::vector<int32_t>& experts,
                      absl::FunctionRef<bool(size_t count)> fits);
  // loading -> ready: the reserved entry `key` holds `payload` (`bytes` of device memory).
  // REQUIRES: `key` was reserved and neither filled nor abandoned.
  void Fill(const ResidentKey& key, std::unique_ptr<ResidentPayload> payload, uint64_t bytes);
  // loading -> absent for each of `keys` (a failed load); a waiting Take then finds nothing.
  void Abandon(const std::vector<ResidentKey>& keys);

  // ---- Staging and computation -------------------------------------------------------------------------------
  // True when Take would find an entry (loading, ready or in use) of expert `key` for `position`.
  bool Has(const ExpertKey& key, int64_t position) const;
  // absent -> ready (ResidentOrigin::kStaged): an expert loaded ahead for (request_id, position). Returns false,
  // and frees `payload`, when the key has an entry already.
  bool Insert(const ResidentKey& key, uint64_t request_id, std::unique_ptr<ResidentPayload> payload, uint64_t bytes);

  struct Taken {
    ResidentPayload* payload = nullptr;  // null: no entry (load on demand); else valid until Release
    ResidentKey key;
    ResidentOrigin origin = ResidentOrigin::kPrefetch;
  };
  // ready -> in use: the entry of expert `key` for `position`, else the newest for an earlier position (the same
  // weights; entries of later positions wait for their own turn), waiting while it is loading or in use.
  Taken Take(const ExpertKey& key, int64_t position);
  // in use -> ready (kept, ResidentOrigin::kKept) while fewer than `expert_calls` calls have used it; else
  // freed. REQUIRES: `key` was taken and not released.
  void Release(const ResidentKey& key, int32_t expert_calls);
  // An expert loaded on demand (not resident) after its first use: kept ready for the other calls of its
  // (request, position, layer) when `expert_calls` > 1 and `key` has no entry; otherwise freed (an eviction),
  // the use counted on the existing entry if there is one.
  void KeepOrFree(const ResidentKey& key, uint64_t request_id, int32_t expert_calls,
                  std::unique_ptr<ResidentPayload> payload, uint64_t bytes);

  // ---- Progress and freeing ----------------------------------------------------------------------------------
  // True when main has reached or passed (position, layer) of `request_id`, or moved on to another request.
  bool Passed(uint64_t request_id, int64_t position, int64_t layer) const;
  // Records main's progress (request_id 0: nothing) and frees the ready entries it made stale. Returns how many.
  int Advance(uint64_t request_id, int64_t position, int64_t layer);
  // Frees ready entries in eviction order until at least `bytes` are freed. Returns how many were freed.
  int EvictIdle(uint64_t bytes, const std::vector<ExpertKey>& keep);
  // Frees those of `keys` that are ready (loaded ahead by a call that never used them).
  void Drop(const std::vector<ResidentKey>& keys);

  // Entries loading, ready or in use.
  int64_t size() const;
  // The counters; `reset` zeroes them after reading.
  ResidencyCounts counts(bool reset);
  // The counters since start, whatever was reset (the metrics' counters only go up).
  ResidencyCounts totals() const;

 private:
  struct Entry {
    bool loading = true;  // reserved by Reserve, not yet filled
    bool in_use = false;  // taken
    int32_t uses = 0;     // calls that have computed with it
    ResidentOrigin origin = ResidentOrigin::kPrefetch;
    std::unique_ptr<ResidentPayload> payload;
    uint64_t bytes = 0;
    uint64_t sequence = 0;    // eviction order, oldest first
    uint64_t request_id = 0;  // the request it was loaded for (0: untracked, never stale)
  };
  struct Progress {
    uint64_t request_id = 0;
    int64_t position = -1;
    int64_t layer = -1;
  };
  using Map = std::map<ResidentKey, Entry>;
  using Victims = std::vector<std::unique_ptr<ResidentPayload>>;

  static bool PassedBy(const Progress& progress, uint64_t request_id, int64_t position, int64_t layer);
  Map::iterator FindLocked(const ExpertKey& key, int64_t position) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Map::const_iterator FindLocked(const ExpertKey& key, int64_t position) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `entry` ready with `payload`, newest in eviction order, and wakes waiters.
  void SetReadyLocked(Entry& entry, ResidentOrigin origin, uint64_t request_id,
                      std::unique_ptr<ResidentPayload> payload, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the entry's payload to `victims` (freed by the caller after unlocking), erases it, counts it.
  Map::iterator FreeLocked(Map::iterator it, Victims& victims) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // an entry became ready, was released or went
  Map entries_ ABSL_GUARDED_BY(mu_);
  Progress progress_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  ResidencyCounts counts_ ABSL_GUARDED_BY(mu_);
  ResidencyCounts reset_ ABSL_GUARDED_BY(mu_);  // what counts(true) zeroed, summed
};

}  // namespace odmoe
