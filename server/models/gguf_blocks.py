"""Keep a GGUF file's quantised matrices as they are (`--quantization gguf`).

It owns deciding which of a model's matrices can stay in the file's own block format -- every
GGUF tensor that feeds the matrix has a type pagewire has a kernel for (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and MXFP4 for experts only; see
server.kernels.quant.GGUF_QTYPES; and IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0
and TQ2_0, whose blocks are rewritten exactly into a kernel's format as they are copied:
server.models.gguf_transcode) -- and building
those QuantizedWeights from the tensors' raw block bytes: fused matrices (qkv, gate_up) are the
parts' rows one after another, and llama.cpp's Q/K row permutation is undone on whole rows of
blocks, so no value is ever dequantised. A fused 2-D matrix whose parts differ in type (llama.cpp's
Q4_K_M gives attn_v, or ffn_up, Q6_K in some layers) becomes a QuantizedParts: each run of rows of
one type in its own blocks (server.kernels.quant_parts). The embedding tables (token_embd, Gemma 4's
per_layer_token_embd) stay in their blocks too when an exact row dequantiser reads them
(server.kernels.quant_embedding). Every other
tensor (norms, F16/F32, stacked experts whose parts differ in type) is dequantised by the loader as usual. The
Gated DeltaNet hybrids' matrices need rows (and ssm_out's blocks) moved to the model's order
(server.models.qwen3_next_gguf).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from server.kernels.quant import GGUF_QTYPES, Qtype, QuantizedExperts, QuantizedWeight
from server.kernels.quant_embedding import EMBEDDABLE
from server.kernels.quant_parts import QuantizedParts
from server.models.config import ModelConfig
from server.models.gguf_file import GGUFFile, GGUFTensor
from server.models.gguf_transcode import TRANSCODED, transcode
from server.models.qwen3_next_gguf import QWEN3_NEXT_GGUF, qwen3_next_keepable, qwen3_next_kept_groups

__all__ = ["KeptMatrix", "plan_kept_matrices", "build_quantized", "held_qtype", "unpermute_qk", "EMBEDDING",
           "PER_LAYER_EMBEDDING", "TABLES"]

# Each decoder matrix of DecoderLayer and the GGUF tensors that make it, rows in this order.
_LAYER_MATRICES = {
    "qkv_weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "o_weight": ("attn_output.weight",),
    "gate_up_weight": ("ffn_gate.weight", "ffn_up.weight"),
    "down_weight": ("ffn_down.weight",),
}
# Phi-3 files store them fused already (ffn_up is gate and up, stacked).
# A mixture-of-experts layer's (server.models.moe.SparseMoE, under the layer's `moe`): the stacked
# experts ([E, N, K] tensors, concatenated per expert: gate rows, then up rows) and Qwen2-MoE's shared expert.
_MOE_MATRICES = {
    "moe.experts_gate_up": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "moe.experts_down": ("ffn_down_exps.weight",),
    "moe.shared_gate_up_weight": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
    "moe.shared_down_weight": ("ffn_down_shexp.weight",),
}
_FUSED_LAYER_MATRICES = {**_LAYER_MATRICES, "qkv_weight": ("attn_qkv.weight",), "gate_up_weight": ("ffn_up.weight",)}
# The matrices whose parts may differ in type (kept as a QuantizedParts): every path that runs
# them takes one (ops.linear, and decode_layer / moe_decode / the hybrid layers' "parts:" kind).
_MIXABLE = frozenset({"qkv_weight", "gate_up_weight", "moe.shared_gate_up_weight", "gdn.in_proj"})
MIXED = "mixed"  # KeptMatrix.qtype of a matrix whose parts differ in type
EMBEDDING = "embed_tokens"  # KeptMatrix.name of the token embedding table kept in its blocks
# The embedding tables that can stay in blocks (their rows gathered per step), by model attribute:
# the token embeddings, and Gemma 4's per-layer input embeddings (a vocab x layers * P table).
PER_LAYER_EMBEDDING = "embed_tokens_per_layer"
TABLES = {EMBEDDING: "token_embd.weight", PER_LAYER_EMBEDDING: "per_layer_token_embd.weight"}


@dataclass(frozen=True)
class KeptMatrix:
    """One model matrix kept quantised: `layer` (None for lm_head), the attribute `name`, its
    `qtype` (MIXED when its parts differ in type), the GGUF tensor names whose rows it stacks, and
    with MIXED each part's qtype."""

    layer: int | None
    name: str
    qtype: str
    parts: tuple[str, ...]
    part_qtypes: tuple[str, ...] = ()


def _qkv_parts(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """The GGUF tensors of `layer`'s qkv rows, by what the layer projects (DecoderLayer): queries
    only when it reads another layer's KV (the file may still carry its unused attn_k / attn_v),
    queries and keys when its values are the keys (attention_k_eq_v: no attn_v), else all three."""
    if config.kv_source(layer) != layer:
        return ("attn_q.weight",)
    if config.value_from_key(layer):
        return ("attn_q.weight", "attn_k.weight")
    return _LAYER_MATRICES["qkv_weight"]


def plan_kept_matrices(f: GGUFFile, config: ModelConfig, tied: bool) -> list[KeptMatrix]:
    """The matrices of `config`'s model that stay in the file's block format, layer by layer (each
    layer's qkv from the tensors that layer projects: Gemma 4's global and KV-sharing layers differ).
    A tied model's lm_head is kept from token_embd's blocks, and so are the embedding tables (TABLES,
    last: one QuantizedWeight serves the token embeddings and the lm_head when that is token_embd's;
    Gemma 4's per-layer table too). A fused checkpoint (Phi-3) stores qkv and gate_up as one tensor each."""
    groups: list[tuple[int | None, str, tuple[str, ...]]] = []
    for i in range(config.num_layers):
        matrices = (_FUSED_LAYER_MATRICES if config.fused_checkpoint
                    else {**_LAYER_MATRICES, "qkv_weight": _qkv_parts(config, i)})
        # The Gated DeltaNet hybrids: a DeltaNet layer's in_proj / out_proj (their rows and blocks are
        # reordered as they are built: server.models.qwen3_next_gguf).
        if config.model_type in QWEN3_NEXT_GGUF:
            matrices = {**matrices, **qwen3_next_kept_groups(f, config, i)}
        for name, parts in matrices.items():
            groups.append((i, name, tuple(f"blk.{i}.{p}" for p in parts)))
        if f"blk.{i}.ffn_gate_inp.weight" in f.tensors:  # a sparse layer
            groups += [(i, name, tuple(f"blk.{i}.{p}" for p in parts)) for name, parts in _MOE_MATRICES.items()]
    head = "token_embd.weight" if tied or "output.weight" not in f.tensors else "output.weight"
    groups.append((None, "lm_head", (head,)))
    # The embedding tables too: their rows are gathered from the blocks (server.kernels.quant_embedding),
    # the token table's from the lm_head's own QuantizedWeight when that is token_embd's (the loader shares it).
    groups += [(None, name, (tensor,)) for name, tensor in TABLES.items() if tensor in f.tensors]
    kept = []
    for layer, name, parts in groups:
        tensors = [f.tensors.get(p) for p in parts]
        if any(t is None for t in tensors):
            continue  # missing: the loader reports it
        qtypes = [held_qtype(t.type_name) for t in tensors if t is not None]
        mixed = len(set(qtypes)) != 1
        if mixed and name not in _MIXABLE:
            continue  # stacked experts (one format per QuantizedExperts), lm_head: dequantised
        if any(q is None or q is Qtype.MXFP4 and not name.startswith("moe.experts") for q in qtypes):
            continue  # no kernel; GGUF files ship MXFP4 for experts only: dequantised at load
        if name in TABLES and any(q not in EMBEDDABLE for q in qtypes):
            continue  # no exact row dequantiser: a float table
        k = tensors[0].shape[-1] if tensors[0] is not None else 0
        dims = 3 if name.startswith("moe.experts") else 2  # experts: [E, N, K], alike in E
        lead = tensors[0].shape[0] if tensors[0] is not None else 0
        if any(t is None or len(t.shape) != dims or t.shape[-1] != k
               or (dims == 3 and t.shape[0] != lead) for t in tensors):
            continue
        if config.model_type in QWEN3_NEXT_GGUF and not qwen3_next_keepable(f, config, name, parts):
            continue
        if mixed:
            kept.append(KeptMatrix(layer, name, MIXED, parts, tuple(str(q) for q in qtypes)))
        else:
            kept.append(KeptMatrix(layer, name, str(qtypes[0]), parts))
    return kept


def build_quantized(f: GGUFFile, m: KeptMatrix, permute_heads: dict[str, int],
                    reorder: Callable[[KeptMatrix, torch.Tensor], torch.Tensor] | None = None,
                    ) -> QuantizedWeight | QuantizedExperts | QuantizedParts:
    """The QuantizedWeight of `m` from the file's block bytes (a QuantizedParts when its parts
    differ in type); `permute_heads` maps a part's GGUF suffix ("attn_q.weight", "attn_k.weight")
    to its head count when llama.cpp permuted its rows; `reorder` puts the stacked rows' bytes in
    the model's order (the Gated DeltaNet hybrids)."""
    if m.part_qtypes:
        return _build_parts(f, m, permute_heads, reorder)
    first = f.tensors[m.parts[0]]
    if len(first.shape) == 3:  # stacked experts: each expert's rows of every part, in order
        e, k = first.shape[0], first.shape[2]
        stacked = [torch.from_numpy(_kept_bytes(f.tensors[p])).reshape(e, f.tensors[p].shape[1], -1)
                   for p in m.parts]
        data3 = stacked[0] if len(stacked) == 1 else torch.cat(stacked, dim=1)
        return QuantizedExperts.from_gguf_bytes(m.qtype, data3.contiguous(), int(e), int(data3.shape[1]), int(k))
    k = first.shape[1]
    rows = [_part_rows(f, part, permute_heads) for part in m.parts]
    data = rows[0] if len(rows) == 1 else torch.cat(rows)
    if reorder is not None:
        data = reorder(m, data)
    return QuantizedWeight.from_gguf_bytes(m.qtype, data.contiguous(), int(data.shape[0]), int(k))


def _part_rows(f: GGUFFile, part: str, permute_heads: dict[str, int]) -> torch.Tensor:
    """A 2-D part's block bytes [rows, bytes per row] in HF's row order (Q/K un-permuted)."""
    t = f.tensors[part]
    raw = torch.from_numpy(_kept_bytes(t)).reshape(t.shape[0], -1)
    heads = permute_heads.get(part.split(".", 2)[-1]) if part.startswith("blk.") else None
    return unpermute_qk(raw, heads) if heads else raw


def held_qtype(type_name: str) -> Qtype | None:
    """The qtype a GGUF tensor type is kept as (its own blocks, or TRANSCODED's rewrite); None: no kernel."""
    return GGUF_QTYPES.get(type_name) or TRANSCODED.get(type_name)


def _kept_bytes(t: GGUFTensor) -> np.ndarray:
    """A copy of `t`'s blocks, [rows..., bytes per row] uint8: the mapped file is read-only and the
    model must not depend on it staying open. A TRANSCODED type's blocks are rewritten (the copy)."""
    raw = np.asarray(t.data, dtype=np.uint8).reshape(*t.shape[:-1], -1)
    if t.type_name in TRANSCODED:
        return transcode(t.type_name, raw)
    return np.array(raw)


def _build_parts(f: GGUFFile, m: KeptMatrix, permute_heads: dict[str, int],
                 reorder: Callable[[KeptMatrix, torch.Tensor], torch.Tensor] | None) -> QuantizedParts:
    """A matrix whose parts differ in type: its rows in the model's order, cut into runs of one
    type, each run a QuantizedWeight of its rows' blocks. Without `reorder` the runs are the parts
    (same-typed neighbours joined); a hybrid's reorder moves whole rows of a multi-part matrix, so
    applied to the stacked row numbers it gives each model row's source row, and the runs follow
    it (a gated attention's qkv: [q | k | v | gate] from attn_q's interleaved q and gate rows)."""
    raws = [_part_rows(f, p, permute_heads) for p in m.parts]
    k = int(f.tensors[m.parts[0]].shape[1])
    part_of = torch.cat([torch.full((r.shape[0],), i, dtype=torch.long) for i, r in enumerate(raws)])
    row_in = torch.cat([torch.arange(r.shape[0]) for r in raws])
    if reorder is not None:
        order = reorder(m, torch.arange(part_of.numel()).view(-1, 1)).view(-1)
        part_of, row_in = part_of[order], row_in[order]
    parts_l, rows_l = part_of.tolist(), row_in.tolist()
    qtype_of = [m.part_qtypes[i] for i in parts_l]
    runs: list[QuantizedWeight] = []
    start = 0
    for end in range(1, len(qtype_of) + 1):
        if end < len(qtype_of) and qtype_of[end] == qtype_of[start]:
            continue
        # The run's rows as slices of consecutive rows of one part (one slice per part without a
        # reorder, one per head with a gated attention's), joined (one type, one K: one row width).
        pieces, i = [], start
        while i < end:
            j = i + 1
            while j < end and parts_l[j] == parts_l[i] and rows_l[j] == rows_l[j - 1] + 1:
                j += 1
            pieces.append(raws[parts_l[i]][rows_l[i] : rows_l[i] + j - i])
            i = j
        data = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        runs.append(QuantizedWeight.from_gguf_bytes(qtype_of[start], data.contiguous(), end - start, k))
        start = end
    return QuantizedParts.join(runs)


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
