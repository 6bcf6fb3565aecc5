#include "src/worker_node/residency.h"

#include <algorithm>

#include "src/common/status.h"

namespace odmoe {

bool Residency::PassedBy(const Progress& progress, uint64_t request_id, int64_t position, int64_t layer) {
  if (request_id == 0 || progress.request_id == 0) return false;
  if (request_id != progress.request_id) return true;
  return std::pair(position, layer) <= std::pair(progress.position, progress.layer);
}

bool Residency::Passed(uint64_t request_id, int64_t position, int64_t layer) const {
  absl::MutexLock lock(&mu_);
  return PassedBy(progress_, request_id, position, layer);
}

Residency::Map::iterator Residency::FindLocked(const ExpertKey& key, int64_t position) {
  auto it = entries_.upper_bound(ResidentKey{key.first, key.second, position});
  if (it == entries_.begin()) return entries_.end();
  --it;
  if (std::get<0>(it->first) != key.first || std::get<1>(it->first) != key.second) return entries_.end();
  return it;
}

Residency::Map::const_iterator Residency::FindLocked(const ExpertKey& key, int64_t position) const {
  return const_cast<Residency*>(this)->FindLocked(key, position);
}

void Residency::SetReadyLocked(Entry& entry, ResidentOrigin origin, uint64_t request_id,
                               std::unique_ptr<ResidentPayload> payload, uint64_t bytes) {
  entry.loading = false;
  entry.origin = origin;
  entry.sequence = next_sequence_++;
  entry.request_id = request_id;
  entry.payload = std::move(payload);
  entry.bytes = bytes;
  changed_.SignalAll();
}

Residency::Map::iterator Residency::FreeLocked(Map::iterator it, Victims& victims) {
  victims.push_back(std::move(it->second.payload));
  counts_.evictions += 1;
  changed_.SignalAll();
  return entries_.erase(it);
}

Residency::Reservation Residency::Reserve(uint64_t request_id, int64_t position, int64_t layer,
                                          const std::vector<int32_t>& experts,
                                          absl::FunctionRef<bool(size_t count)> fits) {
  Reservation r;
  absl::MutexLock lock(&mu_);
  if (PassedBy(progress_, request_id, position, layer)) {
    counts_.prefetches_late += 1;
    r.outcome = ReserveOutcome::kLate;
    return r;
  }
  for (int32_t e : experts) {
    if (!entries_.contains({layer, e, position})) r.keys.emplace_back(layer, e, position);
  }
  if (!fits(r.keys.size())) {
    r.outcome = ReserveOutcome::kNoRoom;
    return r;
  }
  for (const ResidentKey& key : r.keys) {
    Entry& entry = entries_[key];
    entry.sequence = next_sequence_++;
    entry.request_id = request_id;
  }
  return r;
}

void Residency::Fill(const ResidentKey& key, std::unique_ptr<ResidentPayload> payload, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  ODMOE_CHECK(it != entries_.end() && it->second.loading);
  it->second.payload = std::move(payload);
  it->second.bytes = bytes;
  it->second.loading = false;  // keeps its place in the eviction order: that of its prediction
  changed_.SignalAll();
}

void Residency::Abandon(const std::vector<ResidentKey>& keys) {
  absl::MutexLock lock(&mu_);
  for (const ResidentKey& key : keys) {
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.loading) entries_.erase(it);
  }
  changed_.SignalAll();
}

bool Residency::Has(const ExpertKey& key, int64_t position) const {
  absl::MutexLock lock(&mu_);
  return FindLocked(key, position) != entries_.end();
}

bool Residency::Insert(const ResidentKey& key, uint64_t request_id, std::unique_ptr<ResidentPayload> payload,
                       uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = entries_.try_emplace(key);
    if (inserted) {
      SetReadyLocked(it->second, ResidentOrigin::kStaged, request_id, std::move(payload), bytes);
      return true;
    }
  }
  return false;  // `payload` is freed here, outside the lock
}

Residency::Taken Residency::Take(const ExpertKey& key, int64_t position) {
  absl::MutexLock lock(&mu_);
  auto it = FindLocked(key, position);
  while (it != entries_.end() && (it->second.loading || it->second.in_use)) {
    changed_.Wait(&mu_);
    it = FindLocked(key, position);
  }
  Taken taken;
  if (it == entries_.end()) return taken;
  it->second.in_use = true;
  taken.payload = it->second.payload.get();
  taken.key = it->first;
  taken.origin = it->second.origin;
  return taken;
}

void Residency::Release(const ResidentKey& key, int32_t expert_calls) {
  Victims victims;  // declared first: freed after the lock is released (no expert cache)
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  ODMOE_CHECK(it != entries_.end() && it->second.in_use);
  Entry& entry = it->second;
  entry.in_use = false;
  entry.uses += 1;
  if (entry.uses >= expert_calls) {
    FreeLocked(it, victims);
    return;
  }
  if (entry.origin != ResidentOrigin::kKept) counts_.experts_kept += 1;
  entry.origin = ResidentOrigin::kKept;
  entry.sequence = next_sequence_++;
  changed_.SignalAll();
}

void Residency::KeepOrFree(const ResidentKey& key, uint64_t request_id, int32_t expert_calls,
                           std::unique_ptr<ResidentPayload> payload, uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    if (expert_calls > 1) {
      auto [it, inserted] = entries_.try_emplace(key);
      it->second.uses += 1;
      if (inserted) {
        SetReadyLocked(it->second, ResidentOrigin::kKept, request_id, std::move(payload), bytes);
        counts_.experts_kept += 1;
        return;
      }
    }
    counts_.evictions += 1;
  }
  // `payload` is freed here, outside the lock.
}

int Residency::Advance(uint64_t request_id, int64_t position, int64_t layer) {
  if (request_id == 0) return 0;
  Victims victims;
  {
    absl::MutexLock lock(&mu_);  // released before `victims` go
    progress_ = Progress{request_id, position, layer};
    for (auto it = entries_.begin(); it != entries_.end();) {
      const Entry& entry = it->second;
      const auto& [entry_layer, expert, entry_position] = it->first;
      const bool current = entry.request_id == request_id && entry_position == position && entry_layer == layer;
      if (entry.loading || entry.in_use || current ||
          !PassedBy(progress_, entry.request_id, entry_position, entry_layer)) {
        ++it;
        continue;
      }
      if (entry.origin == ResidentOrigin::kPrefetch) counts_.prefetches_unused += 1;
      it = FreeLocked(it, victims);
    }
  }
  return static_cast<int>(victims.size());
}

int Residency::EvictIdle(uint64_t bytes, const std::vector<ExpertKey>& keep) {
  Victims victims;
  {
    absl::MutexLock lock(&mu_);
    // Candidates: ready entries, those the caller does not need first, then oldest first.
    std::vector<std::pair<std::pair<bool, uint64_t>, ResidentKey>> order;
    for (const auto& [key, entry] : entries_) {
      if (entry.loading || entry.in_use) continue;
      const bool kept =
          std::find(keep.begin(), keep.end(), ExpertKey{std::get<0>(key), std::get<1>(key)}) != keep.end();
      order.push_back({{kept, entry.sequence}, key});
    }
    std::sort(order.begin(), order.end());
    uint64_t freed = 0;
    for (const auto& [rank, key] : order) {
      if (freed >= bytes) break;
      auto it = entries_.find(key);
      freed += it->second.bytes;
      if (it->second.origin == ResidentOrigin::kPrefetch) counts_.prefetches_unused += 1;
      FreeLocked(it, victims);
    }
  }
  return static_cast<int>(victims.size());
}

void Residency::Drop(const std::vector<ResidentKey>& keys) {
  Victims victims;  // declared first: freed after the lock is released
  absl::MutexLock lock(&mu_);
  for (const ResidentKey& key : keys) {
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.in_use || it->second.loading) continue;
    FreeLocked(it, victims);
  }
}

int64_t Residency::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(entries_.size());
}

ResidencyCounts Residency::counts(bool reset) {
  absl::MutexLock lock(&mu_);
  const ResidencyCounts c = counts_;
  if (reset) {
    reset_.Add(counts_);
    counts_ = ResidencyCounts{};
  }
  return c;
}

ResidencyCounts Residency::totals() const {
  absl::MutexLock lock(&mu_);
  ResidencyCounts c = reset_;
  c.Add(counts_);
  return c;
}

}  // namespace odmoe
