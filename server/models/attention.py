"""AttentionMetadata: the per-step plan of where each token's K/V lives, built once by the runner;
and `paged_attention`, the attention call every decoder layer makes.

The metadata is passed explicitly into every model forward (no module-global context). All
tensors live on the model's device; they are computed on the host once per step ("plan") and the
kernels only read them ("run").

`paged_attention` takes the layer's logit soft-cap (Gemma 2). Until the kernels take it
(issue 26 section 4, `ops.paged_attention(..., softcap=)`), a capped layer runs the same math in
plain torch (`_softcapped_attention`); switching is the one marked line below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from server.kernels import ops


@dataclass
class AttentionMetadata:
    """Shapes: T = tokens in the flat batch, S = sequences in the batch.

    slot_mapping:    int64 [T]      cache slot (block * block_size + offset) for each new token; -1 = skip
    block_tables:    int32 [S, B]   physical block ids of each sequence (padded with 0)
    seq_lens:        int32 [S]      tokens in cache for each sequence after this step (context + new)
    query_start_loc: int32 [S + 1]  prefix sum of new tokens per sequence; q_len = diff
    max_query_len / max_seq_len:    host ints, for kernels that size launches by them
    prompt_lens:     int32 [S]      each sequence's prompt length, or None (= seq_lens); read only
                                    by longrope, whose table choice depends on it (rope.long_rows)
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prompt_lens: Optional[torch.Tensor] = None


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
) -> None:
    """ops.paged_attention over `meta` with logits soft-capped to softcap * tanh(logits / softcap)
    when softcap > 0 (0 = off). Shapes as ops.paged_attention: out/query [T, H, D], caches
    [NB, KVH, BS, D]; sliding_window <= 0 is full attention."""
    if softcap <= 0.0:
        ops.paged_attention(out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, scale, sliding_window, meta.max_query_len, meta.max_seq_len)
        return
    # The switch once the kernels take softcap: ops.paged_attention(..., softcap=softcap).
    _softcapped_attention(out, query, key_cache, value_cache, meta, scale, sliding_window, softcap)


def _softcapped_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                          sliding_window: int, softcap: float) -> None:
    """Paged attention in torch ops, in transformers' eager order: scores = q k^T * scale in the
    model dtype, capped, causally (and window-) masked, softmax in fp32 cast back, times v."""
    nkv, bs, d = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // nkv
    starts = meta.query_start_loc.tolist()
    for i, ctx in enumerate(meta.seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        if b == a:
            continue
        blocks = meta.block_tables[i, : -(-ctx // bs)].long()
        # [blocks, KVH, BS, D] -> [KVH, ctx, D], each kv head repeated for its query heads.
        k = key_cache[blocks].transpose(0, 1).reshape(nkv, -1, d)[:, :ctx].repeat_interleave(group, 0)
        v = value_cache[blocks].transpose(0, 1).reshape(nkv, -1, d)[:, :ctx].repeat_interleave(group, 0)
        q = query[a:b].transpose(0, 1)  # [H, n, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (b - a), ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        masked = k_pos > q_pos
        if sliding_window > 0:
            masked |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[a:b] = torch.matmul(probs, v).transpose(0, 1)
