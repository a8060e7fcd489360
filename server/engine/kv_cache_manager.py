"""KVCacheManager: the engine's one typed door to the C++ KV block allocator (`server._C`).

Every allocator call the engine makes goes through here: the scheduler asks it for prefix
matches, block counts and slot allocations, the engine forks samples through it, the runner reads
block tables from it (every KV group's, in one call into a persistent tensor). It speaks in
`Sequence`s; the allocator's integer sequence ids stay inside.

What lives where: which physical blocks a sequence holds, their refcounts, and how far its full
blocks are registered in the prefix cache are allocator state, kept in C++ only. This class keeps
no copy of them. It passes the allocator only the tokens a step writes (from the first block they
touch), so registering blocks costs O(new blocks), never O(sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional
from typing import Sequence as Seq

from server import _C
from server.engine.request import Sequence


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the block pool. Hit/miss token counts are cumulative."""

    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    prefix_hit_tokens: int
    prefix_miss_tokens: int
    evictions: int


class KVCacheManager:
    """Owns the block allocator: blocks per sequence, copy-on-write forks and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: Seq[int] = (0,)) -> None:
        """group_windows: per KV group its window, 0 = full attention (KVGroupLayout.windows)."""
        self._alloc = _C.BlockAllocator(num_blocks, block_size, enable_prefix_caching, 64, list(group_windows))
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Called with each sequence whose blocks `free` releases (finish, abort, preemption), so
        # per-sequence state kept beside the KV (a draft model's own cache) is released with it.
        self._free_listeners: list[Callable[[Sequence], None]] = []

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached ones."""
        return self._alloc.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks of one KV group's table that hold num_tokens tokens of one sequence."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        """Net blocks `allocate(seq, num_new)` would take now: new blocks and copy-on-write copies in
        every KV group, less those its sliding windows give back."""
        return self._alloc.blocks_needed(seq.seq_id, seq.num_computed_tokens, num_new)

    # -- a sequence's blocks ----------------------------------------------------------------------
    def has_blocks(self, seq: Sequence) -> bool:
        return self._alloc.has_sequence(seq.seq_id)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of a sequence that holds no blocks; returns its tokens.

        Never the last token: its logits are needed, so at least one token is always computed.
        """
        return self._alloc.match_prefix(seq.seq_id, _keyed(seq, seq.token_ids[:-1]))

    def allocate(self, seq: Sequence, num_new: int) -> Optional[list[tuple[int, int]]]:
        """Grow `seq` to hold num_computed_tokens + num_new tokens.

        Returns the (src, dst) block copies to run before the write (copy-on-write of shared
        blocks), or None, changing nothing, when too few blocks are free.
        """
        return self._alloc.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)

    def register_full_blocks(self, seq: Sequence, num_new: int) -> None:
        """Offer the blocks this step fills to the prefix cache (their tokens are known now).

        Passes the tokens from the first block the step touches, or from the allocator's own
        registered count when that is lower (after `reset_prefix_cache` every chain starts again
        at block 0, and these already-computed blocks are registered anew): the allocator reads
        only those that complete a block it has not registered yet.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = min(seq.num_computed_tokens // bs * bs, self._alloc.registered_tokens(seq.seq_id))
        end = (seq.num_computed_tokens + num_new) // bs * bs
        if end > start:
            self._alloc.cache_full_blocks(seq.seq_id, _keyed(seq, seq.token_ids[start:end]), start)

    def rollback(self, seq: Sequence) -> None:
        """After speculative verification: keep blocks for the verified tokens only, then register
        the full blocks they complete.

        The step wrote K/V for proposed tokens past `num_computed_tokens`; the tail blocks only
        they used go back to the pool (a kept partial block's stale slots are rewritten before
        they are read: attention reads positions < seq_len only). Registration starts at the
        allocator's own registered count, so it covers the accepted tokens that the scheduler
        could not register before they were verified, and nothing past num_computed_tokens.
        """
        keep = seq.num_computed_tokens
        self._alloc.truncate(seq.seq_id, keep)
        if not self.enable_prefix_caching:
            return
        start = self._alloc.registered_tokens(seq.seq_id)
        end = keep // self.block_size * self.block_size
        if end > start:
            self._alloc.cache_full_blocks(seq.seq_id, _keyed(seq, seq.token_ids[start:end]), start)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks, shared (refcount + 1 each); writes copy them first."""
        self._alloc.fork(parent.seq_id, child.seq_id)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; registered ones stay cached for later prefix hits."""
        self._alloc.free(seq.seq_id)
        for listener in self._free_listeners:
            listener(seq)

    def add_free_listener(self, listener: Callable[[Sequence], None]) -> None:
        """Call `listener(seq)` after every `free(seq)`."""
        self._free_listeners.append(listener)

    def block_table(self, seq: Sequence, group: int = 0) -> list[int]:
        """KV group `group`'s blocks of `seq` (-1 where its sliding window released one)."""
        return self._alloc.block_table(seq.seq_id, group)

    def fill_block_tables(self, seqs: list[Sequence], out: Any) -> int:
        """Write every group's tables of `seqs` into out[g, row, :] in one C++ call (out: a writable
        int32 buffer, e.g. the numpy view of the runner's persistent tensor). Returns the longest table."""
        return self._alloc.fill_block_tables([s.seq_id for s in seqs], out)

    def fill_decode_inputs(self, seq_ids: list[int], tokens: list[int], starts: list[int], prompt_lens: list[int],
                           i64: Any, i32: Any, tables: Any) -> tuple[int, int]:
        """One decode step's inputs for a single-group pool, written by one C++ call into the runner's
        persistent buffers (numpy views): i64 [3, >= n] tokens, positions, slots; i32 [3, >= n + 1]
        seq_lens, prompt_lens, query_start_loc; tables [groups, >= n, width] group 0's block tables.
        Returns (longest table, max seq_len); max seq_len is -1, with nothing written, when the longest
        table is wider than `tables` (grow it and call again)."""
        return self._alloc.fill_decode_inputs(seq_ids, tokens, starts, prompt_lens, i64, i32, tables)

    # -- state snapshots' keys (server/engine/state_cache.py) -------------------------------------
    def chain_key(self, seq: Sequence, index: int) -> tuple[int, int]:
        """(block, generation) of `seq`'s registered block `index` in group 0: names the content of
        tokens [0, (index + 1) * block_size) while `link_valid` holds."""
        block, gen = self._alloc.chain_link(seq.seq_id, index)
        return int(block), int(gen)

    def link_valid(self, key: tuple[int, int]) -> bool:
        """Whether the block of a chain_key is still registered with that generation."""
        return bool(self._alloc.link_valid(key[0], key[1]))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks of `seq`'s first num_tokens tokens (a prefix hit cut back to a state snapshot)."""
        self._alloc.truncate(seq.seq_id, num_tokens)

    # -- introspection (metrics and tests) --------------------------------------------------------
    def registered_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` whose full blocks are registered in the prefix cache."""
        return self._alloc.registered_tokens(seq.seq_id)

    def refcount(self, block_id: int) -> int:
        return self._alloc.refcount(block_id)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(**self._alloc.stats())

    def reset_prefix_cache(self) -> None:
        """Forget every cached block's hash, so no later request can match KV whose write may not
        have happened (after a failed forward, see engine/isolation.py)."""
        self._alloc.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise RuntimeError describing the first broken allocator invariant."""
        self._alloc.check_invariants()


# A LoRA adapter's KV differs from the base model's for the same tokens, so the prefix cache must
# never hand one's blocks to the other: a request over adapter slot k (1..127, Request.lora_slot)
# offers and matches its tokens as token + k * 2^24, a namespace no base token id (< 2^24, checked
# when adapters load: server.models.lora) and no other adapter's can meet. Block ids, hashing and
# identity checks are the allocator's own; only the keys differ.
_LORA_KEY_SHIFT = 24


def _keyed(seq: Sequence, tokens: list[int]) -> list[int]:
    """`tokens` as the prefix cache keys them for `seq`'s request (unchanged for the base model)."""
    slot = seq.request.lora_slot
    if not slot:
        return tokens
    offset = slot << _LORA_KEY_SHIFT
    return [t + offset for t in tokens]
