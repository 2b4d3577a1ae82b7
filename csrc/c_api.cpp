// The extern "C" face of the core for Python (ctypes). Nothing throws across it: failures
// return NULL / -1 and leave a message in um_last_error().
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "chunk_pool.hpp"
#include "device_pools.hpp"
#include "host_backend.hpp"
#include "managed_backend.hpp"
#include "um_alloc.h"

struct um_pool {
  um::ChunkPool* pool;
  bool owned;  // host pools belong to their handle; device pools live for the process
};

namespace um {
namespace {

thread_local std::string t_error;
thread_local int t_error_kind = UM_OK;

Advice advice_from(const um_tag_policy& p) {
  Advice a;
  a.preferred = p.preferred_location == 1 ? Location::gpu
                : p.preferred_location == 2 ? Location::cpu
                                            : Location::none;
  a.read_mostly = p.read_mostly;
  a.accessed_by_gpu = p.accessed_by_gpu;
  a.accessed_by_cpu = p.accessed_by_cpu;
  return a;
}

int invalid(const std::string& message) {
  set_last_error(UM_ERR_INVALID, message);
  return -1;
}

}  // namespace

void set_last_error(int kind, const std::string& message) {
  t_error_kind = kind;
  t_error = message;
}

TagPolicy tag_policy_from(const um_tag_policy& p) { return TagPolicy{advice_from(p), p.prefetch != 0}; }

}  // namespace um

using um::invalid;

extern "C" {

static um_pool* create_pool(std::unique_ptr<um::MemoryBackend> backend, um::PoolConfig config) {
  std::string problem = um::config_problem(config);
  if (!problem.empty()) {
    um::set_last_error(UM_ERR_INVALID, problem);
    return nullptr;
  }
  return new um_pool{new um::ChunkPool(std::move(backend), config), true};
}

um_pool* um_pool_create_host(size_t chunk_size, size_t arena_size, size_t max_reserved) {
  return create_pool(std::make_unique<um::HostBackend>(), {chunk_size, arena_size, max_reserved});
}

um_pool* um_pool_create_managed(int device, size_t chunk_size, size_t arena_size, size_t max_reserved) {
  return create_pool(std::make_unique<um::ManagedBackend>(device), {chunk_size, arena_size, max_reserved});
}

um_pool* um_pool_for_device(int device) {
  um::ChunkPool* pool = um::device_pool(device);
  if (!pool) return nullptr;
  static std::array<um_pool, um::kMaxDevices> handles{};
  handles[device].pool = pool;
  return &handles[device];
}

void um_pool_destroy(um_pool* pool) {
  if (pool && pool->owned) {
    delete pool->pool;
    delete pool;
  }
}

void* um_pool_malloc(um_pool* pool, size_t bytes, void* stream, int tag) {
  if (!um::valid_tag(tag)) return invalid(um::bad_tag_message(tag)), nullptr;
  um::AllocError err;
  void* p = pool->pool->allocate(bytes, stream, um::Tag(tag), &err);
  if (!p) um::set_last_error(err.kind, err.message);
  return p;
}

int um_pool_free(um_pool* pool, void* ptr) {
  return pool->pool->deallocate(ptr) ? 0 : invalid("free of a pointer this pool did not hand out");
}

int um_pool_record_stream(um_pool* pool, void* ptr, void* stream) {
  return pool->pool->record_stream(ptr, stream) ? 0 : invalid("record_stream on an unknown pointer");
}

int um_pool_retag(um_pool* pool, void* ptr, int tag, void* stream) {
  if (!um::valid_tag(tag)) return invalid(um::bad_tag_message(tag));
  return pool->pool->retag(ptr, um::Tag(tag), stream) ? 0 : invalid("retag of memory this pool does not hold");
}

size_t um_pool_retag_many(um_pool* pool, void* const* ptrs, size_t n, int tag, void* stream) {
  if (!um::valid_tag(tag)) return invalid(um::bad_tag_message(tag)), 0;
  return pool->pool->retag_many(const_cast<const void* const*>(ptrs), n, um::Tag(tag), stream);
}

size_t um_pool_migrate(um_pool* pool, const void* ptr, int to_gpu, void* stream) {
  return pool->pool->migrate(ptr, to_gpu != 0, stream);
}

int um_pool_block_at(um_pool* pool, const void* ptr, um_block_info* out) {
  return pool->pool->block_at(ptr, out) ? 0 : -1;
}

size_t um_pool_ranges_for_tag(um_pool* pool, int tag, um_range* out, size_t capacity) {
  if (!um::valid_tag(tag)) return 0;
  std::vector<um_range> ranges = pool->pool->ranges_for_tag(um::Tag(tag));
  for (size_t i = 0; i < ranges.size() && i < capacity; ++i) out[i] = ranges[i];
  return ranges.size();  // may exceed capacity: the caller retries with more room
}

size_t um_pool_empty_cache(um_pool* pool) { return pool->pool->empty_cache(); }

void um_pool_stats(um_pool* pool, um_stats* out) { *out = pool->pool->stats(); }

void um_pool_device_live(um_pool* pool, uint64_t* live, uint64_t* peak) {
  const um::DeviceLive now = pool->pool->device_live();
  *live = now.live;
  *peak = now.peak;
}

void um_pool_device_backed(um_pool* pool, uint64_t* backed, uint64_t* peak) {
  const um::DeviceLive now = pool->pool->device_live();
  *backed = now.backed;
  *peak = now.backed_peak;
}

void um_pool_device_held(um_pool* pool, uint64_t* held, uint64_t* peak) {
  const um::DeviceLive now = pool->pool->device_live();
  *held = now.held;
  *peak = now.held_peak;
}

void um_pool_reset_device_peak(um_pool* pool) { pool->pool->reset_device_peak(); }

void um_pool_reset_peaks(um_pool* pool) { pool->pool->reset_peaks(); }

void um_pool_set_overflow(um_pool* pool, size_t bytes) { pool->pool->set_overflow(bytes); }
uint64_t um_pool_take_overflow_peak(um_pool* pool) { return pool->pool->take_overflow_peak(); }

void um_pool_set_step_arenas(um_pool* pool, int on) { pool->pool->set_step_arenas(on != 0); }
int um_pool_step_arenas(um_pool* pool) { return pool->pool->step_arenas() ? 1 : 0; }

int um_pool_set_tag_policy(um_pool* pool, int tag, um_tag_policy policy) {
  if (!um::valid_tag(tag)) return invalid(um::bad_tag_message(tag));
  pool->pool->set_tag_policy(um::Tag(tag), um::tag_policy_from(policy));
  return 0;
}

int um_pool_set_budget(um_pool* pool, size_t budget, size_t min_swap_size, int enabled, int evict_live) {
  pool->pool->set_budget(um::BudgetConfig{budget, min_swap_size, enabled != 0, evict_live != 0});
  return 0;
}

int um_pool_budget_enabled(um_pool* pool) { return pool->pool->budget().enabled ? 1 : 0; }
int um_pool_budget_evicts_live(um_pool* pool) { return pool->pool->budget().evict_live ? 1 : 0; }

const char* um_pool_backend_error(um_pool* pool) {
  static thread_local std::string copy;
  copy = pool->pool->backend_error();
  return copy.c_str();
}

int um_num_tags(void) { return um::kNumTags; }
const char* um_tag_name(int tag) { return um::valid_tag(tag) ? um::tag_name(um::Tag(tag)) : nullptr; }
size_t um_stats_size(void) { return sizeof(um_stats); }
const char* um_last_error(void) { return um::t_error.c_str(); }
int um_last_error_kind(void) { return um::t_error_kind; }

}  // extern "C"
