// A text record of one pool's calls, from which bench/pool_trace.py replays its layout on the host
// backend: where a step's held bytes outgrow its live bytes, and which requests made the pool back
// new chunks. Off unless UM_POOL_TRACE names a path prefix; each pool then writes
// PREFIX.<pid>.<pool number>, one event a line (the letters are bench/pool_trace.py's).
#pragma once
#include <cstdio>
#include <memory>

namespace um {

class PoolTrace {
 public:
  // Null where UM_POOL_TRACE is unset or its file cannot be opened (said once on stderr).
  static std::unique_ptr<PoolTrace> from_environment();
  explicit PoolTrace(FILE* file) : file_(file) {}
  ~PoolTrace();
  PoolTrace(const PoolTrace&) = delete;
  PoolTrace& operator=(const PoolTrace&) = delete;

  // One event, printf-style; the caller holds the pool's lock, so lines never interleave.
  void line(const char* format, ...)
#if defined(__GNUC__)
      __attribute__((format(printf, 2, 3)))
#endif
      ;

 private:
  FILE* file_;
};

}  // namespace um
