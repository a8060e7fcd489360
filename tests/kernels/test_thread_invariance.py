"""Every CPU kernel family gives the same result at any thread count.

The kernels split their work across OpenMP threads (output rows, heads, query tiles, experts), so
a wrong split or tail shows only at some thread counts. `make test` runs each pytest-xdist worker
with one intra-op thread (tests/conftest.py), so this file is where the splits are exercised: the
same inputs at 1, 2, 3 and 5 threads. In batch-invariant mode the results must be bit-identical
(the engine's determinism test relies on it at model level); outside it, equal up to fp32
summation order, since the float GEMM path may split K differently."""
from __future__ import annotations

from typing import Callable, Iterator

import pytest
import torch

from server.kernels import batch_invariant, ops
from server.kernels.quant import QuantizedExperts, QuantizedWeight
from tests.kernels.paged_reference import make_paged_batch
from tests.kernels.test_moe_experts import experts, routing
from tests.kernels.test_quant4 import random_q4

THREADS = (2, 3, 5)


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def at_threads(fn: Callable[[], torch.Tensor], exact: bool) -> None:
    """fn() at each of THREADS equals fn() at one thread (bitwise when `exact`)."""
    torch.set_num_threads(1)
    want = fn()
    for n in THREADS:
        torch.set_num_threads(n)
        got = fn()
        if exact:
            assert torch.equal(got, want), f"{n} threads differ from 1"
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{n} threads: {m}")


def _weight(kind: str, n: int, k: int) -> torch.Tensor | QuantizedWeight:
    g = torch.Generator().manual_seed(n + k)
    if kind in ("q4_0", "q4_1", "q4_k", "q5_k", "q6_k"):
        return random_q4(kind, n, k, seed=n).for_kernels()
    w = torch.randn(n, k, generator=g)
    if kind == "q8_0":
        return QuantizedWeight.quantize(w).for_kernels()
    return w.to(torch.bfloat16 if kind == "bf16" else torch.float32)


# N = 45 and 203: rows that do not divide by 8 (the interleaved groups) nor by the thread counts.
# N = 200 (25 groups) at 17 rows: the 8-bit-activation ops run quantisation, kernel and rounding in
# one parallel region from two threads (csrc/cpu/float_rows.h fused_linear), against the separate
# steps at one thread.
@pytest.mark.parametrize("kind", ["bf16", "f32", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("M", [1, 5, 17])
def test_linear(cpu_isa: str, kind: str, M: int) -> None:
    K = 256
    for N in (45, 203, 200):
        w = _weight(kind, N, K)
        dtype = torch.float32 if kind == "f32" else torch.bfloat16
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
        b = torch.randn(N, generator=torch.Generator().manual_seed(N)).to(dtype)
        # docs/determinism.md: without AVX2 (the portable family) a float weight goes through the
        # library GEMM, which may split a reduction by thread count; quantised kernels never do.
        exact = cpu_isa != "portable" or kind not in ("bf16", "f32")
        with batch_invariant.mode(True):
            at_threads(lambda: ops.linear(x, w, b), exact=exact)
        at_threads(lambda: ops.linear(x, w, b), exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention(cpu_isa: str, dtype: torch.dtype) -> None:
    # Decodes, a prefill chunk on a context and a long fresh prefill (several query tiles).
    batch = make_paged_batch([(40, 1), (15, 1), (13, 20), (0, 70), (31, 1)], 8, 2, 64, dtype,
                             torch.Generator().manual_seed(3))

    def run() -> torch.Tensor:
        out = torch.full_like(batch.query, float("nan"))
        ops.paged_attention(out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                            batch.seq_lens, batch.query_start_loc, 64 ** -0.5, 0, batch.max_query_len,
                            batch.max_seq_len)
        return out

    with batch_invariant.mode(True):
        at_threads(run, exact=True)
    at_threads(run, exact=True)  # one thread owns each (sequence, head, tile): no split reduction


@pytest.mark.parametrize("kind", ["bfloat16", "q8_0", "q4_0"])
def test_moe_experts(cpu_isa: str, kind: str) -> None:
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    gate_up, down = experts(4, dtype)
    gu: torch.Tensor | QuantizedExperts = gate_up
    dn: torch.Tensor | QuantizedExperts = down
    if kind.startswith("q"):
        gu, dn = QuantizedExperts.quantize(gate_up, kind).for_kernels(), QuantizedExperts.quantize(down, kind).for_kernels()
    x = torch.randn(23, gate_up.shape[-1], generator=torch.Generator().manual_seed(5)).to(dtype)
    ids, w = routing(23, 2, seed=6)
    with batch_invariant.mode(True):
        at_threads(lambda: ops.moe_experts(x, ids, w, gu, dn), exact=True)


def test_norms(cpu_isa: str) -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 576, generator=g).bfloat16()
    d = torch.randn(37, 576, generator=g).bfloat16()
    weight = torch.randn(576, generator=g).bfloat16()
    at_threads(lambda: ops.rms_norm(x, weight, 1e-6), exact=True)

    def fused() -> torch.Tensor:
        residual = x.clone()
        normed = ops.add_rms_norm(residual, d, weight, 1e-6)
        return torch.cat([normed, residual])

    at_threads(fused, exact=True)
