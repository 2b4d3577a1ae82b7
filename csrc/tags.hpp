// What kind of data an allocation holds, so a policy can advise it.
// The order is the Python tuple um_alloc.tags.TAGS; tests check they agree.
#pragma once
#include <cstdint>

namespace um {

enum class Tag : uint8_t { parameter, gradient, optimizer_state, input, activation, other };
constexpr int kNumTags = 6;
constexpr Tag kDefaultTag = Tag::activation;

inline const char* tag_name(Tag t) {
  static const char* const names[kNumTags] = {"parameter", "gradient",   "optimizer_state",
                                              "input",     "activation", "other"};
  return names[static_cast<int>(t)];
}

inline bool valid_tag(int t) { return t >= 0 && t < kNumTags; }

}  // namespace um
