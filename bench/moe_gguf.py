"""A random-weight Qwen3-MoE-shaped GGUF file (llama.cpp's `qwen3moe`), written straight to F16.

bench/vs_llamacpp.py's dense shapes go through a Hugging Face folder (tests.tiny_models) and
tests.gguf_files.write_gguf; a mixture-of-experts shape with billions of parameters cannot: the
transformers model, its state dict and write_gguf's float32 copies of the stacked experts would be
over 20 GB at once. This module writes the same layout (llama.cpp's converter's tensor names, the
experts stacked per layer as `ffn_{gate,up}_exps` [E, I, H] and `ffn_down_exps` [E, H, I], the
router `ffn_gate_inp` and the norms in F32, the `qwen3moe.*` keys tests.gguf_files writes) one
tensor at a time: the tensor table first (GGUFWriter.add_tensor_info), then each tensor's random
values as they are drawn, so memory holds one tensor. Matrices are normal with std 0.02 (as
tests.tiny_models initialises), norms are 1. Quantised copies (Q8_0, Q4_K_M) are made from this
file by llama.cpp's own `llama-quantize`, as a user's downloaded file would be.

It also owns `decode_bytes_per_token`: what one single-sequence decode step reads of a GGUF file,
from its tensors' stored types (any family, dense or sparse).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE layout: every layer sparse, per-head q/k norms, untied lm_head."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    experts_per_tok: int
    moe_intermediate_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], bool]]:
        """(GGUF name, numpy shape, is a matrix drawn at random) in the order the file holds them."""
        H, E, Im = self.hidden_size, self.num_experts, self.moe_intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        yield "token_embd.weight", (self.vocab_size, H), True
        for i in range(self.num_layers):
            b = f"blk.{i}."
            yield b + "attn_norm.weight", (H,), False
            yield b + "attn_q.weight", (q, H), True
            yield b + "attn_k.weight", (kv, H), True
            yield b + "attn_v.weight", (kv, H), True
            yield b + "attn_q_norm.weight", (self.head_dim,), False
            yield b + "attn_k_norm.weight", (self.head_dim,), False
            yield b + "attn_output.weight", (H, q), True
            yield b + "ffn_norm.weight", (H,), False
            yield b + "ffn_gate_inp.weight", (E, H), True
            yield b + "ffn_gate_exps.weight", (E, Im, H), True
            yield b + "ffn_up_exps.weight", (E, Im, H), True
            yield b + "ffn_down_exps.weight", (E, H, Im), True
        yield "output_norm.weight", (H,), False
        yield "output.weight", (self.vocab_size, H), True

    def parameters(self) -> tuple[int, int]:
        """(total, active per token): active counts the router, the top-k experts, attention, norms,
        lm_head and the whole embedding table (not only the row a token reads)."""
        total = sum(int(np.prod(s)) for _, s, _ in self.tensors())
        unused = 3 * (self.num_experts - self.experts_per_tok) * self.moe_intermediate_size * self.hidden_size
        return total, total - self.num_layers * unused


def _metadata(shape: MoeShape) -> dict[str, int | float | str | bool]:
    a = "qwen3moe."
    return {
        a + "block_count": shape.num_layers, a + "context_length": shape.max_position_embeddings,
        a + "embedding_length": shape.hidden_size, a + "feed_forward_length": 3 * shape.hidden_size,
        a + "attention.head_count": shape.num_heads, a + "attention.head_count_kv": shape.num_kv_heads,
        a + "attention.key_length": shape.head_dim, a + "attention.value_length": shape.head_dim,
        a + "attention.layer_norm_rms_epsilon": shape.rms_norm_eps, a + "rope.freq_base": shape.rope_theta,
        a + "vocab_size": shape.vocab_size, a + "expert_count": shape.num_experts,
        a + "expert_used_count": shape.experts_per_tok,
        a + "expert_feed_forward_length": shape.moe_intermediate_size,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 3,
        "tokenizer.ggml.add_bos_token": False,
    }


def write_random_moe_f16(path: Path, shape: MoeShape, vocab: tuple[list[str], list[str], list[int]],
                         seed: int = 0) -> Path:
    """Write `shape` with random weights to `path` as F16 (the router and norms F32), one tensor in
    memory at a time. `vocab` is (tokens, merges, token types) of a gpt2 tokenizer of vocab_size."""
    import gguf

    from tests.gguf_files import CHATML

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in _metadata(shape).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    w.add_string("tokenizer.chat_template", CHATML)
    tokens, merges, types = vocab
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_array("tokenizer.ggml.token_type", types)

    def dtype_of(name: str, matrix: bool) -> type:
        # llama.cpp's converter keeps the router (ffn_gate_inp) and every 1-D tensor in F32.
        return np.float16 if matrix and not name.endswith("ffn_gate_inp.weight") else np.float32

    for name, dims, matrix in shape.tensors():
        dt = np.dtype(dtype_of(name, matrix))
        w.add_tensor_info(name, dims, dt, int(np.prod(dims)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, matrix in shape.tensors():
        if matrix:
            values = rng.standard_normal(dims, dtype=np.float32)
            values *= 0.02
        else:
            values = np.ones(dims, dtype=np.float32)
        w.write_tensor_data(values.astype(dtype_of(name, matrix), copy=False))
    w.close()
    return path


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one decode step reads of a GGUF file's weights, by part."""

    experts: int  # the top-k experts' share of every ffn_*_exps tensor (all three matrices)
    embedding_row: int  # one row of token_embd
    lm_head: int  # output.weight, or the whole token_embd when the embeddings are tied
    rest: int  # every other tensor (attention, routers, dense MLPs, norms), whole

    @property
    def total(self) -> int:
        return self.experts + self.embedding_row + self.lm_head + self.rest


def decode_bytes_per_token(path: Path) -> TokenBytes:
    """What a single-sequence decode step reads of `path`'s weights, from its stored types: each
    expert tensor's bytes x (experts used / experts), one row of the embedding table, the lm_head,
    and every other tensor whole (the KV cache is not counted here)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = str(r.fields["general.architecture"].contents())
    count = r.fields.get(f"{arch}.expert_count")
    used = r.fields.get(f"{arch}.expert_used_count")
    experts = embedding_row = lm_head = rest = 0
    tied = all(t.name != "output.weight" for t in r.tensors)
    for t in r.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            embedding_row += n // int(t.shape[-1])  # ggml order: shape[-1] is the vocabulary
            lm_head += n if tied else 0
        elif t.name == "output.weight":
            lm_head += n
        elif "_exps." in t.name and count is not None and used is not None:
            experts += n * int(used.contents()) // int(count.contents())
        else:
            rest += n
    return TokenBytes(experts, embedding_row, lm_head, rest)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each stored type `path` holds ("Q4_K": 73, ...)."""
    import gguf

    out: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return out
