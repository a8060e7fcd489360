// The KV block allocator's verbs: prefix matching, slot allocation with copy-on-write,
// registration of full blocks, fork/truncate/free, and the invariant checker.
#include "block_allocator.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace pagewire {
namespace {

constexpr int32_t kNoParent = -1;
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

std::string seq_str(int64_t seq_id) { return "seq_id " + std::to_string(seq_id); }

// Group g's chain starts from its own root: a different seed hash and a different (negative)
// parent id, so the first blocks of two groups with the same tokens are never each other's match.
inline uint64_t root_hash(int g) { return g == 0 ? kRootHash : mix64(kRootHash + static_cast<uint64_t>(g)); }
inline int32_t root_parent(int g) { return kNoParent - g; }

std::vector<int64_t> checked_windows(std::vector<int64_t> windows) {
  if (windows.empty()) throw std::invalid_argument("BlockAllocator: group_windows must name at least one group");
  for (int64_t w : windows)
    if (w < 0) throw std::invalid_argument("BlockAllocator: group windows must be >= 0 (0: full), got " +
                                           std::to_string(w));
  return windows;
}

}  // namespace

BlockAllocator::BlockAllocator(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching,
                               int hash_bits, std::vector<int64_t> group_windows)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      hash_mask_(hash_bits >= 64 ? ~0ULL : ((1ULL << (hash_bits > 0 ? hash_bits : 1)) - 1)),
      windows_(checked_windows(std::move(group_windows))) {
  // Block ids are int32 and index num_blocks is the LRU sentinel, hence the strict upper bound.
  if (num_blocks <= 0 || num_blocks >= std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("BlockAllocator: num_blocks must be in [1, 2^31 - 1), got " +
                                std::to_string(num_blocks));
  if (block_size <= 0 || block_size > (1 << 20))
    throw std::invalid_argument("BlockAllocator: block_size must be in [1, 2^20], got " +
                                std::to_string(block_size));
  if (hash_bits < 1 || hash_bits > 64)
    throw std::invalid_argument("BlockAllocator: hash_bits must be in [1, 64], got " +
                                std::to_string(hash_bits));
  const size_t n = static_cast<size_t>(num_blocks);
  refcount_.assign(n, 0);
  state_.assign(n, kFree);
  hashed_.assign(n, 0);
  hash_.assign(n, 0);
  parent_.assign(n, kNoParent);
  parent_gen_.assign(n, 0);
  gen_.assign(n, 0);
  // Token ids are stored only so that a hit can be verified; allocate them up front so that
  // registering a block never allocates.
  tokens_.assign(enable_prefix_caching ? n * static_cast<size_t>(block_size) : 0, 0);
  free_list_.reserve(n);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_list_.push_back(static_cast<int32_t>(b));
  lru_prev_.assign(n + 1, static_cast<int32_t>(num_blocks));
  lru_next_.assign(n + 1, static_cast<int32_t>(num_blocks));
  if (enable_prefix_caching) index_.reserve(n);
}

BlockAllocator::Sequence& BlockAllocator::get_seq(int64_t seq_id, const char* what) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end())
    throw std::invalid_argument(std::string(what) + ": unknown " + seq_str(seq_id));
  return it->second;
}

const BlockAllocator::Sequence& BlockAllocator::get_seq(int64_t seq_id, const char* what) const {
  return const_cast<BlockAllocator*>(this)->get_seq(seq_id, what);
}

BlockAllocator::Sequence BlockAllocator::new_sequence() const {
  const size_t g = windows_.size();
  return Sequence{std::vector<std::vector<int32_t>>(g), std::vector<std::vector<ChainLink>>(g),
                  std::vector<uint8_t>(g, 0), std::vector<int64_t>(g, 0)};
}

BlockAllocator::Sequence& BlockAllocator::get_or_create(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it != seqs_.end()) return it->second;
  return seqs_.emplace(seq_id, new_sequence()).first->second;
}

int64_t BlockAllocator::first_needed(int g, int64_t pos) const {
  const int64_t w = windows_[static_cast<size_t>(g)];
  return w > 0 ? std::max<int64_t>(0, pos - w + 1) / block_size_ : 0;
}

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

int32_t BlockAllocator::take_fresh_block() {
  if (free_list_.empty()) {
    // Evict the least recently used cached block; drop_hash moves it onto the free list.
    drop_hash(lru_next_[num_blocks_]);
    ++evictions_;
  }
  const int32_t b = free_list_.back();
  free_list_.pop_back();
  ++gen_[b];
  refcount_[b] = 1;
  state_[b] = kUsed;
  return b;
}

void BlockAllocator::decref(int32_t block) {
  if (--refcount_[block] > 0) return;
  if (hashed_[block]) {
    state_[block] = kCached;
    lru_push_back(block);
  } else {
    state_[block] = kFree;
    free_list_.push_back(block);
  }
}

void BlockAllocator::lru_push_back(int32_t block) {
  const int32_t s = static_cast<int32_t>(num_blocks_);
  const int32_t last = lru_prev_[s];
  lru_prev_[block] = last;
  lru_next_[block] = s;
  lru_next_[last] = block;
  lru_prev_[s] = block;
  ++lru_size_;
}

void BlockAllocator::lru_remove(int32_t block) {
  lru_next_[lru_prev_[block]] = lru_next_[block];
  lru_prev_[lru_next_[block]] = lru_prev_[block];
  lru_prev_[block] = lru_next_[block] = static_cast<int32_t>(num_blocks_);
  --lru_size_;
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

void BlockAllocator::plan(const Sequence* seq, int64_t num_computed, int64_t num_new,
                          int64_t* fresh_blocks, int64_t* released_blocks) const {
  if (num_computed < 0)
    throw std::invalid_argument("num_computed_tokens must be >= 0, got " + std::to_string(num_computed));
  if (num_new < 0)
    throw std::invalid_argument("num_new_tokens must be >= 0, got " + std::to_string(num_new));
  const int64_t have = seq ? static_cast<int64_t>(seq->blocks[0].size()) : 0;
  if (num_computed > have * block_size_)
    throw std::invalid_argument("num_computed_tokens (" + std::to_string(num_computed) +
                                ") exceeds the " + std::to_string(have * block_size_) +
                                " tokens the sequence's blocks hold");
  if (num_new > std::numeric_limits<int64_t>::max() / 2 - num_computed)
    throw std::invalid_argument("num_new_tokens is too large: " + std::to_string(num_new));
  const int64_t total = num_computed + num_new;
  const int64_t need = (total + block_size_ - 1) / block_size_;
  const int G = num_groups();
  *fresh_blocks = std::max<int64_t>(0, need - have) * G;
  *released_blocks = 0;
  if (seq == nullptr) return;
  const int64_t first = num_computed / block_size_;
  const int64_t end = std::min(have, (total - 1) / block_size_ + 1);
  for (int g = 0; g < G; ++g) {
    const std::vector<int32_t>& blocks = seq->blocks[static_cast<size_t>(g)];
    // Released from the window before the write: blocks of [0, first_needed) this sequence alone holds.
    const int64_t drop = std::min(first_needed(g, num_computed), have);
    for (int64_t i = 0; i < drop; ++i) *released_blocks += blocks[i] != kNullBlock && refcount_[blocks[i]] == 1;
    if (num_new == 0) continue;
    for (int64_t i = std::max(first, drop); i < end; ++i) {
      // A shared block is copied on write; a released entry (only after a truncate below the
      // window start) gets a fresh block.
      *fresh_blocks += blocks[i] == kNullBlock || refcount_[blocks[i]] > 1 ? 1 : 0;
    }
  }
}

int64_t BlockAllocator::blocks_needed(int64_t seq_id, int64_t num_computed, int64_t num_new) const {
  auto it = seqs_.find(seq_id);
  int64_t fresh = 0, released = 0;
  plan(it == seqs_.end() ? nullptr : &it->second, num_computed, num_new, &fresh, &released);
  return fresh - released;
}

std::optional<std::vector<std::pair<int32_t, int32_t>>> BlockAllocator::allocate_slots(
    int64_t seq_id, int64_t num_computed, int64_t num_new) {
  auto it = seqs_.find(seq_id);
  int64_t fresh = 0, released = 0;
  plan(it == seqs_.end() ? nullptr : &it->second, num_computed, num_new, &fresh, &released);
  if (fresh > num_free_blocks() + released) return std::nullopt;  // all-or-nothing: nothing changed

  Sequence& seq = get_or_create(seq_id);
  std::vector<std::pair<int32_t, int32_t>> copies;
  const int64_t have = static_cast<int64_t>(seq.blocks[0].size());
  const int64_t first = num_computed / block_size_;
  const int64_t end = std::min<int64_t>(have, (num_computed + num_new - 1) / block_size_ + 1);
  const int64_t need = (num_computed + num_new + block_size_ - 1) / block_size_;
  for (int g = 0; g < num_groups(); ++g) {
    std::vector<int32_t>& blocks = seq.blocks[static_cast<size_t>(g)];
    // First give back what the window left behind, so the blocks taken below may reuse them.
    // Tail first, as in free(), so LRU evicts the oldest positions first.
    const int64_t drop = std::min(first_needed(g, num_computed), have);
    for (int64_t i = drop - 1; i >= 0; --i) {
      if (blocks[i] == kNullBlock) break;  // nulls are a prefix: everything below is released
      decref(blocks[i]);
      blocks[i] = kNullBlock;
    }
  }
  for (int g = 0; g < num_groups(); ++g) {
    std::vector<int32_t>& blocks = seq.blocks[static_cast<size_t>(g)];
    std::vector<ChainLink>& chain = seq.chain[static_cast<size_t>(g)];
    if (num_new > 0) {
      for (int64_t i = first; i < end; ++i) {
        const int32_t b = blocks[i];
        if (b == kNullBlock) {
          blocks[i] = take_fresh_block();
        } else if (refcount_[b] > 1) {
          // Others still read b: write into a private copy. b keeps its hash (its KV is intact).
          const int32_t dst = take_fresh_block();
          blocks[i] = dst;
          --refcount_[b];
          copies.emplace_back(b, dst);
        } else if (hashed_[b]) {
          drop_hash(b);  // about to be overwritten: its registered contents would become a lie
        }
      }
      // Registrations from the first written block on no longer describe this sequence.
      if (static_cast<int64_t>(chain.size()) > first) {
        chain.resize(static_cast<size_t>(first));
        seq.closed[static_cast<size_t>(g)] = 0;  // the chain is whole up to `first`: continue it
      }
      int64_t& passed = seq.passed[static_cast<size_t>(g)];
      passed = std::min(passed, first);
    }
    for (int64_t k = have; k < need; ++k) blocks.push_back(take_fresh_block());
  }
  return copies;
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

void BlockAllocator::fork(int64_t parent_id, int64_t child_id) {
  if (parent_id == child_id)
    throw std::invalid_argument("fork: parent_id and child_id are both " + std::to_string(parent_id));
  get_seq(parent_id, "fork (parent_id)");
  auto found = seqs_.find(child_id);
  if (found != seqs_.end() && !found->second.blocks[0].empty())
    throw std::invalid_argument("fork: child " + seq_str(child_id) + " already has blocks");
  Sequence& child = get_or_create(child_id);
  const Sequence& parent = seqs_.at(parent_id);  // looked up after the insert (rehash-safe)
  child = parent;
  for (const auto& blocks : child.blocks)
    for (int32_t b : blocks)
      if (b != kNullBlock) ++refcount_[b];
}

void BlockAllocator::truncate(int64_t seq_id, int64_t num_tokens) {
  if (num_tokens < 0)
    throw std::invalid_argument("truncate: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  Sequence& seq = get_seq(seq_id, "truncate");
  const int64_t have = static_cast<int64_t>(seq.blocks[0].size());
  if (num_tokens > have * block_size_)
    throw std::invalid_argument("truncate: num_tokens (" + std::to_string(num_tokens) + ") exceeds the " +
                                std::to_string(have * block_size_) + " tokens " + seq_str(seq_id) +
                                "'s blocks hold");
  const int64_t keep = (num_tokens + block_size_ - 1) / block_size_;
  const size_t full = static_cast<size_t>(num_tokens / block_size_);
  for (int g = 0; g < num_groups(); ++g) {
    // The next token (at num_tokens) must still see its whole window: refuse to go below what a
    // sliding group has already given back (a rollback never does: it keeps the allocated start).
    const std::vector<int32_t>& blocks = seq.blocks[static_cast<size_t>(g)];
    const int64_t released = std::find_if(blocks.begin(), blocks.end(), [](int32_t b) { return b != kNullBlock; }) -
                             blocks.begin();
    if (released > 0 && first_needed(g, num_tokens) < released)
      throw std::invalid_argument("truncate: num_tokens (" + std::to_string(num_tokens) + ") is below what group " +
                                  std::to_string(g) + "'s window of " + std::to_string(windows_[g]) +
                                  " tokens still needs; its first " + std::to_string(released) +
                                  " blocks were already released");
  }
  for (int g = 0; g < num_groups(); ++g) {
    std::vector<int32_t>& blocks = seq.blocks[static_cast<size_t>(g)];
    for (int64_t i = have - 1; i >= keep; --i)  // tail first, as in free()
      if (blocks[i] != kNullBlock) decref(blocks[i]);
    blocks.resize(static_cast<size_t>(keep));
    std::vector<ChainLink>& chain = seq.chain[static_cast<size_t>(g)];
    if (chain.size() > full) chain.resize(full);
    seq.passed[static_cast<size_t>(g)] = std::min<int64_t>(seq.passed[static_cast<size_t>(g)], full);
    if (num_tokens % block_size_ != 0) {
      // The partial tail will be rewritten. A shared one keeps its hash: its KV is still what was
      // registered, and writing into it copies it first.
      const int32_t tail = blocks.back();
      if (tail != kNullBlock && hashed_[tail] && refcount_[tail] == 1) drop_hash(tail);
    }
  }
}

void BlockAllocator::free(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  // Tail first: under LRU the tail of a sequence is then evicted before its head, which keeps
  // the (more shareable) head of a prompt cached longest.
  for (const auto& blocks : it->second.blocks)
    for (auto b = blocks.rbegin(); b != blocks.rend(); ++b)
      if (*b != kNullBlock) decref(*b);
  seqs_.erase(it);
}

const std::vector<int32_t>& BlockAllocator::block_table(int64_t seq_id, int group) const {
  const Sequence& seq = get_seq(seq_id, "block_table");
  if (group < 0 || group >= num_groups())
    throw std::invalid_argument("block_table: group " + std::to_string(group) + " out of range [0, " +
                                std::to_string(num_groups()) + ")");
  return seq.blocks[static_cast<size_t>(group)];
}

int64_t BlockAllocator::fill_block_tables(const std::vector<int64_t>& seq_ids, int32_t* out, int64_t group_stride,
                                          int64_t row_stride, int64_t width) const {
  std::vector<const Sequence*> rows;
  rows.reserve(seq_ids.size());
  int64_t longest = 0;
  for (int64_t id : seq_ids) {
    rows.push_back(&get_seq(id, "fill_block_tables"));
    longest = std::max<int64_t>(longest, static_cast<int64_t>(rows.back()->blocks[0].size()));
  }
  if (longest > width)
    throw std::invalid_argument("fill_block_tables: a table has " + std::to_string(longest) +
                                " blocks, more than the " + std::to_string(width) + " columns of out");
  for (int g = 0; g < num_groups(); ++g) {
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::vector<int32_t>& t = rows[r]->blocks[static_cast<size_t>(g)];
      int32_t* dst = out + g * group_stride + static_cast<int64_t>(r) * row_stride;
      std::copy(t.begin(), t.end(), dst);
      std::fill(dst + t.size(), dst + longest, 0);
    }
  }
  return longest;
}

int32_t BlockAllocator::refcount(int64_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks_)
    throw std::invalid_argument("refcount: block_id " + std::to_string(block_id) + " out of range [0, " +
                                std::to_string(num_blocks_) + ")");
  return refcount_[static_cast<size_t>(block_id)];
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

BlockAllocator::Stats BlockAllocator::stats() const {
  const int64_t free_blocks = static_cast<int64_t>(free_list_.size());
  return Stats{num_blocks_, num_blocks_ - free_blocks - lru_size_, free_blocks, lru_size_,
               hit_tokens_, miss_tokens_, evictions_};
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
