#include "pool_trace.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdlib>
#include <string>

namespace um {

std::unique_ptr<PoolTrace> PoolTrace::from_environment() {
  const char* prefix = std::getenv("UM_POOL_TRACE");
  if (!prefix || !*prefix) return nullptr;
  static std::atomic<int> pools{0};
  const std::string path =
      std::string(prefix) + "." + std::to_string(getpid()) + "." + std::to_string(pools.fetch_add(1));
  FILE* file = std::fopen(path.c_str(), "w");
  if (!file) {
    std::fprintf(stderr, "um_alloc: UM_POOL_TRACE: cannot write %s; this pool is not traced\n", path.c_str());
    return nullptr;
  }
  return std::make_unique<PoolTrace>(file);
}

PoolTrace::~PoolTrace() { std::fclose(file_); }

void PoolTrace::line(const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vfprintf(file_, format, args);
  va_end(args);
  std::fputc('\n', file_);
}

}  // namespace um
