// What the block allocator's translation units (block_allocator.cpp, block_allocator_prefix.cpp)
// share besides the class: the parent id of a chain's root and the id text of error messages.
// Not part of the allocator's interface; included by nothing else.
#pragma once

#include <cstdint>
#include <string>

namespace pagewire {
namespace block_alloc {

// parent_[b] of an unregistered block; group g's root parent is kNoParent - g (see root_parent).
constexpr int32_t kNoParent = -1;

inline std::string seq_str(int64_t seq_id) { return "seq_id " + std::to_string(seq_id); }

}  // namespace block_alloc
}  // namespace pagewire
