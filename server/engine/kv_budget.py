"""The KV cache's size from the engine's settings: the one computation `LLMEngine` and `pagewire plan` share.

Torch-free, so `pagewire plan` can size the pool from a model's config without loading weights.
The engine builds its pool from `kv_layout(...)` and logs `KVLayout.log_line()`; `plan` prints the
same line for the same settings, so the two can never disagree (tests compare them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from server.engine.config import ConfigError, EngineConfig

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
    """The pool the engine allocates: its blocks, its per-token cost and the longest sequence."""

    bytes_per_token: int
    dtype: str
    block_size: int
    num_blocks: int
    watermark_blocks: int
    max_model_len: int
    # Speculative decoding with a draft model: the draft's KV bytes per token. Its own pool has
    # num_blocks blocks as well, carved from the same budget (0: no draft model).
    draft_bytes_per_token: int = 0

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        """The target's pool plus the draft model's, if any."""
        return self.total_tokens * (self.bytes_per_token + self.draft_bytes_per_token)

    @property
    def admission_limit_blocks(self) -> int:
        """The most blocks one sequence can hold when admitted (pool minus watermark)."""
        return self.num_blocks - self.watermark_blocks

    def sequences_fitting(self, seq_len: int) -> int:
        """How many sequences of `seq_len` tokens the pool holds at once (whole blocks each)."""
        return self.num_blocks // -(-seq_len // self.block_size)

    def log_line(self) -> str:
        """What the engine logs at start-up (and `pagewire plan` prints)."""
        draft = (f" + draft model {self.draft_bytes_per_token} bytes/token, same blocks"
                 if self.draft_bytes_per_token else "")
        return (
            f"KV cache: {self.bytes_per_token} bytes/token ({self.dtype}){draft}, {self.num_blocks} blocks x "
            f"{self.block_size} tokens = {self.total_tokens} tokens ({self.total_bytes / 2**30:.2f} GiB); "
            f"fits {self.total_tokens // self.max_model_len} sequences of max_model_len {self.max_model_len}"
        )


def kv_layout(config: EngineConfig, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
              max_position_embeddings: int, kv_cache_tokens: Optional[int] = None,
              draft_bytes_per_token: int = 0) -> KVLayout:
    """Size the pool from `config` (kv_cache_tokens, else kv_cache_memory_gb) for a model of this shape
    whose KV is stored in `dtype`. `kv_cache_tokens` overrides the config's (plan's --memory budget).

    With a draft model (`draft_bytes_per_token` > 0) the budget, in bytes (kv_cache_tokens of the
    target's KV, or kv_cache_memory_gb), is split so that the target's pool and the draft's have the
    same number of blocks: the draft can then hold K/V for every token the target holds.

    Raises ConfigError naming the setting when the pool holds no block or less than one
    `max_model_len` sequence, or max_model_len exceeds the model's positions.
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    bpt = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, DTYPE_BYTES[dtype])
    bs = config.block_size
    explicit = kv_cache_tokens or config.kv_cache_tokens
    tokens = explicit or int(config.kv_cache_memory_gb * 2**30 // bpt)
    num_blocks = tokens * bpt // ((bpt + draft_bytes_per_token) * bs)
    if not explicit:
        # kv_cache_memory_gb is a budget, not a size: the pool needs no more than max_num_seqs
        # sequences of max_model_len at once (plus the watermark). A small model would otherwise
        # commit the whole budget (the demo model: 2 GiB of zeros for a pool of megabytes).
        # A larger pool, for prefix caching, is asked for with kv_cache_tokens.
        longest = config.max_model_len or max_position_embeddings
        need = -(-config.max_num_seqs * longest // bs)
        num_blocks = min(num_blocks, need + default_watermark(need) + 1)
    if num_blocks < 1:
        raise ConfigError("kv_cache_memory_gb", "leaves room for no KV block at all")
    watermark = default_watermark(num_blocks)
    # Default: the longest sequence the scheduler can always admit (pool minus watermark), so that
    # no request within max_model_len is refused for KV room.
    max_model_len = config.max_model_len or min(max_position_embeddings, (num_blocks - watermark) * bs)
    if max_model_len > max_position_embeddings:
        raise ConfigError(
            "max_model_len", f"{max_model_len} exceeds the model's max_position_embeddings ({max_position_embeddings})"
        )
    if max_model_len > num_blocks * bs:
        raise ConfigError(
            "kv_cache_tokens",
            f"the KV cache holds {num_blocks * bs} tokens, fewer than one max_model_len "
            f"sequence ({max_model_len}); raise the KV budget or lower max_model_len",
        )
    return KVLayout(bpt, dtype, bs, num_blocks, watermark, max_model_len, draft_bytes_per_token)
