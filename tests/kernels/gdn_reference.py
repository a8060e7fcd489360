"""Float64 references of the Gated DeltaNet ops (server/kernels/gdn.py), written from the
definitions (one token at a time), and random batches for their tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float64: q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta [L, Hv], state [Hv, Dk, Dv]
    -> (out [L, Hv, Dv], final state)."""
    rep = v.shape[1] // q.shape[1]
    q, k = (x.double().repeat_interleave(rep, 1) for x in (q, k))
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    v, g, beta, s = v.double(), g.double(), beta.double(), state.double().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def conv_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                   silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float64: x [L, C], weight [C, K], state [K - 1, C] -> (out [L, C], new state)."""
    full = torch.cat([state.double(), x.double()])
    K = weight.shape[1]
    out = torch.stack([(full[t : t + K].T * weight.double()).sum(-1) for t in range(x.shape[0])])
    return (F.silu(out) if silu else out), full[-(K - 1):]


@dataclass
class RuleBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    states: torch.Tensor
    slots: torch.Tensor
    qsl: torch.Tensor
    lens: list[int]


def make_rule_batch(lens: list[int], hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype,
                    gen: torch.Generator, num_slots: int = 0) -> RuleBatch:
    T = sum(lens)
    q = torch.randn(T, hk, dk, generator=gen).to(dtype)
    k = torch.randn(T, hk, dk, generator=gen).to(dtype)
    v = torch.randn(T, hv, dv, generator=gen).to(dtype)
    # decays as the model makes them: -exp(A_log) softplus(a + dt_bias), A in [0.01, 16] -> mostly mild, some strong
    g = -(torch.rand(T, hv, generator=gen) * 2) * F.softplus(torch.randn(T, hv, generator=gen))
    beta = torch.rand(T, hv, generator=gen)
    n = max(num_slots, 2 * len(lens) + 1)
    states = torch.randn(n, hv, dk, dv, generator=gen) * 0.5
    slots = torch.randperm(n, generator=gen)[: len(lens)].to(torch.int64)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return RuleBatch(q, k, v, g, beta, states, slots, qsl, lens)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12))
