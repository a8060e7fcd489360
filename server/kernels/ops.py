"""Typed Python entry points for the pagewire tensor ops (torch.ops.pagewire.*) and their fake kernels.

Shapes: T = tokens in the flat batch, S = sequences, H = query heads, KVH = KV heads, D = head_dim,
NB = physical KV blocks, BS = block_size. All argument checking happens in the C++ kernels, which
raise RuntimeError naming the offending argument.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import server._C  # noqa: F401  (loads the TORCH_LIBRARY(pagewire) registrations)

__all__ = ["write_kv_cache", "paged_attention", "copy_blocks", "linear"]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into the paged cache, in place.

    Args:
        key: [T, KVH, D], the cache dtype, contiguous in D.
        value: [T, KVH, D], like key.
        key_cache: [NB, KVH, BS, D], contiguous; written at the slots below.
        value_cache: [NB, KVH, BS, D], like key_cache.
        slot_mapping: int64 [T]; slot = block * BS + offset; -1 marks padding (skipped).
    """
    torch.ops.pagewire.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    max_query_len: int,
    max_seq_len: int,
) -> None:
    """Causal attention of a flat mixed batch (prefill chunks and decodes) over the paged cache.

    Query token i of sequence s sits at position seq_lens[s] - q_len + i and attends to cached
    positions p <= its own (and, when sliding_window > 0, to p with position - p < sliding_window).
    The cache must already hold this step's keys and values (call write_kv_cache first).

    Args:
        out: [T, H, D], query's dtype; overwritten with the attention output.
        query: [T, H, D] float32, bfloat16 or float16, contiguous in D; H % KVH == 0.
        key_cache: [NB, KVH, BS, D], query's dtype, contiguous.
        value_cache: [NB, KVH, BS, D], like key_cache.
        block_tables: int32 [S, max_blocks], physical block ids of each sequence.
        seq_lens: int32 [S], tokens in the cache after this step (context + new).
        query_start_loc: int32 [S + 1], prefix sum of new tokens per sequence; every q_len >= 1.
        scale: softmax scale, usually D ** -0.5.
        sliding_window: window size in tokens (the token itself included); <= 0 disables it.
        max_query_len: an upper bound on q_len over the batch.
        max_seq_len: an upper bound on seq_lens over the batch.
    """
    torch.ops.pagewire.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, sliding_window, max_query_len, max_seq_len,
    )


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole physical blocks (copy-on-write) in every layer's key and value cache, in place.

    Args:
        key_caches: one [NB, KVH, BS, D] tensor per layer, all the same shape.
        value_caches: one per layer, shaped like key_caches.
        block_mapping: int64 [N, 2] of (src, dst) block ids; destinations must be distinct and
            must not also be sources.
    """
    torch.ops.pagewire.copy_blocks(list(key_caches), list(value_caches), block_mapping)


# Largest row count (tokens) for which the bf16 kernel beats torch's own bf16 GEMM on CPU; above
# it torch's blocked GEMM wins (measured with bench/kernels.py linear).
LINEAR_KERNEL_MAX_M = 12


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weight.T + bias, exactly torch.nn.functional.linear's semantics.

    CPU bf16 inputs with at most LINEAR_KERNEL_MAX_M rows (decode batches) and no autograd run the
    pagewire AVX512-BF16 kernel (fp32 accumulation, one bf16 rounding); anything else is F.linear.

    Args:
        x: [..., K].
        weight: [N, K] (nn.Linear layout), x's dtype.
        bias: [N] or None.

    Returns:
        [..., N] in x's dtype.
    """
    if (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.device.type == "cpu"))
        and weight.device.type == "cpu"
        and x.numel() <= LINEAR_KERNEL_MAX_M * weight.shape[1]
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad)))
    ):
        out = torch.ops.pagewire.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# Fake (meta) kernels: the in-place ops produce no new tensors, so shape propagation is trivial.
@torch.library.register_fake("pagewire::write_kv_cache")
def _write_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping) -> None:  # type: ignore[no-untyped-def]
    return None


@torch.library.register_fake("pagewire::paged_attention")
def _paged_attention_fake(  # type: ignore[no-untyped-def]
    out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
    scale, sliding_window, max_query_len, max_seq_len,
) -> None:
    return None


@torch.library.register_fake("pagewire::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping) -> None:  # type: ignore[no-untyped-def]
    return None


@torch.library.register_fake("pagewire::linear")
def _linear_fake(x, weight, bias):  # type: ignore[no-untyped-def]
    torch._check(x.shape[-1] == weight.shape[1], lambda: "x and weight disagree on K")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
