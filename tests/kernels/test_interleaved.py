"""Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS (and the lattice types held in its layout), Q2_K and Q3_K
in the interleaved x8 layouts (csrc/cpu/quant_kernel.h,
quant4_kernel.h), which the model loaders choose on x86 CPUs from AVX2 up (QuantizedWeight.for_kernels): the layout is exactly
the documented byte permutation, dequantises to what the `gguf` package reads from the original
rows, and the linear ops on it match a float64 reference on every kernel family this CPU has (the
portable family reads it through a row-layout copy), row for row whatever the batch."""
from __future__ import annotations

import pytest
import torch

from server.kernels import batch_invariant, ops
from server.kernels.quant import QTYPES, QuantizedWeight
from tests.kernels.conftest import available_isas
from tests.kernels.test_emulated_x8_vnni import activations, weight
from tests.kernels.test_quant4 import gguf_dequantize, linear_reference, random_q4
from tests.pairwise import pairwise

X8_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
# Per qtype: block bytes, where the x8 block's chunks start (after the scales and Q5's fifth bits),
# the codes' offset in a row block, chunks per block.
LAYOUT = {"q8_0": (34, 16, 2, 8), "q4_0": (18, 16, 2, 4), "q4_1": (20, 32, 4, 4), "q5_0": (22, 48, 6, 4),
          "q5_1": (24, 64, 8, 4), "iq4_nl": (18, 16, 2, 4)}
# The x8 types of 32-value blocks (LAYOUT), IQ4_XS, Q2_K and Q3_K (256-value super-blocks: K a multiple of 256).
SUPER_TYPES = ["iq4_xs", "q2_k", "q3_k", "iq3_xxs", "iq3_s", "iq2_xxs", "iq1_s", "iq2_xs", "iq2_s", "iq1_m"]
X8_ALL = [*X8_TYPES, *SUPER_TYPES]


def x8_fifth_bits(qh: int) -> int:
    """A row's Q5 fifth-bit word (bit j: value j) as the x8 layout stores it (quant4_kernel.h): byte
    i holds at bit c the bit of value 4c + i and at bit 4 + c that of value 16 + 4c + i."""
    out = 0
    for i in range(4):
        for c in range(4):
            out |= ((qh >> (4 * c + i)) & 1) << (8 * i + c)
            out |= ((qh >> (16 + 4 * c + i)) & 1) << (8 * i + 4 + c)
    return out


def random_weight(qtype: str, n: int, k: int, seed: int, zero_rows: tuple[int, ...] = ()) -> QuantizedWeight:
    """Row-layout blocks: random_q4's for 4-bit, a random matrix quantised for Q8_0 (zero rows: d = 0)."""
    if qtype != "q8_0":
        return random_q4(qtype, n, k, seed, zero_rows)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[list(zero_rows)] = 0
    return QuantizedWeight.quantize(w)


def interleave(qw: QuantizedWeight) -> QuantizedWeight:
    """The x8 copy of a row-layout weight, whatever this CPU's family (for_kernels decides that)."""
    return qw.interleave()


@pytest.mark.parametrize("qtype", X8_TYPES)
@pytest.mark.parametrize("N", [8, 13, 45])
def test_interleave_is_the_documented_permutation(qtype: str, N: int) -> None:
    K = 96
    qw = random_weight(qtype, N, K, seed=N)
    x8 = interleave(qw)
    src, dst = qw.data, x8.data
    assert dst.shape == src.shape and dst.dtype == torch.uint8
    block, scale_bytes, codes, chunks = LAYOUT[qtype]
    groups = N // 8
    for g in range(groups):
        out = dst[8 * g: 8 * g + 8].reshape(-1)  # the group's bytes, in order
        for b in range(K // 32):
            blk = out[b * 8 * block: (b + 1) * 8 * block]
            for r in range(8):
                row = src[8 * g + r, b * block: (b + 1) * block]
                assert torch.equal(blk[2 * r: 2 * r + 2], row[:2])  # d
                if qtype in ("q4_1", "q5_1"):
                    assert torch.equal(blk[16 + 2 * r: 18 + 2 * r], row[2:4])  # m
                if qtype in ("q5_0", "q5_1"):  # the fifth bits, rearranged, after the scales
                    at = codes - 4
                    qh = int.from_bytes(bytes(row[at:at + 4].tolist()), "little")
                    start = scale_bytes - 32 + 4 * r
                    x8_word = int.from_bytes(bytes(blk[start:start + 4].tolist()), "little")
                    assert x8_word == x8_fifth_bits(qh)
                for c in range(chunks):
                    start = scale_bytes + 32 * c + 4 * r
                    assert torch.equal(blk[start: start + 4], row[codes + 4 * c: codes + 4 * c + 4])
    assert torch.equal(dst[groups * 8:], src[groups * 8:])  # the last N % 8 rows stay as rows


# quant4_kernel.h's x8 layouts of the 256-value super-block types, as (group offset, row block
# offset, bytes) moves of row r's block.
def superblock_moves(qtype: str, r: int) -> list[tuple[int, int, int]]:
    if qtype in ("iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq1_s"):
        # d, scales_l, scales_h, then per sub-block IQ4_NL's four chunks
        return [(2 * r, 0, 2), (16 + 4 * r, 4, 4), (48 + 2 * r, 2, 2)] + [
            (64 + 128 * sb + 32 * c + 4 * r, 8 + 16 * sb + 4 * c, 4) for sb in range(8) for c in range(4)]
    if qtype in ("iq2_xs", "iq2_s", "iq1_m"):  # the x16 layout: d, the l bytes as two vectors, then the chunks from 80
        return [(2 * r, 0, 2)] + [(16 + 32 * v + 4 * r, 2 + 4 * v, 4) for v in range(2)] + [
            (80 + 128 * sb + 32 * c + 4 * r, 10 + 16 * sb + 4 * c, 4) for sb in range(8) for c in range(4)]
    if qtype == "q2_k":  # d, dmin, the scale bytes as four vectors, sixteen chunks of qs
        return [(2 * r, 80, 2), (16 + 2 * r, 82, 2)] + [(32 + 32 * v + 4 * r, 4 * v, 4) for v in range(4)] + [
            (160 + 32 * c + 4 * r, 16 + 4 * c, 4) for c in range(16)]
    assert qtype == "q3_k"  # d, the packed scales as three vectors (the codes: q3_k_planes)
    return [(2 * r, 108, 2)] + [(16 + 32 * v + 4 * r, 96 + 4 * v, 4) for v in range(3)]


def q3_k_planes(block: list[int]) -> list[list[int]]:
    """One Q3_K block's codes as quant4_kernel.h's three x8 planes A, B, C (32 bytes each, one per
    value position l): code (n, j) of position l is value 128n + 32j + l's, q2 | hbit << 2."""
    code = [[[((block[32 + 32 * n + l] >> (2 * j)) & 3) | ((block[l] >> (4 * n + j)) & 1) << 2 for l in range(32)]
             for j in range(4)] for n in range(2)]
    nibbles = [(code[0][0], code[0][1]), (code[0][2], code[0][3]), (code[1][0], code[1][1])]
    return [[lo[l] | ((code[1][2][l] >> k) & 1) << 3 | hi[l] << 4 | ((code[1][3][l] >> k) & 1) << 7 for l in range(32)]
            for k, (lo, hi) in enumerate(nibbles)]


@pytest.mark.parametrize("qtype", SUPER_TYPES)
@pytest.mark.parametrize("N", [8, 21])
def test_superblock_x8_is_the_documented_permutation(qtype: str, N: int) -> None:
    """quant4_kernel.h's IQ4_XS, Q2_K and Q3_K x8 layouts, byte for byte (superblock_moves; Q3_K's
    codes repacked into three planes, q3_k_planes), every byte of a group written once; the last
    N % 8 rows stay rows, and the layout dequantises (through the op's way back) to the rows' values."""
    K, block = 512, QTYPES[qtype].nbytes
    moves = [m for r in range(8) for m in superblock_moves(qtype, r)]
    planes = range(112, 112 + 3 * 256) if qtype == "q3_k" else range(0)  # (Q3_K's code planes)
    covered = sorted([i for at, _, n in moves for i in range(at, at + n)] + list(planes))
    assert covered == list(range(8 * block))
    qw = random_weight(qtype, N, K, seed=N)
    x8 = interleave(qw)
    assert x8.interleaved and x8.op_qtype == f"{qtype}x8" and x8.data.shape == qw.data.shape
    src, dst = qw.data, x8.data
    for g in range(N // 8):
        out = dst[8 * g: 8 * g + 8].reshape(-1)
        for s in range(K // 256):
            grp = out[s * 8 * block: (s + 1) * 8 * block]
            for r in range(8):
                row = src[8 * g + r, s * block: (s + 1) * block]
                for at, off, n in superblock_moves(qtype, r):
                    assert torch.equal(grp[at: at + n], row[off: off + n]), (g, s, r, at)
                if qtype == "q3_k":  # position l of row r at 112 + 256k + 32 (l // 4) + 4r + l % 4
                    for k, plane in enumerate(q3_k_planes(row.tolist())):
                        got = [int(grp[112 + 256 * k + 32 * (l // 4) + 4 * r + l % 4]) for l in range(32)]
                        assert got == plane, (g, s, r, k)
    assert torch.equal(dst[N // 8 * 8:], src[N // 8 * 8:])
    assert torch.equal(x8.dequantize(), gguf_dequantize(qw))


@pytest.mark.parametrize("qtype", X8_ALL)
@pytest.mark.parametrize("N", [8, 13, 45])
def test_interleaved_dequantises_to_the_gguf_rows(qtype: str, N: int) -> None:
    qw = random_weight(qtype, N, 256, seed=2 * N, zero_rows=(3,))
    assert torch.equal(interleave(qw).dequantize(), gguf_dequantize(qw))


# Every pair of (family, qtype, rows, shape, dtype, bias) values (tests/pairwise.py), and in full
# for each family and qtype: one decode row on the smallest shape, and 17 (past the 16-row
# kernel path) and 40 rows (the dequantise + GEMM path) on the largest, with a bias in bf16.
LINEAR_GRID = [(isa, q, m, n, k, dtype, bias) for isa, q, m, (n, k), dtype, bias in pairwise(
    [available_isas(), X8_TYPES, [1, 2, 3, 5, 8, 16, 17, 40], [(8, 32), (37, 256), (96, 768)],
     [torch.bfloat16, torch.float32], [False, True]],
    edges=[(isa, q, m, nk, torch.bfloat16, True) for isa in available_isas() for q in X8_TYPES
           for m, nk in ((1, (8, 32)), (17, (96, 768)), (40, (96, 768)))])]
# IQ4_XS, Q2_K and Q3_K (K whole super-blocks): the same pairs on the two shapes they take.
LINEAR_GRID += [(isa, q, m, n, k, dtype, bias) for isa, q, m, (n, k), dtype, bias in pairwise(
    [available_isas(), SUPER_TYPES, [1, 2, 3, 5, 8, 16, 17, 40], [(37, 256), (96, 768)],
     [torch.bfloat16, torch.float32], [False, True]],
    edges=[(isa, q, m, (96, 768), torch.bfloat16, True) for isa in available_isas() for q in SUPER_TYPES
           for m in (1, 17, 40)])]


@pytest.mark.parametrize("cpu_isa,qtype,M,N,K,dtype,with_bias", LINEAR_GRID, indirect=["cpu_isa"])
def test_interleaved_linear_matches_float64_reference(
    cpu_isa: str, qtype: str, M: int, N: int, K: int, dtype: torch.dtype, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(M * 17 + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype)
    qw = random_weight(qtype, N, K, seed=M + N + 1, zero_rows=(5,) if N > 5 else ())
    x8 = interleave(qw)
    b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    y = ops.linear(x, x8, b)
    assert y.shape == (M, N) and y.dtype == dtype
    ref = linear_reference(x, qw, b)
    # 8-bit activation rounding per 32-value block, as in tests/kernels/test_quant4.py; its tail
    # test's looser bound, since N = 8 or K = 256 leaves few outputs to set the scale.
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 2e-2 + (2.0**-8 if dtype == torch.bfloat16 else 0)
    if N > 5:  # a row of zero scales gives exactly its bias
        want_col = b[5].float() if b is not None else torch.zeros(())
        torch.testing.assert_close(y[:, 5].float(), want_col.expand(M), rtol=0, atol=0)
    # The same integer dot products as the row layout's kernel: equal up to fp32 summation order.
    fp32 = dtype == torch.float32  # (bf16 outputs: one rounding each, up to 2**-8 apart)
    torch.testing.assert_close(y.float(), ops.linear(x, qw, b).float(), rtol=1e-5 if fp32 else 2.0**-7,
                               atol=1e-4 if fp32 else 1e-2)
    if M > 16:  # dequantised chunks and torch's GEMM: no activation rounding
        assert err <= 2.0**-7


@pytest.mark.parametrize("qtype", X8_ALL)
def test_prefill_rows_over_several_dequantised_chunks(qtype: str) -> None:
    """Above 16 rows the ops dequantise the weight in chunks of rows (512 rows at K = 1024, whole x8
    groups) for ATen's GEMM: N = 1031 spans three chunks and ends in a 7-row tail in row layout.
    Both layouts give the float64 product of the dequantised weight (no activation rounding)."""
    qw = random_weight(qtype, 1031, 1024, seed=7)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(8))
    ref = x.double() @ qw.dequantize().double().T
    for w in (qw, interleave(qw)):
        err = ((w.linear(x, None).double() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-5, (w.interleaved, err)


@pytest.mark.parametrize("qtype", X8_ALL)
def test_interleaved_rows_do_not_depend_on_the_batch(cpu_isa: str, qtype: str) -> None:
    """Deterministic mode: 45 rows (five groups and five rows left in row layout), a row's output
    bit-identical whatever the number of activation rows beside it."""
    gen = torch.Generator().manual_seed(11)
    K = 768 if qtype in SUPER_TYPES else 352
    x8 = interleave(random_weight(qtype, 45, K, seed=11))
    x = torch.randn(16, K, generator=gen).bfloat16()
    b = torch.randn(45, generator=gen).bfloat16()
    with batch_invariant.mode(True):
        alone = [ops.linear(x[r:r + 1], x8, b) for r in range(16)]
        for m in (2, 3, 4, 5, 7, 8, 13, 16):
            y = ops.linear(x[:m], x8, b)
            for r in range(m):
                assert torch.equal(y[r:r + 1], alone[r]), (m, r)


# The VNNI build of the x8 kernels (linear_x8_vnni.cpp) against the AVX2 build: the same integer sums,
# so the same floats bit for bit (test_emulated_x8_vnni.py checks it on any CPU). Row counts 1-9
# cover every tile shape (13: Q6_K's VNNI build runs 8, 4 and 1 rows; 9, 13 and 16 with K = 1024: the
# 4-bit pairs' eight-row tiles on AMD, x8_body.h eight_row_tiles); N = 64 and 40 an even and an odd
# number of groups.
VNNI_ROWS = [1, 2, 3, 4, 5, 7, 9, 13, 16]
VNNI_SHAPES = [(64, 256), (40, 512), (40, 1024)]


@pytest.mark.skipif("avx512" not in available_isas(),
                    reason="needs a CPU with AVX-512 VNNI (test_emulated_x8_vnni.py covers it on any CPU)")
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl", "iq4_xs",
                                   "q2_k", "q3_k", "iq3_xxs", "iq3_s", "iq2_xxs", "iq1_s", "iq2_xs", "iq2_s", "iq1_m"])
@pytest.mark.parametrize("extreme", [False, True])
def test_vnni_x8_is_the_avx2_x8_bit_for_bit_natively(monkeypatch: pytest.MonkeyPatch, qtype: str, extreme: bool) -> None:
    for n, k in VNNI_SHAPES:
        x8 = weight(qtype, n, k, seed=n + k, extreme=extreme).interleave()
        bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
        for m in VNNI_ROWS:
            x = activations(m, k, seed=m, extreme=extreme)
            got = {}
            for isa in ("avx2", "avx512"):
                monkeypatch.setenv("PAGEWIRE_CPU_ISA", isa)
                assert ops.cpu_isa() == isa
                got[isa] = ops.linear(x, x8, bias)
            assert torch.equal(got["avx2"], got["avx512"]), (qtype, n, k, m)
            assert torch.isfinite(got["avx2"]).all()


@pytest.mark.skipif("amx" not in available_isas(), reason="needs a CPU with AMX (int8 tiles)")
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("n,k", [(64, 256), (40, 512), (264, 1024), (72, 96)])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_amx_x8_is_the_vnni_x8_bit_for_bit(monkeypatch: pytest.MonkeyPatch, qtype: str, n: int, k: int,
                                           extreme: bool) -> None:
    """The x8 kernels on AMX tiles (linear_x8_amx.cpp: the activations as the A tile; Q8_0's x8
    chunks copied, Q4_0's / Q4_1's unpacked, two groups to a B tile) add the same integers and
    run the same fp32 steps as the VNNI x8 kernels, so every output is the same float, at row
    counts from 1 to 16 (AMX from 4 rows for Q8_0, from 6 for Q4_0 / Q4_1: up to four tiles per
    step, odd group counts -- a lone last 4-bit group -- and partial tiles), with a bias. Chunks of
    16 rows: test_emulated_amx.py."""
    x8 = weight(qtype, n, k, seed=n + k, extreme=extreme).interleave()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
    for m in (1, 3, 4, 5, 6, 7, 8, 13, 16):
        x = activations(m, k, seed=m, extreme=extreme)
        got = {}
        for isa in ("avx512", "amx"):
            monkeypatch.setenv("PAGEWIRE_CPU_ISA", isa)
            assert ops.cpu_isa() == isa
            got[isa] = ops.linear(x, x8, bias)
        assert torch.equal(got["avx512"], got["amx"]), (n, k, m)
        assert torch.isfinite(got["amx"]).all()


def test_for_kernels_interleaves_for_every_x86_kernel_family(monkeypatch: pytest.MonkeyPatch) -> None:
    q0, q1, qk = random_q4("q4_0", 16, 256, seed=1), random_q4("q4_1", 16, 256, seed=2), random_q4("q4_k", 16, 256, 3)
    q8 = QuantizedWeight.quantize(torch.randn(16, 256))
    x86 = ops.cpu_isa() != "portable"
    for qw in (q8, q0, q1, qk):
        prepared = qw.for_kernels()
        assert prepared.interleaved == x86 and prepared.qtype == qw.qtype and prepared.shape == qw.shape
        assert torch.equal(prepared.dequantize(), qw.dequantize())
        assert prepared.for_kernels() is prepared
    for qw in (random_q4("mxfp4", 16, 256, seed=5), random_q4("q4_0", 7, 256, seed=4)):  # no x8 layout; < 8 rows
        assert qw.for_kernels() is qw
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    assert q0.for_kernels() is q0 and q8.for_kernels() is q8  # the portable kernels read rows


def test_interleaved_arguments_are_checked() -> None:
    qk = random_q4("mxfp4", 8, 256, seed=0)
    with pytest.raises(ValueError,
                       match="interleaved: only q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, q5_0, q5_1, iq4_nl, iq4_xs, q2_k, q3_k, "
                             "iq3_xxs, iq3_s, iq2_xxs, iq1_s, iq2_xs, iq2_s, iq1_m, bf16, bf16z "
                             "have an "
                             "interleaved layout, not mxfp4"):
        QuantizedWeight("mxfp4", qk.data, (8, 256), interleaved=True)
    with pytest.raises(RuntimeError, match="qtype must be a row-layout qtype with an x8 layout \\('q4_0', 'q4_1', "
                                           "'q4_k', 'q5_k', 'q6_k', 'q5_0', 'q5_1', 'iq4_nl', 'iq4_xs', 'q2_k', "
                                           "'q3_k', 'iq3_xxs', 'iq3_s', 'iq2_xxs', 'iq1_s', 'iq2_xs', 'iq2_s' or 'iq1_m'\\), "
                                           "got 'mxfp4'"):
        torch.ops.pagewire.interleave_q4(qk.data, "mxfp4")
    with pytest.raises(ValueError, match="interleaved: mxfp4 has no interleaved layout"):
        qk.interleave()
    x8 = interleave(random_q4("q4_0", 8, 64, seed=0))
    with pytest.raises(ValueError, match="interleaved: q4_0 is already interleaved layout"):
        x8.interleave()
    with pytest.raises(RuntimeError, match="qtype must be a row-layout qtype with an x8 layout .*, got 'q4_0x8'"):
        torch.ops.pagewire.interleave_q4(x8.data, "q4_0x8")
    with pytest.raises(RuntimeError, match="weight must be \\[N, 36\\] q4_0x8 bytes"):
        torch.ops.pagewire.linear_q4(torch.randn(2, 64), x8.data[:, :30], "q4_0x8", None)
    with pytest.raises(RuntimeError, match="weight must be \\[N, K / 32 \\* 34\\] Q8_0 bytes"):
        torch.ops.pagewire.interleave_q8_0(torch.zeros(8, 30, dtype=torch.uint8))


def test_opcheck_interleaved_ops() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    for qtype in ("q4_0", "q4_1"):
        qw = random_q4(qtype, 16, 256, seed=6)
        torch.library.opcheck(torch.ops.pagewire.interleave_q4.default, (qw.data, qtype))
        x8 = interleave(qw).data
        torch.library.opcheck(torch.ops.pagewire.dequantize_q4.default, (x8, qtype + "x8"))
        torch.library.opcheck(torch.ops.pagewire.linear_q4.default, (x, x8, qtype + "x8", None))
    q8 = random_weight("q8_0", 16, 256, seed=6)
    torch.library.opcheck(torch.ops.pagewire.interleave_q8_0.default, (q8.data,))
    x8 = interleave(q8).data
    torch.library.opcheck(torch.ops.pagewire.dequantize_q8_0.default, (x8, True))
    torch.library.opcheck(torch.ops.pagewire.linear_q8_0.default, (x, x8, None, True))
