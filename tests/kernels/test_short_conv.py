"""pagewire::short_conv (LFM2's gated short convolution with its state slots) against a float64
PyTorch reference, on this CPU's family (AVX-512, AVX2) and the portable body, in float32 and
bfloat16: several sequences in one flat batch, each continuing from its own slot, fed in chunks
of every size (shorter than the window too), with channel counts that leave vector tails.
The AVX-512 body on a CPU without it: tests/kernels/test_emulated_short_conv.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.kernels import ops
from tests.kernels.short_conv_reference import reference


def run_chunks(dtype: torch.dtype, C: int, K: int, lens: list[int], chunk: int, with_bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    S = len(lens)
    weight = torch.randn(C, K, generator=g)
    bias = torch.randn(C, generator=g) if with_bias else None
    seqs = [torch.randn(n, 3 * C, generator=g).to(dtype) for n in lens]
    slots = torch.tensor([2 * s + 1 for s in range(S)], dtype=torch.int64)  # not 0..S-1: slots are looked up
    pool = torch.zeros(2 * S + 1, K - 1, C, dtype=dtype)
    init = [torch.randn(K - 1, C, generator=g).to(dtype) for _ in range(S)]
    for s in range(S):
        pool[slots[s]] = init[s]
    weight_t = weight.to(dtype).float().t().contiguous()
    outs: list[list[torch.Tensor]] = [[] for _ in range(S)]
    pos = [0] * S
    while any(p < n for p, n in zip(pos, lens)):
        parts, qsl = [], [0]
        for s in range(S):
            take = min(chunk, lens[s] - pos[s])
            parts.append(seqs[s][pos[s]:pos[s] + take])
            qsl.append(qsl[-1] + take)
        out = ops.short_conv(torch.cat(parts), weight_t, bias, pool, slots, torch.tensor(qsl, dtype=torch.int32))
        for s in range(S):
            outs[s].append(out[qsl[s]:qsl[s + 1]])
            pos[s] += qsl[s + 1] - qsl[s]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for s in range(S):
        ref_out, ref_state = reference(seqs[s].float(), weight.to(dtype).float(), bias, init[s].float())
        got = torch.cat(outs[s]).double()
        if dtype == torch.bfloat16:  # the reference rounds where the kernel rounds: B*x and the conv output
            b, c, x = seqs[s].float().chunk(3, dim=-1)
            bx = torch.cat([init[s].float(), (b * x).to(dtype).float()])
            y = F.conv1d(bx.t().unsqueeze(0).double(), weight.to(dtype).double().unsqueeze(1),
                         bias.double() if bias is not None else None, groups=C)[0].t()
            ref_out = c.double() * y.to(dtype).double()
            ref_state = bx[-(K - 1):].double()
        torch.testing.assert_close(got, ref_out.double(), **tol)
        torch.testing.assert_close(pool[slots[s]].double(), ref_state.double(), **tol)
    # Slots no sequence named are untouched.
    assert torch.count_nonzero(pool[0]) == 0


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_short_conv_matches_float64_reference(monkeypatch: pytest.MonkeyPatch, isa: str, dtype: torch.dtype,
                                              chunk: int) -> None:
    if isa == "portable":
        monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    # C = 72 leaves a tail after 64-channel blocks, and after 8 and 16 lanes; K = 3 (LFM2) and 4.
    run_chunks(dtype, 72, 3, [1, 9, 40], chunk, with_bias=False, seed=chunk)
    run_chunks(dtype, 40, 4, [3, 17], chunk, with_bias=True, seed=100 + chunk)


def test_native_and_portable_bodies_agree_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every body computes each channel with the same fused multiply-adds in the same order."""
    g = torch.Generator().manual_seed(7)
    C, K = 136, 3
    bcx = torch.randn(30, 3 * C, generator=g).to(torch.bfloat16)
    w = torch.randn(K, C, generator=g)
    qsl = torch.tensor([0, 4, 30], dtype=torch.int32)
    slots = torch.tensor([0, 1])
    outs = []
    for isa in ("", "portable"):
        monkeypatch.setenv("PAGEWIRE_CPU_ISA", isa or "amx")
        pool = torch.randn(2, K - 1, C, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
        outs.append((ops.short_conv(bcx, w, None, pool, slots, qsl), pool))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_short_conv_names_bad_arguments() -> None:
    C, K = 8, 3
    bcx = torch.zeros(4, 3 * C)
    w = torch.zeros(K, C)
    pool = torch.zeros(2, K - 1, C)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="slot 5 outside"):
        ops.short_conv(bcx, w, None, pool, torch.tensor([5]), qsl)
    with pytest.raises(RuntimeError, match="state must be"):
        ops.short_conv(bcx, w, None, torch.zeros(2, K, C), torch.tensor([0]), qsl)
    with pytest.raises(RuntimeError, match="weight_t must be"):
        ops.short_conv(bcx, torch.zeros(9, C), None, pool, torch.tensor([0]), qsl)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.short_conv(bcx.half(), w, None, pool.half(), torch.tensor([0]), qsl)
