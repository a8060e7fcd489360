// The KV block allocator's prefix cache: chained block hashes per KV group, the index of
// registered blocks (verified by token ids, never by hash alone), match_prefix's longest hit every
// group can serve, cache_full_blocks' registration, the chain links the state cache keys its
// snapshots by, and reset_prefix_cache. The pool and tables are block_allocator.cpp.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_allocator.h"
#include "block_allocator_internal.h"

namespace pagewire {
namespace {

using block_alloc::kNoParent;
using block_alloc::seq_str;

constexpr uint64_t kRootHash = 0x6a09e667f3bcc908ULL;  // chain seed: the "hash" before block 0

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// splitmix64's finalizer: full avalanche, so masking to a few bits still spreads hashes evenly.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Group g's chain starts from its own root: a different seed hash and a different (negative)
// parent id, so the first blocks of two groups with the same tokens are never each other's match.
inline uint64_t root_hash(int g) { return g == 0 ? kRootHash : mix64(kRootHash + static_cast<uint64_t>(g)); }
inline int32_t root_parent(int g) { return kNoParent - g; }

}  // namespace

// xxHash64-style rounds, one token per lane, seeded with the parent's hash so that equal blocks
// under different prefixes hash differently.
uint64_t BlockAllocator::hash_block(uint64_t parent_hash, const int32_t* tokens) const {
  constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL;
  uint64_t acc = mix64(parent_hash ^ P1);
  for (int64_t i = 0; i < block_size_; ++i) {
    acc = rotl(acc + static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) * P2, 31) * P1;
  }
  return mix64(acc ^ static_cast<uint64_t>(block_size_)) & hash_mask_;
}

int32_t BlockAllocator::find_registered(uint64_t hash, int32_t parent, uint64_t parent_gen,
                                        const int32_t* tokens) const {
  auto range = index_.equal_range(hash);
  for (auto it = range.first; it != range.second; ++it) {
    const int32_t b = it->second;
    if (parent_[b] != parent || parent_gen_[b] != parent_gen) continue;
    // Equal hashes prove nothing: only equal token ids may serve this block's KV.
    const int32_t* stored = tokens_.data() + static_cast<size_t>(b) * block_size_;
    if (std::equal(stored, stored + block_size_, tokens)) return b;
  }
  return -1;
}

void BlockAllocator::register_block(int32_t block, uint64_t hash, int32_t parent,
                                    uint64_t parent_gen, const int32_t* tokens) {
  hashed_[block] = 1;
  hash_[block] = hash;
  parent_[block] = parent;
  parent_gen_[block] = parent_gen;
  std::copy(tokens, tokens + block_size_, tokens_.begin() + static_cast<size_t>(block) * block_size_);
  index_.emplace(hash, block);
}

// Removes the block from the index and bumps its generation, so that children registered
// under it stop matching; a cached block becomes free.
void BlockAllocator::drop_hash(int32_t block) {
  auto range = index_.equal_range(hash_[block]);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second == block) {
      index_.erase(it);
      break;
    }
  }
  hashed_[block] = 0;
  parent_[block] = kNoParent;
  ++gen_[block];
  if (state_[block] == kCached) {
    lru_remove(block);
    state_[block] = kFree;
    free_list_.push_back(block);
  }
}

int64_t BlockAllocator::match_prefix(int64_t seq_id, const TokenView& tokens) {
  const int64_t full = tokens.total_len / block_size_;
  if (tokens.begin != 0 || tokens.total_len < 0 || tokens.size < full * block_size_)
    throw std::invalid_argument("match_prefix: token view must start at 0 and hold every full block");
  auto found = seqs_.find(seq_id);
  if (found != seqs_.end() && !found->second.blocks[0].empty())
    throw std::invalid_argument("match_prefix: " + seq_str(seq_id) + " already has " +
                                std::to_string(found->second.blocks[0].size()) +
                                " blocks; match_prefix only runs on a sequence with no blocks");
  Sequence& seq = get_or_create(seq_id);
  if (!enable_prefix_caching_) return 0;

  // Each group's longest registered chain (held or evictable), then the shortest of them: a hit
  // every group can serve. A sliding group's chain must still be registered from its first block
  // on (its parent identities prove the tokens), though only its window's blocks are attached.
  const int G = num_groups();
  std::vector<std::vector<ChainLink>> matched(static_cast<size_t>(G));
  int64_t hit = full;
  for (int g = 0; g < G && hit > 0; ++g) {
    uint64_t prev_hash = root_hash(g);
    int32_t prev_block = root_parent(g);
    uint64_t prev_gen = 0;
    std::vector<ChainLink>& links = matched[static_cast<size_t>(g)];
    for (int64_t i = 0; i < hit; ++i) {
      const int32_t* tok = tokens.data + i * block_size_;
      const uint64_t h = hash_block(prev_hash, tok);
      const int32_t b = find_registered(h, prev_block, prev_gen, tok);
      if (b < 0) break;
      links.push_back(ChainLink{h, b, gen_[b]});
      prev_hash = h;
      prev_block = b;
      prev_gen = gen_[b];
    }
    hit = static_cast<int64_t>(links.size());
  }
  for (int g = 0; g < G; ++g) {
    // The next token computed is at position hit * block_size: what it can see is attached.
    const int64_t keep_from = first_needed(g, hit * block_size_);
    for (int64_t i = 0; i < hit; ++i) {
      const ChainLink& link = matched[static_cast<size_t>(g)][static_cast<size_t>(i)];
      seq.chain[static_cast<size_t>(g)].push_back(link);
      if (i < keep_from) {
        seq.blocks[static_cast<size_t>(g)].push_back(kNullBlock);
        continue;
      }
      const int32_t b = link.block;
      if (refcount_[b] == 0) {
        lru_remove(b);
        state_[b] = kUsed;
      }
      ++refcount_[b];
      seq.blocks[static_cast<size_t>(g)].push_back(b);
    }
  }
  const int64_t covered = hit * block_size_;
  hit_tokens_ += covered;
  miss_tokens_ += tokens.total_len - covered;
  return covered;
}

int64_t BlockAllocator::registered_tokens(int64_t seq_id) const {
  const Sequence& seq = get_seq(seq_id, "cache_full_blocks");
  // The least registered group; a closed one registers nothing more but counts the full blocks
  // it let by, so a caller's next tokens still start at or below this point.
  int64_t least = static_cast<int64_t>(seq.blocks[0].size());
  for (int g = 0; g < num_groups(); ++g) {
    const size_t i = static_cast<size_t>(g);
    least = std::min(least, seq.closed[i] ? seq.passed[i] : static_cast<int64_t>(seq.chain[i].size()));
  }
  return least * block_size_;
}

void BlockAllocator::cache_full_blocks(int64_t seq_id, const TokenView& tokens) {
  Sequence& seq = get_seq(seq_id, "cache_full_blocks");
  const int64_t capacity = static_cast<int64_t>(seq.blocks[0].size()) * block_size_;
  if (tokens.total_len > capacity)
    throw std::invalid_argument("cache_full_blocks: token_ids has " + std::to_string(tokens.total_len) +
                                " tokens but " + seq_str(seq_id) + "'s blocks hold only " +
                                std::to_string(capacity));
  if (!enable_prefix_caching_) return;
  const int64_t full = tokens.total_len / block_size_;
  if (registered_tokens(seq_id) >= full * block_size_) return;  // idempotent: nothing newly full
  for (int g = 0; g < num_groups(); ++g) {
    std::vector<ChainLink>& chain = seq.chain[static_cast<size_t>(g)];
    const std::vector<int32_t>& blocks = seq.blocks[static_cast<size_t>(g)];
    const int64_t start = static_cast<int64_t>(chain.size());
    if (seq.closed[static_cast<size_t>(g)]) {
      seq.passed[static_cast<size_t>(g)] = std::max(seq.passed[static_cast<size_t>(g)], full);
      continue;
    }
    if (start >= full) continue;
    if (tokens.begin > start * block_size_ || tokens.begin + tokens.size < full * block_size_)
      throw std::invalid_argument("cache_full_blocks: token view does not cover the unregistered blocks");

    uint64_t prev_hash = start > 0 ? chain.back().hash : root_hash(g);
    int32_t prev_block = start > 0 ? chain.back().block : root_parent(g);
    uint64_t prev_gen = start > 0 ? chain.back().gen : 0;
    for (int64_t i = start; i < full; ++i) {
      const int32_t* tok = tokens.data + (i * block_size_ - tokens.begin);
      const int32_t b = blocks[i];
      if (b == kNullBlock) {
        // Released before it was registered (a window shorter than what a step wrote): the chain
        // cannot continue past it, so this group registers no more of this sequence.
        seq.closed[static_cast<size_t>(g)] = 1;
        seq.passed[static_cast<size_t>(g)] = full;
        break;
      }
      ChainLink link;
      if (hashed_[b]) {
        // Registered already, by a sibling sharing this block: its KV is what both of them wrote,
        // so the tokens must agree. Continue the chain from that registration.
        const int32_t* stored = tokens_.data() + static_cast<size_t>(b) * block_size_;
        if (!std::equal(stored, stored + block_size_, tok))
          throw std::invalid_argument("cache_full_blocks: token_ids[" + std::to_string(i * block_size_) +
                                      ":" + std::to_string((i + 1) * block_size_) + "] of " +
                                      seq_str(seq_id) + " differ from the tokens block " +
                                      std::to_string(b) + " holds");
        link = ChainLink{hash_[b], b, gen_[b]};
      } else {
        const uint64_t h = hash_block(prev_hash, tok);
        int32_t canonical = find_registered(h, prev_block, prev_gen, tok);
        if (canonical < 0) {
          register_block(b, h, prev_block, prev_gen, tok);
          canonical = b;
        }
        // An identical block registered earlier stays the index entry; later links of this
        // sequence chain from it, so they are found by a match that walked through it.
        link = ChainLink{h, canonical, gen_[canonical]};
      }
      chain.push_back(link);
      prev_hash = link.hash;
      prev_block = link.block;
      prev_gen = link.gen;
    }
  }
}

std::pair<int32_t, uint64_t> BlockAllocator::chain_link(int64_t seq_id, int64_t index) const {
  const Sequence& seq = get_seq(seq_id, "chain_link");
  const std::vector<ChainLink>& chain = seq.chain[0];
  if (index < 0 || index >= static_cast<int64_t>(chain.size()))
    throw std::invalid_argument("chain_link: index " + std::to_string(index) + " outside the " +
                                std::to_string(chain.size()) + " registered blocks of " + seq_str(seq_id));
  const ChainLink& link = chain[static_cast<size_t>(index)];
  return {link.block, link.gen};
}

bool BlockAllocator::link_valid(int32_t block, uint64_t gen) const {
  return block >= 0 && block < num_blocks_ && hashed_[static_cast<size_t>(block)] &&
         gen_[static_cast<size_t>(block)] == gen;
}

void BlockAllocator::reset_prefix_cache() {
  while (lru_size_ > 0) drop_hash(lru_next_[num_blocks_]);  // cached -> free
  for (int32_t b = 0; b < num_blocks_; ++b)
    if (hashed_[b]) drop_hash(b);  // used blocks stay held, unregistered
  // Every link points at an unregistered block now; the next cache_full_blocks re-registers
  // (a sliding group whose early blocks were released cannot, and closes).
  for (auto& kv : seqs_) {
    for (auto& chain : kv.second.chain) chain.clear();
    std::fill(kv.second.closed.begin(), kv.second.closed.end(), 0);
    std::fill(kv.second.passed.begin(), kv.second.passed.end(), 0);
  }
}

}  // namespace pagewire
