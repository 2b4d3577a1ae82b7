#include "managed_backend.hpp"

#include <string>

namespace um {

ManagedBackend::~ManagedBackend() {
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
}

bool ManagedBackend::check(cudaError_t err, const char* what) noexcept {
  if (err == cudaSuccess) return true;
  error_ = std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
           ")";
  cudaGetLastError();  // clear the sticky-free error so later calls are not blamed for it
  return false;
}

void* ManagedBackend::reserve(size_t bytes) noexcept {
  void* p = nullptr;
  if (!check(cudaMallocManaged(&p, bytes, cudaMemAttachGlobal), "cudaMallocManaged")) return nullptr;
  return p;
}

void ManagedBackend::release(void* base, size_t) noexcept { check(cudaFree(base), "cudaFree"); }

bool ManagedBackend::order_after(Stream waiter, Stream producer) noexcept {
  Event point = record(producer);
  if (!point) return false;
  const bool ok = wait(waiter, point);
  release_event(point);  // the wait holds the point on the GPU; the event can be recorded again
  return ok;
}

Event ManagedBackend::record(Stream s) noexcept {
  cudaEvent_t e = take_event();
  if (!e) return nullptr;
  if (check(cudaEventRecord(e, static_cast<cudaStream_t>(s)), "cudaEventRecord")) return e;
  free_events_.push_back(e);
  return nullptr;
}

bool ManagedBackend::wait(Stream waiter, Event point) noexcept {
  return check(cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter), static_cast<cudaEvent_t>(point), 0),
               "cudaStreamWaitEvent");
}

bool ManagedBackend::reached(Event point) noexcept {
  const cudaError_t state = cudaEventQuery(static_cast<cudaEvent_t>(point));
  if (state == cudaErrorNotReady) {
    cudaGetLastError();  // not an error: the work is still running
    return false;
  }
  return check(state, "cudaEventQuery");
}

void ManagedBackend::release_event(Event point) noexcept {
  free_events_.push_back(static_cast<cudaEvent_t>(point));
}

// Frees can come from any thread (autograd's run backward on their own), whose current device
// may be another: an event must be created on the device whose streams record it.
cudaEvent_t ManagedBackend::take_event() noexcept {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  int previous = -1;
  cudaEvent_t e = nullptr;
  if (!check(cudaGetDevice(&previous), "cudaGetDevice") || !check(cudaSetDevice(device_), "cudaSetDevice"))
    return nullptr;
  if (!check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate")) e = nullptr;
  cudaSetDevice(previous);
  return e;
}

bool ManagedBackend::call_advise(void* p, size_t n, cudaMemoryAdvise advice,
                                 cudaMemLocation where) noexcept {
  return check(cudaMemAdvise(p, n, advice, where), "cudaMemAdvise");
}

bool ManagedBackend::advise(void* p, size_t n, const Advice& from, const Advice& to) noexcept {
  bool ok = true;
  if (from.preferred != to.preferred) {
    if (to.preferred == Location::none)
      ok &= call_advise(p, n, cudaMemAdviseUnsetPreferredLocation, host());
    else
      ok &= call_advise(p, n, cudaMemAdviseSetPreferredLocation,
                        to.preferred == Location::gpu ? gpu() : host());
  }
  if (from.read_mostly != to.read_mostly)
    ok &= call_advise(p, n, to.read_mostly ? cudaMemAdviseSetReadMostly : cudaMemAdviseUnsetReadMostly,
                      gpu());
  if (from.accessed_by_gpu != to.accessed_by_gpu)
    ok &= call_advise(p, n, to.accessed_by_gpu ? cudaMemAdviseSetAccessedBy : cudaMemAdviseUnsetAccessedBy,
                      gpu());
  if (from.accessed_by_cpu != to.accessed_by_cpu)
    ok &= call_advise(p, n, to.accessed_by_cpu ? cudaMemAdviseSetAccessedBy : cudaMemAdviseUnsetAccessedBy,
                      host());
  return ok;
}

bool ManagedBackend::prefetch_to_gpu(void* p, size_t n, Stream s) noexcept {
  return check(cudaMemPrefetchAsync(p, n, gpu(), 0, static_cast<cudaStream_t>(s)),
               "cudaMemPrefetchAsync");
}

bool ManagedBackend::prefetch_to_host(void* p, size_t n, Stream s) noexcept {
  return check(cudaMemPrefetchAsync(p, n, host(), 0, static_cast<cudaStream_t>(s)),
               "cudaMemPrefetchAsync(host)");
}

}  // namespace um
