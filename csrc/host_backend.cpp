#include "host_backend.hpp"

#include <sys/mman.h>

namespace um {

void* HostBackend::reserve(size_t bytes) noexcept {
  // MAP_NORESERVE: address space only, so tests can reserve far more than this machine's RAM.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void HostBackend::release(void* base, size_t bytes) noexcept { munmap(base, bytes); }

bool HostBackend::order_after(Stream, Stream) noexcept { return true; }
Event HostBackend::record(Stream) noexcept { return reinterpret_cast<Event>(++next_point_); }
bool HostBackend::wait(Stream, Event) noexcept { return true; }
// Never known to be reached: tests see the pool's path for work still running on the GPU.
bool HostBackend::reached(Event) noexcept { return false; }
void HostBackend::release_event(Event) noexcept {}
bool HostBackend::advise(void*, size_t, const Advice&, const Advice&) noexcept { return true; }
bool HostBackend::prefetch_to_gpu(void*, size_t, Stream) noexcept { return true; }
bool HostBackend::prefetch_to_host(void*, size_t, Stream) noexcept { return true; }

}  // namespace um
