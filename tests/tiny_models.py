"""make_tiny_model: write a tiny random-weight Hugging Face checkpoint folder for tests (no downloads).

It owns the test models' shapes: small enough to run in milliseconds on a CPU, with the features
of each supported architecture switched on (Qwen2 qkv bias, Qwen3 q/k norm and a decoupled
head_dim, Mistral's sliding window), and weights large enough that greedy choices are not
decided by rounding noise.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Per-architecture defaults on top of _BASE. Mistral's window is smaller than test prompts (~50
# tokens) so the window actually masks; Qwen3's head_dim differs from hidden/heads on purpose.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 24},
    "qwen2": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2},
    "qwen3": {"head_dim": 32, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2},
    # The families of issue 26, each with its special case on (windows shorter than the prompts,
    # interleaved layer kinds, soft-capping, NoPE layers, long-context RoPE factors). head_dim 32
    # differs from hidden / heads = 16, and query_pre_attn_scalar = head_dim, the scale
    # llama.cpp hard-wires for Gemma, so the GGUF copies mean the same model.
    "gemma2": {"num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 24,
               "attn_logit_softcapping": 8.0, "final_logit_softcapping": 6.0},
    "gemma3": {"num_hidden_layers": 6, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 24,
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1000000.0}}},
    # Gemma 4 with every special case on: global layers with their own head size (64 vs 16) and
    # KV heads (1 vs 2, so a global layer's K/V per token is twice a local one's), proportional
    # RoPE, values from the keys (attention_k_eq_v), the last two layers reading earlier layers'
    # KV with a double-wide MLP, per-layer input embeddings and final soft-capping.
    "gemma4": {"num_hidden_layers": 6, "head_dim": 16, "global_head_dim": 64, "num_global_key_value_heads": 1,
               "attention_k_eq_v": True, "sliding_window": 24, "num_kv_shared_layers": 2,
               "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8, "final_logit_softcapping": 10.0,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                               "sliding_attention", "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1000000.0}}},
    "phi3": {"original_max_position_embeddings": 64,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                 "long_factor": [1.5 + 0.5 * i for i in range(6)]}},
    # Mixture of experts (issue 27): more experts than top-k, top-k > 1, renormalisation on
    # (Qwen3-MoE, Mixtral) and off (OLMoE, Qwen2-MoE), a dense layer among sparse ones (Qwen3-MoE's
    # mlp_only_layers), Mixtral's window shorter than the prompts, Qwen2-MoE's gated shared expert.
    "qwen3moe": {"num_hidden_layers": 3, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
                 "use_sliding_window": False, "sliding_window": None},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": 24},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 3, "intermediate_size": 32, "norm_topk_prob": False},
    "qwen2moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 64, "norm_topk_prob": False, "use_sliding_window": False,
                 "sliding_window": None},
    # gpt-oss: 8 experts, top-2 softmaxed after the top-k, biases in the router and experts, the
    # SwiGLU limit of the checkpoints (7.0, which llama.cpp hard-wires; the experts' gate_up is
    # scaled up below so the tiny activations cross it), alternating 24-token windows (shorter than
    # the prompts) and full layers, attention sinks, YaRN with an original context short enough
    # that the tiny head's frequencies span its ramp.
    "gpt_oss": {"num_hidden_layers": 4, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 32, "sliding_window": 24, "swiglu_limit": 7.0, "attention_bias": True,
                "max_position_embeddings": 2048,  # = factor x original, as transformers' YaRN check wants
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
    # dots.llm1: a sigmoid router whose selection bias (randomised below) and group limit (2 groups of
    # 4, only the best one kept) change which experts run, renormalised and scaled by 2.5; a dense
    # first layer; one ungated shared expert; Qwen3's per-head q/k norm. No window (llama.cpp runs
    # dots1 without one, so the GGUF copy means the same model).
    "dots1": {"num_hidden_layers": 3, "head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
              "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "sliding_window": None},
    # GLM-4.5: the same router and experts as dots1 (norm on by default; 16 experts in 4 groups, 2
    # kept, top-3), with q/k/v biases, half-rotary heads and per-head q/k norm (use_qk_norm).
    "glm4_moe": {"num_hidden_layers": 3, "head_dim": 32, "n_routed_experts": 16, "num_experts_per_tok": 3,
                 "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
                 "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 1.5, "attention_bias": True,
                 "use_qk_norm": True,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # ERNIE 4.5 MoE: a softmax router whose selection bias (a parameter, randomised below with the
    # biases) changes which of 8 experts run, top-2 renormalised; layers 1..2 sparse (0 dense); one
    # shared expert; interleaved (GPT-J) RoPE.
    "ernie4_5_moe": {"num_hidden_layers": 3, "head_dim": 16, "moe_num_experts": 8, "moe_k": 2,
                     "moe_intermediate_size": 32, "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    # LFM2 (issue 28): convolution layers around two attention layers, the 3-tap kernel of the
    # checkpoints, transformers' auto-adjusted MLP width (2/3 x 128 rounded up to 32: 96).
    "lfm2": {"num_hidden_layers": 5, "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention"],
             "conv_L_cache": 3, "norm_eps": 1e-5, "block_auto_adjust_ff_dim": True, "block_multiple_of": 32,
             "block_ffn_dim_multiplier": 1.0},
    # Hybrids (issue 28): Gated DeltaNet layers (2 key heads serving 4 value heads, a 4-tap conv)
    # with gated full-attention layers every second layer, partial rotary (8 of 32 dims), every
    # norm 1 + w; Qwen3-Next and Qwen3.5-MoE with routed experts and a gated shared expert.
    "qwen3_next": {"num_hidden_layers": 4, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "layer_types": ["linear_attention", "full_attention"] * 2, "num_experts": 8,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "norm_topk_prob": True, "mlp_only_layers": [2],
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
    "qwen3_5": {"num_hidden_layers": 4, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "layer_types": ["linear_attention", "full_attention"] * 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
    "qwen3_5_moe": {"num_hidden_layers": 4, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                    "layer_types": ["linear_attention", "full_attention"] * 2, "num_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.25}},
    "olmo2": {},
    "olmo3": {"num_hidden_layers": 4, "sliding_window": 24,
              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}},
    "smollm3": {"num_hidden_layers": 4},
    "granite": {"embedding_multiplier": 6.0, "attention_multiplier": 0.2, "residual_multiplier": 0.4,
                "logits_scaling": 4.0},
}
_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    # ~7x HF's default std, so logits are spread out and fp32 comparisons are not ties.
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that the tiny head_dim's frequencies fall in all three llama3 bands.
    "original_max_position_embeddings": 64,
}


def _classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "qwen3moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
        "qwen2moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "dots1": (tf.Dots1Config, tf.Dots1ForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, tf.Ernie4_5_MoeForCausalLM),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
        "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM),
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
        "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
    }
    if arch not in table:
        raise ValueError(f"arch: expected one of {', '.join(table)}, got {arch!r}")
    return table[arch]


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    dtype: str = "float32",
    *,
    vocab_size: int,
    config_format: str = "v5",
    num_shards: int = 1,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> Path:
    """Create a tiny random-weight model folder and return its path.

    Args:
        out_dir: folder to write (created; existing checkpoint files in it are replaced).
        arch: a key of _ARCH_DEFAULTS ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
            "phi3", "olmo2", "olmo3", "smollm3", "granite").
        dtype: "float32" | "bfloat16" | "float16": the saved weights' dtype and config dtype.
        vocab_size: embedding rows (match the tokenizer the test uses).
        config_format: "v5" (rope_parameters, as transformers 5 writes) or "v4" (top-level
            rope_theta/rope_scaling and torch_dtype, as transformers-4 checkpoints are).
        num_shards: >1 writes model-0000x-of-0000y.safetensors plus model.safetensors.index.json.
        tie_word_embeddings: share lm_head with the embedding (no lm_head.weight is saved).
        seed: weights are a deterministic function of (seed, arch, config).
        rope_theta, rope_scaling: RoPE base and optional scaling dict (e.g. LLAMA3_ROPE_SCALING).
        config_overrides: any other config fields (num_hidden_layers=3, sliding_window=16, ...).
    """
    if config_format not in ("v4", "v5"):
        raise ValueError(f"config_format: expected 'v4' or 'v5', got {config_format!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards: must be >= 1, got {num_shards}")
    import torch  # here: the chat-template helpers below import without torch (make test-py310)

    config_cls, model_cls = _classes(arch)
    fields = {**_BASE, **_ARCH_DEFAULTS[arch], **config_overrides}
    fields["vocab_size"] = vocab_size
    if arch == "gemma4":  # the per-layer input table has the tokenizer's vocabulary too
        fields.setdefault("vocab_size_per_layer_input", vocab_size)
    fields["tie_word_embeddings"] = tie_word_embeddings
    if "rope_parameters" not in fields:  # a family default above may set its own (per layer type)
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    fields.setdefault("pad_token_id", 0)  # the families' defaults lie outside the tiny vocab
    config = config_cls(**fields)

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # HF initialises norms to 1 and biases to 0, which would let a model that skips them
            # still match; random values make every parameter observable in the logits.
            if name.endswith("norm.weight"):
                # Gemma 2/3 scale by 1 + w: around 0 there is around 1 elsewhere (Gemma 4 scales by w).
                # Qwen3-Next / Qwen3.5 too, except the DeltaNet's gated norm (linear_attn.norm), which scales by w.
                one_plus_w = arch in ("gemma2", "gemma3") or (arch.startswith(("qwen3_next", "qwen3_5"))
                                                              and "linear_attn" not in name)
                p.uniform_(-0.5, 0.5) if one_plus_w else p.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
                p.normal_(0.0, 0.1)
            elif name.endswith(".sinks"):  # gpt-oss: sinks near the scores' size, so they matter
                p.normal_(0.0, 1.0)
            elif name.endswith("experts.gate_up_proj"):  # gpt-oss: pre-activations past the limit of 7
                p.mul_(6.0)
            elif name.endswith("experts.down_proj"):  # ... and outputs of the usual size again
                p.div_(6.0)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer scalar (a saved buffer, init 1)
                b.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):  # dots1: a selection bias that changes choices
                b.normal_(0.0, 0.2)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    _save(model, out, num_shards)
    if config_format == "v4":
        _rewrite_config_v4(out / "config.json")
    return out


def _save(model: Any, out: Path, num_shards: int) -> None:
    """save_pretrained with a max_shard_size that yields exactly `num_shards` files."""
    if num_shards == 1:
        model.save_pretrained(out)
        return
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    # Sharding is greedy per tensor, so search upward from an even split for a size that
    # produces the requested count.
    for step in range(40):
        size = int(total / num_shards * (1.0 + 0.05 * step))
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, max_shard_size=size)
            shards = sorted(Path(tmp).glob("model-*-of-*.safetensors"))
            if len(shards) == num_shards:
                for f in Path(tmp).iterdir():
                    shutil.copy2(f, out / f.name)
                return
    raise ValueError(f"num_shards: could not split this model into exactly {num_shards} shards")


def _rewrite_config_v4(path: Path) -> None:
    """Rewrite a transformers-5 config.json in the transformers-4 layout."""
    raw = json.loads(path.read_text())
    params = raw.pop("rope_parameters", None) or {}
    raw["rope_theta"] = params.pop("rope_theta", 10000.0)
    raw["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    if "dtype" in raw:
        raw["torch_dtype"] = raw.pop("dtype")
    # transformers 4 derived Qwen's sliding layers from max_window_layers; it did not save layer_types.
    raw.pop("layer_types", None)
    raw["transformers_version"] = "4.46.3"
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


# A Hermes/Qwen-style chat template with tool support, written for these tests: tools listed in
# the system turn, assistant calls as <tool_call> blocks (arguments rendered with tojson, so they
# must arrive as objects), tool results as a user turn in <tool_response> tags.
HERMES_TOOL_TEMPLATE = (
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{% if sys %}{{- sys + '\\n\\n' }}{% endif %}"
    "{{- 'Tools:\\n<tools>\\n' }}{% for t in tools %}{{- t | tojson }}{{- '\\n' }}{% endfor %}"
    "{{- '</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif sys %}{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% if m['content'] %}{{- m['content'] }}{% endif %}"
    "{%- for c in m['tool_calls'] or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{{- c['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)


def with_chat_template(model_dir: str | Path, out_dir: str | Path, template: str) -> Path:
    """A copy of a model folder whose tokenizer_config.json carries `template` as its chat template."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_dir, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


# sentence-transformers' pooling config keys, by pagewire's method name (server.models.pooling).
_ST_POOLING_KEYS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def with_pooling_config(model_dir: str | Path, out_dir: str | Path, method: str, normalize: bool = True,
                        base_model: bool = False) -> Path:
    """A copy of a model folder made a sentence-transformers embedding model: modules.json, its
    1_Pooling/config.json pooling by `method` ("last", "mean" or "cls"), and a 2_Normalize module
    when `normalize`. `base_model` re-saves the weights as transformers' AutoModel does (tensor
    names without the `model.` prefix, no lm_head), as real embedding checkpoints are stored."""
    if method not in _ST_POOLING_KEYS:
        raise ValueError(f"method: expected one of {', '.join(_ST_POOLING_KEYS)}, got {method!r}")
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_dir, out)
    if base_model:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(out / "model.safetensors"))
        bare = {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}
        save_file(bare, str(out / "model.safetensors"), metadata={"format": "pt"})
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, "include_prompt": True, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               **{key: m == method for m, key in _ST_POOLING_KEYS.items()}}
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    return out
