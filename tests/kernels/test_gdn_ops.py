"""The Gated DeltaNet ops (csrc/cpu/gdn_ops.cpp, server/kernels/gdn.py) on every CPU family this
machine runs (`cpu_isa`: portable and the AVX2 body; AVX-512 in test_emulated_gdn.py), against the
float64 definitions of gdn_reference.py and against transformers' own torch implementation
(qwen3_next's torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, causal conv1d and
RMSNormGated): mixed batches of prefills and decodes, prompts split into chunks that carry the
state, chunk boundaries inside the conv window, GQA-style value heads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from server.kernels import gdn
from tests.kernels.gdn_reference import (
    conv_reference,
    make_rule_batch,
    relative_error,
    rule_reference,
)

F32_TOL = 2e-5
LENS = [1, 5, 64, 1, 130, 7]


def run_rule(b, chunk_size: int = 64) -> torch.Tensor:
    return gdn.gated_delta_rule(b.q, b.k, b.v, b.g, b.beta, b.states, b.slots, b.qsl, chunk_size)


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 24), (2, 2, 32, 32), (1, 3, 20, 8)])
def test_rule_matches_float64(cpu_isa: str, hk: int, hv: int, dk: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(hk * 100 + dk + dv)
    b = make_rule_batch(LENS, hk, hv, dk, dv, torch.float32, gen)
    before = b.states.clone()
    out = run_rule(b)
    for s, (t0, t1) in enumerate(zip(b.qsl[:-1].tolist(), b.qsl[1:].tolist())):
        slot = int(b.slots[s])
        want, state = rule_reference(b.q[t0:t1], b.k[t0:t1], b.v[t0:t1], b.g[t0:t1], b.beta[t0:t1], before[slot])
        assert relative_error(out[t0:t1], want) <= F32_TOL, f"sequence {s} (len {t1 - t0}) output"
        assert relative_error(b.states[slot], state) <= F32_TOL, f"sequence {s} state"
    untouched = [i for i in range(b.states.shape[0]) if i not in b.slots.tolist()]
    assert torch.equal(b.states[untouched], before[untouched])


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_rule_chunk_size_and_split_prefill_carry_the_state(cpu_isa: str, chunk_size: int) -> None:
    """A 150-token prompt in the kernel's chunks of any size, or fed in pieces through the state
    pool (then decoded token by token), gives the one-pass float64 result."""
    gen = torch.Generator().manual_seed(chunk_size)
    b = make_rule_batch([150], 2, 4, 16, 16, torch.float32, gen)
    want, want_state = rule_reference(b.q, b.k, b.v, b.g, b.beta, b.states[int(b.slots[0])])
    pieces, outs, t0 = [37, 1, 64, 40, 1, 1, 1, 5], [], 0
    for n in pieces:
        sl = slice(t0, t0 + n)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        outs.append(gdn.gated_delta_rule(b.q[sl], b.k[sl], b.v[sl], b.g[sl].contiguous(), b.beta[sl].contiguous(),
                                         b.states, b.slots, qsl, chunk_size))
        t0 += n
    assert relative_error(torch.cat(outs), want) <= F32_TOL
    assert relative_error(b.states[int(b.slots[0])], want_state) <= F32_TOL


def test_rule_bf16_inputs(cpu_isa: str) -> None:
    gen = torch.Generator().manual_seed(7)
    b = make_rule_batch(LENS, 2, 4, 32, 32, torch.bfloat16, gen)
    before = b.states.clone()
    out = run_rule(b)
    assert out.dtype == torch.bfloat16
    for s, (t0, t1) in enumerate(zip(b.qsl[:-1].tolist(), b.qsl[1:].tolist())):
        want, _ = rule_reference(b.q[t0:t1], b.k[t0:t1], b.v[t0:t1], b.g[t0:t1], b.beta[t0:t1],
                                 before[int(b.slots[s])])
        assert relative_error(out[t0:t1], want) <= 1e-2


def _hf_layout(b, t0: int, t1: int) -> tuple[torch.Tensor, ...]:
    return tuple(x[t0:t1].unsqueeze(0) for x in (b.q, b.k, b.v, b.g, b.beta))


def test_rule_matches_transformers_chunk_and_recurrent(cpu_isa: str) -> None:
    """transformers' chunked form on each prompt (with the initial state, final state out) and its
    recurrent form on single tokens: same outputs and states as the op."""
    gen = torch.Generator().manual_seed(11)
    b = make_rule_batch(LENS, 2, 4, 32, 24, torch.float32, gen)
    before = b.states.clone()
    out = run_rule(b)
    for s, (t0, t1) in enumerate(zip(b.qsl[:-1].tolist(), b.qsl[1:].tolist())):
        slot = int(b.slots[s])
        q, k, v, g, beta = _hf_layout(b, t0, t1)
        fn = hf.torch_recurrent_gated_delta_rule if t1 - t0 == 1 else hf.torch_chunk_gated_delta_rule
        want, state = fn(q, k, v, g=g, beta=beta, initial_state=before[slot : slot + 1].clone(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert relative_error(out[t0:t1], want[0]) <= F32_TOL
        assert relative_error(b.states[slot], state[0]) <= F32_TOL


def test_rule_rejects_shared_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    b = make_rule_batch([2, 3], 1, 1, 8, 8, torch.float32, gen)
    b.slots[1] = b.slots[0]
    with pytest.raises(RuntimeError, match="appears twice"):
        run_rule(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv_matches_float64_and_carries_state(cpu_isa: str, dtype: torch.dtype) -> None:
    """Pieces of 1, 2 and 3 tokens (inside the K = 4 window) then longer ones, one batch of two
    sequences in different slots per call: outputs and final states as one pass over the prompt."""
    gen = torch.Generator().manual_seed(5)
    C, K, N = 40, 4, 5
    xs = [torch.randn(L, C, generator=gen).to(dtype) for L in (23, 17)]
    weight = (torch.randn(C, K, generator=gen) * 0.5).to(dtype)
    states = (torch.randn(N, K - 1, C, generator=gen)).to(dtype)
    slots = torch.tensor([3, 1])
    want = [conv_reference(x, weight, states[int(s)]) for x, s in zip(xs, slots)]
    pieces = [(1, 2), (2, 1), (3, 3), (10, 1), (7, 10)]
    got: list[list[torch.Tensor]] = [[], []]
    pos = [0, 0]
    for p in pieces:
        x = torch.cat([xs[i][pos[i] : pos[i] + p[i]] for i in range(2)])
        qsl = torch.tensor([0, p[0], p[0] + p[1]], dtype=torch.int32)
        out = gdn.causal_conv1d(x, weight, None, states, slots, qsl)
        got[0].append(out[: p[0]])
        got[1].append(out[p[0]:])
        pos = [pos[0] + p[0], pos[1] + p[1]]
    tol = F32_TOL if dtype == torch.float32 else 1e-2
    for i in range(2):
        assert relative_error(torch.cat(got[i]), want[i][0]) <= tol
        assert torch.equal(states[int(slots[i])].double(), want[i][1])


def test_conv_matches_transformers(cpu_isa: str) -> None:
    """transformers' causal_conv1d_fn on a prompt, then causal_conv1d_update per decoded token."""
    gen = torch.Generator().manual_seed(9)
    C, K, L = 24, 4, 9
    x = torch.randn(1, C, L + 3, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    want_prefill = hf.causal_conv1d_fn(x[:, :, :L], weight, None, activation="silu")
    hf_state = F.pad(x[:, :, :L], (K - L, 0)) if L < K else x[:, :, L - K : L].clone()
    states = torch.zeros(2, K - 1, C)
    slots = torch.tensor([1])
    got = gdn.causal_conv1d(x[0, :, :L].T.contiguous(), weight, None, states, slots, torch.tensor([0, L], dtype=torch.int32))
    assert relative_error(got, want_prefill[0].T) <= F32_TOL
    for t in range(L, L + 3):
        want = hf.causal_conv1d_update(x[:, :, t : t + 1], hf_state, weight, None, "silu")
        got = gdn.causal_conv1d(x[0, :, t : t + 1].T.contiguous(), weight, None, states, slots,
                                torch.tensor([0, 1], dtype=torch.int32))
        assert relative_error(got, want[0].T) <= F32_TOL
        assert torch.equal(states[1], hf_state[0, :, 1:].T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gating_and_gated_norm_match_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    T, H, D = 6, 4, 32
    a, b = (torch.randn(T, H, generator=gen) * 4).to(dtype), torch.randn(T, H, generator=gen).to(dtype)
    a[0, 0] = 30.0  # softplus's linear branch
    A_log = torch.log(torch.rand(H, generator=gen) * 16 + 0.01).to(dtype)
    dt_bias = torch.randn(H, generator=gen).to(dtype)
    g, beta = gdn.gating(a, b, A_log, dt_bias)
    want_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    torch.testing.assert_close(g, want_g, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta, b.sigmoid().float(), rtol=0, atol=0)

    norm = hf.Qwen3NextRMSNormGated(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=gen))
    x, z = torch.randn(T, H, D, generator=gen).to(dtype), torch.randn(T, H, D, generator=gen).to(dtype)
    want = norm(x.reshape(-1, D), z.reshape(-1, D)).reshape(T, H, D)
    got = gdn.gated_rms_norm(x, z, norm.weight.detach(), 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
