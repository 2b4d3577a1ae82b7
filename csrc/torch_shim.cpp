// The four functions PyTorch's CUDAPluggableAllocator calls. No Python runs here.
//
// The one place that includes a PyTorch header: an out-of-memory must reach Python as
// torch.OutOfMemoryError, which only a thrown c10::OutOfMemoryError becomes. PyTorch's own
// caching allocator reports OOM the same way, from the same call.
#include <c10/util/Exception.h>

#include "device_pools.hpp"
#include "um_alloc.h"

extern "C" {

void* um_torch_malloc(size_t bytes, int device, void* stream) {
  if (bytes == 0) return nullptr;  // PyTorch never frees a null data pointer
  um::ChunkPool* pool = um::device_pool(device);
  TORCH_CHECK(pool != nullptr, "um_alloc: ", um_last_error());
  um::AllocError err;
  void* p = pool->allocate(bytes, stream, um::tag_for(bytes), &err);
  if (p) return p;
  TORCH_CHECK_WITH(OutOfMemoryError, err.kind != UM_ERR_OOM, err.message);
  TORCH_CHECK(false, "um_alloc: ", err.message);
}

void um_torch_free(void* ptr, size_t, int device, void*) {
  // Runs inside tensor destructors: it must not throw. An unknown pointer is a bug elsewhere;
  // the pool ignores it rather than corrupt its lists.
  if (um::ChunkPool* pool = um::existing_device_pool(device)) pool->deallocate(ptr);
}

void um_torch_empty_cache(void) {
  for (int d = 0; d < um::kMaxDevices; ++d)
    if (um::ChunkPool* pool = um::existing_device_pool(d)) pool->empty_cache();
}

void um_torch_record_stream(void* ptr, void* stream) {
  for (int d = 0; d < um::kMaxDevices; ++d) {
    um::ChunkPool* pool = um::existing_device_pool(d);
    if (pool && pool->record_stream(ptr, stream)) return;
  }
}

}  // extern "C"
