"""llama.cpp's GGUF forms of the Gated DeltaNet hybrids -- `qwen3next` (Qwen3-Next), `qwen35`
(Qwen3.5) and `qwen35moe` (Qwen3.5-MoE) -- read into the model of server/models/qwen3_next.py.

It owns both halves of the reading: the metadata -> ModelConfig translation and the way back from
llama.cpp's tensors to transformers' (the model's checkpoint names and layouts). What llama.cpp's
converter does to these checkpoints, and so what is undone here:

* the DeltaNet's sizes are `{arch}.ssm.*` keys: group_count = key heads, time_step_rank = value
  heads, state_size = key head size, inner_size = value heads x value head size, conv_kernel;
  which layers are recurrent is `{arch}.attention.recurrent_layers` (one bool per layer) or else
  every layer but each `{arch}.full_attention_interval`-th (default 4);
* every RMSNorm but the DeltaNet's gated one is stored as 1 + w, so the config has no norm offset;
* A_log is stored as A = -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the conv kernel squeezed
  to [channels, K] (`ssm_conv1d`), out_proj as `ssm_out`, the gated norm as `ssm_norm`;
* in_proj_qkv / in_proj_z are `attn_qkv` / `attn_gate` (Qwen3-Next's per-key-head in_proj_qkvz is
  regrouped into those two; files of its first converter kept it as `ssm_in`), in_proj_b / in_proj_a
  are `ssm_beta` / `ssm_alpha`, and Qwen3-Next's in_proj_ba is kept grouped as `ssm_ba`;
* for Qwen3.5 and Qwen3.5-MoE with fewer key heads than value heads, the value heads are reordered
  from transformers' grouped order (the r = Hv / Hk heads of key head 0, then key head 1's, ...)
  to tiled order (head 0 of every group, then head 1 of every group, ...) in every tensor indexed
  by value head: the v rows of attn_qkv and of the conv kernel, attn_gate, ssm_beta, ssm_alpha,
  ssm_a, ssm_dt and the columns of ssm_out;
* layers past `block_count - nextn_predict_layers` are the multi-token-prediction head, which
  pagewire does not run: their tensors are skipped.
The attention layers, the routed experts and the gated shared expert use the shared GGUF names.
With --quantization gguf (server.models.gguf_blocks), the same reorderings are applied to the
file's block bytes: whole rows for in_proj and the gated attention's qkv (attn_q's query and gate
rows apart), whole blocks of columns for ssm_out where a value head fills whole blocks.
Torch is imported only by the tensor half.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

from server.models.config import ModelConfig, ModelLoadError
from server.models.gguf_config import gguf_base
from server.models.gguf_file import GGUFFile
from server.models.state_specs import ATTENTION, GATED_DELTANET

if TYPE_CHECKING:
    import torch

# general.architecture -> the transformers architecture the model stands for
QWEN3_NEXT_GGUF = {"qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                   "qwen35moe": "Qwen3_5MoeForCausalLM"}
# Tensors that are a rename only (GGUF suffix -> transformers suffix under linear_attn.).
_RENAMES = {"attn_qkv.weight": "in_proj_qkv.weight", "attn_gate.weight": "in_proj_z.weight",
            "ssm_beta.weight": "in_proj_b.weight", "ssm_alpha.weight": "in_proj_a.weight",
            "ssm_conv1d.weight": "conv1d.weight", "ssm_dt.bias": "dt_bias", "ssm_a": "A_log",
            "ssm_norm.weight": "norm.weight", "ssm_out.weight": "out_proj.weight"}
# Tensors that split into two of transformers' (Qwen3-Next's grouped ones).
_SPLITS = {"ssm_ba.weight": ("in_proj_b.weight", "in_proj_a.weight"),
           "ssm_in.weight": ("in_proj_qkv.weight", "in_proj_z.weight")}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Every DeltaNet tensor suffix of these files (error messages name a missing one by it).
QWEN3_NEXT_GGUF_PARTS = (*_RENAMES, *_SPLITS)


class _Keys:
    """A GGUFFile whose integer keys in `values` read as given (what gguf_base reads that these
    architectures state elsewhere or not at all)."""

    def __init__(self, f: GGUFFile, values: dict[str, int]) -> None:
        self._f, self._values = f, values

    def get_int(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return self._values[key] if key in self._values else self._f.get_int(key, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _layer_types(f: GGUFFile, k: str, n: int) -> tuple[str, ...]:
    key = k + "attention.recurrent_layers"
    raw = f.metadata.get(key)
    if raw is not None:
        if not isinstance(raw, list) or len(raw) < n or not all(isinstance(b, bool) for b in raw):
            raise ModelLoadError(f"{f.path}: metadata key {key!r} must list a boolean per layer ({n})")
        recurrent = raw[:n]
    else:
        interval = f.get_int(k + "full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    if all(recurrent):
        raise ModelLoadError(f"{f.path}: {key}: at least one layer must be full attention")
    return tuple(GATED_DELTANET if r else ATTENTION for r in recurrent)


def qwen3_next_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """ModelConfig of a `qwen3next` / `qwen35` / `qwen35moe` file (the module docstring)."""
    k = arch + "."
    total = f.get_int(k + "block_count")
    n = total - f.get_int(k + "nextn_predict_layers", 0, positive=False)
    if n <= 0:
        raise ModelLoadError(f"{f.path}: {k}nextn_predict_layers leaves no decoder layer of {total}")
    experts = f.get_int(k + "expert_count", 0, positive=False)
    moe_ff = f.get_int(k + "expert_feed_forward_length", 0, positive=False)
    keys = {k + "block_count": n}
    if k + "feed_forward_length" not in f.metadata and moe_ff:  # Qwen3.5-MoE: no dense MLP anywhere
        keys[k + "feed_forward_length"] = moe_ff
    base = gguf_base(cast(GGUFFile, _Keys(f, keys)), arch, QWEN3_NEXT_GGUF[arch])
    value_heads, key_heads = f.get_int(k + "ssm.time_step_rank"), f.get_int(k + "ssm.group_count")
    inner = f.get_int(k + "ssm.inner_size")
    if value_heads % key_heads or inner % value_heads:
        raise ModelLoadError(f"{f.path}: {k}ssm.time_step_rank {value_heads} must be a multiple of "
                             f"{k}ssm.group_count {key_heads} and divide {k}ssm.inner_size {inner}")
    conv = f.get_int(k + "ssm.conv_kernel")
    if conv < 2:
        raise ModelLoadError(f"{f.path}: metadata key {k}ssm.conv_kernel must be at least 2, got {conv}")
    parts: dict[str, Any] = dict(
        layer_sliding_windows=(None,) * n, layer_ropes=(0,) * n,
        qk_norm=True, norm_weight_offset=0.0, attn_output_gate=True,  # the file holds 1 + w already
        layer_types=_layer_types(f, k, n), linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=f.get_int(k + "ssm.state_size"), linear_value_head_dim=inner // value_heads,
        conv_kernel=conv, gdn_checkpoint="split",
    )
    if experts:
        kinds = tuple("sparse" if f"blk.{i}.ffn_gate_inp.weight" in f.tensors else "dense" for i in range(n))
        down = next((t for t in f.tensors.values() if t.name.endswith("ffn_down_shexp.weight")), None)
        parts.update(layer_mlp_kinds=kinds, num_experts=experts,
                     num_experts_per_tok=f.get_int(k + "expert_used_count"),
                     # llama.cpp renormalises the top-k weights of all three architectures
                     norm_topk_prob=f.get_bool(k + "expert_weights_norm", True),
                     moe_intermediate_size=moe_ff or base["intermediate_size"],
                     shared_expert_intermediate_size=f.get_int(
                         k + "expert_shared_feed_forward_length",
                         int(down.shape[-1]) if down is not None else 0, positive=False))
    return ModelConfig(**{**base, **parts})


def qwen3_next_gguf_names(gguf_name: str, config: ModelConfig) -> tuple[str, ...] | None:
    """The transformers names a DeltaNet tensor of these files fills (two for Qwen3-Next's grouped
    ssm_ba / ssm_in), () for a multi-token-prediction layer's tensor (skipped), None for a tensor
    the shared GGUF map names."""
    m = _BLOCK.fullmatch(gguf_name)
    if m is None:
        return None
    if int(m.group(1)) >= config.num_layers:
        return ()
    prefix, part = f"model.layers.{m.group(1)}.linear_attn.", m.group(2)
    if part in _RENAMES:
        return (prefix + _RENAMES[part],)
    if part in _SPLITS:
        return tuple(prefix + p for p in _SPLITS[part])
    return None


def qwen3_next_from_gguf(gguf_name: str, t: "torch.Tensor", config: ModelConfig) -> list["torch.Tensor"]:
    """A dequantised DeltaNet tensor in transformers' layout, one per qwen3_next_gguf_names entry."""
    import torch

    c = config
    part = gguf_name.split(".", 2)[2]
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = hv // hk
    if part == "ssm_ba.weight":  # per key head: [b (r rows), a (r rows)]
        grouped = t.reshape(hk, 2 * r, -1)
        return [grouped[:, :r].reshape(hv, -1), grouped[:, r:].reshape(hv, -1)]
    if part == "ssm_in.weight":  # per key head: [q (Dk), k (Dk), v (r Dv), z (r Dv)]
        q, k, v, z = t.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
        return [torch.cat([q.reshape(-1, t.shape[-1]), k.reshape(-1, t.shape[-1]), v.reshape(-1, t.shape[-1])]),
                z.reshape(-1, t.shape[-1])]
    if part == "ssm_a":  # A = -exp(A_log), computed back in float64
        t = torch.log(-t.double()).to(t.dtype)
    if c.model_type == "qwen3next" or r == 1:
        return [t]
    # Qwen3.5: value heads in tiled order -> transformers' grouped order.
    if part in ("attn_qkv.weight", "ssm_conv1d.weight"):
        qk = 2 * hk * dk
        return [torch.cat([t[:qk], _untile(t[qk:], 0, hk, r, dv)])]
    if part == "attn_gate.weight":
        return [_untile(t, 0, hk, r, dv)]
    if part in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
        return [_untile(t, 0, hk, r, 1)]
    if part == "ssm_out.weight":
        return [_untile(t, 1, hk, r, dv)]
    return [t]


def _untile(t: "torch.Tensor", dim: int, key_heads: int, per_key: int, head: int) -> "torch.Tensor":
    """Value heads along `dim` from tiled order [per_key, key_heads, head] to grouped order
    [key_heads, per_key, head]."""
    shape = list(t.shape)
    tiled = t.reshape(*shape[:dim], per_key, key_heads, head, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


# --quantization gguf: which of a layer's matrices stay in the file's blocks, and the row (and,
# for ssm_out, block-column) order that puts the file's rows where the model's matrix has them.
def qwen3_next_kept_groups(f: GGUFFile, config: ModelConfig, layer: int) -> dict[str, tuple[str, ...]]:
    """A DeltaNet layer's in_proj (its GGUF parts, rows stacked in this order before reordering)
    and out_proj; {} for an attention layer (the shared qkv / o / MLP groups cover it)."""
    if config.layer_types[layer] != GATED_DELTANET:
        return {}
    if f"blk.{layer}.ssm_in.weight" in f.tensors:  # the first qwen3next converter's files
        parts: tuple[str, ...] = ("ssm_in.weight", "ssm_ba.weight")
    elif f"blk.{layer}.ssm_ba.weight" in f.tensors:
        parts = ("attn_qkv.weight", "attn_gate.weight", "ssm_ba.weight")
    else:
        parts = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")
    return {"gdn.in_proj": parts, "gdn.out_proj": ("ssm_out.weight",)}


def qwen3_next_row_order(config: ModelConfig, name: str, parts: list[tuple[str, int]]) -> "torch.Tensor":
    """For a kept matrix `name` stacked from `parts` ((GGUF name, rows) in order): the stacked
    row each of the model's rows comes from."""
    import torch

    stacked = torch.arange(sum(n for _, n in parts), dtype=torch.float64)
    if name == "qkv_weight":  # attn_q interleaves each head's query and gate rows: gates go last
        q = 2 * config.num_heads * config.head_dim
        heads = stacked[:q].view(config.num_heads, 2, config.head_dim)
        return torch.cat([heads[:, 0].reshape(-1), stacked[q:], heads[:, 1].reshape(-1)]).long()
    pieces, start = [], 0
    for part, rows in parts:
        index = stacked[start : start + rows].view(rows, 1)
        pieces += [p.reshape(-1) for p in qwen3_next_from_gguf("blk.0." + part, index, config)]
        start += rows
    return torch.cat(pieces).long()


def qwen3_next_block_columns(config: ModelConfig, part: str, cols: int, block: int) -> "torch.Tensor | None":
    """ssm_out's columns in the model's order, as an order of whole blocks of `block` values;
    None when the reordering moves values within a block (the matrix is then dequantised)."""
    import torch

    order = qwen3_next_from_gguf("blk.0." + part, torch.arange(cols, dtype=torch.float64).view(1, cols),
                                 config)[0].view(-1).long()
    if cols % block:
        return None
    runs = order.view(-1, block)
    starts = runs[:, 0]
    if bool((starts % block).any()) or not torch.equal(runs - starts[:, None], torch.arange(block).expand_as(runs)):
        return None
    return starts // block


def qwen3_next_reorder_blocks(f: GGUFFile, config: ModelConfig, name: str, parts: tuple[str, ...],
                              data: "torch.Tensor") -> "torch.Tensor":
    """A kept matrix's block bytes [rows, bytes per row] (its parts' rows stacked) in the model's
    row order (in_proj, a gated attention's qkv) or block-column order (out_proj)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from server.kernels.quant import QTYPES
    from server.models.gguf_transcode import TRANSCODED

    first = f.tensors[parts[0]]
    if name == "gdn.out_proj":
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[first.type_name]]
        if first.type_name in TRANSCODED:  # its blocks were rewritten (gguf_transcode): their size now
            nbytes = QTYPES[TRANSCODED[first.type_name]].nbytes
        order = qwen3_next_block_columns(config, parts[0].split(".", 2)[2], int(first.shape[1]), block)
        if order is None:  # the file's column order stays; the layer gathers its input to match (qwen3_next_out_columns)
            return data
        return data.view(data.shape[0], -1, nbytes)[:, order].reshape(data.shape[0], -1)
    if name not in ("qkv_weight", "gdn.in_proj"):
        return data
    rows = [(p.split(".", 2)[2], int(f.tensors[p].shape[0])) for p in parts]
    return data[qwen3_next_row_order(config, name, rows)]


def qwen3_next_keepable(f: GGUFFile, config: ModelConfig, name: str, parts: tuple[str, ...]) -> bool:
    """Whether the kept matrix can be built from the file's blocks: always, since ssm_out's rows
    are whole blocks; where its value heads' columns do not fill whole blocks (Qwen3.5's heads of
    128 in K-quants' 256-value blocks) the blocks stay in the file's column order and the layer
    gathers its input into that order instead (qwen3_next_out_columns)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if name != "gdn.out_proj":
        return True
    t = f.tensors[parts[0]]
    return int(t.shape[1]) % GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]][0] == 0


def qwen3_next_out_columns(f: GGUFFile, config: ModelConfig, parts: tuple[str, ...]) -> "torch.Tensor | None":
    """For a kept ssm_out whose blocks could not be moved into the model's column order: the
    model-order column each of the file's columns takes (int64 [value_dim]), to gather out_proj's
    input with (GatedDeltaNet.out_columns); None when the blocks were moved (or need no move)."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    t = f.tensors[parts[0]]
    part, cols = parts[0].split(".", 2)[2], int(t.shape[1])
    if qwen3_next_block_columns(config, part, cols, GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]][0]) is not None:
        return None
    # Model column j holds the file's column order[j]; file column c is then fed model column argsort(order)[c].
    order = qwen3_next_from_gguf("blk.0." + part, torch.arange(cols, dtype=torch.float64).view(1, cols), config)[0]
    return torch.argsort(order.view(-1).long())
