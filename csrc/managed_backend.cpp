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
  cudaEvent_t e;
  if (free_events_.empty()) {
    if (!check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate")) return false;
  } else {
    e = free_events_.back();
    free_events_.pop_back();
  }
  bool ok = check(cudaEventRecord(e, static_cast<cudaStream_t>(producer)), "cudaEventRecord") &&
            check(cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter), e, 0), "cudaStreamWaitEvent");
  free_events_.push_back(e);
  return ok;
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
