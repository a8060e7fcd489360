"""Errors the engine raises for invalid settings (`ConfigError`) and for requests, and the checks
that raise them.

Torch-free so the edge can catch them by type and the engine thread can run the checks on the
caller's thread, before a request is queued.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from server.engine.kv_groups import KVGroupLayout


class ConfigError(ValueError):
    """An invalid engine setting; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class RequestTooLongError(ValueError):
    """The prompt (plus max_tokens) does not fit max_model_len. Never silently truncated."""

    def __init__(self, num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        if max_tokens is None or num_prompt_tokens >= max_model_len:
            msg = (
                f"prompt: {num_prompt_tokens} tokens does not fit this model's context "
                f"(max_model_len = {max_model_len}; at least one output token is needed)"
            )
        else:
            msg = (
                f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({max_model_len})"
            )
        super().__init__(msg)


def check_context(num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int) -> None:
    """Raise RequestTooLongError unless the prompt leaves room for output (and max_tokens fits)."""
    if num_prompt_tokens >= max_model_len or (
        max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len
    ):
        raise RequestTooLongError(num_prompt_tokens, max_tokens, max_model_len)


@dataclass(frozen=True, slots=True)
class CapacityLimits:
    """The engine's fixed limits that decide whether a request can ever be scheduled."""

    max_model_len: int
    block_size: int
    num_blocks: int
    watermark_blocks: int  # free blocks the scheduler keeps back when it admits a sequence
    max_num_seqs: int
    # The pool's KV groups (a sequence holds blocks in each; None: one full-attention group) and the
    # most tokens one step writes for a sequence (a sliding group holds its window plus those).
    groups: Optional[KVGroupLayout] = None
    chunk_tokens: int = 1

    @property
    def admission_limit_blocks(self) -> int:
        """The most KV blocks one sequence can hold when it is admitted."""
        return self.num_blocks - self.watermark_blocks


class KVCapacityError(ValueError):
    """One sample of the request, at its longest, needs more KV blocks than a sequence can hold
    when admitted (the pool minus the watermark): it could wait forever, so it is refused."""

    def __init__(self, field_name: str, message: str, blocks_needed: int, limit_blocks: int) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.blocks_needed = blocks_needed
        self.limit_blocks = limit_blocks


def check_capacity(num_prompt_tokens: int, max_tokens: Optional[int], n: int, limits: CapacityLimits) -> None:
    """Raise a ValueError naming the field and the limit unless the request is sure to progress.

    Checked: the context (check_context), `n` against max_num_seqs (all samples of a request are
    admitted together), and the KV blocks of one sample at its longest against the blocks a
    sequence may hold at admission. A request that passes always gets scheduled eventually.
    """
    check_context(num_prompt_tokens, max_tokens, limits.max_model_len)
    if n > limits.max_num_seqs:
        raise ValueError(
            f"n: {n} samples exceed max_num_seqs ({limits.max_num_seqs}), the most sequences a step "
            f"runs; the samples of one request are admitted together"
        )
    total = num_prompt_tokens + max_tokens if max_tokens is not None else limits.max_model_len
    bs = limits.block_size
    # The last sampled token ends the sequence before its K/V is ever computed.
    need = (limits.groups.blocks_for(total - 1, bs, limits.chunk_tokens) if limits.groups is not None
            else -(-(total - 1) // bs))
    limit = limits.admission_limit_blocks
    if need <= limit:
        return
    prompt_need = (limits.groups.blocks_for(num_prompt_tokens, bs, limits.chunk_tokens) if limits.groups is not None
                   else -(-num_prompt_tokens // bs))
    asked = f"max_tokens ({max_tokens})" if max_tokens is not None else f"output up to max_model_len ({total})"
    field_name = "prompt" if prompt_need > limit else "max_tokens"
    raise KVCapacityError(
        field_name,
        f"prompt ({num_prompt_tokens} tokens) + {asked} needs up to {need} KV blocks of {bs} tokens "
        f"for one sample, but a sequence can hold at most {limit} when admitted: the KV cache has "
        f"{limits.num_blocks} blocks and keeps a free-block watermark of {limits.watermark_blocks} "
        f"in reserve for running sequences to grow; lower the prompt or max_tokens, or raise "
        f"kv_cache_tokens / kv_cache_memory_gb",
        need,
        limit,
    )
