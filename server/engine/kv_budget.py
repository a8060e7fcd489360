"""The KV cache's size from the engine's settings: the one computation `LLMEngine` and `pagewire plan` share.

Counted per KV group (kv_groups.py): a block is block_size tokens of one group's layers, and a
sequence's cost is the blocks each group holds for it (a sliding-window group: about its window).

Torch-free, so `pagewire plan` can size the pool from a model's config without loading weights.
The engine builds its pool from `kv_layout(...)` and logs `KVLayout.log_line()`; `plan` prints the
same line for the same settings, so the two can never disagree (tests compare them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from server.engine.config import ConfigError, EngineConfig
from server.engine.kv_groups import KVGroupLayout, kv_groups, kv_layer_groups

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """K and V of one token over all layers: 2 × layers × kv_heads × head_dim × bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * elem_bytes


def default_watermark(num_blocks: int) -> int:
    """Free blocks the scheduler keeps back at admission: 1 % of the pool, at least one block, but
    never the whole pool (a one-block pool keeps none back)."""
    return min(max(1, num_blocks // 100), num_blocks - 1)


@dataclass(frozen=True)
class KVLayout:
    """The pool the engine allocates: its blocks, their KV groups, and the longest sequence.

    A block holds block_size tokens of K/V for the `groups.group_size` layers of one KV group
    (server/engine/kv_groups.py), so `block_bytes` is the same in every group; a sequence's cost is
    counted per group (`seq_blocks`), not per token.
    """

    bytes_per_token: int  # K and V of one token over ALL layers (what a model without groups stores)
    dtype: str
    block_size: int
    num_blocks: int
    watermark_blocks: int
    max_model_len: int
    # Speculative decoding with a draft model: the draft's KV bytes per token. Its own pool has
    # num_blocks blocks as well, carved from the same budget (0: no draft model).
    draft_bytes_per_token: int = 0
    groups: KVGroupLayout = field(default_factory=lambda: kv_groups([None]))
    block_bytes: int = 0  # bytes of one block (0: bytes_per_token x block_size, one full group)
    chunk_tokens: int = 1  # the most tokens a step writes for one sequence (max_num_batched_tokens)
    # Hybrid models' state cache (engine/state_cache.py): bytes of one sequence's slot (every
    # recurrent layer's state), slots for running sequences (max_num_seqs) and for prefix-cache
    # snapshots. 0: a model without recurrent layers.
    state_slot_bytes: int = 0
    state_slots: int = 0
    snapshot_slots: int = 0

    @property
    def state_bytes(self) -> int:
        """The state cache: running and snapshot slots."""
        return (self.state_slots + self.snapshot_slots) * self.state_slot_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes or self.bytes_per_token * self.block_size

    @property
    def total_tokens(self) -> int:
        """The pool in tokens of every layer's KV (what --kv-cache-tokens counts): num_blocks x
        block_size for a model with one full group."""
        return -(-self.num_blocks * self.bytes_per_block // self.bytes_per_token)

    @property
    def total_bytes(self) -> int:
        """The target's pool plus the draft model's, if any, plus the state cache of a hybrid model."""
        return self.num_blocks * (self.bytes_per_block + self.draft_bytes_per_token * self.block_size) + self.state_bytes

    def state_line(self) -> str:
        """The state cache's part of the log line ("" for a model without recurrent layers)."""
        if not self.state_slot_bytes:
            return ""
        return (f"; state cache: {self.state_slots} running + {self.snapshot_slots} snapshot slots x "
                f"{self.state_slot_bytes} bytes ({self.state_bytes / 2**20:.2f} MiB, in the total)")

    @property
    def admission_limit_blocks(self) -> int:
        """The most blocks one sequence can hold when admitted (pool minus watermark)."""
        return self.num_blocks - self.watermark_blocks

    def seq_blocks(self, seq_len: int, new_tokens: int = 1) -> int:
        """Blocks one sequence of seq_len tokens holds, over every group (decoding: new_tokens 1)."""
        return self.groups.blocks_for(seq_len, self.block_size, new_tokens)

    def seq_bytes(self, seq_len: int) -> int:
        """KV bytes one decoding sequence of seq_len tokens holds (whole blocks, every group)."""
        return self.seq_blocks(seq_len) * self.bytes_per_block

    def sequences_fitting(self, seq_len: int) -> int:
        """How many sequences of `seq_len` tokens the pool holds at once (whole blocks each)."""
        return self.num_blocks // self.seq_blocks(seq_len)

    def log_line(self) -> str:
        """What the engine logs at start-up (and `pagewire plan` prints)."""
        draft = (f" + draft model {self.draft_bytes_per_token} bytes/token, same blocks"
                 if self.draft_bytes_per_token else "")
        fits = self.sequences_fitting(self.max_model_len)
        if len(self.groups.groups) == 1 and self.groups.groups[0].window == 0:
            return (
                f"KV cache: {self.bytes_per_token} bytes/token ({self.dtype}){draft}, {self.num_blocks} blocks x "
                f"{self.block_size} tokens = {self.total_tokens} tokens ({self.total_bytes / 2**30:.2f} GiB); "
                f"fits {fits} sequences of max_model_len {self.max_model_len}{self.state_line()}"
            )
        n = self.max_model_len
        return (
            f"KV cache: {self.groups.describe()}; {self.bytes_per_block} bytes/block of {self.block_size} tokens "
            f"({self.dtype}){draft}, {self.num_blocks} blocks ({self.total_bytes / 2**30:.2f} GiB); a sequence of "
            f"max_model_len {n} holds {self.seq_blocks(n)} blocks = {self.seq_bytes(n)} bytes "
            f"({self.seq_bytes(n) / (n * self.bytes_per_token):.3f} x every layer's {n * self.bytes_per_token}); "
            f"fits {fits} sequences of max_model_len {n}{self.state_line()}"
        )


def kv_layout(config: EngineConfig, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
              max_position_embeddings: int, kv_cache_tokens: Optional[int] = None,
              draft_bytes_per_token: int = 0,
              layer_windows: Optional[Sequence[Optional[int]]] = None,
              layer_elems: Optional[Sequence[int]] = None,
              layer_sources: Optional[Sequence[Optional[int]]] = None,
              state_slot_bytes: int = 0) -> KVLayout:
    """Size the pool from `config` (kv_cache_tokens, else kv_cache_memory_gb) for a model of this shape
    whose KV is stored in `dtype`. `kv_cache_tokens` overrides the config's (plan's --memory budget);
    either counts tokens of every layer's KV, so the budget in bytes is the same with or without groups.

    layer_windows: per layer, its sliding window (None or 0: full attention), from which the KV
    groups are built (kv_groups.py); None: every layer full, one group.
    layer_elems, layer_sources: per layer, kv_heads x head_dim and the layer whose KV it reads (None:
    its own), for models whose layers differ (Gemma 4); None: every layer num_kv_heads x head_dim,
    its own. Layers that read another's KV cost no bytes.

    With a draft model (`draft_bytes_per_token` > 0) the budget, in bytes, is split so that the
    target's pool and the draft's have the same number of blocks: the draft can then hold K/V for
    every token the target holds.

    state_slot_bytes: a hybrid model's state per sequence (state_specs.state_slot_bytes; 0: none).
    It has max_num_seqs running slots and, with prefix caching, snapshot slots worth an eighth of the
    KV bytes (at most one per KV block). With kv_cache_memory_gb the budget holds both pools (the
    KV blocks get what the slots leave); kv_cache_tokens sizes the KV pool alone, slots on top.

    Raises ConfigError naming the setting when the pool holds no block or less than one
    `max_model_len` sequence, the state slots alone exceed the budget, or max_model_len exceeds the
    model's positions.
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
    if len(windows) != num_layers:
        raise ConfigError("layer_windows", f"lists {len(windows)} layers, the model has {num_layers}")
    e = DTYPE_BYTES[dtype]
    bs = config.block_size
    if layer_elems is None and layer_sources is None:
        groups = kv_groups(windows)
        bpt = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, e)
        block_bytes = kv_bytes_per_token(groups.group_size, num_kv_heads, head_dim, e) * bs
    else:
        elems = list(layer_elems) if layer_elems is not None else [num_kv_heads * head_dim] * num_layers
        sources = list(layer_sources) if layer_sources is not None else [None] * num_layers
        if len(elems) != num_layers or len(sources) != num_layers:
            raise ConfigError("layer_elems", f"lists {len(elems)} layers, the model has {num_layers}")
        groups = kv_layer_groups(windows, elems, sources)
        bpt = 2 * sum(elems[i] for i in range(num_layers) if groups.layer_source[i] == i) * e
        block_bytes = 2 * groups.group_size * groups.slot_elems * e * bs
    explicit = kv_cache_tokens or config.kv_cache_tokens
    tokens = explicit or int(config.kv_cache_memory_gb * 2**30 // bpt)
    budget = tokens * bpt
    running_slots = config.max_num_seqs if state_slot_bytes else 0
    snapshot_slots = 0
    if state_slot_bytes:
        # kv_cache_tokens sizes the KV pool itself, the state slots come on top; kv_cache_memory_gb
        # is a budget for both pools together.
        if not explicit:
            budget -= running_slots * state_slot_bytes
            if budget <= 0:
                raise ConfigError("kv_cache_memory_gb", f"{running_slots} state slots (max_num_seqs) of "
                                  f"{state_slot_bytes} bytes leave no room for KV blocks; raise the budget or lower "
                                  "max_num_seqs")
        if config.enable_prefix_caching:
            snapshot_slots = budget // 8 // state_slot_bytes
            if not explicit:
                budget -= snapshot_slots * state_slot_bytes
    num_blocks = budget // (block_bytes + draft_bytes_per_token * bs)
    if not explicit:
        # kv_cache_memory_gb is a budget, not a size: the pool needs no more than max_num_seqs
        # sequences of max_model_len at once, over every KV group (plus the watermark). A small
        # model would otherwise commit the whole budget (the demo model: 2 GiB of zeros for a
        # pool of megabytes). A larger pool, for prefix caching, is asked for with kv_cache_tokens.
        longest = config.max_model_len or max_position_embeddings
        need = config.max_num_seqs * groups.blocks_for(longest, bs, config.max_num_batched_tokens)
        num_blocks = min(num_blocks, need + default_watermark(need) + 1)
    if num_blocks < 1:
        raise ConfigError("kv_cache_memory_gb", "leaves room for no KV block at all")
    watermark = default_watermark(num_blocks)
    # Default: the longest sequence the scheduler can always admit (pool minus watermark), so that
    # no request within max_model_len is refused for KV room. Blocks grow monotonically with length.
    limit = num_blocks - watermark
    # A step writing `chunk` tokens holds a sliding group's window plus them (admission counts it).
    chunk = config.max_num_batched_tokens
    if config.max_model_len:
        max_model_len = config.max_model_len
    else:
        lo, hi = 0, max_position_embeddings
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if groups.blocks_for(mid, bs, chunk) <= limit:
                lo = mid
            else:
                hi = mid - 1
        max_model_len = max(lo, 1)
    if max_model_len > max_position_embeddings:
        raise ConfigError(
            "max_model_len", f"{max_model_len} exceeds the model's max_position_embeddings ({max_position_embeddings})"
        )
    if groups.blocks_for(max_model_len, bs, chunk) > num_blocks:
        raise ConfigError(
            "kv_cache_tokens",
            f"the KV cache holds {num_blocks} blocks of {bs} tokens, fewer than one max_model_len "
            f"sequence ({max_model_len} tokens, {groups.blocks_for(max_model_len, bs, chunk)} blocks); raise the "
            f"KV budget or lower max_model_len",
        )
    # A snapshot is only ever wanted at a cached block's boundary: no more of them than blocks.
    snapshot_slots = min(snapshot_slots, num_blocks)
    return KVLayout(bpt, dtype, bs, num_blocks, watermark, max_model_len, draft_bytes_per_token, groups,
                    block_bytes, chunk, state_slot_bytes, running_slots, snapshot_slots)
