"""load_gguf_model: turn a GGUF file of any registered family into a runnable model.

It owns the GGUF -> Hugging Face tensor-name map (which depends on the family's norm placement
and whether its checkpoint fuses qkv / gate_up), dequantising each tensor at load (with the
`gguf` package's numpy dequantisers) to the serving dtype -- or, with keep_quantized, leaving the
matrices `gguf_blocks` can run in their block format as they are -- and undoing the Q/K row permutation
llama.cpp's converter applies to the attention weights of the families it runs with interleaved
RoPE (Llama, Mistral, SmolLM3, Granite). Every failure names the file and
the tensor: an unsupported tensor type, a missing or unexpected tensor, a shape mismatch.
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from server.models import gguf_pages
from server.models.config import ModelConfig, ModelLoadError, UnsupportedModelError
from server.models.dtype import resolve_dtype
from server.models.gguf_blocks import EMBEDDING, TABLES, build_quantized, plan_kept_matrices, unpermute_qk
from server.models.gguf_config import CONFIG_TENSORS
from server.models.gguf_file import GGUFFile, GGUFTensor
from server.models.lfm2_config import lfm2_gguf_name
from server.models.protocol import CausalLM
from server.models.qwen3_next_gguf import (
    QWEN3_NEXT_GGUF,
    QWEN3_NEXT_GGUF_PARTS,
    qwen3_next_from_gguf,
    qwen3_next_gguf_names,
    qwen3_next_out_columns,
    qwen3_next_reorder_blocks,
)
from server.models.registry import config_from_gguf, gguf_permuted_qk, model_class

# Every type the `gguf` package dequantises. With --quantization gguf, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/
# IQ4_XS/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K (and MXFP4 experts) stay in their blocks, IQ3_XXS/IQ3_S/IQ2_XXS/IQ2_XS/IQ2_S/IQ1_S/
# TQ1_0/TQ2_0 are rewritten exactly into a kernel's blocks (gguf_transcode); the float types are in
# the serving dtype.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                          "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M",
                          "IQ1_S", "TQ1_0", "TQ2_0", "MXFP4")

logger = logging.getLogger("pagewire.loader")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Gemma 4's per-layer input embeddings.
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",  # gpt-oss
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    # Gemma 4: the per-layer input block and the layer's scalar.
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "layer_output_scale.weight": "layer_scalar",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")

__all__ = ["load_gguf_model", "hf_tensor_name", "dequantize", "unpermute_qk", "SUPPORTED_TENSOR_TYPES"]


def hf_tensor_name(gguf_name: str, config: ModelConfig | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if pagewire has no use for it. `config`
    decides the names that differ by family: ffn_norm is Gemma's pre_feedforward_layernorm (its
    post_attention_layernorm is attn_post_norm), and Phi-3's ffn_up is the fused gate_up_proj."""
    if config is not None and config.model_type == "lfm2":  # its own spelling (models/lfm2_config.py)
        return lfm2_gguf_name(gguf_name, hf_tensor_name(gguf_name))
    if config is not None and config.model_type in QWEN3_NEXT_GGUF:  # the DeltaNet's (models/qwen3_next_gguf.py)
        names = qwen3_next_gguf_names(gguf_name, config)
        if names is not None:
            return names[0] if len(names) == 1 else None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    moe = _moe_tensor_names(gguf_name, config)
    if moe is not None and len(moe) == 1:
        return moe[0]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    part = m.group(2)
    name = _BLOCK_NAMES[part]
    if config is not None and config.norm_placement == "both" and part == "ffn_norm.weight":
        name = "pre_feedforward_layernorm.weight"
    if config is not None and config.fused_checkpoint and part == "ffn_up.weight":
        name = "mlp.gate_up_proj.weight"
    return f"model.layers.{m.group(1)}.{name}"


# Mixture of experts: the router, Qwen2-MoE's shared expert, and the experts stacked per matrix
# ([E, I, H] gate and up, [E, H, I] down), which the loader copies into each expert's HF name.
_MOE_NAMES = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "shared_expert.down_proj.weight",
    "exp_probs_b.bias": "gate.e_score_correction_bias",  # a sigmoid router's selection bias (dots1)
}
_EXPERT_PARTS = {"ffn_gate_exps.weight": ("gate_proj", "w1"), "ffn_up_exps.weight": ("up_proj", "w3"),
                 "ffn_down_exps.weight": ("down_proj", "w2")}


def _extra_layer(gguf_name: str, config: ModelConfig) -> bool:
    """A `blk.N.*` tensor of one of the checkpoint_extra_layers past the model's layers."""
    m = _BLOCK.fullmatch(gguf_name)
    return m is not None and config.num_layers <= int(m.group(1)) < config.num_layers + config.checkpoint_extra_layers


def _moe_tensor_names(gguf_name: str, config: ModelConfig | None) -> list[str] | None:
    """The HF names of an MoE tensor: one for the router and the shared expert, one per expert
    for a stacked `ffn_*_exps` tensor; None for any other tensor."""
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or config is None or not config.num_experts or config.moe_checkpoint == "gpt_oss":
        return None  # gpt-oss: its MoE tensors have targets of their own (_gpt_oss_targets)
    mixtral = config.moe_checkpoint == "mixtral"
    prefix = f"model.layers.{m.group(1)}." + ("block_sparse_moe." if mixtral else "mlp.")
    part = m.group(2)
    if part in _MOE_NAMES:  # "deepseek" (dots1) names its ungated shared experts shared_experts.*
        name = _MOE_NAMES[part]
        if config.moe_checkpoint == "ernie" and part == "exp_probs_b.bias":
            return [prefix + "moe_statics.e_score_correction_bias"]
        return [prefix + (name.replace("shared_expert.", "shared_experts.")
                          if config.moe_checkpoint in ("deepseek", "ernie") else name)]
    if part in _EXPERT_PARTS:
        hf = _EXPERT_PARTS[part][1 if mixtral else 0]
        return [f"{prefix}experts.{e}.{hf}.weight" for e in range(config.num_experts)]
    return None


def dequantize(t: GGUFTensor, path: Path) -> np.ndarray:
    """float32 numpy array of `t.shape`. Raises UnsupportedModelError naming the type for others."""
    if t.type_name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"{path}: tensor {t.name!r} has type {t.type_name}, which pagewire cannot load; "
            f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    from gguf import quants

    try:
        values = np.asarray(quants.dequantize(t.data, t.qtype), dtype=np.float32).reshape(t.shape)
        # F32 comes back as a view of the read-only memory map; torch wants memory it may write.
        values = values if values.flags.writeable else values.copy()
        gguf_pages.release(t.data)  # copied: its mapped pages need not stay resident (load peak)
        return values
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {t.name!r} ({t.type_name}, shape {list(t.shape)}) is corrupt: {e}") from None


def load_gguf_model(
    path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu", keep_quantized: bool = False
) -> tuple[CausalLM, ModelConfig]:
    """Load a GGUF file of a registered family (server.models.registry), dequantised to `dtype`.

    Args:
        path: the .gguf file.
        dtype: "auto" (the file's float type; float32 for quantised files), "float32", "bfloat16", "float16".
        device: where the parameters live.
        keep_quantized: keep every matrix whose tensors are Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/IQ4_XS/Q2_K/Q3_K/Q4_K/Q5_K/
            Q6_K as a QuantizedWeight of the file's blocks (CPU only; IQ3_XXS/IQ3_S/IQ2_XXS/IQ2_XS/IQ2_S/IQ1_S/IQ1_M/TQ1_0/TQ2_0
            too, their blocks rewritten exactly: gguf_transcode), the token embedding table included
            (its rows dequantised per step); norms and other types are dequantised to `dtype` as usual.
    Returns:
        (model, config), the model in eval mode with requires_grad off.
    Raises:
        ModelFileNotFoundError, UnsupportedModelError (architecture, tensor type, RoPE), or
        ModelLoadError naming the file and the tensor or metadata key.
    """
    f = GGUFFile.open(path)
    config = config_from_gguf(f)
    torch_dtype = resolve_dtype(dtype, config)
    model: Any = model_class(config)(config, torch_dtype, torch.device(device))
    targets = model.checkpoint_tensors()
    by_gguf = _gpt_oss_targets(model, targets) if config.moe_checkpoint == "gpt_oss" else {}
    permute = gguf_permuted_qk(config)
    # Tensors the file may carry that the model does not use (Gemma 4's shared-KV layers' K/V).
    ignored = model.ignored_checkpoint_tensors() if hasattr(model, "ignored_checkpoint_tensors") else frozenset()
    if keep_quantized and torch.device(device).type != "cpu":
        raise ValueError(f"quantization: 'gguf' runs on CPU only, got device {device!r}")
    kept = plan_kept_matrices(f, config, model.lm_head is model.embed_tokens) if keep_quantized else []
    # Their float destinations are skipped (and replaced below); a tied lm_head's token_embd fills
    # the embedding unless the table stays in its blocks too (EMBEDDING).
    skip = {hf_tensor_name(p, config) for m in kept for p in m.parts if p != "token_embd.weight" or m.name == EMBEDDING}
    kept_parts = {p for m in kept for p in m.parts}
    loaded: set[str] = set()
    bar = tqdm(total=len(f.tensors), desc="Loading GGUF", unit="tensor", file=sys.stderr,
               disable=not sys.stderr.isatty())
    with bar, torch.no_grad():
        for t in f.tensors.values():
            bar.update(1)
            if t.name in CONFIG_TENSORS:
                continue  # read by the translation (longrope's factors)
            if config.checkpoint_extra_layers and _extra_layer(t.name, config):
                continue  # a layer the model does not run (GLM-4.5's nextn / MTP layer)
            if t.name in by_gguf:  # gpt-oss's router and stacked experts (and their biases)
                _load_direct(f, t, by_gguf[t.name], t.name in kept_parts)
                loaded.add(t.name)
                continue
            gdn = qwen3_next_gguf_names(t.name, config) if config.model_type in QWEN3_NEXT_GGUF else None
            if gdn is not None:  # Gated DeltaNet tensors (or a skipped multi-token-prediction layer's)
                _load_gdn(f, t, gdn, config, targets, loaded, t.name in kept_parts)
                continue
            experts = _moe_tensor_names(t.name, config)
            if experts is not None and len(experts) > 1:
                _load_experts(f, t, experts, targets, loaded, kept_parts)
                continue
            name = hf_tensor_name(t.name, config)
            if name is None:
                raise ModelLoadError(
                    f"unexpected tensor {t.name!r} in {f.path}: the {config.model_type} architecture does not use it"
                )
            target = targets.get(name)
            if target is None and name in ignored:
                continue
            if target is None:
                raise ModelLoadError(
                    f"unexpected tensor {t.name!r} in {f.path}: this model's config does not use it ({name})"
                )
            # ([H]: llama.cpp's shexp gate; a squeezed tensor already in dest's layout: LFM2's conv kernel)
            if t.shape != target.shape and (1, *t.shape) != target.shape and t.shape != tuple(target.dest.shape):
                raise ModelLoadError(
                    f"tensor {t.name!r} in {f.path} has shape {list(t.shape)}, expected {list(target.shape)}"
                )
            if name in skip:
                loaded.add(name)
                continue
            tensor = torch.from_numpy(dequantize(t, f.path))
            if target.convert is not None and t.shape == target.shape:  # checkpoint layout -> dest's
                tensor = target.convert(tensor)
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                tensor = unpermute_qk(tensor, config.num_heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                tensor = unpermute_qk(tensor, config.num_kv_heads)
            target.dest.copy_(tensor)  # converts to the serving dtype/device
            loaded.add(name)
    missing = [name for name in [*targets, *by_gguf] if name not in loaded]
    if missing:
        raise ModelLoadError(
            f"{f.path}: tensor {_gguf_name(missing[0], config)!r} ({missing[0]}) not found"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    for m in kept:
        if m.name in TABLES:  # planned after the lm_head: one QuantizedWeight when both are token_embd's
            head = next((h for h in kept if h.name == "lm_head"), None)
            shared = m.name == EMBEDDING and head is not None and head.parts == m.parts
            table = model.lm_head if shared else build_quantized(f, m, {})
            gguf_pages.release(f.tensors[m.parts[0]].data)
            model._parameters.pop(m.name, None)  # the never-filled float table is freed
            setattr(model, m.name, table)  # rows gathered and dequantised per step (linear_route.embedding)
            continue
        kv_heads = config.kv_heads_of(m.layer) if m.layer is not None else config.num_kv_heads
        heads = {"attn_q.weight": config.num_heads, "attn_k.weight": kv_heads} if permute else {}
        module = model if m.layer is None else model._layers[m.layer]
        owner, _, attr = m.name.rpartition(".")  # "moe.experts_gate_up": the layer's SparseMoE
        module = getattr(module, owner) if owner else module
        reorder = ((lambda k, data: qwen3_next_reorder_blocks(f, config, k.name, k.parts, data))
                   if config.model_type in QWEN3_NEXT_GGUF else None)
        qw = build_quantized(f, m, heads, reorder).for_kernels()  # this CPU's fastest layout of the same bytes
        for part in m.parts:  # copied out: the mapped pages need not stay resident (load peak)
            gguf_pages.release(f.tensors[part].data)
        # A registered parameter can only be reassigned to a Parameter: unregister it first, so
        # the never-filled float matrix is freed.
        module._parameters.pop(attr, None)
        setattr(module, attr, qw)
        if m.name == "gdn.out_proj":  # a Qwen3.5 ssm_out kept in the file's column order
            module.out_columns = qwen3_next_out_columns(f, config, m.parts)
    return model, config


def _load_experts(f: GGUFFile, t: GGUFTensor, names: list[str], targets: dict[str, Any], loaded: set[str],
                  kept_parts: set[str]) -> None:
    """A stacked `ffn_*_exps` tensor [E, N, K] into each expert's target (or only marked loaded
    when --quantization gguf keeps its blocks)."""
    for name in names:
        target = targets.get(name)
        if target is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {f.path}: this model's config does not use it ({name})")
        if tuple(t.shape) != (len(names), *target.shape):
            raise ModelLoadError(f"tensor {t.name!r} in {f.path} has shape {list(t.shape)}, expected "
                                 f"{[len(names), *target.shape]}")
    if t.name not in kept_parts:
        values = torch.from_numpy(dequantize(t, f.path))
        for e, name in enumerate(names):
            targets[name].dest.copy_(values[e])
    loaded.update(names)


def _load_gdn(f: GGUFFile, t: GGUFTensor, names: tuple[str, ...], config: ModelConfig, targets: dict[str, Any],
              loaded: set[str], kept: bool) -> None:
    """A Gated DeltaNet tensor of a qwen3next / qwen35 / qwen35moe file into its targets, in
    transformers' layout (qwen3_next_from_gguf); none for a multi-token-prediction layer's; only
    marked loaded when --quantization gguf keeps its blocks."""
    if not names:
        return
    if kept:
        loaded.update(names)
        return
    for name, tensor in zip(names, qwen3_next_from_gguf(t.name, torch.from_numpy(dequantize(t, f.path)), config)):
        target = targets.get(name)
        if target is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {f.path}: this model's config does not use it ({name})")
        if tuple(tensor.shape) == tuple(target.shape) and target.convert is not None:
            tensor = target.convert(tensor)
        if tuple(tensor.shape) != tuple(target.dest.shape):
            raise ModelLoadError(f"tensor {t.name!r} in {f.path} has shape {list(t.shape)}, which does not give "
                                 f"{name} its shape {list(target.shape)}")
        target.dest.copy_(tensor)
        loaded.add(name)


def _gpt_oss_targets(model: Any, targets: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's MoE targets by GGUF name (SparseMoE.gguf_tensors: llama.cpp stores gate and up
    apart, the checkpoint interleaves them); their HF-named targets leave `targets`."""
    out: dict[str, Any] = {}
    for i, layer in enumerate(model._layers):
        if layer.moe is None:
            continue
        prefix = f"model.layers.{i}.mlp."
        for name in [n for n in targets if n.startswith(prefix)]:
            del targets[name]
        out.update(layer.moe.gguf_tensors(i))
    return out


def _load_direct(f: GGUFFile, t: GGUFTensor, target: Any, kept: bool) -> None:
    """One tensor into a target named by its GGUF name, shape checked (only checked when
    --quantization gguf keeps its blocks)."""
    if tuple(t.shape) != tuple(target.shape):
        raise ModelLoadError(f"tensor {t.name!r} in {f.path} has shape {list(t.shape)}, expected {list(target.shape)}")
    if not kept:
        target.dest.copy_(torch.from_numpy(dequantize(t, f.path)))


def _gguf_name(hf_name: str, config: ModelConfig) -> str:
    """The GGUF spelling of an HF tensor name, for error messages."""
    for g, h in _GLOBAL_NAMES.items():
        if h == hf_name:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m:
        for part in [*_BLOCK_NAMES, *QWEN3_NEXT_GGUF_PARTS]:
            if hf_tensor_name(f"blk.{m.group(1)}.{part}", config) == hf_name:
                return f"blk.{m.group(1)}.{part}"
    return hf_name
