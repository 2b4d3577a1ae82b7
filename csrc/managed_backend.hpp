// CUDA Unified Memory: arenas from cudaMallocManaged, hints through cudaMemAdvise,
// prefetch through cudaMemPrefetchAsync, cross-stream order through pooled events.
#pragma once
#include <cuda_runtime_api.h>

#include <vector>

#include "backend.hpp"

namespace um {

class ManagedBackend final : public MemoryBackend {
 public:
  explicit ManagedBackend(int device) : device_(device) {}
  ~ManagedBackend() override;

  void* reserve(size_t bytes) noexcept override;
  void release(void* base, size_t bytes) noexcept override;
  bool order_after(Stream waiter, Stream producer) noexcept override;
  Event record(Stream s) noexcept override;
  bool wait(Stream waiter, Event point) noexcept override;
  bool reached(Event point) noexcept override;
  void release_event(Event point) noexcept override;
  bool advise(void* p, size_t n, const Advice& from, const Advice& to) noexcept override;
  bool prefetch_to_gpu(void* p, size_t n, Stream s) noexcept override;
  bool prefetch_to_host(void* p, size_t n, Stream s) noexcept override;
  const char* name() const noexcept override { return "managed"; }

 private:
  bool check(cudaError_t err, const char* what) noexcept;
  bool call_advise(void* p, size_t n, cudaMemoryAdvise advice, cudaMemLocation where) noexcept;
  cudaEvent_t take_event() noexcept;  // from free_events_, or a new one on device_
  cudaMemLocation gpu() const { return {cudaMemLocationTypeDevice, device_}; }
  static cudaMemLocation host() { return {cudaMemLocationTypeHost, 0}; }

  int device_;
  // Events are reused: cudaStreamWaitEvent captures the event's state when it is called,
  // so an event can go back to the free list right after the wait is enqueued.
  std::vector<cudaEvent_t> free_events_;
};

}  // namespace um
