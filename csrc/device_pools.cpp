#include "device_pools.hpp"

#include <array>
#include <atomic>
#include <mutex>

#include "managed_backend.hpp"

namespace um {
namespace {

std::mutex g_mu;  // guards creation and the settings below; the hot path only reads g_pools
PoolConfig g_config;
std::array<TagPolicy, kNumTags> g_policies{};
BudgetConfig g_budget;
std::array<std::atomic<ChunkPool*>, kMaxDevices> g_pools{};
// Process-wide rather than per thread: autograd runs backward on its own threads, and a tag
// scope opened by the training loop must cover the allocations made there too.
std::atomic<int> g_current_tag{static_cast<int>(kDefaultTag)};
// A scope for large allocations only (um_alloc.tag(name, min_size=...)): those of at least
// g_large_min bytes get g_large_tag, smaller ones the current tag. 0: no such scope.
std::atomic<int> g_large_tag{static_cast<int>(kDefaultTag)};
std::atomic<size_t> g_large_min{0};

bool is_power_of_two(size_t n) { return n && !(n & (n - 1)); }

}  // namespace

std::string config_problem(const PoolConfig& c) {
  if (!is_power_of_two(c.chunk_size) || c.chunk_size < 4096)
    return "chunk_size " + std::to_string(c.chunk_size) + " must be a power of two >= 4096";
  if (c.arena_size < c.chunk_size || c.arena_size % c.chunk_size)
    return "arena_size " + std::to_string(c.arena_size) + " must be a multiple of chunk_size " +
           std::to_string(c.chunk_size);
  return "";
}

ChunkPool* existing_device_pool(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return g_pools[device].load(std::memory_order_acquire);
}

ChunkPool* device_pool(int device) {
  if (device < 0 || device >= kMaxDevices) {
    set_last_error(UM_ERR_INVALID, "device " + std::to_string(device) + " is out of range");
    return nullptr;
  }
  ChunkPool* pool = g_pools[device].load(std::memory_order_acquire);
  if (pool) return pool;
  std::lock_guard<std::mutex> lock(g_mu);
  pool = g_pools[device].load(std::memory_order_relaxed);
  if (!pool) {
    // Never destroyed: PyTorch frees tensors during interpreter teardown, after static
    // destructors may have run, so the pool must outlive everything.
    pool = new ChunkPool(std::make_unique<ManagedBackend>(device), g_config);
    for (int t = 0; t < kNumTags; ++t) pool->set_tag_policy(Tag(t), g_policies[t]);
    pool->set_budget(g_budget);
    g_pools[device].store(pool, std::memory_order_release);
  }
  return pool;
}

Tag current_tag() { return Tag(g_current_tag.load(std::memory_order_relaxed)); }

Tag tag_for(size_t bytes) {
  const size_t large = g_large_min.load(std::memory_order_acquire);  // published after the tag
  if (large && bytes >= large) return Tag(g_large_tag.load(std::memory_order_relaxed));
  return current_tag();
}

}  // namespace um

extern "C" {

int um_configure(size_t chunk_size, size_t arena_size, size_t max_reserved) {
  um::PoolConfig config{chunk_size, arena_size, max_reserved};
  std::string problem = um::config_problem(config);
  if (!problem.empty()) {
    um::set_last_error(UM_ERR_INVALID, problem);
    return -1;
  }
  std::lock_guard<std::mutex> lock(um::g_mu);
  for (auto& p : um::g_pools) {
    if (p.load()) {
      um::set_last_error(UM_ERR_INVALID, "um_configure after the first device allocation");
      return -1;
    }
  }
  um::g_config = config;
  return 0;
}

int um_set_default_tag_policy(int tag, um_tag_policy policy) {
  if (!um::valid_tag(tag)) {
    um::set_last_error(UM_ERR_INVALID, um::bad_tag_message(tag));
    return -1;
  }
  std::lock_guard<std::mutex> lock(um::g_mu);
  um::g_policies[tag] = um::tag_policy_from(policy);
  for (auto& p : um::g_pools)
    if (um::ChunkPool* pool = p.load()) pool->set_tag_policy(um::Tag(tag), um::g_policies[tag]);
  return 0;
}

int um_set_default_budget(size_t budget, size_t min_swap_size, int enabled, int evict_live) {
  std::lock_guard<std::mutex> lock(um::g_mu);
  um::g_budget = um::BudgetConfig{budget, min_swap_size, enabled != 0, evict_live != 0};
  for (auto& p : um::g_pools)
    if (um::ChunkPool* pool = p.load()) pool->set_budget(um::g_budget);
  return 0;
}

void um_set_current_tag(int tag) {
  if (um::valid_tag(tag)) um::g_current_tag.store(tag, std::memory_order_relaxed);
}

int um_current_tag(void) { return um::g_current_tag.load(std::memory_order_relaxed); }

int um_set_large_tag(int tag, size_t min_bytes) {
  if (!um::valid_tag(tag)) {
    um::set_last_error(UM_ERR_INVALID, um::bad_tag_message(tag));
    return -1;
  }
  um::g_large_min.store(0, std::memory_order_release);  // never the new size with the old tag
  um::g_large_tag.store(tag, std::memory_order_relaxed);
  um::g_large_min.store(min_bytes, std::memory_order_release);
  return 0;
}

int um_large_tag(void) { return um::g_large_tag.load(std::memory_order_relaxed); }

size_t um_large_tag_min(void) { return um::g_large_min.load(std::memory_order_acquire); }

}  // extern "C"
