// The KV block allocator: owns which physical KV blocks each sequence holds, their refcounts,
// the prefix-cache hash index and the LRU of evictable cached blocks. Plain C++17, no torch.
//
// Block states (exactly one at a time):
//   free    refcount 0, no hash, on the free list;
//   cached  refcount 0, has a hash, on the LRU list (evictable, reusable by match_prefix);
//   used    refcount > 0 (held by that many sequence block tables), hashed or not.
//
// A registered (hashed) block is identified by (chained hash, parent identity, token ids). The
// parent identity is (block id, generation) of the previous block in the chain; a block's
// generation changes whenever its hash is dropped or it is handed out fresh, so a child that
// points at a recycled or rewritten parent can never match again.
//
// KV groups (vLLM v1's hybrid KV cache manager): a sequence holds one block table per group. A
// group is a set of layers sharing a window (0: full attention, server/engine/kv_groups.py); a
// block of the pool holds bs tokens of K/V for every layer of ONE group, so all groups draw from
// the same pool and the refcount / copy-on-write / LRU rules are the same for every block. A
// full-attention group keeps every block; a sliding-window group of window W gives back the blocks
// no future token can see (every position < num_computed - W + 1) when allocate_slots grows the
// sequence: their entries become kNullBlock (-1). Nulls are always a prefix of a group's table.
// Prefix hashes are chained per group (seeded by the group, so identical tokens in two groups
// never match each other); a prefix hit is the longest prefix EVERY group matches, and attaches
// only the blocks each group still needs for the next token.
//
// Not thread-safe. The Python bindings hold the GIL for every call (calls are short), which
// serialises all access from the engine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pagewire {

// A read-only window [begin, begin + size) over a sequence's token ids, out of total_len tokens
// the caller passed. Windows let the bindings convert only the tokens a call will read (a decode
// step's cache_full_blocks touches one new block, not the whole prompt).
struct TokenView {
  const int32_t* data = nullptr;  // data[k] is token (begin + k)
  int64_t begin = 0;
  int64_t size = 0;
  int64_t total_len = 0;
};

// A group's table entry for a block released from its sliding window.
constexpr int32_t kNullBlock = -1;

class BlockAllocator {
 public:
  // group_windows: one entry per KV group, 0 for full attention, W > 0 for a sliding window of W
  // tokens. Throws std::invalid_argument for num_blocks <= 0, block_size <= 0, hash_bits outside
  // [1, 64], no group or a negative window.
  BlockAllocator(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching = true,
                 int hash_bits = 64, std::vector<int64_t> group_windows = {0});

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  int num_groups() const { return static_cast<int>(windows_.size()); }
  const std::vector<int64_t>& group_windows() const { return windows_; }
  bool prefix_caching_enabled() const { return enable_prefix_caching_; }
  // Blocks allocatable now: free + evictable cached.
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_list_.size()) + lru_size_; }

  bool has_sequence(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }

  // Attaches the longest cached chain of full blocks matching tokens[0, view.total_len) to a
  // sequence with no blocks (created if unknown). view must start at 0 and hold at least every
  // full block. Returns the number of tokens covered (a multiple of block_size).
  int64_t match_prefix(int64_t seq_id, const TokenView& tokens);

  // Grows the block table to cover num_computed + num_new tokens and copies-on-write every shared
  // block the write range touches. Returns the (src, dst) copies to run, or nullopt (and changes
  // nothing) when too few blocks are available.
  std::optional<std::vector<std::pair<int32_t, int32_t>>> allocate_slots(int64_t seq_id,
                                                                         int64_t num_computed,
                                                                         int64_t num_new);
  // Net blocks allocate_slots would take from the pool right now: new blocks + copy-on-write
  // copies over every group, minus the blocks it releases from sliding windows (may be negative).
  int64_t blocks_needed(int64_t seq_id, int64_t num_computed, int64_t num_new) const;

  // Registers every full block not yet registered. view.begin must be <= registered_tokens() and
  // the view must reach the last full block of view.total_len tokens.
  void cache_full_blocks(int64_t seq_id, const TokenView& tokens);
  // Tokens of the sequence whose blocks are already registered (the next cache_full_blocks reads
  // from here). Throws std::invalid_argument for an unknown sequence.
  int64_t registered_tokens(int64_t seq_id) const;

  void fork(int64_t parent_id, int64_t child_id);
  // Keeps ceil(num_tokens / block_size) blocks per group. Throws std::invalid_argument when a
  // sliding group has released blocks the token at num_tokens would need.
  void truncate(int64_t seq_id, int64_t num_tokens);
  void free(int64_t seq_id);  // unknown id: no-op

  // Group `group`'s table (kNullBlock where a sliding window released a block).
  const std::vector<int32_t>& block_table(int64_t seq_id, int group = 0) const;
  // Writes the tables of seq_ids into out[g][r][0, width) for every group g (row r = seq_ids[r]):
  // entries past a table's end are 0. Returns the longest table; throws std::invalid_argument if
  // it exceeds width (nothing is then written) or a sequence is unknown.
  int64_t fill_block_tables(const std::vector<int64_t>& seq_ids, int32_t* out, int64_t group_stride,
                            int64_t row_stride, int64_t width) const;
  // One decode step's inputs (one new token per sequence) for a single-group pool, written into
  // the runner's persistent buffers so that a decode step builds no tensor of its own. Row r is
  // seq_ids[r], whose new token tokens[r] sits at position starts[r]:
  //   i64[0][r] token, i64[1][r] position, i64[2][r] its cache slot (block * block_size + offset);
  //   i32[0][r] seq_len (starts[r] + 1), i32[1][r] prompt_lens[r], i32[2][0..n] query_start_loc (0..n);
  //   tables[r][0, longest) the block table, 0 past its end.
  // Returns {longest table, max seq_len}. When the longest table exceeds `width` nothing is
  // written and max seq_len is -1 (the caller grows its tables and calls again). Throws
  // std::invalid_argument for an unknown sequence, a position without an allocated block, or a
  // pool with several groups.
  std::pair<int64_t, int64_t> fill_decode_inputs(const std::vector<int64_t>& seq_ids,
                                                 const std::vector<int64_t>& tokens,
                                                 const std::vector<int64_t>& starts,
                                                 const std::vector<int64_t>& prompt_lens, int64_t* i64,
                                                 int64_t i64_stride, int32_t* i32, int64_t i32_stride,
                                                 int32_t* tables, int64_t row_stride, int64_t width) const;
  int32_t refcount(int64_t block_id) const;
  // Group 0's registered chain link `index` of a sequence: (representative block, its generation).
  // The pair names that prefix's content for as long as link_valid says so (the state cache keys
  // its snapshots by it). Throws std::invalid_argument past the registered chain.
  std::pair<int32_t, uint64_t> chain_link(int64_t seq_id, int64_t index) const;
  // Whether `block` is still registered with generation `gen` (not evicted, reset or rewritten).
  bool link_valid(int32_t block, uint64_t gen) const;

  struct Stats {
    int64_t num_blocks, used_blocks, free_blocks, cached_blocks;
    int64_t prefix_hit_tokens, prefix_miss_tokens, evictions;
  };
  Stats stats() const;

  void reset_prefix_cache();
  // Throws std::runtime_error describing the first broken invariant.
  void check_invariants() const;

 private:
  enum State : uint8_t { kFree = 0, kCached = 1, kUsed = 2 };

  // One link of a sequence's hash chain: the hash of its i-th full block and the block that
  // represents it in the index (itself, or an identical block registered earlier elsewhere).
  struct ChainLink {
    uint64_t hash;
    int32_t block;
    uint64_t gen;
  };
  // Per group g: blocks[g] (all groups' tables have the same length), chain[g] its registered
  // prefix (chain[g].size() <= blocks[g].size()); closed[g] once a registration met a released
  // block (after a reset_prefix_cache), after which that group registers nothing more for this
  // sequence: passed[g] then counts the full blocks it has let by (its registration point).
  struct Sequence {
    std::vector<std::vector<int32_t>> blocks;
    std::vector<std::vector<ChainLink>> chain;
    std::vector<uint8_t> closed;
    std::vector<int64_t> passed;
  };
  Sequence new_sequence() const;
  Sequence& get_or_create(int64_t seq_id);
  // First logical block a token at position `pos` (and every later one) can still see in group g.
  int64_t first_needed(int g, int64_t pos) const;

  Sequence& get_seq(int64_t seq_id, const char* what);
  const Sequence& get_seq(int64_t seq_id, const char* what) const;

  uint64_t hash_block(uint64_t parent_hash, const int32_t* tokens) const;
  // The registered block identical to (hash, parent, tokens), or -1.
  int32_t find_registered(uint64_t hash, int32_t parent, uint64_t parent_gen,
                          const int32_t* tokens) const;
  void register_block(int32_t block, uint64_t hash, int32_t parent, uint64_t parent_gen,
                      const int32_t* tokens);
  void drop_hash(int32_t block);

  int32_t take_fresh_block();  // caller checked num_free_blocks() > 0
  void decref(int32_t block);
  void lru_push_back(int32_t block);
  void lru_remove(int32_t block);

  // Counts for allocate_slots / blocks_needed: fresh blocks (appended, copied on write, or
  // replacing a released entry in the write range) and released blocks that return to the pool.
  void plan(const Sequence* seq, int64_t num_computed, int64_t num_new, int64_t* fresh_blocks,
            int64_t* released_blocks) const;

  const int64_t num_blocks_;
  const int64_t block_size_;
  const bool enable_prefix_caching_;
  const uint64_t hash_mask_;
  const std::vector<int64_t> windows_;

  std::vector<int32_t> refcount_;
  std::vector<uint8_t> state_;
  std::vector<uint8_t> hashed_;
  std::vector<uint64_t> hash_;
  std::vector<int32_t> parent_;  // root_parent(g) (< 0): the block is the first of group g's chain
  std::vector<uint64_t> parent_gen_;
  std::vector<uint64_t> gen_;
  std::vector<int32_t> tokens_;  // [num_blocks * block_size]: token ids of registered blocks

  std::vector<int32_t> free_list_;  // stack; block 0 is handed out first on a fresh allocator
  // Intrusive doubly linked LRU over block ids; index num_blocks_ is the sentinel.
  // sentinel.next is the least recently used (evicted first), sentinel.prev the most recent.
  std::vector<int32_t> lru_prev_, lru_next_;
  int64_t lru_size_ = 0;

  std::unordered_multimap<uint64_t, int32_t> index_;
  std::unordered_map<int64_t, Sequence> seqs_;

  int64_t hit_tokens_ = 0, miss_tokens_ = 0, evictions_ = 0;
};

}  // namespace pagewire
