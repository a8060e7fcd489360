"""paged_attention against a float64 reference: mixed batches, GQA ratios, head dims, dtypes, windows,
logit soft-capping."""
from __future__ import annotations

import pytest
import torch

from server.kernels import ops
from tests.kernels.conftest import available_isas
from tests.kernels.paged_reference import (
    TOLERANCE,
    PagedBatch,
    make_paged_batch,
    reference_paged_attention,
    relative_error,
    release_out_of_window,
)
from tests.pairwise import pairwise

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_heads, num_kv_heads): GQA ratios 1 (MHA), 2, 4, 8 and multi-query.
HEADS = [(4, 4), (4, 2), (8, 2), (8, 1), (16, 1)]
HEAD_DIMS = [64, 80, 96, 128, 256]
# (context_len, q_len): decodes at block boundaries, prefill chunks on top of context, fresh prefills.
MIXED = [(0, 1), (14, 1), (15, 1), (16, 1), (31, 1), (32, 1), (0, 15), (0, 17), (13, 20), (16, 16), (40, 3)]


@pytest.fixture
def isa(cpu_isa: str) -> str:
    """Runs a test on every attention kernel this CPU can execute: AVX-512, AVX2 and the portable
    one (conftest's `cpu_isa` caps PAGEWIRE_CPU_ISA per run, over the families this CPU has)."""
    return cpu_isa


def run_kernel(batch: PagedBatch, scale: float, sliding_window: int, softcap: float = 0.0) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))  # rows the kernel forgets stay NaN and fail
    ops.paged_attention(
        out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, scale, sliding_window, batch.max_query_len, batch.max_seq_len, softcap,
    )
    return out


def check(batch: PagedBatch, dtype: torch.dtype, sliding_window: int = 0, softcap: float = 0.0,
          scale: float | None = None) -> None:
    scale = batch.query.shape[-1] ** -0.5 if scale is None else scale
    out = run_kernel(batch, scale, sliding_window, softcap)
    err = relative_error(out, reference_paged_attention(batch, scale, sliding_window, softcap))
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]} for {dtype}"


# Every pair of (family, head dim, GQA ratio, dtype) values (tests/pairwise.py), on the attention
# kernels this CPU has; the portable kernel is slow and has no per-head-dim code paths, so it
# takes three of the five dims. In full for each family: the largest head dim with multi-query
# attention in both 16-bit dtypes, and the smallest with MHA in float32.
_ATTENTION_ISAS = [isa for isa in ("avx512bf16", "avx2", "portable") if isa in available_isas()]
GRID = [
    pytest.param(isa, dtype, heads, head_dim, id=f"{isa}-{head_dim}-{heads[0]}q{heads[1]}kv-{dtype}")
    for isa, head_dim, heads, dtype in pairwise(
        [_ATTENTION_ISAS, HEAD_DIMS, HEADS, DTYPES],
        edges=[(isa, 256, (16, 1), dt) for isa in _ATTENTION_ISAS for dt in (torch.bfloat16, torch.float16)]
        + [(isa, 64, (4, 4), torch.float32) for isa in _ATTENTION_ISAS],
        allowed=lambda r: r[0] != "portable" or r[1] in (64, 80, 256))
]


@pytest.mark.parametrize("cpu_isa,dtype,heads,head_dim", GRID, indirect=["cpu_isa"])
def test_mixed_batch_matches_reference(cpu_isa: str, dtype: torch.dtype, heads: tuple[int, int], head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + heads[0] * 10 + heads[1])
    check(make_paged_batch(MIXED, heads[0], heads[1], head_dim, dtype, gen), dtype)


@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 32, 33, 47, 48, 49])
def test_block_boundary_lengths(isa: str, seq_len: int) -> None:
    gen = torch.Generator().manual_seed(seq_len)
    specs = [(seq_len - 1, 1), (0, seq_len), (seq_len // 2, seq_len - seq_len // 2)]
    check(make_paged_batch(specs, 8, 2, 64, torch.float32, gen), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [8, 40, 72, 36, 100])
def test_other_head_dims(isa: str, dtype: torch.dtype, head_dim: int) -> None:
    """Multiples of 8 (not of 16) run on the AVX2 kernel under avx512bf16 and avx2; 36 and 100 fall
    back to the portable kernel on every family."""
    gen = torch.Generator().manual_seed(head_dim)
    check(make_paged_batch(MIXED + [(70, 9)], 8, 2, head_dim, dtype, gen), dtype)
    check(make_paged_batch(MIXED, 8, 2, head_dim, dtype, gen), dtype, sliding_window=21)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 5, 16, 17, 50, 4096])
def test_sliding_window(isa: str, dtype: torch.dtype, window: int) -> None:
    gen = torch.Generator().manual_seed(window)
    specs = [(0, 1), (3, 1), (60, 1), (70, 12), (0, 40), (33, 33)]
    check(make_paged_batch(specs, 8, 2, 64, dtype, gen), dtype, sliding_window=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 72, 36])
@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
@pytest.mark.parametrize("window", [0, 17])
def test_logit_softcapping(isa: str, dtype: torch.dtype, head_dim: int, softcap: float, window: int) -> None:
    """Gemma 2's soft-capping on every kernel (head_dim 64: AVX-512 / AVX2; 72: AVX2; 36: portable):
    a cap of 0.5 squashes almost every score into tanh's flat part, 50 leaves them nearly linear.
    The per-layer scale is Gemma's query_pre_attn_scalar ** -0.5 here, not head_dim ** -0.5, and
    large enough (scores of several units) that capping changes the result."""
    gen = torch.Generator().manual_seed(int(softcap * 10) + head_dim + window)
    batch = make_paged_batch(MIXED + [(70, 9)], 8, 2, head_dim, dtype, gen)
    check(batch, dtype, sliding_window=window, softcap=softcap, scale=256**-0.5 * 4)
    plain = reference_paged_attention(batch, 256**-0.5 * 4, window)
    capped = reference_paged_attention(batch, 256**-0.5 * 4, window, softcap)
    if softcap < 50:  # the reference itself must differ, or the test would prove nothing
        assert relative_error(plain, capped) > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 72, 36])
@pytest.mark.parametrize("window", [0, 17])
def test_attention_sinks(isa: str, dtype: torch.dtype, head_dim: int, window: int) -> None:
    """gpt-oss's sinks on every kernel (64: AVX-512 / AVX2, 72: AVX2, 36: portable), with and
    without a window: per-head logits from far below the scores (no effect) to far above them (the
    sink takes most of the mass, and must not overflow the running maximum)."""
    gen = torch.Generator().manual_seed(head_dim + window)
    batch = make_paged_batch(MIXED + [(70, 9)], 8, 2, head_dim, dtype, gen)
    sinks = torch.tensor([-30.0, -2.0, 0.0, 0.5, 1.5, 3.0, 8.0, 60.0])
    scale = head_dim**-0.5
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_attention(out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
                        batch.query_start_loc, scale, window, batch.max_query_len, batch.max_seq_len, 0.0, sinks)
    ref = reference_paged_attention(batch, scale, window, sinks=sinks)
    assert relative_error(out[:, :7], ref[:, :7]) <= TOLERANCE[dtype]
    # The 60-logit sink leaves its head ~e^-55 of the mass: the output is ~0 (and finite).
    assert torch.isfinite(out).all() and out[:, 7].abs().max() < 1e-6
    plain = reference_paged_attention(batch, scale, window)
    assert relative_error(plain[:, 3:6], ref[:, 3:6]) > 10 * TOLERANCE[dtype]  # sinks matter here


def test_sinks_are_checked(isa: str) -> None:
    gen = torch.Generator().manual_seed(0)
    b = make_paged_batch([(3, 2)], 4, 2, 64, torch.float32, gen)
    args = (torch.empty_like(b.query), b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
            b.query_start_loc, 0.125, 0, b.max_query_len, b.max_seq_len, 0.0)
    with pytest.raises(RuntimeError, match=r"sinks must be a contiguous \[4\]"):
        ops.paged_attention(*args, torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="sinks must be float32"):
        ops.paged_attention(*args, torch.zeros(4, dtype=torch.bfloat16))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 72, 36])
@pytest.mark.parametrize("window", [5, 16, 40, 130])
def test_released_blocks_before_the_window_are_never_read(isa: str, dtype: torch.dtype, head_dim: int,
                                                          window: int) -> None:
    """A sliding-window group's table holds -1 where its blocks left the window (kv_groups.py): no
    kernel reads those entries, nor the 64-position span start below the window (its zero rows)."""
    gen = torch.Generator().manual_seed(window + head_dim)
    batch = make_paged_batch([(0, 1), (60, 1), (70, 12), (150, 1), (200, 40), (129, 3)], 8, 2, head_dim, dtype, gen)
    scale = head_dim**-0.5
    ref = reference_paged_attention(batch, scale, window)
    released = release_out_of_window(batch, window)
    assert (released.block_tables == -1).any()
    err = relative_error(run_kernel(released, scale, window), ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g}"


@pytest.mark.parametrize("heads", [(4, 4), (8, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("window", [0, 100])
def test_long_prefill_splits_into_query_tiles(isa: str, heads: tuple[int, int], window: int) -> None:
    gen = torch.Generator().manual_seed(7)
    batch = make_paged_batch([(37, 300), (0, 1)], heads[0], heads[1], 64, torch.bfloat16, gen)
    check(batch, torch.bfloat16, sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 32, 48])
def test_other_block_sizes(isa: str, dtype: torch.dtype, block_size: int) -> None:
    """KV spans then straddle blocks at offsets that are not multiples of 16."""
    gen = torch.Generator().manual_seed(block_size)
    batch = make_paged_batch(MIXED + [(90, 7)], 8, 2, 80, dtype, gen, block_size=block_size)
    check(batch, dtype, sliding_window=0)
    check(batch, dtype, sliding_window=9)


def test_strided_query_and_out_views() -> None:
    """q and out may be views into wider buffers (e.g. a fused qkv projection)."""
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch(MIXED, 8, 2, 64, torch.float32, gen)
    T, H, D = batch.query.shape
    qkv = torch.randn(T, H + 2, D, generator=gen)
    qkv[:, :H] = batch.query
    out_buf = torch.full((T, H + 3, D), float("nan"))
    out = out_buf[:, 1 : H + 1]
    ops.paged_attention(
        out, qkv[:, :H], batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, D**-0.5, 0, batch.max_query_len, batch.max_seq_len,
    )
    assert relative_error(out, reference_paged_attention(batch, D**-0.5, 0)) <= TOLERANCE[torch.float32]
    assert out_buf[:, 0].isnan().all() and out_buf[:, H + 1 :].isnan().all(), "wrote outside the out view"


def test_bad_arguments_name_the_argument() -> None:
    gen = torch.Generator().manual_seed(0)
    b = make_paged_batch([(5, 2)], 4, 2, 64, torch.float32, gen)
    out = torch.empty_like(b.query)
    args = [out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125, 0, 2, 7]

    def call(i: int, value: object) -> None:
        bad = list(args)
        bad[i] = value
        ops.paged_attention(*bad)  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        call(4, b.block_tables.long())
    with pytest.raises(RuntimeError, match="seq_lens"):
        call(5, b.seq_lens.long())
    with pytest.raises(RuntimeError, match="key_cache dtype"):
        call(2, b.key_cache.double())
    with pytest.raises(RuntimeError, match=r"out shape"):
        call(0, out[:1])
    with pytest.raises(RuntimeError, match="num_heads 3 must be a multiple of key_cache num_kv_heads 2"):
        q3 = torch.randn(2, 3, 64)
        ops.paged_attention(torch.empty_like(q3), q3, *args[2:])  # type: ignore[arg-type]
    bad_table = b.block_tables.clone()
    bad_table[0, 0] = 10_000
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 0\] = 10000 is out of range"):
        call(4, bad_table)
    with pytest.raises(RuntimeError, match="max_seq_len"):
        call(10, 3)
    with pytest.raises(RuntimeError, match="softcap must be 0 \\(off\\) or a positive finite number, got -1"):
        ops.paged_attention(*args, -1.0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="softcap must be"):
        ops.paged_attention(*args, float("inf"))  # type: ignore[arg-type]


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(1)
    b = make_paged_batch([(3, 2), (0, 4)], 4, 2, 64, torch.float32, gen)
    # opcheck runs the op on copies; NaN slots would make its output comparisons fail spuriously.
    b.key_cache = torch.nan_to_num(b.key_cache)
    b.value_cache = torch.nan_to_num(b.value_cache)
    out = torch.zeros_like(b.query)
    torch.library.opcheck(
        torch.ops.pagewire.paged_attention.default,
        (out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125, 0,
         b.max_query_len, b.max_seq_len),
    )
    torch.library.opcheck(
        torch.ops.pagewire.paged_attention.default,
        (out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125, 0,
         b.max_query_len, b.max_seq_len, 20.0),
    )
    torch.library.opcheck(
        torch.ops.pagewire.paged_attention.default,
        (out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125, 0,
         b.max_query_len, b.max_seq_len, 0.0, torch.tensor([0.5, -1.0, 2.0, 0.0])),
    )


# Contexts past several KV partitions (csrc/cpu/attention_kernel.h, kPartition = 512): decodes of
# one or a few long sequences, which the tile kernel (AVX-512, portable) splits into one unit per
# partition and merges, and a long prefill chunk, which one unit runs partition after partition.
LONG = [(1300, 1), (700, 1), (511, 1), (512, 1), (1030, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("specs", [LONG[:1], LONG[1:], [(900, 40)]], ids=["one-long-decode", "few-decodes", "chunk"])
@pytest.mark.parametrize("window", [0, 600, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_contexts_across_partitions(isa: str, dtype: torch.dtype, specs: list[tuple[int, int]], window: int,
                                         threads: int) -> None:
    """Against the float64 reference, with windows that start inside a later partition (600) or
    leave whole partitions unread (100), sinks taking real mass, on one thread (never split) and two."""
    gen = torch.Generator().manual_seed(len(specs) + window)
    batch = make_paged_batch(specs, 6, 3, 64, dtype, gen)
    sinks = torch.tensor([-30.0, 0.0, 1.0, 2.0, -1.0, 4.0])
    scale = 64**-0.5
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full_like(batch.query, float("nan"))
        ops.paged_attention(out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
                            batch.query_start_loc, scale, window, batch.max_query_len, batch.max_seq_len, 0.0, sinks)
    finally:
        torch.set_num_threads(old)
    err = relative_error(out, reference_paged_attention(batch, scale, window, sinks=sinks))
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g}"
    if window:  # the same with the blocks out of every row's window released (-1 in the table)
        released = release_out_of_window(batch, window)
        out2 = torch.full_like(batch.query, float("nan"))
        ops.paged_attention(out2, released.query, released.key_cache, released.value_cache, released.block_tables,
                            released.seq_lens, released.query_start_loc, scale, window, batch.max_query_len,
                            batch.max_seq_len, 0.0, sinks)
        assert torch.equal(out2, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 700])
def test_rows_past_partitions_are_the_same_bits_however_run(isa: str, dtype: torch.dtype, window: int) -> None:
    """A row's bits do not depend on how its context was cut into units: alone as a decode (split
    into partitions on two threads by the tile kernel), two rows at once, and inside one 1300-token
    prefill (each tile's unit runs the partitions in turn) give the same bits, at partition edges
    and between them, on one thread and on two."""
    gen = torch.Generator().manual_seed(window + 1)
    L = 1300
    batch = make_paged_batch([(0, L)], 6, 3, 64, dtype, gen)
    scale = 64**-0.5
    view = torch.int32 if dtype == torch.float32 else torch.int16
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        prefill = run_kernel(batch, scale, window)
        assert relative_error(prefill, reference_paged_attention(batch, scale, window)) <= TOLERANCE[dtype]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for p in (0, 511, 512, 700, 1023, 1024, 1100, L - 1):
                for begin in (p, max(0, p - 1)):
                    q = batch.query[begin : p + 1]
                    out = torch.full_like(q, float("nan"))
                    ops.paged_attention(out, q, batch.key_cache, batch.value_cache, batch.block_tables,
                                        torch.tensor([p + 1], dtype=torch.int32),
                                        torch.tensor([0, q.shape[0]], dtype=torch.int32), scale, window, q.shape[0], p + 1)
                    assert torch.equal(out[-1].view(view), prefill[p].view(view)), f"row {p} from {begin}, {threads} threads"
    finally:
        torch.set_num_threads(old)
