"""The supported families: one registry entry each, with its Hugging Face and GGUF translations.

Each translation starts from the shared reading (`hf_base`, `gguf_base`: sizes, heads, RoPE,
biases, special ids) and overrides the parts its family changes. A family the parts of
ModelConfig express needs nothing else: no model class, no loader code.

Where llama.cpp hard-wires a choice instead of writing a metadata key (Gemma's attention scale
and sliding-window period, SmolLM3's NoPE period, Gemma 3's local RoPE base), the GGUF
translation follows llama.cpp's rule, so a file from its converter means what llama.cpp runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from server.models.architecture import Architecture
from server.models.config import ModelConfig, ModelLoadError, RopeSpec, UnsupportedModelError
from server.models.ernie45_moe_config import ernie45_moe_gguf, ernie45_moe_hf
from server.models.gemma4_config import gemma4_gguf, gemma4_hf
from server.models.gguf_config import gguf_base, gguf_windows
from server.models.gguf_file import GGUFFile
from server.models.hf_config import HFFields, hf_base, windows
from server.models.lfm2_config import lfm2_gguf, lfm2_hf
from server.models.qwen3_next_config import QWEN3_NEXT_ARCHITECTURES, qwen3_next_hf
from server.models.qwen3_next_gguf import QWEN3_NEXT_GGUF, qwen3_next_gguf
from server.models.sigmoid_moe_config import dots1_gguf, dots1_hf, glm4_moe_gguf, glm4_moe_hf


def _every(n: int) -> list[bool]:
    return [True] * n


def _period(n: int, period: int) -> list[bool]:
    """Layers i with (i + 1) % period != 0 slide: transformers' sliding_window_pattern rule."""
    return [(i + 1) % period != 0 for i in range(n)]


# -- Llama, Mistral, Qwen2, Qwen3 ------------------------------------------------------------------
def _llama_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    return ModelConfig(**hf_base(raw, source, name))


def _mistral_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p = HFFields(raw, source)
    return ModelConfig(**{**base, **windows(p, base["num_layers"], p.window(), _every(base["num_layers"]))})


def _qwen_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p, n = HFFields(raw, source), base["num_layers"]
    # Qwen configs carry a sliding_window value even when it is switched off; when on, only
    # layers from max_window_layers on slide.
    window = p.window() if raw.get("use_sliding_window", False) else None
    first = raw.get("max_window_layers", 28)
    parts = windows(p, n, window, [i >= first for i in range(n)])
    if name == "Qwen2ForCausalLM":  # always q/k/v bias and never an o_proj bias
        return ModelConfig(**{**base, **parts, "qkv_bias": True, "o_bias": False})
    return ModelConfig(**{**base, **parts, "qk_norm": True})


def _llama_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM"}
    base = gguf_base(f, arch, names[arch])
    if arch == "llama" and f.get_int("llama.expert_count", 0, positive=False):  # Mixtral: ffn_*_exps tensors
        return _moe_gguf(f, arch)
    if arch in ("qwen2", "qwen3"):
        # Qwen files carry no per-layer pattern; llama.cpp runs them without a window.
        return ModelConfig(**{**base, "qkv_bias": base["qkv_bias"] or arch == "qwen2", "qk_norm": arch == "qwen3"})
    return ModelConfig(**{**base, **gguf_windows(f, arch, base["num_layers"], None)})


# -- Gemma 2, Gemma 3 ------------------------------------------------------------------------------
def _gemma_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name, activations=("gelu_tanh",))
    p, n = HFFields(raw, source), base["num_layers"]
    gemma3 = name == "Gemma3ForCausalLM"
    period = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)) if gemma3 else 2
    parts = dict(
        windows(p, n, p.window(), _period(n, period)),
        norm_placement="both", norm_weight_offset=1.0,
        attention_scale=p.number("query_pre_attn_scalar", 256.0) ** -0.5,
        # transformers' Gemma 3 attention does not apply attn_logit_softcapping; Gemma 2's does.
        attn_logit_softcap=0.0 if gemma3 else p.number("attn_logit_softcapping", None) or 0.0,
        final_logit_softcap=p.number("final_logit_softcapping", None) or 0.0,
        embedding_multiplier=base["hidden_size"] ** 0.5,
        qk_norm=gemma3,
    )
    if gemma3 and not isinstance((raw.get("rope_parameters") or {}).get("full_attention"), dict):
        # transformers 4 layout: rope_theta/rope_scaling for global layers, rope_local_base_freq local.
        glob = base["ropes"][0]
        local = RopeSpec(p.number("rope_local_base_freq", 10000.0), None, glob.rotary_dim)
        slide = parts["layer_sliding_windows"]
        parts.update(ropes=(glob, local), layer_ropes=tuple(1 if w else 0 for w in slide))
    return ModelConfig(**{**base, **parts})


def _gemma_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    gemma3 = arch == "gemma3"
    base = gguf_base(f, arch, "Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM")
    n, k = base["num_layers"], arch + "."
    parts: dict[str, Any] = dict(
        gguf_windows(f, arch, n, 6 if gemma3 else 2),
        norm_placement="both", activation="gelu_tanh",  # llama.cpp's converter stored 1 + w already
        embedding_multiplier=base["hidden_size"] ** 0.5, qk_norm=gemma3,
        attn_logit_softcap=0.0 if gemma3 else f.get_float(k + "attn_logit_softcapping", 0.0),
        final_logit_softcap=f.get_float(k + "final_logit_softcapping", 0.0),
    )
    if k + "attention.scale" not in f.metadata:
        # llama.cpp: 1/sqrt(hidden / heads) for the 27B shapes (46 / 62 layers), else 1/sqrt(head size).
        big = n == (62 if gemma3 else 46)
        parts["attention_scale"] = (base["hidden_size"] / base["num_heads"] if big else base["head_dim"]) ** -0.5
    if gemma3:  # local layers: their own base (llama.cpp's default 10000) and no scaling
        glob = base["ropes"][0]
        local = RopeSpec(f.get_float(k + "rope.freq_base_swa", 10000.0), None, glob.rotary_dim)
        parts.update(ropes=(glob, local), layer_ropes=tuple(1 if w else 0 for w in parts["layer_sliding_windows"]))
    return ModelConfig(**{**base, **parts})


# -- Phi-3 / Phi-4 ---------------------------------------------------------------------------------
def _phi3_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p = HFFields(raw, source)
    parts = windows(p, base["num_layers"], p.window(), _every(base["num_layers"]))
    return ModelConfig(**{**base, **parts, "fused_checkpoint": True, "qkv_bias": False, "o_bias": False})


def _phi3_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    base = gguf_base(f, arch, "Phi3ForCausalLM")
    return ModelConfig(**{**base, **gguf_windows(f, arch, base["num_layers"], None), "fused_checkpoint": True})


# -- OLMo 2 / OLMo 3 -------------------------------------------------------------------------------
def _olmo_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p, n = HFFields(raw, source), base["num_layers"]
    window = p.window() if name == "Olmo3ForCausalLM" else None
    parts = windows(p, n, window, _period(n, 4))
    return ModelConfig(**{**base, **parts, "norm_placement": "post", "qk_norm": True, "qk_norm_over": "projection"})


def _olmo_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    # llama.cpp files OLMo 3 under "olmo2", with the window (period 4 unless a pattern is written).
    parts = gguf_windows(f, arch, f.get_int(arch + ".block_count"), 4)
    name = "Olmo3ForCausalLM" if parts["sliding_window"] is not None else "Olmo2ForCausalLM"
    base = gguf_base(f, arch, name)
    return ModelConfig(**{**base, **parts, "norm_placement": "post", "qk_norm": True, "qk_norm_over": "projection"})


# -- SmolLM3 ---------------------------------------------------------------------------------------
def _smollm3_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p, n = HFFields(raw, source), base["num_layers"]
    use = raw.get("no_rope_layers")
    if use is None:
        interval = p.positive_int("no_rope_layer_interval", 4)
        use = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(use, list) or len(use) != n or not all(u in (0, 1) for u in use):
        raise _field_error(source, "no_rope_layers", f"must list {n} entries of 0 or 1")
    window = p.window() if raw.get("use_sliding_window", False) else None
    parts = windows(p, n, window, _every(n))
    return ModelConfig(**{**base, **parts, "layer_ropes": tuple(0 if u else None for u in use)})


def _smollm3_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    base = gguf_base(f, arch, "SmolLM3ForCausalLM")
    n = base["num_layers"]  # llama.cpp hard-wires a NoPE layer every 4th (n_no_rope_layer_step)
    return ModelConfig(**{**base, "layer_ropes": tuple(None if (i + 1) % 4 == 0 else 0 for i in range(n))})


# -- Granite 3 -------------------------------------------------------------------------------------
def _granite_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p = HFFields(raw, source)
    return ModelConfig(**{**base, "embedding_multiplier": p.number("embedding_multiplier", 1.0),
                          "attention_scale": p.number("attention_multiplier", base["attention_scale"]),
                          "residual_multiplier": p.number("residual_multiplier", 1.0),
                          "logits_divisor": p.number("logits_scaling", 1.0)})


def _granite_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    base = gguf_base(f, arch, "GraniteForCausalLM")  # attention.scale is read by gguf_base
    k = arch + "."
    return ModelConfig(**{**base, "embedding_multiplier": f.get_float(k + "embedding_scale", 1.0),
                          "residual_multiplier": f.get_float(k + "residual_scale", 1.0),
                          "logits_divisor": f.get_float(k + "logit_scale", 1.0)})


# -- Mixture of experts: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE ---------------------------------------
def _sparse_layers(raw: dict[str, Any], source: str, n: int) -> tuple[str, ...]:
    """transformers' Qwen-MoE rule: layer i is sparse unless listed in mlp_only_layers, and only
    every decoder_sparse_step-th layer ((i + 1) % step == 0) is."""
    p = HFFields(raw, source)
    step = p.positive_int("decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise _field_error(source, "mlp_only_layers", "must list layer indices")
    return tuple("sparse" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(n))


def _moe_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p, n = HFFields(raw, source), base["num_layers"]
    mixtral, olmoe = name == "MixtralForCausalLM", name == "OlmoeForCausalLM"
    # Mixtral (and transformers 5 for every family) writes num_local_experts; Qwen and OLMoE num_experts.
    experts = p.positive_int("num_local_experts", None) or p.positive_int("num_experts")
    parts: dict[str, Any] = dict(
        num_experts=experts, num_experts_per_tok=p.positive_int("num_experts_per_tok"),
        # Mixtral's router always renormalises; the others follow norm_topk_prob (default off).
        norm_topk_prob=True if mixtral else bool(raw.get("norm_topk_prob", False)),
        moe_intermediate_size=(base["intermediate_size"] if mixtral or olmoe
                               else p.positive_int("moe_intermediate_size")),
        layer_mlp_kinds=("sparse",) * n if mixtral or olmoe else _sparse_layers(raw, source, n),
        moe_checkpoint="mixtral" if mixtral else "mlp",
    )
    if parts["num_experts_per_tok"] > experts:
        raise _field_error(source, "num_experts_per_tok", f"must be at most the {experts} experts")
    if mixtral:  # every layer slides when sliding_window is set (Mistral's attention)
        parts.update(windows(p, n, p.window(), _every(n)))
    elif olmoe:  # q/k RMSNorm over the whole projections
        if raw.get("clip_qkv") is not None:
            raise UnsupportedModelError(f"{source}: clip_qkv is not supported")
        parts.update(qk_norm=True, qk_norm_over="projection")
    else:
        window = p.window() if raw.get("use_sliding_window", False) else None
        if name == "Qwen2MoeForCausalLM":
            first = raw.get("max_window_layers", 28)
            parts.update(windows(p, n, window, [bool((i + 1) % 2) and i < first for i in range(n)]),
                         qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False,
                         shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0))
        else:  # Qwen3-MoE: per-head q/k norm; a window, when on, on every layer
            parts.update(windows(p, n, window, _every(n)), qk_norm=True)
    return ModelConfig(**{**base, **parts})


def _moe_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's MoE keys (`{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length`,
    `expert_shared_feed_forward_length`); a layer is sparse when it has `ffn_gate_inp` (the router).
    Renormalisation follows llama.cpp's per-architecture rule (qwen3moe and Mixtral's llama: on;
    qwen2moe, olmoe: off) unless the file states `{arch}.expert_weights_norm`."""
    names = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
             "llama": "MixtralForCausalLM"}
    base = gguf_base(f, arch, names[arch])
    k, n = arch + ".", base["num_layers"]
    kinds = tuple("sparse" if f"blk.{i}.ffn_gate_inp.weight" in f.tensors else "dense" for i in range(n))
    down = next((t for t in f.tensors.values() if t.name.endswith("ffn_down_shexp.weight")), None)
    shexp = int(down.shape[-1]) if down is not None else 0
    parts: dict[str, Any] = dict(
        layer_mlp_kinds=kinds, num_experts=f.get_int(k + "expert_count"),
        num_experts_per_tok=f.get_int(k + "expert_used_count"),
        moe_intermediate_size=f.get_int(k + "expert_feed_forward_length", base["intermediate_size"]),
        norm_topk_prob=f.get_bool(k + "expert_weights_norm", arch in ("qwen3moe", "llama")),
        # Qwen2-MoE's shared expert: its size is the key, or the shexp tensors' (older files).
        shared_expert_intermediate_size=f.get_int(k + "expert_shared_feed_forward_length", shexp, positive=False),
        moe_checkpoint="mixtral" if arch == "llama" else "mlp",
    )
    if arch == "llama":
        parts.update(gguf_windows(f, arch, n, None))
    elif arch == "olmoe":
        parts.update(qk_norm_over="projection")
    elif arch == "qwen2moe":
        parts.update(qkv_bias=True, o_bias=False)
    return ModelConfig(**{**base, **parts})


# -- gpt-oss ---------------------------------------------------------------------------------------
def _gpt_oss_parts(n: int, experts: int, top_k: int, moe_size: int) -> dict[str, Any]:
    """What gpt-oss changes on top of the shared reading: every layer sparse, biased router and
    experts, softmax over the top-k logits, the clamped SwiGLU, attention sinks."""
    return dict(layer_mlp_kinds=("sparse",) * n, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=moe_size, moe_checkpoint="gpt_oss", moe_router="topk_softmax", moe_bias=True,
                moe_activation="swiglu_oai", attention_sinks=True, norm_weight_fp32=True)


def _gpt_oss_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p, n = HFFields(raw, source), base["num_layers"]
    experts = p.positive_int("num_local_experts", None) or p.positive_int("num_experts")
    top_k = p.positive_int("num_experts_per_tok", None) or p.positive_int("experts_per_token")
    if top_k > experts:
        raise _field_error(source, "num_experts_per_tok", f"must be at most the {experts} experts")
    quant = raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in (None, "mxfp4"):
        raise UnsupportedModelError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                                    "(gpt-oss: none or 'mxfp4')")
    parts = dict(
        # transformers' default layer_types for gpt-oss: even layers slide, odd layers are full.
        windows(p, n, p.window(), _period(n, 2)),
        **_gpt_oss_parts(n, experts, top_k, base["intermediate_size"]),
        swiglu_alpha=p.number("swiglu_alpha", 1.702), swiglu_limit=p.number("swiglu_limit", 7.0),
        experts_quantization="mxfp4" if method == "mxfp4" else "",
    )
    return ModelConfig(**{**base, **parts})


def _gpt_oss_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's `gpt-oss` files: its MoE keys, a window on even layers (its swa pattern of 2), the
    SwiGLU constants it hard-wires (alpha 1.702, limit 7). YaRN is read as transformers' gpt-oss
    applies it, without truncating the correction range (the reference implementation's)."""
    base = gguf_base(f, arch, "GptOssForCausalLM")
    k, n = arch + ".", base["num_layers"]
    experts, top_k = f.get_int(k + "expert_count"), f.get_int(k + "expert_used_count")
    rope = base["ropes"][0]
    if rope.scaling is not None and rope.scaling.rope_type == "yarn":
        base["ropes"] = (RopeSpec(rope.theta, dataclasses.replace(rope.scaling, truncate=False), rope.rotary_dim),)
    parts = dict(gguf_windows(f, arch, n, 2),
                 **_gpt_oss_parts(n, experts, top_k, f.get_int(k + "expert_feed_forward_length")))
    return ModelConfig(**{**base, **parts})


def _field_error(source: str, key: str, what: str) -> Exception:
    return ModelLoadError(f"{source}: field {key!r} {what}")


FAMILIES: list[Architecture] = [
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), _llama_hf, _llama_gguf, gguf_permuted_qk=True),
    Architecture("mistral", ("MistralForCausalLM",), ("mistral",), _mistral_hf, _llama_gguf, gguf_permuted_qk=True),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _qwen_hf, _llama_gguf),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _qwen_hf, _llama_gguf),
    Architecture("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), _gemma_hf, _gemma_gguf),
    Architecture("gemma3", ("Gemma3ForCausalLM",), ("gemma3",), _gemma_hf, _gemma_gguf),
    Architecture("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), ("gemma4",), gemma4_hf,
                 gemma4_gguf),
    Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), _phi3_hf, _phi3_gguf),
    Architecture("olmo2", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), ("olmo2",), _olmo_hf, _olmo_gguf),
    Architecture("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), _smollm3_hf, _smollm3_gguf,
                 gguf_permuted_qk=True),
    Architecture("granite", ("GraniteForCausalLM",), ("granite",), _granite_hf, _granite_gguf,
                 gguf_permuted_qk=True),
    # Mixture of experts (server.models.moe). Mixtral's GGUF files are "llama" with ffn_*_exps tensors.
    Architecture("qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), _moe_hf, _moe_gguf),
    Architecture("mixtral", ("MixtralForCausalLM",), (), _moe_hf, None, gguf_permuted_qk=True),
    Architecture("olmoe", ("OlmoeForCausalLM",), ("olmoe",), _moe_hf, _moe_gguf),
    Architecture("qwen2moe", ("Qwen2MoeForCausalLM",), ("qwen2moe",), _moe_hf, _moe_gguf),
    Architecture("gpt_oss", ("GptOssForCausalLM",), ("gpt-oss",), _gpt_oss_hf, _gpt_oss_gguf),
    # dots.llm1, GLM-4.5: sigmoid routers with a selection bias, ungated shared experts (server.models.sigmoid_moe_config).
    Architecture("dots1", ("Dots1ForCausalLM",), ("dots1",), dots1_hf, dots1_gguf),
    Architecture("glm4_moe", ("Glm4MoeForCausalLM",), ("glm4moe",), glm4_moe_hf, glm4_moe_gguf),
    # ERNIE 4.5 MoE: a softmax router with the same selection bias; interleaved RoPE (server.models.ernie45_moe_config).
    Architecture("ernie4_5_moe", ("Ernie4_5_MoeForCausalLM",), ("ernie4_5-moe",), ernie45_moe_hf, ernie45_moe_gguf,
                 gguf_permuted_qk=True),
    # Hybrids: recurrent layers with a state slot per sequence (server/engine/state_cache.py).
    Architecture("lfm2", ("Lfm2ForCausalLM",), ("lfm2",), lfm2_hf, lfm2_gguf,
                 model="server.models.lfm2:Lfm2ForCausalLM"),
    # Gated DeltaNet hybrids: Qwen3-Next, Qwen3.5, Qwen3.5-MoE (llama.cpp's qwen3next, qwen35, qwen35moe).
    Architecture("qwen3_next", tuple(QWEN3_NEXT_ARCHITECTURES), tuple(QWEN3_NEXT_GGUF), qwen3_next_hf, qwen3_next_gguf,
                 model="server.models.qwen3_next:Qwen3NextForCausalLM"),
]


