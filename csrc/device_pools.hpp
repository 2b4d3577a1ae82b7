// The per-device pools PyTorch allocates from, their shared settings, and the current tag.
#pragma once
#include <string>

#include "chunk_pool.hpp"

namespace um {

constexpr int kMaxDevices = 64;

ChunkPool* device_pool(int device);           // created on first use; nullptr + last error if not
ChunkPool* existing_device_pool(int device);  // nullptr if that device has none yet
Tag current_tag();
Tag tag_for(size_t bytes);  // the current tag, or a large-allocation scope's tag

std::string config_problem(const PoolConfig& config);  // empty when valid
void set_last_error(int kind, const std::string& message);
TagPolicy tag_policy_from(const um_tag_policy& policy);

}  // namespace um
