"""Float64 reference implementations and random paged-batch builders for the kernel tests."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """A random mixed batch laid out in a paged cache, as the runner would hand it to the kernels.

    query: [T, H, D]; key_cache/value_cache: [NB, KVH, BS, D] (unused slots hold NaN);
    block_tables int32 [S, max_blocks]; seq_lens int32 [S]; query_start_loc int32 [S + 1].
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


def make_paged_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    block_size: int = 16,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Builds a batch from (context_len, q_len) pairs: seq_len = context_len + q_len.

    Physical blocks are a random permutation (never contiguous per sequence); every slot that no
    sequence owns, and every table entry past a sequence's last block, is poison (NaN / a random
    block), so a kernel reading outside the visible range fails.
    """
    seq_lens = [c + q for c, q in specs]
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    max_blocks = max(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    key_cache = torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    tables = torch.randint(0, num_blocks, (len(specs), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        blocks = perm[used : used + needed[s]]
        used += needed[s]
        tables[s, : needed[s]] = blocks.to(torch.int32)
        for i, b in enumerate(blocks.tolist()):
            valid = min(block_size, n - i * block_size)
            shape = (num_kv_heads, valid, head_dim)
            key_cache[b, :, :valid] = torch.randn(shape, generator=gen).to(dtype)
            value_cache[b, :, :valid] = torch.randn(shape, generator=gen).to(dtype)
    q_lens = [q for _, q in specs]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn((qsl[-1], num_heads, head_dim), generator=gen).to(dtype)
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def gather_kv(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[KVH, seq_len, D] float64: one sequence's keys (or values) read through its block table."""
    num_kv_heads, block_size, head_dim = cache.shape[1:]
    nb = math.ceil(seq_len / block_size)
    blocks = cache[table[:nb].long()].double()  # [nb, KVH, BS, D]
    return blocks.permute(1, 0, 2, 3).reshape(num_kv_heads, nb * block_size, head_dim)[:, :seq_len]


def reference_paged_attention(batch: PagedBatch, scale: float, sliding_window: int, softcap: float = 0.0,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H, D] float64 attention with the causal (+ Mistral sliding-window) mask, softmax in float64;
    softcap > 0 caps the scaled scores to softcap * tanh(s / softcap) first (Gemma 2's
    attn_logit_softcapping, as transformers applies it: after the scale, before the mask); sinks
    [H]: one more logit per head in each row's softmax, dropped after it (gpt-oss, as transformers'
    eager_attention_forward concatenates and drops it)."""
    query = batch.query.double()
    num_heads = query.shape[1]
    out = torch.empty_like(query)
    for s in range(batch.seq_lens.numel()):
        seq_len = int(batch.seq_lens[s])
        q0, q1 = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        q_len = q1 - q0
        k = gather_kv(batch.key_cache, batch.block_tables[s], seq_len)
        v = gather_kv(batch.value_cache, batch.block_tables[s], seq_len)
        group = num_heads // k.shape[0]
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [H, L, D]
        q = query[q0:q1].transpose(0, 1)  # [H, q_len, D]
        scores = (q @ k.transpose(1, 2)) * scale  # [H, q_len, L]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        pos_q = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        pos_k = torch.arange(seq_len).unsqueeze(0)
        visible = pos_k <= pos_q
        if sliding_window > 0:
            visible &= (pos_q - pos_k) < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = (probs @ v).transpose(0, 1)
    return out


def release_out_of_window(batch: PagedBatch, sliding_window: int, null: int = -1) -> PagedBatch:
    """The batch with every block-table entry wholly before its sequence's first query's window
    set to `null`, as a sliding-window KV group's table is once the allocator has returned those
    blocks to the pool. Compute the reference on the original batch: this one reads no such block."""
    tables = batch.block_tables.clone()
    bs = batch.key_cache.shape[2]
    for s in range(tables.shape[0]):
        q_len = int(batch.query_start_loc[s + 1] - batch.query_start_loc[s])
        first_pos = int(batch.seq_lens[s]) - q_len
        tables[s, : max(0, first_pos - sliding_window + 1) // bs] = null
    return PagedBatch(batch.query, batch.key_cache, batch.value_cache, tables, batch.seq_lens,
                      batch.query_start_loc, batch.max_query_len, batch.max_seq_len)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (NaN anywhere -> inf)."""
    diff = (actual.double() - expected.double()).abs().max().item()
    if math.isnan(diff):
        return math.inf
    return diff / max(expected.double().abs().max().item(), 1e-30)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
