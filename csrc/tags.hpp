// What kind of data an allocation holds, so a policy can advise it.
// The order is the Python tuple um_alloc.tag_names.TAGS; tests check they agree.
#pragma once
#include <cstdint>
#include <string>

namespace um {

// spill: the large temporaries of a region marked with um_alloc.spill_from (a loss over a large
// vocabulary, say), which a policy places in host memory the GPU maps.
enum class Tag : uint8_t { parameter, gradient, optimizer_state, input, activation, other, spill };
constexpr int kNumTags = 7;
constexpr Tag kDefaultTag = Tag::activation;

inline const char* tag_name(Tag t) {
  static const char* const names[kNumTags] = {"parameter", "gradient",   "optimizer_state",
                                              "input",     "activation", "other",
                                              "spill"};
  return names[static_cast<int>(t)];
}

inline bool valid_tag(int t) { return t >= 0 && t < kNumTags; }

// The error for a call given a tag number out of range: "tag 9 is not 0..6".
inline std::string bad_tag_message(int t) {
  return "tag " + std::to_string(t) + " is not 0.." + std::to_string(kNumTags - 1);
}

}  // namespace um
