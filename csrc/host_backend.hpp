// A backend on anonymous host mappings: the pool's logic without a GPU.
// Device operations are counted, not performed, so tests can check when the pool asks for them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend.hpp"

namespace um {

class HostBackend final : public MemoryBackend {
 public:
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
  const char* name() const noexcept override { return "host"; }

 private:
  uintptr_t next_point_ = 0;  // points are numbered: nothing runs, so nothing is recorded
};

}  // namespace um
