"""GatedDeltaNet: the linear-attention token mixer of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, run
over explicit per-sequence state tensors (a conv state and a recurrent state per layer, held in
slot pools by the engine's state cache) so a prompt can be prefilled in chunks and decoded token
by token in mixed batches.

Per token (transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet):
  q, k, v, z, b, a = in-projections of the normed hidden row
  q, k, v = silu(depthwise causal conv1d over the last K inputs)          (conv state: K - 1 rows)
  g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b)
  o = gated delta rule(l2norm(q) / sqrt(Dk), l2norm(k), v, g, beta)      (recurrent state [Hv, Dk, Dv])
  out = out_proj(RMSNorm(o) * w * silu(z))  per value head
The four steps are pagewire's C++ ops (server/kernels/gdn.py); the projections are one fused
matrix [q, k, v, z, b, a] (rows reordered at load from Qwen3-Next's per-key-head grouping).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from server.kernels import gdn
from server.kernels.linear_route import linear
from server.kernels.quant import QuantizedWeight
from server.kernels.quant_parts import QuantizedParts
from server.models.weights import WeightTarget, param

# How a checkpoint spells the in-projections: "qkvz" (Qwen3-Next: in_proj_qkvz and in_proj_ba, rows
# grouped per key head) or "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
GDN_CHECKPOINTS = ("qkvz", "split")


@dataclass(frozen=True)
class GdnShape:
    """One Gated DeltaNet layer's sizes: hidden size, key heads Hk and value heads Hv (a multiple of
    Hk), their head sizes Dk and Dv, the conv kernel K, the gated norm's eps and the checkpoint
    spelling (GDN_CHECKPOINTS)."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float
    checkpoint: str = "split"

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The per-sequence states: name -> (shape, dtype: "model" or "float32")."""
        return {"conv": ((self.conv_kernel - 1, self.conv_dim), "model"),
                "recurrent": ((self.num_value_heads, self.key_head_dim, self.value_head_dim), "float32")}


class GatedDeltaNet(nn.Module):
    """Parameters: in_proj [conv_dim + value_dim + 2 Hv, H] (q, k, v, z, b, a rows), conv_weight
    [conv_dim, K], A_log and dt_bias [Hv], norm_weight [Dv], out_proj [H, value_dim]."""

    def __init__(self, shape: GdnShape, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        s = shape
        assert s.checkpoint in GDN_CHECKPOINTS and s.num_value_heads % s.num_key_heads == 0
        self.shape = s
        H, Hv = s.hidden_size, s.num_value_heads
        self.in_proj: torch.Tensor | QuantizedWeight | QuantizedParts = param(
            (s.conv_dim + s.value_dim + 2 * Hv, H), dtype, device)
        self.conv_weight = param((s.conv_dim, s.conv_kernel), dtype, device)
        self.A_log = param((Hv,), dtype, device)
        self.dt_bias = param((Hv,), dtype, device)
        self.norm_weight = param((s.value_head_dim,), dtype, device)
        self.out_proj: torch.Tensor | QuantizedWeight = param((H, s.value_dim), dtype, device)
        self._conv_cache: tuple[tuple[int, int], torch.Tensor] | None = None
        # A GGUF ssm_out kept in the file's (tiled) column order: int64 [value_dim], the column of
        # the normed output each of out_proj's columns reads (server.models.qwen3_next_gguf); None:
        # out_proj's columns are in this layer's order.
        self.out_columns: torch.Tensor | None = None

    def conv_weight_f32(self) -> torch.Tensor:
        """conv_weight [conv_dim, K] as a float32 [conv_dim, K] view of a contiguous [K, conv_dim]
        copy: the layout the conv op computes in, so it converts nothing per call (that conversion
        was most of a decode step's conv time). The copy is kept while the parameter's storage and
        version counter say the weights are unchanged; bf16 -> float32 is exact, so the floats are
        the same as from conv_weight itself."""
        w = self.conv_weight
        try:
            key = (w.data_ptr(), w._version)
        except RuntimeError:  # an inference tensor has no version counter: convert every call
            return w.float().t().contiguous().t()
        if self._conv_cache is None or self._conv_cache[0] != key:
            self._conv_cache = (key, w.float().t().contiguous().t())
        return self._conv_cache[1]

    def forward(self, x: torch.Tensor, conv_states: torch.Tensor, recurrent_states: torch.Tensor,
                slots: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """x [T, H]: the layer's normed input, sequences laid out by query_start_loc int32 [S + 1];
        conv_states [N, K - 1, conv_dim] (x's dtype) and recurrent_states float32 [N, Hv, Dk, Dv]:
        the pools, rows `slots` int64 [S] read and updated in place. Returns [T, H]."""
        s = self.shape
        T = x.shape[0]
        kd, vd, Hv = s.key_dim, s.value_dim, s.num_value_heads
        proj = linear(x, self.in_proj)  # [T, conv_dim + value_dim + 2 Hv]
        mixed = gdn.causal_conv1d(proj[:, : s.conv_dim], self.conv_weight_f32(), None, conv_states, slots,
                                  query_start_loc)
        q = mixed[:, :kd].view(T, s.num_key_heads, s.key_head_dim)
        k = mixed[:, kd : 2 * kd].view(T, s.num_key_heads, s.key_head_dim)
        v = mixed[:, 2 * kd :].view(T, Hv, s.value_head_dim)
        z = proj[:, s.conv_dim : s.conv_dim + vd].view(T, Hv, s.value_head_dim)
        b = proj[:, s.conv_dim + vd : s.conv_dim + vd + Hv]
        a = proj[:, s.conv_dim + vd + Hv :]
        g, beta = gdn.gating(a, b, self.A_log, self.dt_bias)
        core = gdn.gated_delta_rule(q, k, v, g, beta, recurrent_states, slots, query_start_loc)
        normed = gdn.gated_rms_norm(core, z, self.norm_weight, s.eps).view(T, vd)
        if self.out_columns is not None:
            normed = normed.index_select(1, self.out_columns)
        return linear(normed, self.out_proj)

    def checkpoint_tensors(self, prefix: str) -> dict[str, WeightTarget]:
        """HF names under `prefix` (e.g. "model.layers.0.linear_attn.") -> slices of the fused parameters."""
        s = self.shape
        H, Hv, kd, vd, cd = s.hidden_size, s.num_value_heads, s.key_dim, s.value_dim, s.conv_dim
        assert isinstance(self.in_proj, torch.Tensor) and isinstance(self.out_proj, torch.Tensor), \
            "checkpoint_tensors: the layer is already quantised"
        w = self.in_proj
        t = {prefix + "conv1d.weight": WeightTarget(self.conv_weight, (cd, 1, s.conv_kernel), convert=_squeeze1),
             prefix + "A_log": WeightTarget(self.A_log, (Hv,)),
             prefix + "dt_bias": WeightTarget(self.dt_bias, (Hv,)),
             prefix + "norm.weight": WeightTarget(self.norm_weight, (s.value_head_dim,)),
             prefix + "out_proj.weight": WeightTarget(self.out_proj, (H, vd))}
        if s.checkpoint == "split":
            t[prefix + "in_proj_qkv.weight"] = WeightTarget(w[:cd], (cd, H))
            t[prefix + "in_proj_z.weight"] = WeightTarget(w[cd : cd + vd], (vd, H))
            t[prefix + "in_proj_b.weight"] = WeightTarget(w[cd + vd : cd + vd + Hv], (Hv, H))
            t[prefix + "in_proj_a.weight"] = WeightTarget(w[cd + vd + Hv :], (Hv, H))
        else:
            t[prefix + "in_proj_qkvz.weight"] = WeightTarget(w[: cd + vd], (2 * kd + 2 * vd, H),
                                                             convert=_ungroup(s, "qkvz"))
            t[prefix + "in_proj_ba.weight"] = WeightTarget(w[cd + vd :], (2 * Hv, H), convert=_ungroup(s, "ba"))
        return t

    def linear_weights(self) -> list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]]:
        return [("gdn_in", self.in_proj), ("gdn_out", self.out_proj)]


def _squeeze1(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(1)


def _ungroup(s: GdnShape, which: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz rows come per key head as [q (Dk), k (Dk), v (r Dv), z (r Dv)]
    (r = Hv / Hk), and in_proj_ba's as [b (r), a (r)]; this regroups them as [all q, all k, all v,
    all z] and [all b, all a] (transformers' fix_query_key_value_ordering)."""
    r = s.num_value_heads // s.num_key_heads
    sizes = ([s.key_head_dim, s.key_head_dim, r * s.value_head_dim, r * s.value_head_dim] if which == "qkvz"
             else [r, r])

    def convert(t: torch.Tensor) -> torch.Tensor:
        grouped = t.view(s.num_key_heads, sum(sizes), t.shape[-1])
        return torch.cat([p.reshape(-1, t.shape[-1]) for p in grouped.split(sizes, dim=1)])

    return convert
