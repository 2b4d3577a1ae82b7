// A pool of managed memory carved into fixed-size chunks (Hayakawa & Narihira §4).
//
// Large requests (> chunk_size / 2) are rounded up to whole chunks and placed on contiguous
// chunk runs, so a request wastes less than one chunk. Small requests are sub-allocated in
// chunks set aside for one tag at a time, so a chunk carries one tag's hints. Free runs merge
// with free neighbours and serve any size later. Arenas (cudaMallocManaged calls) are made
// only when no free run fits, and returned only by empty_cache() or to make room under the cap.
//
// Streams: a block freed by stream S is reused at once by S; another stream T first waits on S
// through an event (never a host wait). record_stream adds streams the block must wait for; their
// events are recorded when the block is freed (as PyTorch's caching allocator does), so a reuse
// waits for the work that used the block, not for all the work those streams were given since.
#pragma once
#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "advice.hpp"
#include "backend.hpp"
#include "pool_trace.hpp"
#include "tags.hpp"
#include "um_alloc.h"

namespace um {

struct PoolConfig {
  size_t chunk_size = size_t(2) << 20;
  size_t arena_size = size_t(1) << 30;
  size_t max_reserved = SIZE_MAX;  // cap on all arenas together
};

// Where the pool believes a chunk's pages are; the scheduler will keep this current.
enum class Residency : uint8_t { untouched, gpu, host };

enum class ChunkUse : uint8_t { free, large, small };

struct ChunkState {
  Advice applied;  // hints currently set on the chunk
  Residency residency = Residency::untouched;
  bool gpu_backed = false;  // the GPU has held its pages since the arena was reserved (see um_stats)
  ChunkUse use = ChunkUse::free;
  Tag tag = kDefaultTag;  // of the run holding it (the last one, while free)
  uint64_t last_use = 0;  // pool tick of its last allocation or retag: the LRU order
};

struct BudgetConfig {
  size_t budget = 0;  // bytes of GPU residency; 0 = no budget
  size_t min_swap_size = size_t(1) << 20;
  bool enabled = true;
  // true: reactive mode, a bound on residency: live blocks may be evicted (faults bring them
  // back). false: a hard bound on GPU-backed bytes: nothing is evicted (the driver would keep the
  // GPU memory anyway), wholly free arenas are returned, and then the allocation fails as OOM.
  bool evict_live = true;
};

// What an arena holds: data that outlasts a training step (parameters, optimizer state, what is
// allocated between steps) or one step's own (what its forward and backward allocate, while
// set_step_arenas is on). Kept apart, a step's arenas are wholly free between steps, so a hard
// budget can give their GPU memory back (empty_cache) instead of being held by a few lasting
// tensors scattered through them. Small requests (half a chunk or less) always take lasting
// arenas: the small tensors a step makes that outlive it are the common case, not the exception
// (the loss a loop still holds as the next step begins, a library's workspace made at its first
// call, a gradient scaler's scale), and one would keep a whole step arena and its backing.
enum class ArenaUse : uint8_t { lasting, step };
constexpr int kArenaUses = 2;

struct Arena {
  char* base;
  size_t size;
  std::vector<ChunkState> chunks;
  ArenaUse use = ArenaUse::lasting;
  uint64_t backed = 0;     // bytes of its chunks the GPU has backed
  uint32_t taken_runs = 0;  // chunk runs handed out (large blocks, small chunks): while any, its
                            // backing cannot be given back
};

// A stream that may still touch a block. `freed`: the point that stream had reached when the
// block was freed, so reuse waits for that point only, not for work the stream took on later;
// null: not known, so reuse orders after everything enqueued on the stream by then.
struct StreamUse {
  Stream stream;
  std::shared_ptr<void> freed;  // an Event, given back to the backend when no block holds it
  uint64_t seq = 0;             // of `freed`: of two points on one stream, the later covers both
};

// The streams that may still touch a block; nearly always one, the stream it was taken on.
struct StreamSet {
  std::vector<StreamUse> uses;
  void add(Stream s);
  void merge(const StreamSet& other);
  void reset(Stream s) { uses.assign(1, StreamUse{s}); }
};

struct Block {
  Block(char* p, size_t n, Arena* a) : ptr(p), size(n), arena(a) {}
  char* ptr;
  size_t size;
  Arena* arena;
  Block* prev = nullptr;  // address neighbours in the same run list (arena, or one small chunk)
  Block* next = nullptr;
  Block* container = nullptr;  // small blocks: the chunk they live in
  size_t requested = 0;
  Tag tag = kDefaultTag;
  bool allocated = false;
  bool is_container = false;  // a chunk holding small blocks
  bool device_live = false;   // counted in device_live_: allocated under a tag that is not host-mapped
  // Bytes of its chunks in host memory the GPU maps, where the hard budget refused to back them
  // (set_overflow); its other chunks are on the GPU. 0: none.
  size_t overflowed = 0;
  StreamSet streams;
};

struct BySizeThenAddress {
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
};
using FreeSet = std::set<Block*, BySizeThenAddress>;

struct DeviceLive {
  uint64_t live = 0, peak = 0;
  // GPU-backed bytes (what a hard budget counts: live or not) and their peak, over the same span.
  uint64_t backed = 0, backed_peak = 0;
  // Backed bytes of arenas holding a taken run: what a hard budget cannot get back by returning
  // wholly free arenas. Beyond live bytes, this is the fragmentation a layout really costs.
  uint64_t held = 0, held_peak = 0;
};

struct AllocError {
  um_error_kind kind = UM_OK;
  bool over_budget = false;  // refused by a hard budget rather than by the reserve cap
  std::string message;
};

class ChunkPool {
 public:
  ChunkPool(std::unique_ptr<MemoryBackend> backend, PoolConfig config);
  ~ChunkPool();
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

  // Returns nullptr and fills `err` when the request cannot be met.
  void* allocate(size_t bytes, Stream stream, Tag tag, AllocError* err);
  bool deallocate(void* ptr) noexcept;  // false: not a live allocation of this pool
  bool record_stream(void* ptr, Stream stream);
  // Moves the allocation containing `ptr` to `tag` and applies that tag's hints (large blocks).
  bool retag(const void* ptr, Tag tag, Stream stream);
  // retag() for many allocations under one lock; returns how many were found.
  size_t retag_many(const void* const* ptrs, size_t n, Tag tag, Stream stream);
  bool block_at(const void* ptr, um_block_info* out) const;
  // Moves the chunks of the (large) allocation containing `ptr` to the GPU or to the host, on
  // `stream`, and records where they now are. Returns the bytes moved (0: small, unknown, or
  // already there): the scheduler's planned transfers go through here so residency stays true.
  size_t migrate(const void* ptr, bool to_gpu, Stream stream);
  std::vector<um_range> ranges_for_tag(Tag tag) const;
  size_t empty_cache();  // bytes returned
  um_stats stats() const;
  // Live bytes of tags that are not host-mapped (what kernels keep in GPU memory), and their peak
  // since the last reset_device_peak(): the planner reads these around each block of a step.
  DeviceLive device_live() const;
  void reset_device_peak();
  // The peaks stats() reports of live and reserved bytes, from the bytes now (not the above).
  void reset_peaks();
  void set_tag_policy(Tag tag, const TagPolicy& policy);
  void set_budget(const BudgetConfig& budget);
  BudgetConfig budget() const;
  // Up to `bytes` of a step's large requests that a hard budget refuses go to host memory the GPU
  // maps instead of failing (0: none, the default), of each only the chunks the budget cannot
  // back (overflow_run): a step whose plan misjudged its peak runs slower, over the link, rather
  // than ending. Step arenas only: what outlasts a step never does.
  void set_overflow(size_t bytes);
  // The peak of overflowed bytes live at once since the last call; the next call starts from now.
  uint64_t take_overflow_peak();
  // On: runs taken from here on come from step arenas (see ArenaUse); off: from lasting ones.
  void set_step_arenas(bool on);
  bool step_arenas() const { return step_arenas_.load(std::memory_order_relaxed); }
  std::string backend_error() const;

 private:
  void* allocate_large(size_t bytes, Stream stream, Tag tag, ArenaUse arenas, AllocError* err);
  void* allocate_small(size_t bytes, Stream stream, Tag tag, ArenaUse arenas, AllocError* err);
  Block* take_chunk_run(size_t rounded, Stream stream, Tag tag, ChunkUse use, ArenaUse arenas, AllocError* err);
  Block* overflow_run(size_t rounded, Stream stream, ChunkUse use, ArenaUse arenas, size_t* host_bytes);
  void place_over_budget(Block* run, Tag tag, size_t host_bytes);
  Block* grow(size_t rounded, ArenaUse use);
  Block* find_fit(FreeSet& set, size_t size);
  Block* find_run(size_t rounded, bool for_host, Stream stream, ArenaUse use);
  Block* fewest_unbacked(FreeSet& runs, Block* best, size_t rounded);
  Block* carve(Block* run, size_t offset);
  void take_arena_run(Arena* a);
  void give_arena_run(Arena* a);
  FreeSet& free_runs_of(const Arena* a) { return free_runs_[static_cast<int>(a->use)]; }
  FreeSet& free_small_of(Tag tag) { return free_small_[static_cast<int>(tag)]; }
  size_t largest_free_run() const;
  bool idle_for(Block* b, Stream stream);
  void split(Block* b, size_t size, FreeSet& set);
  Block* merge_into_free(Block* b, FreeSet& set);
  void release_chunk_run(Block* b);
  void release_small(Block* b);
  size_t release_free_arenas(const Arena* keep = nullptr, bool backed_only = false);
  void order_for_reuse(Block* b, Stream stream);
  void mark_freed(Block* b);
  void apply_tag(Block* run, Tag tag, Stream stream);
  void advise_chunks(Arena* a, size_t first, size_t end, const Advice& want);
  void prefetch_chunks(Arena* a, size_t first, size_t end, Stream stream);
  // residency (budget.cpp)
  void claim_chunks(Block* run, Tag tag, ChunkUse use);
  void mark_resident(Block* run);
  void mark_free(Block* run);
  void set_residency(Arena* a, size_t i, Residency r);
  bool make_room(Arena* a, size_t first, size_t end, Stream stream);
  bool within_backing(Arena* a, size_t first, size_t end);
  bool hard_budget() const { return budget_.budget && budget_.enabled && !budget_.evict_live; }
  bool evict_one(Arena* skip_arena, size_t skip_first, size_t skip_end, Stream stream);
  bool host_mapped(Tag tag) const;
  void send_to_host(Block* run, Stream stream);
  void evict_range(Arena* a, size_t first, size_t end, Stream stream);
  uint64_t& resident_bucket(const ChunkState& c);
  void relabel(ChunkState& c, ChunkUse use, Tag tag);
  struct ChunkRange {
    size_t first, end;
  };
  ChunkRange chunk_range(const Block* run) const;
  void count_live(Block* b, int sign);
  void add_device_live(uint64_t bytes);
  void move_accounting(Block* b, Tag to_tag);
  bool retag_locked(const void* ptr, Tag tag, Stream stream);
  void note_backend_failure();
  Block* live_block_containing(const void* ptr) const;
  std::string oom_message(size_t bytes, Tag tag, bool over_budget) const;

  mutable std::mutex mu_;
  std::unique_ptr<MemoryBackend> backend_;
  PoolConfig config_;
  std::array<TagPolicy, kNumTags> policies_{};
  std::vector<std::unique_ptr<Arena>> arenas_;
  std::array<FreeSet, kArenaUses> free_runs_;  // free chunk runs, by the use of their arena
  // Free space inside each tag's small chunks, whichever arena holds the chunk: a chunk a step
  // arena lends when the budget leaves the lasting ones no new backing serves the next small
  // requests too, rather than each taking a chunk of its own.
  std::array<FreeSet, kNumTags> free_small_;
  std::atomic<bool> step_arenas_{false};
  std::map<char*, Block*> live_;               // allocations handed out, by address
  um_stats stats_{};
  DeviceLive device_live_{};
  std::string backend_error_;
  std::unique_ptr<PoolTrace> trace_;  // UM_POOL_TRACE's record of the calls below; null: none
  BudgetConfig budget_;
  size_t overflow_limit_ = 0;      // set_overflow
  uint64_t overflow_peak_ = 0;     // take_overflow_peak's, since its last call
  uint64_t tick_ = 0;
  uint64_t mark_seq_ = 0;  // numbers the points mark_freed records
};

}  // namespace um
