// Memory hints for one tag, and the prefetch choice that goes with them.
#pragma once
#include <cstdint>

namespace um {

enum class Location : uint8_t { none, gpu, cpu };

// The cudaMemAdvise state of a range. Equality decides whether a chunk needs new calls,
// so keep every field here a hint the driver holds.
struct Advice {
  Location preferred = Location::none;
  bool read_mostly = false;
  bool accessed_by_gpu = false;
  bool accessed_by_cpu = false;

  bool operator==(const Advice& o) const {
    return preferred == o.preferred && read_mostly == o.read_mostly &&
           accessed_by_gpu == o.accessed_by_gpu && accessed_by_cpu == o.accessed_by_cpu;
  }
  bool operator!=(const Advice& o) const { return !(*this == o); }
};

struct TagPolicy {
  Advice advice;
  bool prefetch = false;  // prefetch to the GPU when allocated or retagged
};

}  // namespace um
