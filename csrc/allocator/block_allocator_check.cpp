// BlockAllocator::check_invariants: a full O(num_blocks + table sizes) audit of the allocator's
// bookkeeping, for tests and debugging. Kept apart from the hot-path verbs.
#include <stdexcept>
#include <string>
#include <vector>

#include "block_allocator.h"

namespace pagewire {
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("BlockAllocator invariant violated: " + what);
}

std::string blk(int64_t b) { return "block " + std::to_string(b); }

}  // namespace

void BlockAllocator::check_invariants() const {
  const size_t n = static_cast<size_t>(num_blocks_);

  // Refcounts equal the number of block-table entries holding each block, over every group. All
  // of a sequence's group tables have one length; released entries (kNullBlock) only in sliding
  // groups, and only as a prefix of the table.
  std::vector<int64_t> held(n, 0);
  const size_t groups = windows_.size();
  for (const auto& kv : seqs_) {
    const Sequence& seq = kv.second;
    const std::string who = "seq_id " + std::to_string(kv.first);
    if (seq.blocks.size() != groups || seq.chain.size() != groups || seq.closed.size() != groups ||
        seq.passed.size() != groups)
      fail(who + " has tables for " + std::to_string(seq.blocks.size()) + " groups, not " + std::to_string(groups));
    for (size_t g = 0; g < groups; ++g) {
      const std::vector<int32_t>& blocks = seq.blocks[g];
      const std::string where = who + " group " + std::to_string(g);
      if (blocks.size() != seq.blocks[0].size()) fail(where + " has a table of another length than group 0's");
      bool released = true;  // still inside the leading run of released entries
      for (int32_t b : blocks) {
        if (b == kNullBlock) {
          if (windows_[g] == 0) fail(where + " (full attention) holds a released entry");
          if (!released) fail(where + " has a released entry after a held block");
          continue;
        }
        released = false;
        if (b < 0 || b >= num_blocks_) fail(where + " holds out-of-range " + blk(b));
        ++held[b];
      }
      if (seq.chain[g].size() > blocks.size()) fail(where + " has more registered links than blocks");
      if (seq.passed[g] > static_cast<int64_t>(blocks.size())) fail(where + " let by more blocks than it holds");
    }
  }

  int64_t used = 0, free_count = 0, cached = 0, hashed = 0;
  for (size_t b = 0; b < n; ++b) {
    if (refcount_[b] < 0) fail(blk(b) + " has negative refcount " + std::to_string(refcount_[b]));
    if (refcount_[b] != held[b])
      fail(blk(b) + " has refcount " + std::to_string(refcount_[b]) + " but " + std::to_string(held[b]) +
           " block-table entries hold it");
    const bool is_hashed = hashed_[b] != 0;
    hashed += is_hashed;
    if (is_hashed && !enable_prefix_caching_) fail(blk(b) + " is hashed with prefix caching disabled");
    if (is_hashed && (hash_[b] & ~hash_mask_) != 0) fail(blk(b) + " has a hash wider than hash_bits");
    switch (state_[b]) {
      case kUsed:
        if (refcount_[b] == 0) fail(blk(b) + " is marked used with refcount 0");
        ++used;
        break;
      case kCached:
        if (refcount_[b] != 0) fail(blk(b) + " is cached (evictable) but referenced");
        if (!is_hashed) fail(blk(b) + " is cached without a hash");
        ++cached;
        break;
      case kFree:
        if (refcount_[b] != 0) fail(blk(b) + " is free but referenced");
        if (is_hashed) fail(blk(b) + " is free but still hashed");
        ++free_count;
        break;
      default:
        fail(blk(b) + " has an unknown state");
    }
  }
  if (used + free_count + cached != num_blocks_) fail("free + cached + used != num_blocks");

  // The free list holds exactly the free blocks, once each.
  std::vector<uint8_t> seen(n, 0);
  for (int32_t b : free_list_) {
    if (b < 0 || b >= num_blocks_) fail("free list holds out-of-range " + blk(b));
    if (state_[b] != kFree) fail("free list holds " + blk(b) + " which is not free");
    if (seen[b]++) fail("free list holds " + blk(b) + " twice");
  }
  if (static_cast<int64_t>(free_list_.size()) != free_count)
    fail("free list has " + std::to_string(free_list_.size()) + " entries for " +
         std::to_string(free_count) + " free blocks");

  // The LRU is a well-formed cycle through the sentinel holding exactly the cached blocks.
  const int32_t sentinel = static_cast<int32_t>(num_blocks_);
  int64_t walked = 0;
  for (int32_t b = lru_next_[sentinel], prev = sentinel; b != sentinel; prev = b, b = lru_next_[b]) {
    if (b < 0 || b > num_blocks_) fail("LRU links to out-of-range " + blk(b));
    if (lru_prev_[b] != prev) fail("LRU back link of " + blk(b) + " is broken");
    if (state_[b] != kCached) fail("LRU holds " + blk(b) + " which is not cached");
    if (++walked > num_blocks_) fail("LRU has a cycle that skips the sentinel");
  }
  if (walked != lru_size_ || walked != cached)
    fail("LRU walk found " + std::to_string(walked) + " blocks, lru_size is " + std::to_string(lru_size_) +
         ", cached blocks " + std::to_string(cached));

  // The hash index holds each hashed block once, under its own hash, and no two entries are
  // identical (same hash, parent identity and tokens): duplicates are never registered.
  std::fill(seen.begin(), seen.end(), 0);
  for (const auto& entry : index_) {
    const int32_t b = entry.second;
    if (b < 0 || b >= num_blocks_) fail("hash index holds out-of-range " + blk(b));
    if (!hashed_[b]) fail("hash index holds unhashed " + blk(b));
    if (hash_[b] != entry.first) fail("hash index files " + blk(b) + " under the wrong hash");
    if (seen[b]++) fail("hash index holds " + blk(b) + " twice");
  }
  if (static_cast<int64_t>(index_.size()) != hashed)
    fail("hash index has " + std::to_string(index_.size()) + " entries for " + std::to_string(hashed) +
         " hashed blocks");
  for (size_t b = 0; b < n; ++b) {
    if (!hashed_[b]) continue;
    const int32_t* tok = tokens_.data() + b * static_cast<size_t>(block_size_);
    const int32_t first = find_registered(hash_[b], parent_[b], parent_gen_[b], tok);
    if (first != static_cast<int32_t>(b)) fail(blk(b) + " duplicates registered " + blk(first));
  }
}

}  // namespace pagewire
