// GPU residency accounting and the budgets (the pool's half of the out-of-core work).
//
// A hard budget (evict_live false) bounds GPU-backed chunks: those the GPU has held pages of since
// their arena was reserved, because the driver keeps a range's GPU memory until cudaFree. The rest
// of this comment is the reactive budget.
//
// Every chunk records whether the pool believes its pages are on the GPU. A run handed to PyTorch
// is assumed to be touched by the GPU, so it becomes resident; prefetches make chunks resident;
// evictions (prefetch to host) make them not. When an allocation would push residency past the
// budget, least recently used chunks go to host memory first: free chunks (dead data) and live
// blocks of at least min_swap_size, whole. Faults bring evicted data back when a kernel needs it,
// unseen by the pool, so NVML's high-water mark is the external check on this accounting.
#include <limits>

#include "chunk_pool.hpp"

namespace um {
uint64_t& ChunkPool::resident_bucket(const ChunkState& c) {
  return c.use == ChunkUse::free ? stats_.resident_free_bytes : stats_.resident_bytes[static_cast<int>(c.tag)];
}

ChunkPool::ChunkRange ChunkPool::chunk_range(const Block* run) const {
  const size_t first = static_cast<size_t>(run->ptr - run->arena->base) / config_.chunk_size;
  return {first, first + run->size / config_.chunk_size};
}

void ChunkPool::set_residency(Arena* a, size_t i, Residency r) {
  ChunkState& c = a->chunks[i];
  const bool was = c.residency == Residency::gpu, now = r == Residency::gpu;
  c.residency = r;
  if (was == now) return;
  const uint64_t n = config_.chunk_size;
  if (now) {
    resident_bucket(c) += n;
    stats_.resident_bytes_total += n;
    stats_.peak_resident_bytes = std::max(stats_.peak_resident_bytes, stats_.resident_bytes_total);
    if (!c.gpu_backed) {
      c.gpu_backed = true;
      a->backed += n;
      if (a->taken_runs) {
        device_live_.held += n;
        device_live_.held_peak = std::max(device_live_.held_peak, device_live_.held);
      }
      stats_.backed_bytes += n;
      stats_.peak_backed_bytes = std::max(stats_.peak_backed_bytes, stats_.backed_bytes);
      device_live_.backed_peak = std::max(device_live_.backed_peak, stats_.backed_bytes);
    }
  } else {
    resident_bucket(c) -= n;
    stats_.resident_bytes_total -= n;
  }
}

// An arena's first taken run makes its backed chunks held (DeviceLive::held); its last one's
// return lets them go.
void ChunkPool::take_arena_run(Arena* a) {
  if (a->taken_runs++ == 0) {
    device_live_.held += a->backed;
    device_live_.held_peak = std::max(device_live_.held_peak, device_live_.held);
  }
}

void ChunkPool::give_arena_run(Arena* a) {
  if (--a->taken_runs == 0) device_live_.held -= a->backed;
}

// Changes what holds a chunk; a resident chunk's bytes move to the new holder's bucket.
void ChunkPool::relabel(ChunkState& c, ChunkUse use, Tag tag) {
  const bool resident = c.residency == Residency::gpu;
  if (resident) resident_bucket(c) -= config_.chunk_size;
  c.use = use;
  c.tag = tag;
  if (resident) resident_bucket(c) += config_.chunk_size;
}

// A run taken for `tag`: its resident bytes count for the tag, and it is the most recently used.
void ChunkPool::claim_chunks(Block* run, Tag tag, ChunkUse use) {
  const uint64_t now = ++tick_;
  const auto [first, end] = chunk_range(run);
  for (size_t i = first; i < end; ++i) {
    relabel(run->arena->chunks[i], use, tag);
    run->arena->chunks[i].last_use = now;
  }
}

void ChunkPool::mark_resident(Block* run) {
  const auto [first, end] = chunk_range(run);
  for (size_t i = first; i < end; ++i) set_residency(run->arena, i, Residency::gpu);
}

void ChunkPool::mark_free(Block* run) {
  const auto [first, end] = chunk_range(run);
  for (size_t i = first; i < end; ++i) relabel(run->arena->chunks[i], ChunkUse::free, run->arena->chunks[i].tag);
}

// Makes room on the GPU for chunks [first, end) of `a` about to be handed out. Reactive mode
// (evict_live) always succeeds, over budget if nothing else can go; a hard budget is checked
// against GPU-backed memory instead and returns false when the chunks do not fit it.
bool ChunkPool::make_room(Arena* a, size_t first, size_t end, Stream stream) {
  if (!budget_.budget || !budget_.enabled) return true;
  if (hard_budget()) return within_backing(a, first, end);
  uint64_t incoming = 0;
  for (size_t i = first; i < end; ++i)
    if (a->chunks[i].residency != Residency::gpu) incoming += config_.chunk_size;
  while (stats_.resident_bytes_total + incoming > budget_.budget) {
    if (!evict_one(a, first, end, stream)) {
      ++stats_.over_budget_allocations;  // everything else is small or in use by this request
      return true;
    }
  }
  return true;
}

// A hard budget bounds the GPU memory the driver backs for the pool. Evicting would not lower it
// (the driver keeps a range's GPU memory until cudaFree), so wholly free arenas are returned,
// never the one holding the request; false if the chunks still do not fit.
bool ChunkPool::within_backing(Arena* a, size_t first, size_t end) {
  auto incoming = [&] {
    uint64_t n = 0;
    for (size_t i = first; i < end; ++i) n += a->chunks[i].gpu_backed ? 0 : config_.chunk_size;
    return n;
  };
  if (stats_.backed_bytes + incoming() <= budget_.budget) return true;
  release_free_arenas(a, /*backed_only=*/true);
  return stats_.backed_bytes + incoming() <= budget_.budget;
}

// Host-mapped tags (preferred location cpu, accessed by the GPU): kernels reach their pages over
// the link and the driver does not migrate them, so they stay out of the GPU's residency.
bool ChunkPool::host_mapped(Tag tag) const {
  const Advice& advice = policies_[static_cast<int>(tag)].advice;
  return advice.preferred == Location::cpu && advice.accessed_by_gpu;
}

// The run's pages go (or stay) in host memory: resident stretches are moved out once.
void ChunkPool::send_to_host(Block* run, Stream stream) {
  Arena* a = run->arena;
  const auto [first, end] = chunk_range(run);
  for (size_t i = first; i < end;) {
    size_t j = i;
    if (a->chunks[i].residency != Residency::gpu) {
      set_residency(a, i, Residency::host);
      ++i;
      continue;
    }
    while (j < end && a->chunks[j].residency == Residency::gpu) ++j;
    evict_range(a, i, j, stream);
    i = j;
  }
}

// Evicts the least recently used evictable unit outside [skip_first, skip_end) of skip_arena.
bool ChunkPool::evict_one(Arena* skip_arena, size_t skip_first, size_t skip_end, Stream stream) {
  Arena* best_arena = nullptr;
  size_t best = 0, best_end = 0;
  uint64_t oldest = std::numeric_limits<uint64_t>::max();
  for (auto& arena : arenas_) {
    Arena* a = arena.get();
    for (size_t i = 0; i < a->chunks.size(); ++i) {
      const ChunkState& c = a->chunks[i];
      if (c.residency != Residency::gpu || c.last_use >= oldest || c.use == ChunkUse::small) continue;
      if (a == skip_arena && i >= skip_first && i < skip_end) continue;
      size_t start = i, end = i + 1;
      if (c.use == ChunkUse::free) {  // dead data: take the whole resident free stretch in one call
        while (end < a->chunks.size() && a->chunks[end].use == ChunkUse::free &&
               a->chunks[end].residency == Residency::gpu &&
               !(a == skip_arena && end >= skip_first && end < skip_end))
          ++end;
      } else {  // a live block goes whole, if it is large enough to swap
        Block* b = live_block_containing(a->base + i * config_.chunk_size);
        if (!b) continue;
        start = static_cast<size_t>(b->ptr - a->base) / config_.chunk_size;
        end = start + b->size / config_.chunk_size;
        const bool overlaps_request = a == skip_arena && start < skip_end && end > skip_first;
        if (b->size < budget_.min_swap_size || overlaps_request) {
          i = end - 1;  // skip the rest of this block
          continue;
        }
      }
      oldest = c.last_use, best_arena = a, best = start, best_end = end;
      i = end - 1;
    }
  }
  if (!best_arena) return false;
  evict_range(best_arena, best, best_end, stream);
  return true;
}

void ChunkPool::evict_range(Arena* a, size_t first, size_t end, Stream stream) {
  const size_t chunk = config_.chunk_size;
  ++stats_.evictions;
  stats_.evicted_bytes += (end - first) * chunk;
  if (!backend_->prefetch_to_host(a->base + first * chunk, (end - first) * chunk, stream))
    note_backend_failure();
  for (size_t i = first; i < end; ++i) set_residency(a, i, Residency::host);
}

size_t ChunkPool::migrate(const void* ptr, bool to_gpu, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (trace_) trace_->line("m %p %d %p", ptr, to_gpu ? 1 : 0, stream);
  Block* b = live_block_containing(ptr);
  if (!b || b->container || b->overflowed) return 0;  // an overflowed block stays where the budget put it
  Arena* a = b->arena;
  const size_t chunk = config_.chunk_size;
  const auto [first, end] = chunk_range(b);
  const Residency want = to_gpu ? Residency::gpu : Residency::host;
  size_t moved = 0;
  for (size_t i = first; i < end; ++i) moved += a->chunks[i].residency != want ? chunk : 0;
  if (!moved) return 0;
  if (to_gpu) {
    const uint64_t now = ++tick_;
    for (size_t i = first; i < end; ++i) a->chunks[i].last_use = now;
    prefetch_chunks(a, first, end, stream);  // only the stretches not already there
  } else {
    evict_range(a, first, end, stream);
  }
  return moved;
}

void ChunkPool::set_budget(const BudgetConfig& budget) {
  std::lock_guard<std::mutex> lock(mu_);
  if (trace_)
    trace_->line("b %zu %zu %d %d", budget.budget, budget.min_swap_size, budget.enabled ? 1 : 0,
                 budget.evict_live ? 1 : 0);
  budget_ = budget;
  stats_.budget_bytes = budget.budget;
  stats_.min_swap_size = budget.min_swap_size;
}

BudgetConfig ChunkPool::budget() const {
  std::lock_guard<std::mutex> lock(mu_);
  return budget_;
}

}  // namespace um
