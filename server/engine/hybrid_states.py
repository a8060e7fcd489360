"""HybridStates: a hybrid model's state slots through the scheduler's and engine's lifecycle, and
prefix caching that never uses a KV prefix without its recurrent state.

The state cache (state_cache.py) holds the tensors; this class decides when they move:

* Admission reserves a slot as it reserves blocks (`free_slots`, checked with the KV room) and
  takes it when the sequence is admitted (`admit`: zeroed, or the snapshot of a prefix hit).
* Finish, abort and preemption free blocks through `KVCacheManager.free`, whose free listener
  releases the slot (`release`): a preempted sequence rebuilds its state by recompute.
* n > 1: a forked sample gets a copy of sample 0's state (`fork`).
* Prefix caching: a recurrent state cannot be rebuilt from K/V, so a hit is cut back to the newest
  boundary at or before it where a snapshot of the state was saved (`match`), and the rest is
  prefilled again. Snapshots are taken at block-aligned boundaries of each prompt: every
  `interval_blocks` blocks, and the last block boundary before the prompt's last token (what the
  same prompt, or a next chat turn that extends it, can match). A prefill chunk is cut so that it
  ends on such a boundary (`chunk`); the step that ends there saves the snapshot
  (`after_compute`), keyed by the allocator's chain link of the block ending there.
"""
from __future__ import annotations

from typing import Optional

from server.engine.kv_cache_manager import KVCacheManager
from server.engine.request import Sequence
from server.engine.state_cache import SnapshotKey, StateCache

DEFAULT_INTERVAL_BLOCKS = 16  # a snapshot every 256 tokens of a long prompt at block_size 16


class HybridStates:
    def __init__(self, cache: StateCache, kv: KVCacheManager, interval_blocks: int = DEFAULT_INTERVAL_BLOCKS) -> None:
        if interval_blocks < 1:
            raise ValueError(f"interval_blocks must be >= 1, got {interval_blocks}")
        self.cache = cache
        self.kv = kv
        self.block_size = kv.block_size
        self.interval = interval_blocks * kv.block_size
        self.snapshots_on = kv.enable_prefix_caching and cache.snapshot_slots > 0
        self._pending: dict[int, SnapshotKey] = {}  # seq_id -> the snapshot its admission restores
        # seq_id of an admitted n > 1 sample 0 -> slots kept for the samples it forks once its
        # prompt is computed (admission counted all n; others must not take them meanwhile).
        self._reserved: dict[int, int] = {}
        kv.add_free_listener(self.release)

    # -- admission and lifecycle ------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Slots a new admission may take: free ones less those kept for pending n > 1 forks."""
        return self.cache.num_free_slots - sum(self._reserved.values())

    def match(self, seq: Sequence, matched: int) -> int:
        """After KVCacheManager.match_prefix attached `matched` tokens of KV: the tokens that can be
        used, the newest snapshot boundary <= matched (0 without one). Blocks past it go back to
        the cache (truncate); the snapshot is restored when the sequence is admitted."""
        self._pending.pop(seq.seq_id, None)
        if matched == 0:
            return 0
        usable = 0
        if self.snapshots_on:
            for k in range(matched // self.block_size - 1, -1, -1):
                key = self.kv.chain_key(seq, k)
                if self.cache.has_snapshot(key) and self.kv.link_valid(key):
                    usable = (k + 1) * self.block_size
                    self._pending[seq.seq_id] = key
                    break
        if usable < matched:
            self.kv.truncate(seq, usable)
        return usable

    def admit(self, seq: Sequence) -> None:
        """Give an admitted sequence its slot: the pending snapshot's state, else zeros."""
        self.cache.acquire(seq)
        req = seq.request
        if req.params.n > 1 and not req.forked:
            self._reserved[seq.seq_id] = req.params.n - 1
        key = self._pending.pop(seq.seq_id, None)
        if key is not None:
            covered = self.cache.restore(key, seq)
            assert covered == seq.num_computed_tokens, f"snapshot covers {covered} tokens, {seq} resumes there"

    def release(self, seq: Sequence) -> None:
        """The KV cache's free listener: finish, abort, preemption, an unadmitted prefix match."""
        self.cache.release(seq)
        self._pending.pop(seq.seq_id, None)
        self._reserved.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A forked sample takes one of the slots its parent's admission kept, holding a copy."""
        left = self._reserved.get(parent.seq_id, 0) - 1
        if left > 0:
            self._reserved[parent.seq_id] = left
        else:
            self._reserved.pop(parent.seq_id, None)
        self.cache.fork(parent, child)

    # -- snapshots --------------------------------------------------------------------------------
    def _boundaries_after(self, seq: Sequence, c: int) -> Optional[int]:
        """The first snapshot boundary > c of seq's prompt, or None."""
        if not self.snapshots_on:
            return None
        last = (seq.num_prompt_tokens - 1) // self.block_size * self.block_size
        if c >= last:
            return None
        nxt = (c // self.interval + 1) * self.interval
        return min(nxt, last)

    def chunk(self, seq: Sequence, num_new: int) -> int:
        """num_new cut so that the chunk ends on the next snapshot boundary if it would cross it."""
        b = self._boundaries_after(seq, seq.num_computed_tokens)
        if b is not None and seq.num_computed_tokens + num_new > b:
            return b - seq.num_computed_tokens
        return num_new

    def after_compute(self, seq: Sequence, before: int) -> None:
        """After a step moved seq from `before` to num_computed_tokens computed: save a snapshot
        when it ends on a boundary whose blocks are registered."""
        c = seq.num_computed_tokens
        if self._boundaries_after(seq, before) != c or self.kv.registered_tokens(seq) < c:
            return
        self.cache.save_snapshot(self.kv.chain_key(seq, c // self.block_size - 1), seq, c, self.kv.link_valid)

    def reset(self) -> None:
        """After the prefix cache was reset: every snapshot's block is gone."""
        self.cache.drop_invalid(self.kv.link_valid)
