#include "chunk_pool.hpp"

#include <algorithm>
#include <cstdio>

namespace um {
namespace {

constexpr size_t kSmallAlignment = 512;  // as PyTorch's caching allocator: keeps vector loads aligned
// What an overflowed run carries: host memory the GPU maps, as a host-mapped tag's (spill.py).
constexpr Advice kHostMapped{Location::cpu, false, true, false};

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

std::string format_bytes(uint64_t n) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

size_t chunk_index(const Arena* a, const char* p, size_t chunk) {
  return static_cast<size_t>(p - a->base) / chunk;
}

}  // namespace

void StreamSet::add(Stream s) {
  for (const StreamUse& use : uses)
    if (use.stream == s) return;
  uses.push_back(StreamUse{s});
}

// Per stream, what covers both: not knowing the point covers any point; else the later point.
void StreamSet::merge(const StreamSet& other) {
  for (const StreamUse& theirs : other.uses) {
    auto mine = std::find_if(uses.begin(), uses.end(), [&](const StreamUse& u) { return u.stream == theirs.stream; });
    if (mine == uses.end())
      uses.push_back(theirs);
    else if (mine->freed && (!theirs.freed || theirs.seq > mine->seq))
      *mine = theirs;
  }
}

ChunkPool::ChunkPool(std::unique_ptr<MemoryBackend> backend, PoolConfig config)
    : backend_(std::move(backend)), config_(config), trace_(PoolTrace::from_environment()) {
  stats_.chunk_size = config_.chunk_size;
  stats_.max_reserved_bytes = config_.max_reserved;
  if (trace_) trace_->line("c %zu %zu %zu", config_.chunk_size, config_.arena_size, config_.max_reserved);
}

ChunkPool::~ChunkPool() {
  // Every block is in a free set or live_, and every small chunk holds at least one of them.
  std::set<Block*> blocks;
  for (auto& set : free_runs_) blocks.insert(set.begin(), set.end());
  for (auto& [ptr, b] : live_) blocks.insert(b);
  for (auto& set : free_small_) blocks.insert(set.begin(), set.end());
  std::set<Block*> containers;
  for (Block* b : blocks)
    if (b->container) containers.insert(b->container);
  for (Block* b : blocks) delete b;
  for (Block* c : containers) delete c;
  for (auto& a : arenas_) backend_->release(a->base, a->size);
}

// ---- allocation -------------------------------------------------------------------------------

void* ChunkPool::allocate(size_t bytes, Stream stream, Tag tag, AllocError* err) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes == 0) bytes = 1;  // a distinct address per request, as cudaMalloc callers expect
  const bool small = bytes <= config_.chunk_size / 2;
  // Read once: another thread may switch it meanwhile. Small requests stay in lasting arenas (ArenaUse).
  const bool step = step_arenas();
  const ArenaUse arenas = step && !small ? ArenaUse::step : ArenaUse::lasting;
  void* p = small ? allocate_small(bytes, stream, tag, arenas, err) : allocate_large(bytes, stream, tag, arenas, err);
  if (trace_) {
    if (p)
      trace_->line("a %p %zu %d %d %p", p, bytes, static_cast<int>(tag), static_cast<int>(step), stream);
    else
      trace_->line("o %zu %d %d %p", bytes, static_cast<int>(tag), static_cast<int>(step), stream);
  }
  if (!p && err->kind == UM_ERR_OOM) {
    ++stats_.num_ooms;
    err->message = oom_message(bytes, tag, err->over_budget);
  }
  return p;
}

void* ChunkPool::allocate_large(size_t bytes, Stream stream, Tag tag, ArenaUse arenas, AllocError* err) {
  Block* b = take_chunk_run(round_up(bytes, config_.chunk_size), stream, tag, ChunkUse::large, arenas, err);
  if (!b) return nullptr;
  b->requested = bytes;
  live_.emplace(b->ptr, b);
  count_live(b, +1);
  return b->ptr;
}

void* ChunkPool::allocate_small(size_t bytes, Stream stream, Tag tag, ArenaUse arenas, AllocError* err) {
  const size_t rounded = round_up(bytes, kSmallAlignment);
  FreeSet& free_set = free_small_of(tag);
  Block* b = find_fit(free_set, rounded);
  if (b) {
    free_set.erase(b);
    order_for_reuse(b, stream);
    Arena* a = b->arena;
    a->chunks[chunk_index(a, b->ptr, config_.chunk_size)].last_use = ++tick_;
  } else {
    Block* chunk = take_chunk_run(config_.chunk_size, stream, tag, ChunkUse::small, arenas, err);
    if (!chunk) return nullptr;
    chunk->is_container = true;
    stats_.held_bytes[static_cast<int>(tag)] += chunk->size;
    ++stats_.small_chunks;
    b = new Block(chunk->ptr, chunk->size, chunk->arena);
    b->container = chunk;
    b->streams.reset(stream);
  }
  split(b, rounded, free_set);
  b->allocated = true;
  b->tag = tag;
  b->requested = bytes;
  live_.emplace(b->ptr, b);
  count_live(b, +1);
  return b->ptr;
}

// A run of whole chunks for `tag`, ordered after its previous users and carrying the tag's hints.
// A host-mapped tag's chunks live in host memory (the GPU reads and writes them over the link),
// so they never count against the budget; every other run is made room for first, and where the
// hard budget refuses it, a step's large request may overflow to host memory (set_overflow).
Block* ChunkPool::take_chunk_run(size_t rounded, Stream stream, Tag tag, ChunkUse use, ArenaUse arenas,
                                 AllocError* err) {
  bool on_gpu = !host_mapped(tag);
  Block* b = find_run(rounded, !on_gpu, stream, arenas);
  if (!b) b = grow(rounded, arenas);
  // Cached arenas may hold the cap while no free run fits: return them and try once more.
  if (!b && release_free_arenas() > 0) b = grow(rounded, arenas);
  if (!b) {
    err->kind = UM_ERR_OOM;  // allocate() writes the message, with the size the caller asked for
    return nullptr;
  }
  auto room = [&](Block* run) {
    const size_t first = chunk_index(run->arena, run->ptr, config_.chunk_size);
    return !on_gpu || make_room(run->arena, first, first + rounded / config_.chunk_size, stream);
  };
  size_t overflowed = 0;
  if (!room(b)) {
    // Before failing, the other arenas' free runs: backed memory of one use serves the other when
    // the budget leaves no new backing (an optimizer's temporaries in the step's freed activations,
    // while the step's gradients keep its arena).
    const ArenaUse other = arenas == ArenaUse::step ? ArenaUse::lasting : ArenaUse::step;
    b = find_run(rounded, false, stream, other);
    if (!b || !room(b)) {
      b = overflow_run(rounded, stream, use, arenas, &overflowed);
      if (!b) {
        err->kind = UM_ERR_OOM;
        err->over_budget = true;
        return nullptr;
      }
    }
  }
  free_runs_of(b->arena).erase(b);
  split(b, rounded, free_runs_of(b->arena));
  take_arena_run(b->arena);  // before mark_resident: the chunks it backs are held
  order_for_reuse(b, stream);
  b->allocated = true;
  b->tag = tag;
  b->overflowed = overflowed;
  claim_chunks(b, tag, use);
  if (overflowed) {
    place_over_budget(b, tag, overflowed);
    return b;
  }
  apply_tag(b, tag, stream);
  if (on_gpu)
    mark_resident(b);  // PyTorch hands it to GPU kernels: its pages will be on the GPU
  else
    send_to_host(b, stream);
  return b;
}

// Where the hard budget refuses a step's large request: the window of free chunks the GPU has
// backed most of (find_run), of whose other chunks as many as the budget still backs go on the
// GPU and the rest, `host_bytes`, stay in host memory, so that no more of the request than the
// budget forces is reached over the link. A window of 1 GiB with 0.8 GiB of it backed overflows
// 0.2 GiB, not 1 GiB. nullptr where overflow is off or would pass its limit.
Block* ChunkPool::overflow_run(size_t rounded, Stream stream, ChunkUse use, ArenaUse arenas, size_t* host_bytes) {
  if (!hard_budget() || !overflow_limit_ || use != ChunkUse::large || arenas != ArenaUse::step) return nullptr;
  Block* b = find_run(rounded, false, stream, arenas);
  if (!b) b = grow(rounded, arenas);
  if (!b) return nullptr;
  const size_t first = chunk_index(b->arena, b->ptr, config_.chunk_size);
  size_t unbacked = 0;
  for (size_t i = first; i < first + rounded / config_.chunk_size; ++i)
    unbacked += b->arena->chunks[i].gpu_backed ? 0 : config_.chunk_size;
  const size_t room = budget_.budget > stats_.backed_bytes ? budget_.budget - stats_.backed_bytes : 0;
  const size_t host = unbacked - std::min(unbacked, room / config_.chunk_size * config_.chunk_size);
  if (stats_.overflow_bytes + host > overflow_limit_) return nullptr;
  *host_bytes = host;  // 0 where arenas returned since the first look left the budget room for it all
  return b;
}

// An overflowed run's chunks: those the GPU has backed, and the first of the others up to
// `host_bytes` short of them all, carry the tag's hints and count as on the GPU; the last
// `host_bytes` of the unbacked ones are hinted as host memory the GPU maps (the tag's own hints
// would bring their pages to the GPU) and count as in host memory.
void ChunkPool::place_over_budget(Block* run, Tag tag, size_t host_bytes) {
  Arena* a = run->arena;
  const auto [first, end] = chunk_range(run);
  std::vector<bool> on_host(end - first, false);
  for (size_t i = end, left = host_bytes / config_.chunk_size; i-- > first && left;)
    if (!a->chunks[i].gpu_backed) on_host[i - first] = true, --left;
  const Advice& advice = policies_[static_cast<int>(tag)].advice;
  for (size_t i = first; i < end;) {
    size_t j = i;
    while (j < end && on_host[j - first] == on_host[i - first]) ++j;
    advise_chunks(a, i, j, on_host[i - first] ? kHostMapped : advice);
    for (size_t k = i; k < j; ++k) set_residency(a, k, on_host[i - first] ? Residency::host : Residency::gpu);
    i = j;
  }
}

// Best fit, with two exceptions among the next few fits. Under a budget, only a run whose first
// `rounded` bytes are already where the request wants them, so reuse neither pushes other chunks
// out nor makes the driver back new GPU memory: on the GPU (resident; GPU-backed under a hard
// budget) for GPU tags, never GPU-backed for host-mapped tags (a new arena if none is free, under
// a hard budget). And a run a side stream (record_stream) may still be using gives way to an idle
// one up to twice the request: the kernel that takes it then need not wait for, say, the copy of
// an offloaded activation (PyTorch's caching allocator, too, reuses only blocks whose events are
// done). Twice at most, so that waiting is preferred to cutting up large runs.
Block* ChunkPool::find_run(size_t rounded, bool for_host, Stream stream, ArenaUse use) {
  FreeSet& runs = free_runs_[static_cast<int>(use)];
  Block* best = find_fit(runs, rounded);
  if (!best) return nullptr;
  const bool placed = budget_.budget && budget_.enabled;
  const bool backing = hard_budget();
  auto suits = [&](const ChunkState& c) {
    if (for_host) return !c.gpu_backed;
    return backing ? c.gpu_backed : c.residency == Residency::gpu;
  };
  auto in_place = [&](const Block* run) {
    const size_t first = chunk_index(run->arena, run->ptr, config_.chunk_size);
    const size_t end = first + rounded / config_.chunk_size;
    size_t i = first;
    while (i < end && suits(run->arena->chunks[i])) ++i;
    return i == end;
  };
  constexpr int kLookahead = 64;  // bounds the hot path; free runs are few in steady state
  Block* busy = nullptr;          // the first in place, still in use on a side stream
  int looked = 0;
  for (auto it = runs.find(best); it != runs.end() && looked < kLookahead; ++it, ++looked) {
    Block* run = *it;
    if (busy && run->size > 2 * rounded) break;
    if (placed && !in_place(run)) continue;
    if (idle_for(run, stream)) return run;
    if (!busy) busy = run;
  }
  if (busy) return busy;  // its reuse waits on the GPU for the side stream, never on the host
  // Host data in GPU-backed chunks would hold budget it never uses: new address space instead.
  if (placed && for_host && backing) {
    if (Block* fresh = grow(rounded, use)) return fresh;
  }
  // GPU data under a hard budget, with no run backed for all of it: where it needs least new backing.
  if (placed && backing && !for_host) return fewest_unbacked(runs, best, rounded);
  return best;
}

// The stretch of `rounded` bytes, in any free run at any chunk offset, with the fewest chunks the
// GPU has not backed yet: the request then backs as little new GPU memory as the free runs allow.
// Best fit alone would take the smallest run that fits, even unbacked, while backed chunks sit
// free in runs of other sizes (ResNet-50 at batch 616 under 8 GiB: a 943 MiB request with 2.5 GiB
// free and backed, none of it where best fit looked). Only reached when no run is wholly backed.
Block* ChunkPool::fewest_unbacked(FreeSet& runs, Block* best, size_t rounded) {
  const size_t n = rounded / config_.chunk_size;
  Block* chosen = nullptr;
  size_t chosen_offset = 0, fewest = SIZE_MAX;
  for (auto it = runs.find(best); it != runs.end(); ++it) {  // every run from the best fit up
    Block* run = *it;
    const auto [first, end] = chunk_range(run);
    const std::vector<ChunkState>& chunks = run->arena->chunks;
    size_t unbacked = 0;
    for (size_t i = first; i < first + n; ++i) unbacked += !chunks[i].gpu_backed;
    for (size_t start = first;; ++start) {  // the window [start, start + n) slides over the run
      if (unbacked < fewest) fewest = unbacked, chosen = run, chosen_offset = (start - first) * config_.chunk_size;
      if (fewest == 0 || start + n == end) break;
      unbacked += !chunks[start + n].gpu_backed;
      unbacked -= !chunks[start].gpu_backed;
    }
    if (fewest == 0) break;
  }
  return chosen && chosen_offset ? carve(chosen, chosen_offset) : chosen;
}

// Splits free run `run` at `offset`: its first `offset` bytes stay a free run, and the rest, also
// free and in the same set, is returned.
Block* ChunkPool::carve(Block* run, size_t offset) {
  FreeSet& set = free_runs_of(run->arena);
  set.erase(run);
  split(run, offset, set);
  set.insert(run);
  return run->next;
}

Block* ChunkPool::find_fit(FreeSet& set, size_t size) {
  Block key(nullptr, size, nullptr);
  auto it = set.lower_bound(&key);
  return it == set.end() ? nullptr : *it;
}

// A new arena for `use`, inserted into its free runs as one; nullptr if the cap or the backend refuses.
// Under a hard budget a step arena spans the whole budget: one address range, in which a large
// request can take any stretch of free backed chunks (fewest_unbacked), where arenas of 1 GiB
// would each hold a few live blocks and leave no stretch of 943 MiB (ResNet-50 at batch 616)
// backed in any of them. It costs address space only: the budget bounds what the GPU backs.
Block* ChunkPool::grow(size_t rounded, ArenaUse use) {
  const size_t arena_size = use == ArenaUse::step && hard_budget()
                                ? round_up(std::max<size_t>(budget_.budget, config_.arena_size), config_.chunk_size)
                                : config_.arena_size;
  size_t size = std::max(arena_size, rounded);
  if (stats_.reserved_bytes + size > config_.max_reserved) size = rounded;  // a smaller one may fit
  if (stats_.reserved_bytes + size > config_.max_reserved) return nullptr;
  void* base = backend_->reserve(size);
  if (!base) {
    note_backend_failure();
    return nullptr;
  }
  auto arena = std::make_unique<Arena>(
      Arena{static_cast<char*>(base), size, std::vector<ChunkState>(size / config_.chunk_size), use});
  Block* b = new Block(arena->base, size, arena.get());
  arenas_.push_back(std::move(arena));
  stats_.reserved_bytes += size;
  ++stats_.arena_reserves;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  free_runs_of(b->arena).insert(b);
  return b;
}

// Cuts `b` down to `size` bytes; the rest becomes a free neighbour in `set`.
void ChunkPool::split(Block* b, size_t size, FreeSet& set) {
  if (b->size == size) return;
  Block* rest = new Block(b->ptr + size, b->size - size, b->arena);
  rest->container = b->container;
  rest->streams = b->streams;  // whoever might touch the whole might touch the rest
  rest->prev = b;
  rest->next = b->next;
  if (b->next) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  set.insert(rest);
}

// Forgets the side streams known to be done with `b`; true if `stream` need wait for none of them.
// The stream that took it last, and a side stream whose point is not known, are not waited for here.
bool ChunkPool::idle_for(Block* b, Stream stream) {
  auto& uses = b->streams.uses;
  if (uses.size() < 2) return true;
  auto done = [&](const StreamUse& use) { return use.freed && backend_->reached(use.freed.get()); };
  uses.erase(std::remove_if(uses.begin() + 1, uses.end(), done), uses.end());
  return std::none_of(uses.begin() + 1, uses.end(),
                      [&](const StreamUse& use) { return use.freed && use.stream != stream; });
}

// Stream order: waits only where another stream may still use the memory.
void ChunkPool::order_for_reuse(Block* b, Stream stream) {
  for (const StreamUse& use : b->streams.uses) {
    if (use.stream == stream) continue;
    ++stats_.stream_waits;
    const bool ok = use.freed ? backend_->wait(stream, use.freed.get()) : backend_->order_after(stream, use.stream);
    if (!ok) note_backend_failure();
  }
  b->streams.reset(stream);
}

// Records, for each stream record_stream added, the point it has reached as the block is freed.
// The stream the block was taken on needs none: it reuses the block in its own order, and the
// rare other taker orders after it at reuse.
void ChunkPool::mark_freed(Block* b) {
  auto& uses = b->streams.uses;
  for (size_t i = 1; i < uses.size(); ++i) {
    Event point = backend_->record(uses[i].stream);
    if (!point) {  // stays unknown: reuse orders after all that stream's work, still correct
      note_backend_failure();
      continue;
    }
    MemoryBackend* backend = backend_.get();
    uses[i].freed = std::shared_ptr<void>(point, [backend](void* e) { backend->release_event(e); });
    uses[i].seq = ++mark_seq_;
    ++stats_.free_events;
  }
}

// ---- hints ------------------------------------------------------------------------------------

void ChunkPool::apply_tag(Block* run, Tag tag, Stream stream) {
  const TagPolicy& policy = policies_[static_cast<int>(tag)];
  const size_t first = chunk_index(run->arena, run->ptr, config_.chunk_size);
  const size_t end = first + run->size / config_.chunk_size;
  advise_chunks(run->arena, first, end, policy.advice);
  if (policy.prefetch && !host_mapped(tag)) prefetch_chunks(run->arena, first, end, stream);
}

// One cudaMemAdvise sequence per run of chunks that share their current hints; chunks that
// already carry the wanted hints cost nothing, so steady-state reuse makes no calls.
void ChunkPool::advise_chunks(Arena* a, size_t first, size_t end, const Advice& want) {
  const size_t chunk = config_.chunk_size;
  for (size_t i = first; i < end;) {
    const Advice have = a->chunks[i].applied;
    size_t j = i;
    while (j < end && a->chunks[j].applied == have) ++j;
    if (have != want) {
      ++stats_.advise_calls;
      // A failed hint is counted and reported, not retried: hints never change correctness.
      if (!backend_->advise(a->base + i * chunk, (j - i) * chunk, have, want)) note_backend_failure();
      for (size_t k = i; k < j; ++k) a->chunks[k].applied = want;
    }
    i = j;
  }
}

void ChunkPool::prefetch_chunks(Arena* a, size_t first, size_t end, Stream stream) {
  const size_t chunk = config_.chunk_size;
  for (size_t i = first; i < end;) {
    if (a->chunks[i].residency == Residency::gpu) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < end && a->chunks[j].residency != Residency::gpu) ++j;
    ++stats_.prefetch_calls;
    stats_.prefetch_bytes += (j - i) * chunk;
    if (!backend_->prefetch_to_gpu(a->base + i * chunk, (j - i) * chunk, stream)) note_backend_failure();
    for (size_t k = i; k < j; ++k) set_residency(a, k, Residency::gpu);
    i = j;
  }
}

void ChunkPool::set_overflow(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (trace_) trace_->line("O %zu", bytes);
  overflow_limit_ = bytes;
}

uint64_t ChunkPool::take_overflow_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t peak = overflow_peak_;
  overflow_peak_ = stats_.overflow_bytes;
  return peak;
}

void ChunkPool::set_step_arenas(bool on) {
  step_arenas_.store(on, std::memory_order_relaxed);
  if (trace_) {
    std::lock_guard<std::mutex> lock(mu_);
    trace_->line("s %d", on ? 1 : 0);
  }
}

void ChunkPool::set_tag_policy(Tag tag, const TagPolicy& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  if (trace_)
    trace_->line("P %d %d %d %d %d %d", static_cast<int>(tag), static_cast<int>(policy.advice.preferred),
                 policy.advice.read_mostly, policy.advice.accessed_by_gpu, policy.advice.accessed_by_cpu,
                 policy.prefetch);
  policies_[static_cast<int>(tag)] = policy;
}

void ChunkPool::note_backend_failure() {
  ++stats_.backend_errors;
  backend_error_ = backend_->error();
}

std::string ChunkPool::backend_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return backend_error_;
}

// ---- release ----------------------------------------------------------------------------------

bool ChunkPool::deallocate(void* ptr) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(static_cast<char*>(ptr));
  if (it == live_.end()) return false;
  if (trace_) trace_->line("f %p", ptr);
  Block* b = it->second;
  live_.erase(it);
  count_live(b, -1);
  b->allocated = false;
  mark_freed(b);
  if (b->container)
    release_small(b);
  else
    release_chunk_run(b);
  return true;
}

void ChunkPool::release_chunk_run(Block* b) {
  give_arena_run(b->arena);
  mark_free(b);
  b->allocated = false;
  b->is_container = false;
  merge_into_free(b, free_runs_of(b->arena));
}

// A small block goes back to its chunk; a chunk left wholly free goes back to the chunk runs,
// where any size can use it.
void ChunkPool::release_small(Block* b) {
  FreeSet& set = free_small_of(b->container->tag);
  b = merge_into_free(b, set);
  if (b->prev || b->next) return;
  set.erase(b);
  Block* chunk = b->container;
  chunk->streams = b->streams;  // everyone who used any part of the chunk
  delete b;
  stats_.held_bytes[static_cast<int>(chunk->tag)] -= chunk->size;
  --stats_.small_chunks;
  release_chunk_run(chunk);
}

// Joins `b` with free neighbours; the result carries every stream that touched its parts.
Block* ChunkPool::merge_into_free(Block* b, FreeSet& set) {
  for (Block* n : {b->prev, b->next}) {
    if (!n || n->allocated) continue;
    set.erase(n);
    if (n == b->prev) {
      b->ptr = n->ptr;
      b->prev = n->prev;
      if (n->prev) n->prev->next = b;
    } else {
      b->next = n->next;
      if (n->next) n->next->prev = b;
    }
    b->size += n->size;
    b->streams.merge(n->streams);
    delete n;
  }
  set.insert(b);
  return b;
}

size_t ChunkPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  if (trace_) trace_->line("e");
  return release_free_arenas();
}

// Returns arenas that are one free run; `backed_only`: only those the GPU has backed some of,
// which are all a hard budget gains from (an arena an overflowed request took holds host memory
// only, and returning it would cost a cudaFree and, at the next overflow, a new arena, each step).
// cudaFree synchronizes the device, which is also what makes this safe while other streams may
// still be finishing work on that memory.
size_t ChunkPool::release_free_arenas(const Arena* keep, bool backed_only) {
  std::vector<Block*> whole;
  for (FreeSet& runs : free_runs_)
    for (Block* b : runs)
      if (!b->prev && !b->next && b->arena != keep && (!backed_only || b->arena->backed)) whole.push_back(b);
  size_t released = 0;
  for (Block* b : whole) {
    free_runs_of(b->arena).erase(b);
    Arena* a = b->arena;
    for (size_t i = 0; i < a->chunks.size(); ++i) {  // gone, and the driver's GPU memory with it
      set_residency(a, i, Residency::untouched);
      if (a->chunks[i].gpu_backed) stats_.backed_bytes -= config_.chunk_size;
    }
    backend_->release(a->base, a->size);
    released += a->size;
    stats_.reserved_bytes -= a->size;
    ++stats_.arena_releases;
    delete b;
    arenas_.erase(std::find_if(arenas_.begin(), arenas_.end(),
                               [a](const std::unique_ptr<Arena>& p) { return p.get() == a; }));
  }
  return released;
}

// ---- tags, streams, queries -------------------------------------------------------------------

bool ChunkPool::record_stream(void* ptr, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(static_cast<char*>(ptr));
  if (it == live_.end()) return false;
  if (trace_) trace_->line("r %p %p", ptr, stream);
  it->second->streams.add(stream);
  return true;
}

Block* ChunkPool::live_block_containing(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  auto it = live_.upper_bound(const_cast<char*>(p));
  if (it == live_.begin()) return nullptr;
  Block* b = std::prev(it)->second;
  return p < b->ptr + std::max<size_t>(b->requested, 1) ? b : nullptr;
}

bool ChunkPool::retag(const void* ptr, Tag tag, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  return retag_locked(ptr, tag, stream);
}

size_t ChunkPool::retag_many(const void* const* ptrs, size_t n, Tag tag, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t found = 0;
  for (size_t i = 0; i < n; ++i) found += retag_locked(ptrs[i], tag, stream);
  return found;
}

bool ChunkPool::retag_locked(const void* ptr, Tag tag, Stream stream) {
  Block* b = live_block_containing(ptr);
  if (!b) return false;
  if (trace_) trace_->line("t %p %d %p", static_cast<void*>(b->ptr), static_cast<int>(tag), stream);
  if (b->tag == tag) return true;
  move_accounting(b, tag);
  b->tag = tag;
  // A small block shares its chunk's hints with its neighbours, and an overflowed one stays in host
  // memory (the budget refused it), so only their accounting moves.
  if (!b->container && !b->overflowed) {
    claim_chunks(b, tag, ChunkUse::large);
    apply_tag(b, tag, stream);
    if (host_mapped(tag)) send_to_host(b, stream);
  }
  return true;
}

bool ChunkPool::block_at(const void* ptr, um_block_info* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = live_block_containing(ptr);
  if (!b) return false;
  const Block* run = b->container ? b->container : b;
  out->base = reinterpret_cast<uint64_t>(b->ptr);
  out->size = b->size;
  out->requested = b->requested;
  out->tag = static_cast<int32_t>(b->tag);
  out->is_small = b->container != nullptr;
  out->residency = static_cast<int32_t>(
      run->arena->chunks[chunk_index(run->arena, static_cast<const char*>(ptr), config_.chunk_size)].residency);
  return true;
}

std::vector<um_range> ChunkPool::ranges_for_tag(Tag tag) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<um_range> out;
  for (auto& [ptr, b] : live_)
    if (b->tag == tag) out.push_back({reinterpret_cast<uint64_t>(ptr), b->requested});
  return out;
}

// ---- statistics -------------------------------------------------------------------------------

// Live bytes count what was asked for; held bytes count whole chunks (small chunks are counted
// when they are opened), so held - live is the rounding waste that chunking bounds.
void ChunkPool::count_live(Block* b, int sign) {
  const int t = static_cast<int>(b->tag);
  const bool small = b->container != nullptr;
  if (sign > 0) {
    stats_.live_bytes[t] += b->requested;
    stats_.live_bytes_total += b->requested;
    ++stats_.allocations[t];
    stats_.peak_live_bytes[t] = std::max(stats_.peak_live_bytes[t], stats_.live_bytes[t]);
    stats_.peak_live_bytes_total = std::max(stats_.peak_live_bytes_total, stats_.live_bytes_total);
    if (!small) stats_.held_bytes[t] += b->size;
    ++(small ? stats_.small_blocks : stats_.large_blocks);
    b->device_live = !host_mapped(b->tag);
    if (b->device_live) add_device_live(b->requested);
    if (b->overflowed) {
      ++stats_.overflow_allocations;
      stats_.overflow_bytes += b->overflowed;
      stats_.peak_overflow_bytes = std::max(stats_.peak_overflow_bytes, stats_.overflow_bytes);
      overflow_peak_ = std::max(overflow_peak_, stats_.overflow_bytes);
    }
  } else {
    stats_.live_bytes[t] -= b->requested;
    stats_.live_bytes_total -= b->requested;
    ++stats_.frees[t];
    if (!small) stats_.held_bytes[t] -= b->size;
    --(small ? stats_.small_blocks : stats_.large_blocks);
    if (b->device_live) device_live_.live -= b->requested;
    b->device_live = false;
    stats_.overflow_bytes -= b->overflowed;
    b->overflowed = 0;
  }
}

void ChunkPool::add_device_live(uint64_t bytes) {
  device_live_.live += bytes;
  device_live_.peak = std::max(device_live_.peak, device_live_.live);
}

void ChunkPool::move_accounting(Block* b, Tag to_tag) {
  const int from = static_cast<int>(b->tag), to = static_cast<int>(to_tag);
  stats_.live_bytes[from] -= b->requested;
  stats_.live_bytes[to] += b->requested;
  stats_.peak_live_bytes[to] = std::max(stats_.peak_live_bytes[to], stats_.live_bytes[to]);
  if (!b->container) {
    stats_.held_bytes[from] -= b->size;
    stats_.held_bytes[to] += b->size;
  }
  const bool on_device = !host_mapped(to_tag);  // a retag can move a block in or out of GPU memory
  if (on_device != b->device_live) {
    if (on_device) add_device_live(b->requested);
    else device_live_.live -= b->requested;
    b->device_live = on_device;
  }
}

DeviceLive ChunkPool::device_live() const {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceLive now = device_live_;
  now.backed = stats_.backed_bytes;
  return now;
}

void ChunkPool::reset_device_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  if (trace_)  // the peaks this call ends, for a replay to check its own against
    trace_->line("p %llu %llu %llu %llu %llu %llu", static_cast<unsigned long long>(device_live_.live),
                 static_cast<unsigned long long>(device_live_.peak), static_cast<unsigned long long>(stats_.backed_bytes),
                 static_cast<unsigned long long>(device_live_.backed_peak),
                 static_cast<unsigned long long>(device_live_.held), static_cast<unsigned long long>(device_live_.held_peak));
  device_live_.peak = device_live_.live;
  device_live_.backed_peak = stats_.backed_bytes;
  device_live_.held_peak = device_live_.held;
}

void ChunkPool::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  for (int t = 0; t < kNumTags; ++t) stats_.peak_live_bytes[t] = stats_.live_bytes[t];
  stats_.peak_live_bytes_total = stats_.live_bytes_total;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

um_stats ChunkPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  um_stats s = stats_;
  uint64_t held = 0;
  for (int t = 0; t < kNumTags; ++t) held += s.held_bytes[t];
  s.arena_count = arenas_.size();
  s.free_chunk_bytes = s.reserved_bytes - held;
  s.internal_waste_bytes = held - s.live_bytes_total;
  s.internal_waste_bound_bytes = (s.large_blocks + s.small_chunks) * config_.chunk_size;
  s.fragmentation_bytes = s.reserved_bytes - s.live_bytes_total;
  s.largest_free_run_bytes = largest_free_run();
  return s;
}

size_t ChunkPool::largest_free_run() const {
  size_t largest = 0;
  for (const FreeSet& runs : free_runs_)
    if (!runs.empty()) largest = std::max(largest, (*runs.rbegin())->size);
  return largest;
}

std::string ChunkPool::oom_message(size_t bytes, Tag tag, bool over_budget) const {
  // Opens as PyTorch's own does: tools that shrink the batch and try again on out of memory
  // recognise it by those words (accelerate's find_executable_batch_size, which Hugging Face's
  // Trainer uses for auto_find_batch_size, looks for " out of memory."; Lightning's batch size
  // finder for "CUDA" and "out of memory").
  std::string m = "um_alloc: CUDA out of memory. Tried to allocate " + format_bytes(bytes) + " (tag " +
                  tag_name(tag) + "); ";
  if (over_budget) {
    m += "GPU-backed memory " + format_bytes(stats_.backed_bytes) + " + this request would pass the " +
         format_bytes(budget_.budget) + " budget (scheduler.budget, evict_live: false; wholly free arenas " +
         "already returned); reserved " + format_bytes(stats_.reserved_bytes);
    if (overflow_limit_)
      m += "; in host memory already, overflowed from this step: " + format_bytes(stats_.overflow_bytes) + " of " +
           format_bytes(overflow_limit_) + " allowed";
  } else {
    m += "reserved " + format_bytes(stats_.reserved_bytes) + " of a " + format_bytes(config_.max_reserved) +
         " limit (pool.max_reserved)";
  }
  m += "; live " + format_bytes(stats_.live_bytes_total) + ":";
  for (int t = 0; t < kNumTags; ++t)
    if (stats_.live_bytes[t]) m += std::string(" ") + tag_name(Tag(t)) + " " + format_bytes(stats_.live_bytes[t]);
  m += "; largest free run " +
       format_bytes(largest_free_run()) + ".";
  if (!backend_error_.empty()) m += " Last device error: " + backend_error_ + ".";
  m += over_budget ? " Lower the batch size, use micro-batches, raise the budget, or keep a tag in host "
                     "memory (preferred_location: cpu, accessed_by: [gpu])."
                   : " Lower the batch size, use micro-batches, or raise pool.max_reserved "
                     "(oversubscribe: true only on a GPU you do not share).";
  return m;
}

}  // namespace um
