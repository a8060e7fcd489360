"""Small numeric building blocks shared by the model files: RMSNorm (with the residual add) and the
gated MLP activations (SiLU, GELU-tanh), each routed to pagewire's fused C++ op on CPU and composed from torch
ops elsewhere (or, for SiLU, on large CPU batches where torch's vectorised kernel wins).

They are plain functions over tensors (no nn.Module), because the per-layer loop runs every engine
step and each avoided Python call is overhead saved on every token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from server.kernels import batch_invariant, ops

# CPU batches use the fused C++ silu_and_mul: with AVX2 (a vectorised exp) at any size (measured
# 2x torch's SiLU + multiply at 1 and at 1024 tokens); on CPUs without it the op runs a libm expf
# loop, which still saves an op per layer for decode batches but loses to torch's kernels beyond
# FUSED_SILU_MAX_TOKENS.
FUSED_SILU_MAX_TOKENS = 32
_FUSED_SILU_ANY_SIZE = ops.detected_cpu_isa() != "portable"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as transformers' LlamaRMSNorm computes it.

    Args: x [..., d]; weight [d] (or broadcastable to x, e.g. [n, d] for per-head norms over [T, n, d]).
    The statistics are taken in fp32 and the result cast back to x's dtype before scaling by
    `weight`, matching HF's rounding for bf16/fp16 models.
    """
    # Spelled out rather than F.rms_norm: torch's CPU rms_norm is ~10x slower than these six
    # kernels for prefill-sized inputs (measured 13.6 ms vs 1.2 ms for [512, 4096] fp32).
    xf = x if x.dtype == torch.float32 else x.float()
    inv_rms = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if x.dtype == torch.float32:
        return (xf * inv_rms).mul_(weight)
    return weight * (xf * inv_rms).to(x.dtype)


def rms_norm_fixed_blocks(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm over blocks of exactly batch_invariant.BLOCK_ROWS rows (the last zero-padded).

    Batch-invariant mode off the CPU: a GPU reduction kernel picks its launch shape (and with it
    how a row's sum is split across threads) from the number of rows, so every call gets one shape.
    The CPU op needs none of this: each row is one thread's fixed eight-way sum (fused_ops.cpp).
    """
    b = batch_invariant.BLOCK_ROWS
    t = x.shape[0]
    pad = (-t) % b
    xp = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x
    return torch.cat([rms_norm(xp[i : i + b], weight, eps) for i in range(0, t + pad, b)])[:t]


def rms_norm_weight_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' GptOssRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) in fp32,
    rounded once to x's dtype (rms_norm rounds before the weight). Equal to rms_norm in fp32."""
    xf = x.float()
    inv_rms = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (weight.float() * (xf * inv_rms)).to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False) -> torch.Tensor:
    """rms_norm of a [T, d] residual stream by weight [d]: one C++ op on CPU, rms_norm elsewhere;
    `weight_fp32` (gpt-oss): rms_norm_weight_fp32 for bf16/fp16 streams."""
    if weight_fp32 and x.dtype != torch.float32:
        return rms_norm_weight_fp32(x, weight, eps)
    if x.is_cpu:
        return ops.rms_norm(x, weight, eps)
    if batch_invariant.enabled():
        return rms_norm_fixed_blocks(x, weight, eps)
    return rms_norm(x, weight, eps)


def add_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
             weight_fp32: bool = False) -> torch.Tensor:
    """residual += delta in place, then return rms_norm(residual, weight, eps); one C++ op on CPU.

    Args: residual [T, d] (the residual stream, mutated); delta [T, d]; weight [d]; weight_fp32: as
    `norm`'s.
    """
    if weight_fp32 and residual.dtype != torch.float32:
        return norm(residual.add_(delta), weight, eps, True)
    if residual.is_cpu:
        return ops.add_rms_norm(residual, delta, weight, eps)
    residual.add_(delta)
    return norm(residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Args: gate_up [T, 2 * I] = cat(gate, up). Returns silu(gate) * up, [T, I]."""
    if gate_up.is_cpu and (_FUSED_SILU_ANY_SIZE or gate_up.shape[0] <= FUSED_SILU_MAX_TOKENS):
        return ops.silu_and_mul(gate_up)
    half = gate_up.shape[-1] // 2
    out = F.silu(gate_up[:, :half])
    return out.mul_(gate_up[:, half:])


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Args: gate_up [T, 2 * I] = cat(gate, up). Returns gelu(gate, approximate="tanh") * up, [T, I]
    (Gemma's MLP); routed as silu_and_mul is."""
    if gate_up.is_cpu and (_FUSED_SILU_ANY_SIZE or gate_up.shape[0] <= FUSED_SILU_MAX_TOKENS):
        return ops.gelu_tanh_and_mul(gate_up)
    half = gate_up.shape[-1] // 2
    out = F.gelu(gate_up[:, :half], approximate="tanh")
    return out.mul_(gate_up[:, half:])
