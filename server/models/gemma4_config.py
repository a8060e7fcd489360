"""Gemma 4 (text): its Hugging Face and GGUF translations into ModelConfig.

A Gemma 3 layer (four norms, GELU-tanh, per-head q/k norm, local and global layers with their own
RoPE) plus the parts Gemma 4 adds, each a general ModelConfig field:
  * global layers have their own head size and KV heads (`layer_head_dims`, `layer_kv_heads`) and
    a "proportional" RoPE over the whole head of which only a fraction rotates;
  * norms scale by w (not 1 + w); the attention scale is 1 (q and k are RMS-normed);
  * values are RMS-normed per head without a weight (`value_norm`); with attention_k_eq_v the
    global layers' values are their key projection (`layer_value_from_key`);
  * the last num_kv_shared_layers layers read the KV of the last earlier layer of their kind
    (`layer_kv_sources`) and, with use_double_wide_mlp, have twice the MLP width;
  * per-layer input embeddings (`per_layer_input_size`) and a per-layer scalar on the residual.
The mixture-of-experts variant (enable_moe_block) is refused here.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from server.models.config import ModelConfig, ModelLoadError, RopeScaling, RopeSpec, UnsupportedModelError
from server.models.gguf_config import gguf_base
from server.models.gguf_file import GGUFFile
from server.models.hf_config import HFFields, hf_base, rope_spec

_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}


def kv_sources(sliding: list[bool], num_shared: int, where: str) -> tuple[Optional[int], ...]:
    """transformers' kv_sharing_modes: layers from n - num_shared on read the KV of the last
    earlier layer of the same kind (sliding or global)."""
    n = len(sliding)
    first = n - num_shared
    if num_shared and first <= 0:
        raise ModelLoadError(f"{where}: every layer shares KV ({num_shared} of {n}); no layer writes any")
    out: list[Optional[int]] = [None] * n
    for i in range(first, n):
        same = [j for j in range(first) if sliding[j] == sliding[i]]
        if not same:
            raise ModelLoadError(f"{where}: shared layer {i} has no earlier layer of its kind to read KV from")
        out[i] = same[-1]
    return tuple(out)


def _config(base: dict[str, Any], *, sliding: list[bool], window: Optional[int], local_hd: int, global_hd: int,
            local_kv: int, global_kv: int, k_eq_v: bool, num_shared: int, double_mlp: bool, ple: int,
            ple_vocab: int, ropes: tuple[RopeSpec, RopeSpec], final_softcap: float, where: str) -> ModelConfig:
    """The parts both sources share, from the values each reads in its own spelling."""
    sources = kv_sources(sliding, num_shared, where)
    inter = base["intermediate_size"]
    return ModelConfig(**{
        **base,
        "head_dim": local_hd, "num_kv_heads": local_kv,
        "sliding_window": window,
        "layer_sliding_windows": tuple(window if s else None for s in sliding),
        "layer_head_dims": tuple(local_hd if s else global_hd for s in sliding),
        "layer_kv_heads": tuple(local_kv if s else global_kv for s in sliding),
        "layer_kv_sources": sources,
        "layer_value_from_key": tuple(k_eq_v and not s and src is None for s, src in zip(sliding, sources)),
        "layer_intermediate_sizes": tuple(inter * 2 if double_mlp and src is not None else inter for src in sources),
        "ropes": ropes, "layer_ropes": tuple(1 if s else 0 for s in sliding),  # 0 global, 1 local
        "norm_placement": "both", "norm_weight_offset": 0.0, "activation": "gelu_tanh",
        "qk_norm": True, "value_norm": True, "layer_scalar": True, "attention_scale": 1.0,
        "embedding_multiplier": base["hidden_size"] ** 0.5, "final_logit_softcap": final_softcap,
        "per_layer_input_size": ple, "per_layer_vocab_size": ple_vocab if ple else 0,
    })


def gemma4_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    """Gemma4ForCausalLM's config.json (model_type gemma4_text), or Gemma4ForConditionalGeneration's
    text_config (its language model; the vision and audio towers are not loaded)."""
    if name == "Gemma4ForConditionalGeneration":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(f"{source}: field 'text_config' must be an object for {name}")
        outer = raw
        raw = {**text, "architectures": [name], "tie_word_embeddings": outer.get("tie_word_embeddings", True)}
        for key in ("dtype", "torch_dtype", "eos_token_id", "bos_token_id"):
            if raw.get(key) is None and outer.get(key) is not None:
                raw[key] = outer[key]
    if raw.get("enable_moe_block"):
        raise UnsupportedModelError(f"{source}: field 'enable_moe_block' is true: Gemma 4's mixture-of-experts "
                                    "layers are not supported yet (dense Gemma 4 models are)")
    if raw.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(f"{source}: field 'use_bidirectional_attention' is 'all': a causal LM "
                                    "must attend causally")
    p = HFFields(raw, source)
    n = p.positive_int("num_hidden_layers")
    types = p.layer_types(n) or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types = types[:-1] + ["full_attention"]  # transformers forces the last layer global
    sliding = [t == "sliding_attention" for t in types]
    # hf_base reads the shared fields; RoPE is per layer kind with per-kind head sizes (below).
    # transformers' Gemma4TextConfig defaults: GELU-tanh, a 512-token window.
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    base = hf_base({**raw, "rope_parameters": None, "rope_scaling": None, "layer_types": types,
                    "hidden_activation": act}, source, name, activations=("gelu_tanh",))
    local_hd, local_kv = base["head_dim"], base["num_kv_heads"]
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    global_hd = p.positive_int("global_head_dim", 512)
    global_kv = p.positive_int("num_global_key_value_heads", None) if k_eq_v else None
    global_kv = global_kv or local_kv
    overrides = raw.get("per_layer_config")
    if overrides is not None:  # transformers' serialised form: {"<layer>": {"head_dim": .., "num_key_value_heads": ..}}
        global_hd, global_kv = _per_layer_overrides(overrides, sliding, local_hd, local_kv, source)
    if base["num_heads"] % global_kv:
        raise ModelLoadError(f"{source}: num_attention_heads {base['num_heads']} is not a multiple of the global "
                             f"layers' {global_kv} KV heads")
    params = raw.get("rope_parameters") or _DEFAULT_ROPE
    ropes = []
    for kind, hd in (("full_attention", global_hd), ("sliding_attention", local_hd)):
        kind_params = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(kind_params, dict):
            raise ModelLoadError(f"{source}: field 'rope_parameters.{kind}' must be an object")
        ropes.append(rope_spec(kind_params, {}, source, f"rope_parameters.{kind}", hd, base["max_position_embeddings"]))
    ple = int(raw.get("hidden_size_per_layer_input") or 0)
    window = p.window() if "sliding_window" in raw else 512
    return _config(base, sliding=sliding, window=window, local_hd=local_hd, global_hd=global_hd,
                   local_kv=local_kv, global_kv=global_kv, k_eq_v=k_eq_v,
                   num_shared=int(raw.get("num_kv_shared_layers") or 0),
                   double_mlp=bool(raw.get("use_double_wide_mlp", False)), ple=ple,
                   ple_vocab=p.positive_int("vocab_size_per_layer_input", 262_144) if ple else 0,
                   ropes=(ropes[0], ropes[1]), final_softcap=p.number("final_logit_softcapping", None) or 0.0,
                   where=source)


def _per_layer_overrides(overrides: Any, sliding: list[bool], local_hd: int, local_kv: int,
                         source: str) -> tuple[int, int]:
    """(global head size, global KV heads) from `per_layer_config`, which must override exactly
    the global layers, all alike, and nothing but head_dim / num_key_value_heads."""
    if not isinstance(overrides, dict):
        raise ModelLoadError(f"{source}: field 'per_layer_config' must be an object")
    seen: set[tuple[int, int]] = set()
    for key, value in overrides.items():
        if not str(key).isdigit() or not isinstance(value, dict) or set(value) - {"head_dim", "num_key_value_heads"}:
            raise UnsupportedModelError(f"{source}: field 'per_layer_config' entry {key!r}: only layer indices "
                                        "overriding head_dim and num_key_value_heads are supported")
        i = int(key)
        if i >= len(sliding) or sliding[i]:
            raise UnsupportedModelError(f"{source}: field 'per_layer_config' overrides layer {i}, which is not a "
                                        "global layer")
        seen.add((int(value.get("head_dim", local_hd)), int(value.get("num_key_value_heads", local_kv))))
    if len(seen) > 1 or len(overrides) != sliding.count(False):
        raise UnsupportedModelError(f"{source}: field 'per_layer_config' must give every global layer the same shape")
    return seen.pop() if seen else (local_hd, local_kv)


def gemma4_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's `gemma4` keys: key_length / key_length_swa (global / local head size),
    head_count_kv and feed_forward_length per layer or one value, the sliding pattern as one bool
    per layer, shared_kv_layers, embedding_length_per_layer_input, and the global layers'
    proportional RoPE as a rope_freqs tensor (1 for a rotating pair, 1e30 for a still one)."""
    k = arch + "."
    n = f.get_int(k + "block_count")
    kv_list = _int_per_layer(f, k + "attention.head_count_kv", n)
    ff_list = _int_per_layer(f, k + "feed_forward_length", n)
    overrides = {k + "attention.head_count_kv": kv_list[0], k + "feed_forward_length": min(ff_list),
                 k + "rope.dimension_count": None}
    # gguf_base reads the shared keys from a view with one value for the per-layer ones and without
    # rope_freqs (read below: here it is proportional RoPE, not llama3-style factors).
    metadata = {**{key: v for key, v in f.metadata.items() if key not in overrides},
                **{key: v for key, v in overrides.items() if v is not None}}
    tensors = {name: t for name, t in f.tensors.items() if name != "rope_freqs.weight"}
    base = gguf_base(GGUFFile(f.path, metadata, tensors), arch, "Gemma4ForCausalLM")
    pattern = f.metadata.get(k + "attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n or not all(isinstance(b, bool) for b in pattern):
        raise ModelLoadError(f"{f.path}: metadata key {k + 'attention.sliding_window_pattern'!r} must list {n} "
                             "booleans")
    sliding = list(pattern)
    global_hd = f.get_int(k + "attention.key_length")
    local_hd = f.get_int(k + "attention.key_length_swa", global_hd)
    local_kv = next((kv for kv, s in zip(kv_list, sliding) if s), kv_list[0])
    global_kv = next((kv for kv, s in zip(kv_list, sliding) if not s), local_kv)
    num_shared = f.get_int(k + "attention.shared_kv_layers", 0, positive=False)
    double = max(ff_list) != min(ff_list)
    # Global layers without an attn_v tensor (and not sharing KV) take their values from the keys.
    first_shared = n - num_shared
    k_eq_v = any(not s and i < first_shared and f"blk.{i}.attn_v.weight" not in f.tensors
                 for i, s in enumerate(sliding))
    local_rope = RopeSpec(f.get_float(k + "rope.freq_base_swa", 10000.0), None, local_hd)
    global_rope = RopeSpec(base["ropes"][0].theta, _proportional(f, global_hd), global_hd)
    ple = f.get_int(k + "embedding_length_per_layer_input", 0, positive=False)
    ple_table = f.tensors.get("per_layer_token_embd.weight")
    return _config({**base, "intermediate_size": min(ff_list)}, sliding=sliding,
                   window=f.get_int(k + "attention.sliding_window"), local_hd=local_hd, global_hd=global_hd,
                   local_kv=local_kv, global_kv=global_kv, k_eq_v=k_eq_v, num_shared=num_shared, double_mlp=double,
                   ple=ple, ple_vocab=ple_table.shape[0] if ple_table is not None else base["vocab_size"],
                   ropes=(global_rope, local_rope), final_softcap=f.get_float(k + "final_logit_softcapping", 0.0),
                   where=str(f.path))


def _int_per_layer(f: GGUFFile, key: str, n: int) -> list[int]:
    raw = f.metadata.get(key)
    if isinstance(raw, list):
        if len(raw) != n or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in raw):
            raise ModelLoadError(f"{f.path}: metadata key {key!r} must list {n} positive integers")
        return list(raw)
    return [f.get_int(key)] * n


def _proportional(f: GGUFFile, head_dim: int) -> Optional[RopeScaling]:
    """The rope_freqs tensor as llama.cpp's converter writes it for proportional RoPE: per
    frequency pair, 1.0 (rotates) or 1e30 (still); the rotating ones come first."""
    t = f.tensors.get("rope_freqs.weight")
    if t is None:
        return None
    values = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if t.type_name != "F32" or values.shape != (head_dim // 2,):
        raise ModelLoadError(f"{f.path}: tensor 'rope_freqs.weight' must be F32 of shape [{head_dim // 2}]")
    rotating = int((values == 1.0).sum())
    if not np.all(values[:rotating] == 1.0) or not np.all(values[rotating:] >= 1e20):
        raise UnsupportedModelError(f"{f.path}: tensor 'rope_freqs.weight' is not a proportional-RoPE mask "
                                    "(1 for the leading pairs, 1e30 for the rest)")
    return RopeScaling("proportional", 1.0, proportion=2 * rotating / head_dim)
