/* The C interface of the um_alloc core: what Python (ctypes) and PyTorch's pluggable allocator call.
 *
 * Nothing here throws. Functions that can fail return NULL or a negative number and leave a
 * message in um_last_error() (per thread). Sizes are bytes; streams are cudaStream_t handles
 * (opaque on the host backend). Tags are the indices of um_alloc.tag_names.TAGS.
 */
#ifndef UM_ALLOC_H
#define UM_ALLOC_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define UM_NUM_TAGS 7

typedef struct um_pool um_pool; /* opaque */

typedef enum { UM_OK = 0, UM_ERR_OOM = 1, UM_ERR_CUDA = 2, UM_ERR_INVALID = 3 } um_error_kind;

typedef struct {
  int8_t preferred_location; /* 0 none, 1 gpu, 2 cpu */
  uint8_t read_mostly, accessed_by_gpu, accessed_by_cpu, prefetch;
} um_tag_policy;

typedef struct {
  uint64_t base, size, requested; /* size: bytes the block occupies; requested: bytes asked for */
  int32_t tag, is_small, residency; /* of the chunk holding ptr: 0 untouched, 1 gpu, 2 host */
} um_block_info;

typedef struct {
  uint64_t base, bytes;
} um_range;

/* um_alloc/stats_fields.py lists these fields in this order for Python; a field added here goes
 * there too (um_stats_size() lets Python check). */
typedef struct {
  /* per tag: bytes asked for and still live, their peak, whole chunks held, counts */
  uint64_t live_bytes[UM_NUM_TAGS], peak_live_bytes[UM_NUM_TAGS], held_bytes[UM_NUM_TAGS];
  uint64_t allocations[UM_NUM_TAGS], frees[UM_NUM_TAGS];
  uint64_t live_bytes_total, peak_live_bytes_total;
  uint64_t reserved_bytes, peak_reserved_bytes, max_reserved_bytes, arena_count;
  uint64_t chunk_size, large_blocks, small_chunks, small_blocks;
  /* fragmentation = reserved - live = internal waste (held - live) + free chunks */
  uint64_t fragmentation_bytes, internal_waste_bytes, internal_waste_bound_bytes, free_chunk_bytes;
  uint64_t largest_free_run_bytes;
  uint64_t num_ooms, advise_calls, prefetch_calls, prefetch_bytes, stream_waits, backend_errors;
  uint64_t free_events; /* events recorded at free on streams record_stream added */
  uint64_t arena_reserves, arena_releases; /* cudaMallocManaged / cudaFree calls (cudaFree syncs the device) */
  /* GPU residency as the pool believes it (chunks it placed or prefetched on the GPU and has not
   * evicted); faults can bring evicted data back unseen, so NVML's high-water mark is the check. */
  uint64_t resident_bytes[UM_NUM_TAGS], resident_free_bytes, resident_bytes_total, peak_resident_bytes;
  uint64_t budget_bytes, min_swap_size, evictions, evicted_bytes, over_budget_allocations;
  /* GPU-backed: chunks the GPU has held pages of since their arena was reserved. The driver keeps
   * GPU memory for such a range until cudaFree even after its pages leave (measured), so this,
   * not residency, is what NVML's used memory follows; a hard budget (evict_live=0) bounds it. */
  uint64_t backed_bytes, peak_backed_bytes;
  /* A step's large requests the hard budget refused, which went partly to host memory the GPU
   * maps (um_pool_set_overflow): how many, the bytes of them in host memory now, and their peak. */
  uint64_t overflow_allocations, overflow_bytes, peak_overflow_bytes;
} um_stats;

/* Pools. A host pool runs the same placement logic over host mappings, for tests. */
um_pool* um_pool_create_host(size_t chunk_size, size_t arena_size, size_t max_reserved);
um_pool* um_pool_create_managed(int device, size_t chunk_size, size_t arena_size, size_t max_reserved);
um_pool* um_pool_for_device(int device); /* the pool PyTorch allocates from; created on first use */
void um_pool_destroy(um_pool* pool); /* pools made by the create functions */

void* um_pool_malloc(um_pool* pool, size_t bytes, void* stream, int tag);
int um_pool_free(um_pool* pool, void* ptr);
int um_pool_record_stream(um_pool* pool, void* ptr, void* stream);
int um_pool_retag(um_pool* pool, void* ptr, int tag, void* stream);
/* Retags n allocations under one lock (one call per training step, not one per tensor); returns how many were found. */
size_t um_pool_retag_many(um_pool* pool, void* const* ptrs, size_t n, int tag, void* stream);
int um_pool_block_at(um_pool* pool, const void* ptr, um_block_info* out);
/* Moves the large allocation containing ptr to the GPU (to_gpu=1) or host on `stream`, keeping the
 * pool's residency true; returns bytes moved (0: small, unknown or already there). */
size_t um_pool_migrate(um_pool* pool, const void* ptr, int to_gpu, void* stream);
size_t um_pool_ranges_for_tag(um_pool* pool, int tag, um_range* out, size_t capacity);
size_t um_pool_empty_cache(um_pool* pool);
void um_pool_stats(um_pool* pool, um_stats* out);
/* Starts the peaks of live bytes (per tag and in all) and of reserved bytes over from the bytes
 * now: torch.cuda.reset_peak_memory_stats() under um_alloc (torch_stats.py). */
void um_pool_reset_peaks(um_pool* pool);
/* Live bytes of tags that are not host-mapped (kept in GPU memory), and their peak since the last
 * um_pool_reset_device_peak; cheaper than um_pool_stats, for reading around each block of a step. */
void um_pool_device_live(um_pool* pool, uint64_t* live, uint64_t* peak);
void um_pool_reset_device_peak(um_pool* pool);
/* GPU-backed bytes (live or free: what a hard budget counts) and their peak since the same reset. */
void um_pool_device_backed(um_pool* pool, uint64_t* backed, uint64_t* peak);
/* Of those, the bytes in arenas that hold a live allocation, which returning wholly free arenas
 * cannot give back, and their peak since the same reset. */
void um_pool_device_held(um_pool* pool, uint64_t* held, uint64_t* peak);
int um_pool_set_tag_policy(um_pool* pool, int tag, um_tag_policy policy);
/* Under a hard budget, up to `bytes` of large requests made while step arenas are on, which the
 * budget would refuse, are placed in host memory the GPU maps instead (0: none, the default): of
 * such a request, only the chunks the budget cannot back; the step runs slower, over the link,
 * instead of failing. um_pool_take_overflow_peak returns the most
 * such bytes live at once since its last call. */
void um_pool_set_overflow(um_pool* pool, size_t bytes);
uint64_t um_pool_take_overflow_peak(um_pool* pool);
/* on=1: chunk runs taken from now on come from the pool's step arenas, apart from those of data
 * that outlasts a training step (on=0, the default), so that between steps the step arenas are
 * wholly free and um_pool_empty_cache returns them with their GPU memory. */
void um_pool_set_step_arenas(um_pool* pool, int on);
int um_pool_step_arenas(um_pool* pool);
const char* um_pool_backend_error(um_pool* pool);

/* The GPU residency budget (0: none) and the smallest allocation it may swap; enabled=0 pauses
 * eviction without forgetting the settings. evict_live=1 is the reactive mode: least recently used
 * chunks are moved to host memory when an allocation would pass the budget, and faults bring them
 * back. evict_live=0 is a hard budget: only free chunks leave, and an allocation that still does
 * not fit fails as out of memory. */
int um_pool_set_budget(um_pool* pool, size_t budget, size_t min_swap_size, int enabled, int evict_live);
int um_pool_budget_enabled(um_pool* pool);
int um_pool_budget_evicts_live(um_pool* pool);
int um_set_default_budget(size_t budget, size_t min_swap_size, int enabled, int evict_live);

/* Settings for device pools; must precede the first device allocation. */
int um_configure(size_t chunk_size, size_t arena_size, size_t max_reserved);
int um_set_default_tag_policy(int tag, um_tag_policy policy);
void um_set_current_tag(int tag);
int um_current_tag(void);
/* A scope for large allocations only: from here on, allocations of at least min_bytes get `tag`
 * whatever the current tag is; min_bytes 0 ends it. um_large_tag_min() is 0 outside one. */
int um_set_large_tag(int tag, size_t min_bytes);
int um_large_tag(void);
size_t um_large_tag_min(void);
int um_num_tags(void);
const char* um_tag_name(int tag);
size_t um_stats_size(void); /* sizeof(um_stats), so Python can check its mirror */

const char* um_last_error(void);
int um_last_error_kind(void);

/* PyTorch's CUDAPluggableAllocator hooks (torch_shim.cpp). */
void* um_torch_malloc(size_t bytes, int device, void* stream);
void um_torch_free(void* ptr, size_t bytes, int device, void* stream);
void um_torch_empty_cache(void);
void um_torch_record_stream(void* ptr, void* stream);

#ifdef __cplusplus
}
#endif
#endif
