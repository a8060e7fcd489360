"""write_gguf: turn a tiny Hugging Face checkpoint folder into a GGUF file the way llama.cpp's
converter lays one out, for tests (no downloads).

It owns the test side of the format, written independently of server.models.gguf_loader so the
loader is checked against a second reading of llama.cpp's conventions: GGUF tensor names, the
Q/K row permutation for Llama/Mistral, `{arch}.*` metadata, quantisation with the `gguf` package,
and a byte-level BPE (or SentencePiece-style) vocabulary trained on the demo corpus.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.torch import load_file

from tests.gguf_qwen3_next import QWEN3_NEXT_TYPES, qwen3_next_metadata, qwen3_next_tensors

# Block types the `gguf` package cannot quantise to (tests write random valid blocks instead, see
# random_k_blocks): the byte offsets of each block's fp16 scales.
RANDOM_BLOCKS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,),
                 "IQ4_XS": (0,), "IQ3_S": (0,), "IQ3_XXS": (0,), "IQ2_S": (0,), "IQ2_XS": (0,), "IQ2_XXS": (0,),
                 "IQ1_S": (0,), "IQ1_M": ()}  # (IQ1_M: d's four nibbles on top of its scale words, random_k_blocks)
# Values per block of every type the tests write quantised.
QUANT_BLOCK = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
               for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", *RANDOM_BLOCKS)}
FLOAT_TYPES = ("F32", "F16", "BF16")

_HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Gemma, OLMo 2: norms on the sub-blocks' outputs; Gemma's pre-MLP norm is ffn_norm.
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    # Phi-3: llama.cpp keeps the fused matrices (ffn_up holds gate and up).
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    # Gemma 4: the per-layer input block and the layer scalar (llama.cpp appends ".weight" to it).
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    "self_attn.sinks": "attn_sinks.weight",  # gpt-oss
    "self_attn.o_proj.bias": "attn_output.bias",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
# model_type -> llama.cpp's general.architecture (OLMo 3 files are "olmo2" with a window).
GGUF_ARCH = {"glm4_moe": "glm4moe", "ernie4_5_moe": "ernie4_5-moe",
             "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "gpt_oss": "gpt-oss",
             "gemma3_text": "gemma3", "gemma4_text": "gemma4", "olmo3": "olmo2", **QWEN3_NEXT_TYPES}
# llama.cpp's converter permutes Q/K rows for the architectures it runs with interleaved RoPE.
PERMUTED = ("llama", "mistral", "smollm3", "granite", "mixtral")
# Families whose post_attention_layernorm is written post_attention_norm: the attention output's
# norm, and gpt-oss's and GLM-4.5's MLP input norm (llama.cpp names it so for those architectures).
_POST_NORM_TYPES = ("gemma2", "gemma3_text", "gemma4_text", "olmo2", "olmo3", "gpt_oss", "glm4_moe", *QWEN3_NEXT_TYPES)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# LFM2 (llama.cpp's `lfm2`): its own transformers names; the convolution's tensors are shortconv.*,
# the final norm token_embd_norm.
_LFM2_TO_GGUF = {
    "operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight", "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    **{f"conv.{p}.{w}": f"shortconv.{p}.{w}" for p in ("conv", "in_proj", "out_proj") for w in ("weight", "bias")},
}


def gguf_name(hf_name: str, model_type: str = "llama") -> str:
    if model_type == "lfm2":
        if hf_name == "model.embedding_norm.weight":
            return "token_embd_norm.weight"
        if hf_name in _HF_TO_GGUF_GLOBAL:
            return _HF_TO_GGUF_GLOBAL[hf_name]
        parts = hf_name.split(".", 3)
        return f"blk.{parts[2]}.{_LFM2_TO_GGUF[parts[3]]}"
    if hf_name.endswith("post_attention_layernorm.weight") and model_type in _POST_NORM_TYPES:
        return f"blk.{hf_name.split('.')[2]}.post_attention_norm.weight"
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    return f"blk.{parts[2]}.{_HF_TO_GGUF_BLOCK[parts[3]]}"


# Mixture of experts: llama.cpp's converter stacks each layer's experts into one tensor per matrix
# ([E, I, H] gate and up, [E, H, I] down), keeps the router (ffn_gate_inp) and Qwen2-MoE's shared
# expert gate (ffn_gate_inp_shexp, a [H] vector) in F32, and names the shared expert's matrices *_shexp.
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_MOE_NAMES = {"gate.weight": "ffn_gate_inp.weight", "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
              "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
              "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
              "shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
# What stack_experts also writes (not one-to-one, so kept apart: tests/gguf_qwen3_next.py inverts
# _MOE_NAMES): dots1's / GLM-4.5's / ERNIE 4.5's selection bias and their ungated shared experts.
_MOE_WRITE_NAMES = {**_MOE_NAMES, "gate.e_score_correction_bias": "exp_probs_b.bias",
                    "moe_statics.e_score_correction_bias": "exp_probs_b.bias",  # ERNIE 4.5's [1, E], written [E]
                    **{f"shared_experts.{m}_proj.weight": f"ffn_{m}_shexp.weight" for m in ("gate", "up", "down")}}
F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Pops every MoE tensor (mlp.* or Mixtral's block_sparse_moe.*) from `state` and returns them
    under their GGUF names, the experts stacked."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name in [n for n in state if ".mlp." in n or ".block_sparse_moe." in n]:
        parts = name.split(".")
        layer, rest = parts[2], ".".join(parts[4:])
        if parts[4] == "experts":
            experts.setdefault((layer, _EXPERT_PARTS[parts[6]]), {})[int(parts[5])] = state.pop(name).float().numpy()
        elif rest in _MOE_WRITE_NAMES:
            arr = state.pop(name).float().numpy()
            flat = rest in ("shared_expert_gate.weight", "moe_statics.e_score_correction_bias")
            out[f"blk.{layer}.{_MOE_WRITE_NAMES[rest]}"] = arr.reshape(-1) if flat else arr
    for (layer, part), by_expert in experts.items():
        out[f"blk.{layer}.{part}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute`: each head's [first half; second half] rows become
    interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # the K-quants pagewire has kernels for


def random_k_blocks(rows: int, cols: int, qtype: str, seed: int) -> np.ndarray:
    """[rows, cols / block values * block bytes] uint8 of valid `qtype` blocks (RANDOM_BLOCKS):
    random codes and sub-scales, fp16 scales in [0.002, 0.02] (Q3_K, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S: [0.0002,
    0.002]; IQ4_XS: [0.0001, 0.001]; IQ2_XXS: [0.0005, 0.005]) so the weights are finite and of a
    usual size."""
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    scales = RANDOM_BLOCKS[qtype]
    # Q3_K's signed sub-scales (to +-32) and codes (to +-4) make weights ten times Q4_K's at the same
    # d: a tiny model of them turns chaotic (its logits swing with any rounding), so its d is smaller.
    # IQ4_XS's sub-scales (to +-32) times its levels (to +-127) need a smaller d still; the lattice
    # types' odd multipliers (to 31) times their grid values (IQ3_XXS to 62 / 4, IQ3_S 15, IQ2_XXS
    # 43 / 8) too, and IQ2_XS's / IQ2_S's, whose grids (512 and 1024 points) hold more large values.
    low, high = {"Q3_K": (0.0002, 0.002), "IQ4_XS": (0.0001, 0.001), "IQ3_XXS": (0.0002, 0.002),
                 "IQ3_S": (0.0002, 0.002), "IQ2_XXS": (0.0005, 0.005), "IQ2_XS": (0.0002, 0.002),
                 "IQ2_S": (0.0002, 0.002)}.get(qtype, (0.002, 0.02))
    blocks = rng.integers(0, 256, size=(rows * cols // values, nbytes), dtype=np.uint8)
    for off in scales:
        halves = np.asarray(rng.uniform(low, high, size=blocks.shape[0]), dtype=np.float16)
        blocks[:, off:off + 2] = halves.view(np.uint8).reshape(-1, 2)
    if qtype == "IQ1_M":  # d's bits 4k..4k+3 are the top nibble of scale word k (bytes 48 + 2k, 49 + 2k)
        d = np.asarray(rng.uniform(low, high, size=blocks.shape[0]), dtype=np.float16).view(np.uint16)
        for k in range(4):
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4).astype(np.uint8)
    return blocks.reshape(rows, cols // values * nbytes)


def encode_tensor(w: np.ndarray, qtype: str, seed: int = 0) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype) for GGUFWriter.add_tensor. RANDOM_BLOCKS types ignore `w`'s values (see random_k_blocks)."""
    from gguf import GGMLQuantizationType, quants

    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype == "I32":  # not a weight type: for the loader's refusal
        return w.astype(np.int32), None
    t = GGMLQuantizationType[qtype]
    if qtype in RANDOM_BLOCKS:
        return random_k_blocks(w.shape[0], w.shape[1], qtype, seed), t
    return quants.quantize(w.astype(np.float32), t), t


def train_byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges "a b", token types) of a byte-level BPE trained on the demo corpus; ids 0..3
    are the control tokens <|endoftext|>, <|im_start|>, <|im_end|>, <|pad|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from server.models.demo_model import _corpus_paragraphs

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus_paragraphs(), trainer)
    model = json.loads(tok.to_str())["model"]
    inv = {i: t for t, i in model["vocab"].items()}
    tokens = [inv[i] for i in range(len(inv))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    return tokens, merges, types


def train_sentencepiece_vocab(num_pieces: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) shaped like a llama.cpp SentencePiece vocabulary: <unk>, <s>, </s>,
    the 256 byte tokens <0x00>..<0xFF>, then "▁"-marked pieces scored by learning order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from server.models.demo_model import _corpus_paragraphs

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=num_pieces, show_progress=False)
    tok.train_from_iterator(_corpus_paragraphs(), trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def write_gguf(
    out: Path,
    hf_dir: Path,
    qtype: str = "F32",
    *,
    arch: Optional[str] = None,
    pre: str = "gpt-2",
    sliding_window: Optional[int] = None,
    skip_tensors: Sequence[str] = (),
    drop_metadata: Sequence[str] = (),
    extra_metadata: Optional[dict[str, Any]] = None,
    vocab: Optional[tuple[list[str], list[str], list[int]]] = None,
    qtype_of: Optional[Callable[[str], str]] = None,
) -> Path:
    """Write `hf_dir` (a tests.tiny_models folder) as a GGUF file at `out`.

    Args:
        qtype: the type of every 2-D weight (norms and biases stay F32, as llama.cpp keeps them).
        arch: the GGUF architecture to state (default: the folder's model_type).
        pre: tokenizer.ggml.pre.
        skip_tensors: GGUF tensor names to leave out.
        drop_metadata: metadata keys to leave out.
        extra_metadata: more string/int/float keys (overriding written ones of the same name).
        vocab: (tokens, merges, types) for a gpt2 tokenizer; default: trained to the model's vocab size.
        qtype_of: a 2-D weight's type by its GGUF name (a mix such as llama.cpp's Q4_K_M);
            default: `qtype` for every one.
    """
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = arch or GGUF_ARCH.get(model_type, model_type)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # per-layer-type RoPE: the file's base is the global one
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tokens, merges, types = vocab or train_byte_level_vocab(cfg["vocab_size"])

    w = gguf.GGUFWriter(str(out), arch)
    meta: dict[str, Any] = {
        f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.context_length": cfg["max_position_embeddings"],
        f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", cfg.get("norm_eps", 1e-6))),
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        f"{arch}.vocab_size": cfg["vocab_size"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 3,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    if cfg.get("head_dim"):
        meta[f"{arch}.attention.key_length"] = cfg["head_dim"]
        meta[f"{arch}.attention.value_length"] = cfg["head_dim"]
    if sliding_window is None and "sliding_attention" in (cfg.get("layer_types") or []):
        sliding_window = cfg["sliding_window"]
    if sliding_window is not None:
        meta[f"{arch}.attention.sliding_window"] = sliding_window
    meta.update(_family_metadata(arch, cfg, rope))
    meta.update(extra_metadata or {})
    for key, value in meta.items():
        if key in drop_metadata:
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_array("tokenizer.ggml.token_type", types)

    state = load_file(str(hf_dir / "model.safetensors"))
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors travel as tensors
        state["rope_factors_long"] = torch.tensor(rope["long_factor"])
        state["rope_factors_short"] = torch.tensor(rope["short_factor"])
    if model_type == "gemma4_text":  # proportional RoPE as per-pair frequency factors (1: rotates, 1e30: still)
        hd = _gemma4_global_head_dim(cfg)
        rot = int(hd * rope["partial_rotary_factor"] / 2)
        state["rope_freqs"] = torch.tensor([1.0] * rot + [1e30] * (hd // 2 - rot))
    # The Gated DeltaNet hybrids' linear_attn tensors (tests/gguf_qwen3_next.py; the conv kernel stays F32).
    hybrid = qwen3_next_tensors(state, cfg) if model_type in QWEN3_NEXT_TYPES else {}
    for seed, (name, arr) in enumerate(sorted(hybrid.items())):
        this = qtype_of(name) if qtype_of and arr.ndim == 2 else qtype
        fits = arr.ndim == 2 and arr.shape[1] % QUANT_BLOCK.get(this, 1) == 0 and "ssm_conv1d" not in name
        data, raw = encode_tensor(arr, this if fits else "F32", 2000 + seed)
        if name not in skip_tensors:
            w.add_tensor(name, data, raw_dtype=raw)
    raw_moe: dict[str, np.ndarray] = {}
    if model_type == "gpt_oss":  # stacked, interleaved experts; an MXFP4 folder's stay MXFP4
        from tests.gpt_oss_files import gpt_oss_moe

        moe, raw_moe = gpt_oss_moe(state)
    else:
        moe = stack_experts(state) if _experts(cfg) else {}
    for name, data in sorted(raw_moe.items()):
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    for seed, (name, arr) in enumerate(sorted(moe.items())):
        if name in skip_tensors:
            continue
        if name.endswith(F32_TENSORS) or arr.ndim == 1 or name.endswith(".bias"):
            w.add_tensor(name, arr.astype(np.float32))
            continue
        flat = arr.reshape(-1, arr.shape[-1])
        data, raw = encode_tensor(flat, qtype_of(name) if qtype_of else qtype, 1000 + seed)
        w.add_tensor(name, data.reshape(*arr.shape[:-1], -1) if raw is not None else data.reshape(arr.shape),
                     raw_dtype=raw)
    for seed, (hf_name, tensor) in enumerate(sorted(state.items())):
        name = hf_name + ".weight" if hf_name.startswith("rope_") else gguf_name(hf_name, model_type)
        if name in skip_tensors:
            continue
        arr = tensor.to(torch.float32).numpy()
        if model_type == "lfm2" and name.endswith("shortconv.conv.weight"):
            arr = arr.squeeze(1)  # llama.cpp's converter: the depthwise kernel as [H, K]
        if model_type in ("gemma2", "gemma3_text") and name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's Gemma 2/3 converter stores the 1 + w the model scales by (Gemma 4: w)
        if model_type in PERMUTED and name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = llama_cpp_permute(arr, heads)
        elif model_type in PERMUTED and name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = llama_cpp_permute(arr, kv_heads)
        # Rows that do not fill whole blocks stay F32, as llama.cpp's converter falls back for them.
        this = qtype_of(name) if qtype_of and arr.ndim == 2 else qtype
        fits = arr.ndim == 2 and arr.shape[1] % QUANT_BLOCK.get(this, 1) == 0
        data, raw = encode_tensor(arr, this if fits else "F32", seed)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _experts(cfg: dict[str, Any]) -> int:
    """The routed experts' count however the family spells it (0: a dense model)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
               or cfg.get("moe_num_experts") or 0)


def _family_metadata(arch: str, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The `{arch}.*` keys llama.cpp's converter writes for the families beyond Llama/Qwen."""
    meta: dict[str, Any] = {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    prf = rope.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        meta[f"{arch}.rope.dimension_count"] = int(head_dim * prf)
    if rope.get("rope_type") == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
    if rope.get("rope_type") == "yarn":
        meta[f"{arch}.rope.scaling.type"] = "yarn"
        meta[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
        meta[f"{arch}.rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    if rope.get("rope_type") == "longrope":
        orig = rope["original_max_position_embeddings"]
        factor = cfg["max_position_embeddings"] / orig
        meta[f"{arch}.rope.scaling.original_context_length"] = orig
        meta[f"{arch}.rope.scaling.attn_factor"] = math.sqrt(1 + math.log(factor) / math.log(orig))
    experts = _experts(cfg)
    if experts:  # llama.cpp's MoE keys (Mixtral: "llama" with a window when its config has one)
        meta[f"{arch}.expert_count"] = experts
        meta[f"{arch}.expert_used_count"] = cfg.get("num_experts_per_tok") or cfg["moe_k"]
        if cfg.get("moe_intermediate_size") or cfg["model_type"] == "gpt_oss":
            meta[f"{arch}.expert_feed_forward_length"] = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        if cfg.get("shared_expert_intermediate_size"):
            meta[f"{arch}.expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
        if cfg["model_type"] in ("dots1", "glm4_moe"):  # as llama.cpp's Dots1Model / Glm4MoeModel converters write them
            meta[f"{arch}.leading_dense_block_count"] = cfg["first_k_dense_replace"]
            meta[f"{arch}.expert_shared_count"] = cfg["n_shared_experts"]
            meta[f"{arch}.expert_weights_scale"] = float(cfg["routed_scaling_factor"])
            meta[f"{arch}.expert_weights_norm"] = bool(cfg["norm_topk_prob"])
            meta[f"{arch}.expert_gating_func"] = 2  # sigmoid
            if cfg["model_type"] == "glm4_moe":  # the MTP layers count in block_count
                extra = cfg.get("num_nextn_predict_layers", 0)
                meta[f"{arch}.nextn_predict_layers"] = extra
                meta[f"{arch}.block_count"] = cfg["num_hidden_layers"] + extra
            if cfg.get("n_group", 1) > 1:
                meta[f"{arch}.expert_group_count"] = cfg["n_group"]
                meta[f"{arch}.expert_group_used_count"] = cfg["topk_group"]
        if cfg["model_type"] == "ernie4_5_moe":  # as llama.cpp's Ernie4_5MoeModel converter writes them
            meta[f"{arch}.expert_shared_count"] = cfg["moe_num_shared_experts"]
            meta[f"{arch}.leading_dense_block_count"] = cfg["moe_layer_start_index"]
            meta[f"{arch}.interleave_moe_layer_step"] = cfg["moe_layer_interval"]
        if cfg["model_type"] == "mixtral" and cfg.get("sliding_window"):
            meta[f"{arch}.attention.sliding_window"] = cfg["sliding_window"]
    if cfg["model_type"] in QWEN3_NEXT_TYPES:
        meta.update(qwen3_next_metadata(arch, cfg))
    if arch == "gemma2":
        meta[f"{arch}.attn_logit_softcapping"] = float(cfg["attn_logit_softcapping"])
        meta[f"{arch}.final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    if arch == "gemma4":
        meta.update(_gemma4_metadata(arch, cfg))
    if arch == "lfm2":  # as llama.cpp's Lfm2Model: KV heads per layer (0: a convolution layer)
        from server.models.lfm2_config import lfm2_intermediate

        meta[f"{arch}.attention.head_count_kv"] = [cfg["num_key_value_heads"] if t == "full_attention" else 0
                                                   for t in cfg["layer_types"]]
        meta[f"{arch}.shortconv.l_cache"] = cfg["conv_L_cache"]
        meta[f"{arch}.feed_forward_length"] = lfm2_intermediate(cfg, "config.json")
        meta[f"{arch}.attention.layer_norm_rms_epsilon"] = float(cfg["norm_eps"])
    if arch == "granite":
        meta[f"{arch}.attention.scale"] = float(cfg["attention_multiplier"])
        meta[f"{arch}.embedding_scale"] = float(cfg["embedding_multiplier"])
        meta[f"{arch}.residual_scale"] = float(cfg["residual_multiplier"])
        meta[f"{arch}.logit_scale"] = float(cfg["logits_scaling"])
    return meta


def _gemma4_global_head_dim(cfg: dict[str, Any]) -> int:
    over = [v["head_dim"] for v in (cfg.get("per_layer_config") or {}).values() if "head_dim" in v]
    return int(over[0]) if over else int(cfg.get("global_head_dim", 512))


def _gemma4_metadata(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Gemma 4 converter writes beyond Gemma 3's keys: the global head size as
    key_length and the local one as key_length_swa, KV heads and MLP widths per layer when they
    differ, the sliding pattern as one bool per layer, the shared-KV layer count and the per-layer
    input size (norms are stored as w: Gemma 4 does not add 1)."""
    n = cfg["num_hidden_layers"]
    swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    hd, ghd = cfg["head_dim"], _gemma4_global_head_dim(cfg)
    over = [v.get("num_key_value_heads") for v in (cfg.get("per_layer_config") or {}).values()]
    global_kv = over[0] if over and over[0] else cfg.get("num_global_key_value_heads")
    shared = cfg.get("num_kv_shared_layers") or 0
    meta: dict[str, Any] = {
        f"{arch}.attention.key_length": ghd, f"{arch}.attention.value_length": ghd,
        f"{arch}.attention.key_length_swa": hd, f"{arch}.attention.value_length_swa": hd,
        f"{arch}.attention.sliding_window_pattern": swa,
        f"{arch}.attention.shared_kv_layers": shared,
        f"{arch}.embedding_length_per_layer_input": cfg.get("hidden_size_per_layer_input") or 0,
        f"{arch}.rope.dimension_count": ghd, f"{arch}.rope.dimension_count_swa": hd,
        f"{arch}.rope.freq_base_swa": float(cfg["rope_parameters"]["sliding_attention"]["rope_theta"]),
    }
    if global_kv is not None:
        meta[f"{arch}.attention.head_count_kv"] = [cfg["num_key_value_heads"] if s else global_kv for s in swa]
    if cfg.get("use_double_wide_mlp"):
        ff = cfg["intermediate_size"]
        meta[f"{arch}.feed_forward_length"] = [ff if i < n - shared else 2 * ff for i in range(n)]
    if cfg.get("final_logit_softcapping"):
        meta[f"{arch}.final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    return meta
