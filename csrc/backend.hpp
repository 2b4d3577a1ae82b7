// The memory a chunk pool carves up, and the device operations it needs.
//
// Two implementations: ManagedBackend (cudaMallocManaged, cudaMemAdvise, prefetch, events)
// and HostBackend (anonymous host mappings, operations only counted) so the pool's placement,
// reuse and stream logic is tested on machines without a GPU.
#pragma once
#include <cstddef>
#include <string>

#include "advice.hpp"

namespace um {

using Stream = void*;  // a cudaStream_t on the managed backend; opaque elsewhere
using Event = void*;   // a cudaEvent_t on the managed backend; opaque elsewhere

class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;

  // Reserves `bytes` of address space; nullptr when refused (the pool turns that into OOM).
  virtual void* reserve(size_t bytes) noexcept = 0;
  // Returns a reservation. May synchronize the device (cudaFree does): never on the hot path.
  virtual void release(void* base, size_t bytes) noexcept = 0;

  // Makes work enqueued later on `waiter` start after the work already enqueued on `producer`,
  // without blocking the host. Returns false and sets error() on failure.
  virtual bool order_after(Stream waiter, Stream producer) noexcept = 0;
  // The point `s` has reached: the work enqueued on it so far. nullptr on failure (error() says
  // why). Held until release_event(); wait() makes another stream's later work start after it.
  virtual Event record(Stream s) noexcept = 0;
  virtual bool wait(Stream waiter, Event point) noexcept = 0;
  virtual bool reached(Event point) noexcept = 0;  // the work before it is done (false if unsure)
  virtual void release_event(Event point) noexcept = 0;
  // Moves the hints on [p, p+n) from `from` to `to`, calling only for what differs.
  virtual bool advise(void* p, size_t n, const Advice& from, const Advice& to) noexcept = 0;
  virtual bool prefetch_to_gpu(void* p, size_t n, Stream s) noexcept = 0;
  // Moves [p, p+n) to host memory, ordered on `s` after the work already enqueued there.
  virtual bool prefetch_to_host(void* p, size_t n, Stream s) noexcept = 0;

  virtual const char* name() const noexcept = 0;
  const std::string& error() const noexcept { return error_; }

 protected:
  std::string error_;
};

}  // namespace um
