"""Typed wrappers of the Gated DeltaNet ops (csrc/cpu/gdn_ops.cpp): the linear-attention layers of
Qwen3-Next, Qwen3.5 and Qwen3.5-MoE. A call covers a batch of sequences laid out as paged
attention's (`query_start_loc`); each sequence reads and updates its own row (`slots`) of the state
pools in place, so a prompt can be prefilled in chunks and decoded token by token with the same ops."""
from __future__ import annotations

from typing import Optional

import torch

from server.kernels import ops  # noqa: F401  (loads the extension and registers the fakes)

# transformers' torch_chunk_gated_delta_rule chunk length; any length gives the same result up to
# float32 rounding, and this one keeps the per-chunk [L, L] systems small.
CHUNK_SIZE = 64


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv_states: torch.Tensor,
                  slots: torch.Tensor, query_start_loc: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Depthwise causal conv1d over each sequence's previous inputs (its conv state) and new ones.

    Args:
        x: [T, C], contiguous in C (rows may be strided: a slice of a projection).
        weight: [C, K] (nn.Conv1d's [C, 1, K] squeezed); bias: [C] or None.
        conv_states: [N, K - 1, C] in x's dtype, the last K - 1 inputs of each slot, oldest first;
            the rows of `slots` are replaced by their sequence's last K - 1 inputs.
        slots: int64 [S], distinct; query_start_loc: int32 [S + 1].
        activation: "silu" (Gated DeltaNet) or "none".
    Returns: [T, C] in x's dtype.
    """
    return torch.ops.pagewire.gdn_causal_conv1d(x, weight, bias, conv_states, slots, query_start_loc, activation)


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(g, beta) float32 [T, Hv] from the projections a, b [T, Hv]: g = -exp(A_log) softplus(a + dt_bias),
    beta = sigmoid(b) (rounded to b's dtype, as transformers computes it)."""
    g, beta = torch.ops.pagewire.gdn_gating(a, b, A_log, dt_bias)
    return g, beta


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                     chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """The gated delta rule with l2-normalised q and k (`use_qk_l2norm_in_kernel`).

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv] with Hv a multiple of Hk; each contiguous in its last dim.
        g, beta: float32 [T, Hv] (`gating`).
        states: float32 [N, Hv, Dk, Dv]; the rows of `slots` are read as the state before the tokens
            and replaced by the state after them.
        slots: int64 [S], distinct; query_start_loc: int32 [S + 1].
    Returns: [T, Hv, Dv] in v's dtype.
    """
    return torch.ops.pagewire.gated_delta_rule(q, k, v, g, beta, states, slots, query_start_loc, chunk_size)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) * silu(gate) per head (Qwen3-Next's RMSNormGated).

    Args: x, gate [T, H, D] of one dtype, contiguous in D; weight [D]. Returns [T, H, D].
    """
    return torch.ops.pagewire.gated_rms_norm(x, gate, weight, eps)
