"""The AVX2 paged_attention kernel is batch-invariant: a query row's output bits are the same whether
the row is computed alone as a decode, inside a prefill of the whole sequence, in a prefill chunk
on top of a cached prefix, or in a batch with other sequences at any position, at any thread count.

The engine's deterministic mode (issue 14) builds on this; the kernel's comment
(csrc/cpu/attention_avx2.cpp) says why it holds by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import server._C
from server.kernels import ops
from tests.kernels.conftest import available_isas
from tests.kernels.paged_reference import TOLERANCE, PagedBatch, reference_paged_attention, relative_error

L = 150  # the target sequence: three 64-position KV spans, the last one partial
HEADS, KV_HEADS = 8, 2
BLOCK = 16


@dataclass
class Pool:
    """One paged cache holding the target sequence (all L positions) and a few other sequences."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    q: torch.Tensor  # [L, H, D]: the target's queries, one per position
    table: torch.Tensor  # [max_blocks] the target's block table
    others: list[tuple[torch.Tensor, torch.Tensor, int]]  # (queries [n, H, D], table, seq_len) per other sequence


def make_pool(dtype: torch.dtype, head_dim: int, gen: torch.Generator) -> Pool:
    other_lens = [90, 7, 200, 33]
    per_seq = [math.ceil(n / BLOCK) for n in [L, *other_lens]]
    max_blocks = max(per_seq) + 1
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    shape = (num_blocks, KV_HEADS, BLOCK, head_dim)
    # Every slot holds a finite value: the kernel reads only up to a sequence's last query, and
    # what lies past it must not matter whatever it is.
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    tables, used = [], 0
    for n in per_seq:
        t = torch.zeros(max_blocks, dtype=torch.int32)
        t[:n] = perm[used : used + n]
        used += n
        tables.append(t)
    q = torch.randn(L, HEADS, head_dim, generator=gen).to(dtype)
    others = []
    for n, t in zip(other_lens, tables[1:]):
        q_len = int(torch.randint(1, n + 1, (1,), generator=gen))
        others.append((torch.randn(q_len, HEADS, head_dim, generator=gen).to(dtype), t, n))
    return Pool(key_cache, value_cache, q, tables[0], others)


def attend(pool: Pool, parts: list[tuple[torch.Tensor, torch.Tensor, int]], window: int) -> torch.Tensor:
    """paged_attention over sequences given as (queries, block table, seq_len); the queries are the
    sequence's last q_len positions."""
    query = torch.cat([q for q, _, _ in parts])
    tables = torch.stack([t for _, t, _ in parts])
    seq_lens = torch.tensor([n for _, _, n in parts], dtype=torch.int32)
    qsl = torch.tensor([0] + [q.shape[0] for q, _, _ in parts], dtype=torch.int32).cumsum(0).to(torch.int32)
    out = torch.full_like(query, float("nan"))
    ops.paged_attention(out, query, pool.key_cache, pool.value_cache, tables, seq_lens, qsl,
                        query.shape[-1] ** -0.5, window, max(q.shape[0] for q, _, _ in parts), int(seq_lens.max()))
    return out


def target(pool: Pool, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The target sequence's queries [begin, end) as a prefill chunk on top of positions [0, begin)."""
    return pool.q[begin:end], pool.table, end


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


# Positions checked: the first, span edges (63, 64, 127, 128), one inside each span, the last.
ROWS = [0, 5, 63, 64, 100, 127, 128, 149]


@pytest.mark.skipif("avx2" not in available_isas(), reason=f"this CPU has no AVX2 (detected {server._C.detected_cpu_isa()})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("window", [0, 50])
def test_avx2_rows_are_bit_identical_however_batched(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int, window: int
) -> None:
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "avx2")
    assert server._C.cpu_isa() == "avx2"
    gen = torch.Generator().manual_seed(head_dim + window)
    pool = make_pool(dtype, head_dim, gen)

    # (b) one prefill of the whole sequence; checked against the float64 reference, so the
    # invariance below is not the invariance of a wrong answer.
    prefill = attend(pool, [target(pool, 0, L)], window)
    ref_batch = PagedBatch(pool.q, pool.key_cache, pool.value_cache, pool.table[None], torch.tensor([L], dtype=torch.int32),
                           torch.tensor([0, L], dtype=torch.int32), L, L)
    assert relative_error(prefill, reference_paged_attention(ref_batch, head_dim**-0.5, window)) <= TOLERANCE[dtype]

    chunkings = {"chunks of 37": 37, "chunks of 64": 64, "chunks of 5": 5}
    chunked = {}
    for name, size in chunkings.items():  # (c) chunked prefill on top of the cached prefix
        chunked[name] = torch.cat([attend(pool, [target(pool, b, min(b + size, L))], window) for b in range(0, L, size)])

    old_threads = torch.get_num_threads()
    try:
        for p in ROWS:
            want = bits(prefill[p])
            decode = attend(pool, [target(pool, p, p + 1)], window)[0]  # (a) alone, as a decode
            assert torch.equal(bits(decode), want), f"row {p}: decode alone differs from the prefill"
            for name, out in chunked.items():
                assert torch.equal(bits(out[p]), want), f"row {p}: {name} differs from the prefill"
            # (d) inside batches with other sequences, at each position in the batch, as a decode and
            # as part of a chunk that starts 3 tokens earlier, on one thread and on two.
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for begin in (p, max(0, p - 3)):
                    mine = target(pool, begin, p + 1)
                    for at in range(len(pool.others) + 1):
                        parts = list(pool.others)
                        parts.insert(at, mine)
                        out = attend(pool, parts, window)
                        row = sum(q.shape[0] for q, _, _ in parts[:at]) + (p - begin)
                        assert torch.equal(bits(out[row]), want), (
                            f"row {p}: differs in a batch at position {at} (chunk from {begin}, {threads} threads)"
                        )
    finally:
        torch.set_num_threads(old_threads)
