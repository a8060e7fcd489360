// The KV block allocator's pool and tables: construction, the free list and LRU, slot allocation
// with copy-on-write and sliding-window release, fork/truncate/free, and the block-table reads.
// The prefix cache (hash chains, match, registration) is block_allocator_prefix.cpp; the
// invariant checker block_allocator_check.cpp.
#include "block_allocator.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "block_allocator_internal.h"

namespace pagewire {
namespace {

using block_alloc::kNoParent;
using block_alloc::seq_str;

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

std::pair<int64_t, int64_t> BlockAllocator::fill_decode_inputs(
    const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& tokens, const std::vector<int64_t>& starts,
    const std::vector<int64_t>& prompt_lens, int64_t* i64, int64_t i64_stride, int32_t* i32, int64_t i32_stride,
    int32_t* tables, int64_t row_stride, int64_t width) const {
  const size_t n = seq_ids.size();
  if (tokens.size() != n || starts.size() != n || prompt_lens.size() != n)
    throw std::invalid_argument("fill_decode_inputs: seq_ids, tokens, starts and prompt_lens differ in length");
  if (num_groups() != 1)
    throw std::invalid_argument("fill_decode_inputs: the pool has " + std::to_string(num_groups()) +
                                " KV groups; decode inputs are planned for one");
  std::vector<const std::vector<int32_t>*> rows(n);
  int64_t longest = 0, max_len = 0;
  for (size_t r = 0; r < n; ++r) {
    const std::vector<int32_t>& t = get_seq(seq_ids[r], "fill_decode_inputs").blocks[0];
    const int64_t pos = starts[r];
    if (pos < 0 || pos / block_size_ >= static_cast<int64_t>(t.size()) || t[pos / block_size_] < 0)
      throw std::invalid_argument("fill_decode_inputs: sequence " + std::to_string(seq_ids[r]) +
                                  " has no block for position " + std::to_string(pos));
    rows[r] = &t;
    longest = std::max<int64_t>(longest, static_cast<int64_t>(t.size()));
    max_len = std::max<int64_t>(max_len, pos + 1);
  }
  if (longest > width) return {longest, -1};
  for (size_t r = 0; r < n; ++r) {
    const std::vector<int32_t>& t = *rows[r];
    const int64_t pos = starts[r];
    i64[r] = tokens[r];
    i64[i64_stride + r] = pos;
    i64[2 * i64_stride + r] = static_cast<int64_t>(t[pos / block_size_]) * block_size_ + pos % block_size_;
    i32[r] = static_cast<int32_t>(pos + 1);
    i32[i32_stride + r] = static_cast<int32_t>(prompt_lens[r]);
    int32_t* dst = tables + static_cast<int64_t>(r) * row_stride;
    std::copy(t.begin(), t.end(), dst);
    std::fill(dst + t.size(), dst + longest, 0);
  }
  for (size_t r = 0; r <= n; ++r) i32[2 * i32_stride + r] = static_cast<int32_t>(r);
  return {longest, max_len};
}

int32_t BlockAllocator::refcount(int64_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks_)
    throw std::invalid_argument("refcount: block_id " + std::to_string(block_id) + " out of range [0, " +
                                std::to_string(num_blocks_) + ")");
  return refcount_[static_cast<size_t>(block_id)];
}

BlockAllocator::Stats BlockAllocator::stats() const {
  const int64_t free_blocks = static_cast<int64_t>(free_list_.size());
  return Stats{num_blocks_, num_blocks_ - free_blocks - lru_size_, free_blocks, lru_size_,
               hit_tokens_, miss_tokens_, evictions_};
}

}  // namespace pagewire
