"""4-bit and 5-bit weights in GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL / IQ4_XS / Q2_K / Q3_K / Q4_K / MXFP4 layouts:
dequantisation equals the `gguf` package's (an independent implementation), quantize_q4_0 writes GGUF's bytes,
and pagewire::linear_q4 matches a float64 reference of the dequantised weights on every kernel family this CPU has."""
from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from server.kernels import ops
from server.kernels.quant import QTYPES, QuantizedWeight
from server.models.gguf_transcode import transcode
from tests.gguf_files import random_k_blocks
from tests.kernels.conftest import available_isas
from tests.pairwise import pairwise

# (Q5_K and Q6_K: test_kquants.py; the last four: GGUF's lattice blocks rewritten by gguf_transcode.)
Q4_TYPES = ["q4_0", "q4_1", "q4_k", "mxfp4", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "q2_k", "q3_k", "iq3_xxs", "iq3_s",
            "iq2_xxs", "iq1_s", "iq2_xs", "iq2_s", "iq1_m"]
LATTICE = {"iq3_xxs": "IQ3_XXS", "iq3_s": "IQ3_S", "iq2_xxs": "IQ2_XXS", "iq1_s": "IQ1_S", "iq2_xs": "IQ2_XS",
           "iq2_s": "IQ2_S", "iq1_m": "IQ1_M"}
# A lattice-type weight's GGUF source blocks, for the `gguf` package's reference: by id of its data
# tensor, with a weak reference that says the id is still that tensor's.
_SOURCES: dict[int, tuple["weakref.ref[torch.Tensor]", np.ndarray]] = {}
GGML_NAMES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "q8_0": "Q8_0",
              "mxfp4": "MXFP4", "q5_0": "Q5_0", "q5_1": "Q5_1", "iq4_nl": "IQ4_NL",
              "iq4_xs": "IQ4_XS", "q2_k": "Q2_K", "q3_k": "Q3_K", **LATTICE}
# Where a 32-value block's fp16 scales sit (d, and m for the types with a minimum).
HALVES = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,)}
# Where a 256-value super-block's fp16 scales sit (the K-quants and IQ4_XS).
K_HALVES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,), "q2_k": (80, 82), "q3_k": (108,)}


def random_q4(qtype: str, n: int, k: int, seed: int, zero_rows: tuple[int, ...] = ()) -> QuantizedWeight:
    """Valid random blocks: random codes, fp16 scales of a usual size (Q4_1's mins and the
    K-quants' sub-scales random too); the rows in `zero_rows` get all-zero scales (edge case)."""
    fmt = QTYPES[qtype]
    rng = np.random.default_rng(seed)
    if qtype in LATTICE:  # the file's blocks, rewritten as the loader does
        source = random_k_blocks(n, k, LATTICE[qtype], seed).reshape(n, k // 256, -1)
        for r in zero_rows:
            if qtype == "iq1_m":  # d's nibbles: the top of its four scale words
                source[r, :, 49:56:2] &= 0x0F
            else:
                source[r, :, 0:2] = 0  # d = 0
        source = source.reshape(n, -1)
        qw = QuantizedWeight.from_gguf_bytes(qtype, torch.from_numpy(transcode(LATTICE[qtype], source)), n, k)
        _SOURCES[id(qw.data)] = (weakref.ref(qw.data), source)
        return qw
    if qtype in K_HALVES:
        data = random_k_blocks(n, k, GGML_NAMES[qtype], seed).reshape(n, -1, fmt.nbytes)
        halves = K_HALVES[qtype]
    elif qtype == "mxfp4":  # random E2M1 codes, E8M0 exponents 2^-9 .. 2^-4 (values up to 6 * 2^-4)
        data = rng.integers(0, 256, size=(n, k // 32, fmt.nbytes), dtype=np.uint8)
        data[:, :, 0] = rng.integers(118, 124, size=data.shape[:2])
        for r in zero_rows:
            data[r, :, 1:] = 0  # every code 0: every value zero
        return QuantizedWeight.from_gguf_bytes(qtype, torch.from_numpy(data.reshape(n, -1).copy()), n, k)
    else:
        data = rng.integers(0, 256, size=(n, k // 32, fmt.nbytes), dtype=np.uint8)
        halves = HALVES[qtype]
        for off in halves:
            v = rng.uniform(0.002, 0.02, size=data.shape[:2]) * rng.choice([-1.0, 1.0], size=data.shape[:2])
            data[:, :, off:off + 2] = np.asarray(v, dtype=np.float16)[..., None].view(np.uint8)
    for r in zero_rows:
        for off in halves:
            data[r, :, off:off + 2] = 0
    return QuantizedWeight.from_gguf_bytes(qtype, torch.from_numpy(data.reshape(n, -1).copy()), n, k)


def gguf_dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """float32 [N, K] by the `gguf` package's numpy dequantiser."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[GGML_NAMES[qw.qtype]]
    if qw.qtype in LATTICE:
        ref, raw = _SOURCES[id(qw.data)]
        assert ref() is qw.data, "a lattice weight's source blocks (made by random_q4)"
    else:
        raw = qw.data.numpy()
    return torch.from_numpy(np.asarray(quants.dequantize(raw, t), dtype=np.float32)).reshape(qw.shape)


@pytest.mark.parametrize("qtype", Q4_TYPES)
def test_dequantize_equals_the_gguf_package(qtype: str) -> None:
    qw = random_q4(qtype, 9, 512, seed=1, zero_rows=(3,))
    deq = qw.dequantize()
    assert deq.shape == (9, 512) and deq.dtype == torch.float32
    assert torch.equal(deq, gguf_dequantize(qw))
    assert not deq[3].any()  # zero scales (and mins): every value is zero


def test_quantize_q4_0_writes_gguf_bytes() -> None:
    from gguf import GGMLQuantizationType, quants

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(6, 128, generator=gen)
    w[1, :32] = 0  # an all-zero block
    w[2, 40] = -30.0  # one large negative value sets its block's scale
    qw = QuantizedWeight.quantize(w, "q4_0")
    assert tuple(qw.data.shape) == (6, 4 * 18)
    want = quants.quantize(w.numpy(), GGMLQuantizationType.Q4_0)
    assert np.array_equal(qw.data.numpy(), want)


def linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ gguf_dequantize(qw).double().T
    return y + bias.double() if bias is not None else y


# Every pair of (family, qtype, rows, shape, dtype, bias) values (tests/pairwise.py), and in full
# for each family and qtype: one decode row, 17 rows (past the 16-row kernel path) and 40 (the
# dequantised chunks and torch's GEMM) on the larger shape, with a bias in bf16.
LINEAR_GRID = [(isa, q, m, n, k, dtype, bias) for isa, q, m, (n, k), dtype, bias in pairwise(
    [available_isas(), Q4_TYPES, [1, 2, 3, 7, 16, 17, 40], [(37, 256), (96, 768)],
     [torch.bfloat16, torch.float32], [False, True]],
    edges=[(isa, q, m, (96, 768), torch.bfloat16, True) for isa in available_isas() for q in Q4_TYPES
           for m in (1, 17, 40)])]


@pytest.mark.parametrize("cpu_isa,qtype,M,N,K,dtype,with_bias", LINEAR_GRID, indirect=["cpu_isa"])
def test_linear_q4_matches_float64_reference(
    cpu_isa: str, qtype: str, M: int, N: int, K: int, dtype: torch.dtype, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(M * 31 + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype)
    qw = random_q4(qtype, N, K, seed=M + N, zero_rows=(5,))
    b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    y = ops.linear(x, qw, b)
    assert y.shape == (M, N) and y.dtype == dtype
    ref = linear_reference(x, qw, b)
    # As for Q8_0: the activations are rounded to 8 bits per 32-value block (half a step, 1/254 of
    # the block's max, per value), errors adding like a random walk over K; bf16 output adds 2**-9.
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-2 + (2.0**-8 if dtype == torch.bfloat16 else 0)
    # A row with zero scales contributes nothing: its outputs are the bias exactly (up to dtype).
    # (MXFP4 has no zero scale: its row of zero codes cancels its +12 code offset against the
    # offset term, exact only to fp32 rounding of x's scale.)
    want_col = b[5].float() if b is not None else torch.zeros(())
    atol = 0.0 if qtype != "mxfp4" else 1e-6 * float(ref.abs().max())
    torch.testing.assert_close(y[:, 5].float(), want_col.expand(M), rtol=0, atol=atol)
    if M > 16:  # dequantised chunks and torch's GEMM: no activation rounding
        assert err <= 2.0**-7


@pytest.mark.parametrize("qtype,K", [("q4_0", 512), ("q4_1", 512), ("q4_k", 512), ("q4_0", 352), ("q4_1", 800),
                                     ("mxfp4", 352), ("mxfp4", 512), ("q5_0", 352), ("q5_1", 800),
                                     ("iq4_nl", 512), ("iq4_xs", 512), ("iq4_xs", 768),
                                     ("q2_k", 512), ("q2_k", 768), ("q3_k", 512), ("q3_k", 768),
                                     ("iq3_xxs", 768), ("iq3_s", 512), ("iq2_xxs", 768), ("iq1_s", 512),
                                     ("iq2_xs", 768), ("iq2_s", 512), ("iq1_m", 768)])
def test_kernel_families_agree(cpu_isa: str, qtype: str, K: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same integer dot products: the SIMD kernel equals the portable one up to fp32 summation
    order. K = 352 and 800 (11 and 25 blocks) leave the AVX2 kernel's eight-block steps a tail
    with a pair and an odd last block."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, K, generator=gen)
    qw = random_q4(qtype, 70, K, seed=5)
    y = ops.linear(x, qw)
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    torch.testing.assert_close(y, ops.linear(x, qw), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k", "q6_k", "q8_0", "q5_0", "q5_1", "iq4_nl", "iq4_xs",
                                   "q2_k", "q3_k", "iq3_xxs", "iq1_s", "iq2_s"])
@pytest.mark.parametrize("interleave", [False, True])
def test_bf16_rows_equal_the_fp32_kernel_rounded(cpu_isa: str, qtype: str, interleave: bool) -> None:
    """bf16 activations are widened and the fp32 results rounded inside the op (float_rows.h), not by
    ATen: the output is bit for bit the fp32 op's on x.float() (exact widening) rounded to bf16 by
    torch (round to nearest even), with and without bias, for row counts and an N (45, 16k + 13)
    that leave tails in every converter; fp16 still goes through ATen's conversion."""
    gen = torch.Generator().manual_seed(5)
    K = 768 if qtype in ("q4_k", "q6_k", "iq4_xs", "q2_k", "q3_k", *LATTICE) else 800
    qw = (QuantizedWeight.quantize(torch.randn(45, K, generator=gen)) if qtype == "q8_0"
          else random_q4(qtype, 45, K, seed=5))
    if interleave:
        qw = qw.interleave()
    b = torch.randn(45, generator=gen).bfloat16()
    for m in (1, 3, 16):
        x = (torch.randn(m, K, generator=gen) * 3).bfloat16()
        for bias in (None, b):
            y = ops.linear(x, qw, bias)
            ref = ops.linear(x.float(), qw, None if bias is None else bias.float())
            assert y.dtype == torch.bfloat16 and torch.equal(y, ref.bfloat16()), (m, bias is None)
        # a strided (non-contiguous) input gives the same rows as its contiguous copy
        wide = torch.cat([x, x], dim=1)[:, :K]
        assert torch.equal(ops.linear(wide, qw, None), ops.linear(x.contiguous(), qw, None))
    xh = torch.randn(2, K, generator=gen).half()
    assert torch.equal(ops.linear(xh, qw, None), ops.linear(xh.float(), qw, None).half())


@pytest.mark.parametrize("qtype,K", [("q4_0", 352), ("q4_1", 800), ("q4_k", 768), ("q8_0", 800), ("mxfp4", 800),
                                     ("q5_0", 352), ("q5_1", 800), ("iq4_nl", 352), ("iq4_xs", 768),
                                     ("q2_k", 768), ("q3_k", 768), ("iq3_s", 768), ("iq2_xxs", 768),
                                     ("iq2_xs", 768), ("iq1_m", 768)])
def test_rows_do_not_depend_on_the_batch(cpu_isa: str, qtype: str, K: int) -> None:
    """Deterministic mode: a row's output is bit-identical whatever the number of rows beside it
    (the kernels tile M in fours, twos and ones, and M = 1 takes its own weight-row tiling)."""
    from server.kernels import batch_invariant

    gen = torch.Generator().manual_seed(9)
    qw = random_q4(qtype, 45, K, seed=9) if qtype != "q8_0" else QuantizedWeight.quantize(
        torch.randn(45, K, generator=gen))
    x = torch.randn(16, K, generator=gen).bfloat16()
    b = torch.randn(45, generator=gen).bfloat16()
    with batch_invariant.mode(True):
        alone = [ops.linear(x[r:r + 1], qw, b) for r in range(16)]
        for m in (2, 3, 5, 7, 8, 13, 16):
            y = ops.linear(x[:m], qw, b)
            for r in range(m):
                assert torch.equal(y[r:r + 1], alone[r]), (m, r)


def test_linear_q4_tail_blocks_match_float64_reference(cpu_isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 / Q4_1 rows of 11 and 25 blocks (eight-block steps plus a pair and an odd block), with
    the AVX2 kernel's 1-row and several-row tilings: near the float64 reference (activation
    rounding, a few outputs: a looser bound than the large test's) and equal to the portable
    kernel up to fp32 summation order."""
    for qtype in ("q4_0", "q4_1", "mxfp4", "q5_0", "q5_1", "iq4_nl"):
        for K in (352, 800):
            for M in (1, 6):
                gen = torch.Generator().manual_seed(K + M)
                x = torch.randn(M, K, generator=gen)
                qw = random_q4(qtype, 23, K, seed=K)
                ref = linear_reference(x, qw, None)
                monkeypatch.setenv("PAGEWIRE_CPU_ISA", cpu_isa)
                y = ops.linear(x, qw)
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                assert err <= 2e-2, (qtype, K, M, err)
                monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
                torch.testing.assert_close(y, ops.linear(x, qw), rtol=1e-5, atol=1e-4)


def test_bad_arguments_name_the_argument() -> None:
    qk = random_q4("q4_k", 4, 256, seed=0)
    with pytest.raises(RuntimeError, match="K must be a positive multiple of 256 for q4_k, got 288"):
        torch.ops.pagewire.linear_q4(torch.randn(2, 288), qk.data, "q4_k", None)
    with pytest.raises(ValueError, match="shape: K = 288 must be a positive multiple of 256 for q4_k"):
        QuantizedWeight("q4_k", torch.zeros(4, 144, dtype=torch.uint8), (4, 288))
    with pytest.raises(ValueError, match="K = 96 must be a multiple of 256 for q4_k"):
        QuantizedWeight.from_gguf_bytes("q4_k", torch.zeros(4 * 54, dtype=torch.uint8), 4, 96)
    q0 = random_q4("q4_0", 8, 64, seed=0)
    with pytest.raises(RuntimeError, match="weight must be \\[N, 36\\] q4_0 bytes"):
        torch.ops.pagewire.linear_q4(torch.randn(2, 64), q0.data[:, :30], "q4_0", None)
    with pytest.raises(RuntimeError, match="qtype must be 'q4_0', 'q4_1', 'q4_k', 'q5_k', 'q6_k', 'mxfp4', 'q5_0', "
                                           "'q5_1', 'iq4_nl', 'iq4_xs', 'q2_k', 'q3_k', 'iq3_xxs', 'iq3_s', 'iq2_xxs', "
                                           "'iq1_s', 'iq2_xs', 'iq2_s', 'iq1_m', 'q4_0x8', .*'iq1_mx8', got 'tq1_0'"):
        torch.ops.pagewire.linear_q4(torch.randn(2, 64), q0.data, "tq1_0", None)
    with pytest.raises(RuntimeError, match="got 'mxfp4x8'"):  # MXFP4 has no x8 layout
        torch.ops.pagewire.linear_q4(torch.randn(2, 64), q0.data, "mxfp4x8", None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.pagewire.linear_q4(torch.randn(2, 64), q0.data, "q4_0", torch.randn(9))
    with pytest.raises(RuntimeError, match="multiple of 32 for q4_0"):
        torch.ops.pagewire.quantize_q4_0(torch.randn(4, 40))
    with pytest.raises(ValueError, match="qtype: quantising at load supports q8_0, q4_0"):
        QuantizedWeight.quantize(torch.randn(4, 256), "q4_k")


def test_opcheck_q4_ops() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(16, 256, generator=gen)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.pagewire.quantize_q4_0.default, (w,))
    for qtype in Q4_TYPES:
        qw = random_q4(qtype, 16, 256, seed=6)
        torch.library.opcheck(torch.ops.pagewire.dequantize_q4.default, (qw.data, qtype))
        torch.library.opcheck(torch.ops.pagewire.linear_q4.default, (x, qw.data, qtype, None))
        torch.library.opcheck(torch.ops.pagewire.linear_q4.default, (x, qw.data, qtype, torch.randn(16).bfloat16()))
