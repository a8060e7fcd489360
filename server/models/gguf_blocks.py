"""Keep a GGUF file's quantised matrices as they are (`--quantization gguf`).

It owns deciding which of a model's matrices can stay in the file's own block format -- every
GGUF tensor that feeds the matrix has one type, and pagewire has a kernel for it (Q8_0, Q4_0,
Q4_1, Q4_K; see server.kernels.quant.GGUF_QTYPES) -- and building those QuantizedWeights from the
tensors' raw block bytes: fused matrices (qkv, gate_up) are the parts' rows one after another, and
llama.cpp's Q/K row permutation is undone on whole rows of blocks, so no value is ever
dequantised. Every other tensor (norms, embeddings, F16/F32, Q5_K/Q6_K matrices, a fused matrix
whose parts differ in type) is dequantised by the loader as usual.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from server.kernels.quant import GGUF_QTYPES, QuantizedWeight
from server.models.gguf_file import GGUFFile

__all__ = ["KeptMatrix", "plan_kept_matrices", "build_quantized", "unpermute_qk"]

# Each decoder matrix of DecoderLayer and the GGUF tensors that make it, rows in this order.
_LAYER_MATRICES = {
    "qkv_weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "o_weight": ("attn_output.weight",),
    "gate_up_weight": ("ffn_gate.weight", "ffn_up.weight"),
    "down_weight": ("ffn_down.weight",),
}
# Phi-3 files store them fused already (ffn_up is gate and up, stacked).
_FUSED_LAYER_MATRICES = {**_LAYER_MATRICES, "qkv_weight": ("attn_qkv.weight",), "gate_up_weight": ("ffn_up.weight",)}


@dataclass(frozen=True)
class KeptMatrix:
    """One model matrix kept quantised: `layer` (None for lm_head), the attribute `name`, its
    `qtype`, and the GGUF tensor names whose rows it stacks."""

    layer: int | None
    name: str
    qtype: str
    parts: tuple[str, ...]


def plan_kept_matrices(f: GGUFFile, num_layers: int, tied: bool, fused: bool = False) -> list[KeptMatrix]:
    """The matrices of a `num_layers` model that stay in the file's block format. A tied model's
    lm_head is kept from token_embd's blocks (the embedding table itself is still dequantised).
    `fused`: the file stores qkv and gate_up as one tensor each (ModelConfig.fused_checkpoint)."""
    groups: list[tuple[int | None, str, tuple[str, ...]]] = []
    for i in range(num_layers):
        for name, parts in (_FUSED_LAYER_MATRICES if fused else _LAYER_MATRICES).items():
            groups.append((i, name, tuple(f"blk.{i}.{p}" for p in parts)))
    head = "token_embd.weight" if tied or "output.weight" not in f.tensors else "output.weight"
    groups.append((None, "lm_head", (head,)))
    kept = []
    for layer, name, parts in groups:
        tensors = [f.tensors.get(p) for p in parts]
        types = {t.type_name for t in tensors if t is not None}
        if any(t is None for t in tensors) or len(types) != 1:
            continue  # missing (the loader reports it) or mixed types: dequantised
        qtype = GGUF_QTYPES.get(types.pop())
        k = tensors[0].shape[-1] if tensors[0] is not None else 0
        if qtype is None or any(t is None or len(t.shape) != 2 or t.shape[1] != k for t in tensors):
            continue
        kept.append(KeptMatrix(layer, name, qtype, parts))
    return kept


def build_quantized(f: GGUFFile, m: KeptMatrix, permute_heads: dict[str, int]) -> QuantizedWeight:
    """The QuantizedWeight of `m` from the file's block bytes; `permute_heads` maps a part's GGUF
    suffix ("attn_q.weight", "attn_k.weight") to its head count when llama.cpp permuted its rows."""
    rows = []
    k = f.tensors[m.parts[0]].shape[1]
    for part in m.parts:
        t = f.tensors[part]
        # A copy: the mapped file is read-only, and the model must not depend on it staying open.
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(t.shape[0], -1)
        heads = permute_heads.get(part.split(".", 2)[-1]) if part.startswith("blk.") else None
        rows.append(unpermute_qk(raw, heads) if heads else raw)
    data = rows[0] if len(rows) == 1 else torch.cat(rows)
    return QuantizedWeight.from_gguf_bytes(m.qtype, data.contiguous(), int(data.shape[0]), int(k))


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order.

    The converter regroups each head's rows from HF's [first half | second half] (rotate-half RoPE)
    to interleaved pairs (ggml's "normal" RoPE): row (h, i, j) of shape [heads, half, 2] came from
    HF row (h, j, i) of [heads, 2, half]. Swapping the two small axes back restores HF's order.
    Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
