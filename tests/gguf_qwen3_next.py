"""The test side of llama.cpp's GGUF layout for the Gated DeltaNet hybrids (`qwen3next`,
`qwen35`, `qwen35moe`), written from llama.cpp's converter independently of
server.models.qwen3_next_gguf: what tests.gguf_files.write_gguf adds for these folders, and the
way back (`hf_state_from_gguf`), used to give transformers the exact weights a quantised file holds.

The converter (Qwen3NextModel, and for Qwen3.5 its value-head reordering subclass): every norm but
the DeltaNet's gated one stored as 1 + w; A_log as -exp(A_log) (`ssm_a`); dt_bias as `ssm_dt.bias`;
the conv kernel squeezed (`ssm_conv1d`, always F32); Qwen3-Next's per-key-head in_proj_qkvz split
into `attn_qkv` [all q, all k, all v] and `attn_gate` (z), its in_proj_ba kept as `ssm_ba`;
Qwen3.5's in_proj_qkv / z / b / a as `attn_qkv` / `attn_gate` / `ssm_beta` / `ssm_alpha`, with
its value heads reordered from grouped (per key head) to tiled order when there are fewer key
heads than value heads; the `{arch}.ssm.*` sizes and one recurrent bool per layer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# transformers model_type -> llama.cpp general.architecture
QWEN3_NEXT_TYPES = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}
_RENAMES = {"in_proj_qkv.weight": "attn_qkv.weight", "in_proj_z.weight": "attn_gate.weight",
            "in_proj_b.weight": "ssm_beta.weight", "in_proj_a.weight": "ssm_alpha.weight",
            "in_proj_ba.weight": "ssm_ba.weight", "conv1d.weight": "ssm_conv1d.weight", "dt_bias": "ssm_dt.bias",
            "A_log": "ssm_a", "norm.weight": "ssm_norm.weight", "out_proj.weight": "ssm_out.weight"}


def qwen3_next_metadata(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The converter's `{arch}.ssm.*` keys, recurrent layers and attention interval; for Qwen3.5
    also `{arch}.rope.dimension_sections`, which llama.cpp's qwen35 / qwen35moe loaders require (the
    converter writes the config's mrope_section, or transformers' default [11, 11, 10]; text tokens
    give every section the same position, so it is plain RoPE)."""
    extra: dict[str, Any] = {}
    if arch != "qwen3next":
        sections = list((cfg.get("rope_parameters") or {}).get("mrope_section") or [11, 11, 10])
        extra[f"{arch}.rope.dimension_sections"] = (sections + [0, 0, 0, 0])[:4]
    return {**extra,
        f"{arch}.ssm.conv_kernel": cfg["linear_conv_kernel_dim"],
        f"{arch}.ssm.state_size": cfg["linear_key_head_dim"],
        f"{arch}.ssm.group_count": cfg["linear_num_key_heads"],
        f"{arch}.ssm.time_step_rank": cfg["linear_num_value_heads"],
        f"{arch}.ssm.inner_size": cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
        f"{arch}.attention.recurrent_layers": [t == "linear_attention" for t in cfg["layer_types"]],
        f"{arch}.full_attention_interval": cfg.get("full_attention_interval") or 4,
    }


def _sizes(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    return (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"])


def _reorder(a: np.ndarray, dim: int, hk: int, r: int, d: int, to_tiled: bool) -> np.ndarray:
    """Value heads along `dim`: grouped [hk, r, d] <-> tiled [r, hk, d]."""
    shape = list(a.shape)
    split = [hk, r, d] if to_tiled else [r, hk, d]
    return np.swapaxes(a.reshape(*shape[:dim], *split, *shape[dim + 1:]), dim, dim + 1).reshape(shape)


def qwen3_next_tensors(state: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Pops every linear_attn.* tensor from `state` and returns them under their GGUF names, as
    the converter writes them; adds 1 to the 1 + w norms left in `state`."""
    qwen35 = cfg["model_type"] != "qwen3_next"
    hk, hv, dk, dv = _sizes(cfg)
    r = hv // hk
    for name in [n for n in state if n.endswith("norm.weight") and ".linear_attn." not in n]:
        state[name] = state[name].float() + 1.0
    out: dict[str, np.ndarray] = {}
    for name in [n for n in state if ".linear_attn." in n]:
        layer, part = name.split(".")[2], name.split(".linear_attn.")[1]
        a = state.pop(name).float().numpy()
        blk = f"blk.{layer}."
        if part == "in_proj_qkvz.weight":  # per key head [q, k, v, z] -> all q, all k, all v; z apart
            q, k, v, z = np.split(a.reshape(hk, -1, a.shape[1]), np.cumsum([dk, dk, r * dv])[:3], axis=1)
            out[blk + "attn_qkv.weight"] = np.concatenate([x.reshape(-1, a.shape[1]) for x in (q, k, v)])
            out[blk + "attn_gate.weight"] = z.reshape(-1, a.shape[1])
            continue
        if part == "A_log":
            a = -np.exp(a)
        if part == "conv1d.weight":
            a = a.squeeze(1)
        if qwen35 and r > 1:
            if part in ("in_proj_qkv.weight", "conv1d.weight"):
                a = np.concatenate([a[: 2 * hk * dk], _reorder(a[2 * hk * dk:], 0, hk, r, dv, True)])
            elif part == "in_proj_z.weight":
                a = _reorder(a, 0, hk, r, dv, True)
            elif part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
                a = _reorder(a, 0, hk, r, 1, True)
            elif part == "out_proj.weight":
                a = _reorder(a, 1, hk, r, dv, True)
        out[blk + _RENAMES[part]] = a
    return out


def hf_state_from_gguf(path: Path, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The transformers checkpoint a qwen3next / qwen35 / qwen35moe file holds (its values
    dequantised with the `gguf` package, every converter step undone), to run transformers on
    exactly the weights of a quantised file."""
    from gguf import GGUFReader, quants

    from tests.gguf_files import _HF_TO_GGUF_BLOCK, _HF_TO_GGUF_GLOBAL, _MOE_NAMES

    qwen35 = cfg["model_type"] != "qwen3_next"
    hk, hv, dk, dv = _sizes(cfg)
    r = hv // hk
    block = {g: h for h, g in _HF_TO_GGUF_BLOCK.items() if not h.startswith(("pre_", "self_attn.qkv", "mlp.gate_up"))}
    block.update({g: "mlp." + h for h, g in _MOE_NAMES.items()})
    block["post_attention_norm.weight"] = "post_attention_layernorm.weight"
    gdn = {g: h for h, g in _RENAMES.items()}
    glob = {g: h for h, g in _HF_TO_GGUF_GLOBAL.items()}
    out: dict[str, torch.Tensor] = {}
    for t in GGUFReader(str(path)).tensors:
        a = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim == 1 and len(t.shape) > 1 else a
        if t.name in glob:
            name = glob[t.name]
        else:
            _, layer, part = t.name.split(".", 2)
            prefix = f"model.layers.{layer}."
            if part in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
                proj = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                        "ffn_down_exps.weight": "down_proj"}[part]
                for e in range(a.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.{proj}.weight"] = torch.from_numpy(a[e].copy())
                continue
            if part in gdn:
                h = gdn[part]
                if qwen35 and r > 1:
                    if h in ("in_proj_qkv.weight", "conv1d.weight"):
                        a = np.concatenate([a[: 2 * hk * dk], _reorder(a[2 * hk * dk:], 0, r, hk, dv, False)])
                    elif h == "in_proj_z.weight":
                        a = _reorder(a, 0, r, hk, dv, False)
                    elif h in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
                        a = _reorder(a, 0, r, hk, 1, False)
                    elif h == "out_proj.weight":
                        a = _reorder(a, 1, r, hk, dv, False)
                if h == "A_log":
                    a = np.log(-a.astype(np.float64)).astype(np.float32)
                if h == "conv1d.weight":
                    a = a[:, None, :]
                if not qwen35 and h == "in_proj_qkv.weight":  # back to Qwen3-Next's per-key-head qkvz
                    z = out.pop(prefix + "linear_attn.in_proj_z.weight", None)
                    if z is None:  # pairs with its attn_gate when that comes
                        out[prefix + "linear_attn.in_proj_qkv.weight"] = torch.from_numpy(a.copy())
                        continue
                    a, h = _qkvz(a, z.numpy(), cfg), "in_proj_qkvz.weight"
                elif not qwen35 and h == "in_proj_z.weight" and prefix + "linear_attn.in_proj_qkv.weight" in out:
                    qkv = out.pop(prefix + "linear_attn.in_proj_qkv.weight").numpy()
                    a, h = _qkvz(qkv, a, cfg), "in_proj_qkvz.weight"
                name = prefix + "linear_attn." + h
            else:
                name = prefix + block[part]
            if part == "ffn_gate_inp_shexp.weight":
                a = a.reshape(1, -1)
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            a = a - 1.0
        out[name] = torch.from_numpy(np.array(a, dtype=np.float32))
    return out


def _qkvz(qkv: np.ndarray, z: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """[all q, all k, all v] and z -> Qwen3-Next's in_proj_qkvz, [q, k, v, z] per key head."""
    hk, hv, dk, dv = _sizes(cfg)
    r, cols = hv // hk, qkv.shape[1]
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
    parts = [q.reshape(hk, dk, cols), k.reshape(hk, dk, cols), v.reshape(hk, r * dv, cols), z.reshape(hk, r * dv, cols)]
    return np.concatenate(parts, axis=1).reshape(-1, cols)
