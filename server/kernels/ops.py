"""Typed Python entry points for the pagewire tensor ops (torch.ops.pagewire.*) and their fake kernels.

Shapes: T = tokens in the flat batch, S = sequences, H = query heads, KVH = KV heads, D = head_dim,
NB = physical KV blocks, BS = block_size. All argument checking happens in the C++ kernels, which
raise RuntimeError naming the offending argument.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

import server._C  # (also loads the TORCH_LIBRARY(pagewire) registrations)
from server.kernels import batch_invariant, linear_plan, quant_embedding
from server.kernels.kinds import LinearKind, Qtype
from server.kernels.quant import QuantizedExperts, QuantizedWeight
from server.kernels.quant_parts import QuantizedParts

__all__ = [
    "write_kv_cache", "paged_attention", "copy_blocks", "linear", "rms_norm", "add_rms_norm",
    "rotary_embedding", "silu_and_mul", "gelu_tanh_and_mul", "moe_experts", "moe_decode", "ngram_propose",
    "rejection_sample", "cpu_isa", "detected_cpu_isa", "lora_add", "cpu_features", "without_amx",
]

logger = logging.getLogger(__name__)


def cpu_features() -> dict[str, object]:
    """CPUID features of this CPU as the extension detected them (vendor, brand, avx2, avx512bf16, amx_bf16, ...)."""
    return dict(server._C.cpu_features())


def cpu_isa() -> str:
    """The CPU kernel family in use: "amx", "avx512bf16", "avx512", "avx2" or "portable" (torch fallback).

    It is the best the CPU supports, lowered by $PAGEWIRE_CPU_ISA when that names a lower family.
    """
    return str(server._C.cpu_isa())


def detected_cpu_isa() -> str:
    """The best CPU kernel family this CPU supports (as cpu_isa() names them), ignoring $PAGEWIRE_CPU_ISA."""
    return str(server._C.detected_cpu_isa())


def _log_cpu_dispatch() -> None:
    f = cpu_features()
    flags = " ".join(k for k, v in f.items() if v is True)
    logger.info("CPU kernels: %s (detected %s) on %s %s; flags: %s", cpu_isa(), server._C.detected_cpu_isa(),
                f.get("vendor", "?"), f.get("brand", "?"), flags or "none")


_log_cpu_dispatch()
_ACTIVE_ISA = cpu_isa()  # fixed at load, like the C++ side's choice


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into the paged cache, in place.

    Args:
        key: [T, KVH, D], the cache dtype, contiguous in D.
        value: [T, KVH, D], like key.
        key_cache: [NB, KVH, BS, D], contiguous; written at the slots below.
        value_cache: [NB, KVH, BS, D], like key_cache.
        slot_mapping: int64 [T]; slot = block * BS + offset; -1 marks padding (skipped).
    """
    torch.ops.pagewire.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    max_query_len: int,
    max_seq_len: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of a flat mixed batch (prefill chunks and decodes) over the paged cache.

    Query token i of sequence s sits at position seq_lens[s] - q_len + i and attends to cached
    positions p <= its own (and, when sliding_window > 0, to p with position - p < sliding_window).
    The cache must already hold this step's keys and values (call write_kv_cache first).

    Args:
        out: [T, H, D], query's dtype; overwritten with the attention output.
        query: [T, H, D] float32, bfloat16 or float16, contiguous in D; H % KVH == 0.
        key_cache: [NB, KVH, BS, D], query's dtype, contiguous.
        value_cache: [NB, KVH, BS, D], like key_cache.
        block_tables: int32 [S, max_blocks], physical block ids of each sequence.
        seq_lens: int32 [S], tokens in the cache after this step (context + new).
        query_start_loc: int32 [S + 1], prefix sum of new tokens per sequence; every q_len >= 1.
        scale: the scores' scale (per layer: usually D ** -0.5, Gemma's query_pre_attn_scalar ** -0.5).
        sliding_window: window size in tokens (the token itself included); <= 0 disables it.
        max_query_len: an upper bound on q_len over the batch.
        max_seq_len: an upper bound on seq_lens over the batch.
        softcap: 0 for none; > 0 caps every scaled score s to softcap * tanh(s / softcap) before
            the mask and softmax (Gemma 2's attn_logit_softcapping).
        sinks: None, or float32 [H] on query's device: gpt-oss's attention sinks, one learned logit
            per query head that joins every row's softmax denominator and carries no value.
    """
    torch.ops.pagewire.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, sliding_window, max_query_len, max_seq_len, softcap, sinks,
    )


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole physical blocks (copy-on-write) in every layer's key and value cache, in place.

    Args:
        key_caches: one [NB, KVH, BS, D] tensor per layer, all the same shape.
        value_caches: one per layer, shaped like key_caches.
        block_mapping: int64 [N, 2] of (src, dst) block ids; destinations must be distinct and
            must not also be sources.
    """
    torch.ops.pagewire.copy_blocks(list(key_caches), list(value_caches), block_mapping)


# Largest row count (tokens) for which the AVX512-BF16 kernel is used; above it oneDNN's native
# bf16 GEMM wins. AVX2 CPUs have no native bf16 dot product and torch's bf16 GEMM there is 4-10x
# slower than the AVX2 kernel at every M measured (8-16 rows in bench/kernels.py linear, whole
# prefills in bench/determinism.py: bench/RESULTS.md), so on AVX2 the kernel takes every row count.
LINEAR_KERNEL_MAX_M = 16
BF16_KERNEL_EVERY_M = _ACTIVE_ISA == "avx2"
# Rows the Q8_0 kernel takes per call (kQ8KernelMaxRows in csrc/ops.h); beyond it the op
# dequantises and runs ATen's GEMM, so batch-invariant mode calls it in blocks of this size.
Q8_KERNEL_MAX_ROWS = 16


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | QuantizedParts, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y = x @ weight.T + bias, exactly torch.nn.functional.linear's semantics.

    A QuantizedWeight runs its format's kernel, pagewire::linear_q8_0 or pagewire::linear_q4 (x
    quantised per row to Q8 blocks on the fly, integer block dot products, fp32 accumulation; the
    result is in x's dtype); above Q8_KERNEL_MAX_ROWS rows the op dequantises and runs ATen's GEMM.
    A QuantizedParts (row ranges in different formats) runs each part by these rules, its plan
    included, into its columns of the result.

    CPU bf16 inputs without autograd run the pagewire kernel of the CPU's instruction set (fp32
    accumulation, one bf16 rounding): on AVX512-BF16 CPUs up to LINEAR_KERNEL_MAX_M rows (decode
    batches), on AVX2+FMA CPUs at every row count; anything else, or a CPU with neither, is F.linear.

    Those are the fixed rules. While an autotune table is active on this thread (the engine's
    steps, server.kernels.autotune), a weight shape it tuned takes the path it chose for the row
    count's bucket instead: kernel or F.linear for bf16 and fp32 weights, the integer kernel or
    dequantise + GEMM for quantised ones.

    In batch-invariant mode (server.kernels.batch_invariant) every row count takes a path whose
    per-row result does not depend on the other rows: see _linear_batch_invariant.

    Args:
        x: [..., K].
        weight: [N, K] (nn.Linear layout), x's dtype.
        bias: [N] or None.

    Returns:
        [..., N] in x's dtype.
    """
    # This runs ~65-120 times per decode step, so its Python is kept lean (each check below is a
    # fraction of a microsecond; the op itself is ~5 us): tensor properties instead of torch.device
    # objects, one autograd test, no reshapes for the engine's 2-D activations.
    if isinstance(weight, QuantizedParts):
        return weight.map_rows(x, bias, linear)
    grad = torch.is_grad_enabled() and (
        x.requires_grad or isinstance(weight, torch.Tensor) and weight.requires_grad
        or (bias is not None and bias.requires_grad))
    if not grad and batch_invariant.enabled():  # (autograd keeps F.linear: the kernels have no backward)
        return _linear_batch_invariant(x, weight, bias)
    if isinstance(weight, QuantizedWeight):
        plans = linear_plan.active_table()
        plan = plans.get((weight.qtype, x.dtype, weight.shape)) if plans is not None else None
        if plan is not None:
            choice = plan[linear_plan.bucket(x.numel() // weight.shape[1])]
            if choice == linear_plan.KERNEL_NO_AMX:
                return without_amx(_quant_kernel_path, x, weight, bias)
            return (_quant_kernel_path if choice else _quant_gemm_path)(x, weight, bias)
        return _linear_quantized(x, weight, bias)
    dtype = x.dtype
    if (
        not grad
        and (dtype is torch.bfloat16 or dtype is torch.float32)
        and weight.dtype is dtype
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and weight.shape[1] > 0
        and (bias is None or (bias.dtype is dtype and bias.is_cpu))
    ):
        m = x.numel() // weight.shape[1]
        plans = linear_plan.active_table()
        plan = plans.get((dtype, weight.shape)) if plans is not None else None
        if plan is not None:
            use_kernel = plan[linear_plan.bucket(m)]
            if use_kernel == linear_plan.KERNEL_NO_AMX:
                return without_amx(_float_kernel_path, x, weight, bias)
        else:
            use_kernel = fixed_rule_takes_kernel(weight, m)
        if use_kernel:
            return _float_kernel_path(x, weight, bias)
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, table: torch.Tensor | QuantizedWeight,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """F.embedding(ids, table), also for a bf16 table moved into the x8 layout (a tied model's
    table, which its lm_head projects with: DecoderForCausalLM.interleave_bf16), and for a table
    kept in a GGUF file's blocks (`--quantization gguf`), whose rows come out in `dtype` (the
    model's), equal to the dequantised table's rows (server.kernels.quant_embedding)."""
    if isinstance(table, QuantizedWeight):
        if table.qtype is Qtype.BF16:
            return torch.ops.pagewire.embedding_bf16x8(ids, table.data)
        if dtype is None:
            raise ValueError(f"dtype: a {table.qtype} embedding table needs the dtype its rows come out in")
        return quant_embedding.gather_rows(table, ids, dtype)
    return F.embedding(ids, table)


def linear_kind(dtype: torch.dtype, m: int, weight: torch.Tensor | QuantizedWeight | QuantizedParts,
                bias: Optional[torch.Tensor]) -> Optional[str]:
    """The path `linear` takes for a CPU activation [m, K] of `dtype` (no autograd,
    m <= Q8_KERNEL_MAX_ROWS), named as pagewire::decode_layer takes it: "kernel" (pagewire::linear),
    "torch" (F.linear), "q8_0" / "q8_0x8", a linear_q4 qtype, or for a QuantizedParts
    "parts:KIND*ROWS+..." with each part's own kind; None where that path (or a part's) is not one
    decode_layer has (dequantise + GEMM, AMX turned off for the call, fixed-block F.linear).

    It follows `linear`'s rules line for line, batch-invariant mode's included;
    tests/models/test_decode_layer.py checks that the fused layer gives exactly the unfused layer's
    floats in both modes, so the two cannot drift apart unseen."""
    if isinstance(weight, QuantizedParts):
        kinds = [linear_kind(dtype, m, p, None) for p in weight.parts]
        return None if None in kinds else weight.kind_of([str(k) for k in kinds])
    float_kernel = (
        (dtype is torch.bfloat16 or dtype is torch.float32)
        and isinstance(weight, torch.Tensor)
        and weight.dtype is dtype
        and weight.is_cpu
        and weight.dim() == 2
        and weight.shape[0] > 0
        and weight.shape[1] > 0
        and (bias is None or (bias.dtype is dtype and bias.is_cpu))
    )
    if batch_invariant.enabled():  # _linear_batch_invariant's paths
        if isinstance(weight, QuantizedWeight):
            return weight.op_qtype
        return LinearKind.KERNEL if float_kernel and _ACTIVE_ISA != "portable" else None
    plans = linear_plan.active_table()
    if isinstance(weight, QuantizedWeight):
        plan = plans.get((weight.qtype, dtype, weight.shape)) if plans is not None else None
        if plan is not None:
            choice = plan[linear_plan.bucket(m)]
            if choice == linear_plan.KERNEL_NO_AMX or not choice:
                return None
        return weight.op_qtype
    if float_kernel:
        assert isinstance(weight, torch.Tensor)
        plan = plans.get((dtype, weight.shape)) if plans is not None else None
        if plan is not None:
            use_kernel = plan[linear_plan.bucket(m)]
            if use_kernel == linear_plan.KERNEL_NO_AMX:
                return None
        else:
            use_kernel = fixed_rule_takes_kernel(weight, m)
        if use_kernel:
            return LinearKind.KERNEL
    return LinearKind.TORCH


def fixed_rule_takes_kernel(weight: torch.Tensor | QuantizedWeight, m: int) -> bool:
    """Whether linear's fixed rule (no autotune table) takes the kernel path for m rows: quantised
    weights up to Q8_KERNEL_MAX_ROWS (above it their op dequantises and runs ATen's GEMM); bf16 on
    AVX2 at every m, elsewhere up to LINEAR_KERNEL_MAX_M; fp32 never (F.linear outside
    deterministic mode). The autotune starts from this rule and keeps it unless timing says otherwise."""
    if isinstance(weight, QuantizedWeight):  # (an x8 bf16 weight: the AVX2 kernel, as bf16 on AVX2)
        return m <= Q8_KERNEL_MAX_ROWS or weight.qtype is Qtype.BF16
    return weight.dtype == torch.bfloat16 and (BF16_KERNEL_EVERY_M or m <= LINEAR_KERNEL_MAX_M)


def without_amx(path: Callable[[torch.Tensor, Any, Optional[torch.Tensor]], torch.Tensor], x: torch.Tensor,
                weight: Any, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """path(x, weight, bias) with the linear ops' AMX kernels off on this thread (the autotune
    measured the AVX-512 kernel faster for this shape and row count)."""
    server._C.set_amx_allowed(False)
    try:
        return path(x, weight, bias)
    finally:
        server._C.set_amx_allowed(True)


# The two paths of each weight kind; server.kernels.autotune times exactly these.
def _float_kernel_path(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """pagewire::linear: the bf16 kernel of the CPU's family, or the fp32 AVX2 kernel."""
    if x.dim() == 2:
        return torch.ops.pagewire.linear(x, weight, bias)
    out = torch.ops.pagewire.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _float_torch_path(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _quant_kernel_path(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The format's integer kernel at every row count: in blocks of Q8_KERNEL_MAX_ROWS rows above it
    (an x8 bf16 weight's kernel takes any row count in one call, streaming the weight once)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m <= Q8_KERNEL_MAX_ROWS or weight.qtype is Qtype.BF16:
        out = weight.linear(x2, bias)
    else:
        out = torch.cat([weight.linear(x2[i : i + Q8_KERNEL_MAX_ROWS], bias) for i in range(0, m, Q8_KERNEL_MAX_ROWS)])
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _quant_gemm_path(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Dequantise + ATen's GEMM at every row count (above Q8_KERNEL_MAX_ROWS the op does it itself,
    a chunk of weight rows at a time)."""
    if x.numel() > Q8_KERNEL_MAX_ROWS * x.shape[-1] and weight.qtype is not Qtype.BF16:
        return _linear_quantized(x, weight, bias)
    return F.linear(x, weight.dequantize(x.dtype), bias)


def _linear_quantized(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A QuantizedWeight's linear: its format's kernel (which may take another path above its row limit)."""
    if x.dim() == 2:
        return weight.linear(x, bias)
    out = weight.linear(x.reshape(-1, x.shape[-1]), bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _linear_batch_invariant(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """linear whose row i depends only on x[i] (and the weights), whatever the number of rows.

    - Quantised weights: _quant_kernel_path, the kernel in blocks of at most Q8_KERNEL_MAX_ROWS rows, so the
      format's small-batch kernel serves every row and its dequantise-and-GEMM path for large
      batches never runs (Q8_0: x quantised per row, integer block dots, one fp32 chain per
      output; any other format's kernel must be per-row invariant the same way, docs/determinism.md).
    - CPU bf16 / fp32 on an AVX2 or AVX512-BF16 CPU: pagewire::linear at any M (the bf16 kernel
      of the ISA, or the fp32 AVX2 kernel), which accumulates each output in an order fixed by K.
    - Anything else (other dtypes, other devices, CPUs without AVX2): F.linear over fixed blocks of
      batch_invariant.BLOCK_ROWS rows, the last one zero-padded, so the library GEMM always sees
      one shape and picks one algorithm (and one K split) for every row.
    """
    if isinstance(weight, QuantizedWeight):
        return _quant_kernel_path(x, weight, bias)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    n = weight.shape[0]
    if (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and weight.dtype == x.dtype
        and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu"))
        and _ACTIVE_ISA != "portable"
        and k > 0
        and n > 0
    ):
        return torch.ops.pagewire.linear(x2, weight, bias).reshape(*x.shape[:-1], n)
    b = batch_invariant.BLOCK_ROWS
    pad = (-m) % b
    xp = torch.cat([x2, x2.new_zeros((pad, k))]) if pad else x2
    out = torch.cat([F.linear(xp[i : i + b], weight, bias) for i in range(0, m + pad, b)])
    return out[:m].reshape(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight with transformers' rounding (CPU op).

    Args: x [T, d] contiguous in d; weight [d], x's dtype. Returns a new [T, d] tensor.
    """
    return torch.ops.pagewire.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta in place (rounded to its dtype), then return RMSNorm(residual) * weight (CPU op).

    Args: residual [T, d] (mutated); delta [T, d]; weight [d]; all one dtype, contiguous in d.
    """
    return torch.ops.pagewire.add_rms_norm(residual, delta, weight, eps)


def rotary_embedding(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> None:
    """Rotate-half RoPE (HF Llama convention) of x in place (CPU op).

    Args:
        x: [T, heads, head_dim], any row/head strides with head_dim contiguous (e.g. the q and k
            columns of a fused qkv output); overwritten.
        positions: int64 [T], each in [0, cos.shape[0]).
        cos, sin: float32 [max_positions, head_dim // 2] tables (RotaryEmbedding.cos/.sin; any
            scaling such as llama3's is already in them).
        norm_weight: [heads, head_dim] in x's dtype, or None. When given, each head is first
            RMSNorm'ed over head_dim with its row (Qwen3's q_norm / k_norm).
        eps: the norm's epsilon.
    """
    torch.ops.pagewire.rotary_embedding(x, positions, cos, sin, norm_weight, eps)


def short_conv(bcx: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor], state: torch.Tensor,
               slots: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution: bcx [T, 3C] (in_proj's B, C, x chunks) -> [T, C] =
    C * causal_conv(B * x) per sequence (query_start_loc int32 [S + 1]), each continuing from and
    updating its state slot (state [slots, K - 1, C] of bcx's dtype, slots int64 [S]); weight_t
    fp32 [K, C], bias fp32 [C] or None. AVX-512 / AVX2 / portable bodies (csrc/cpu/short_conv*)."""
    return torch.ops.pagewire.short_conv(bcx, weight_t, bias, state, slots, query_start_loc)


def lora_add(out: torch.Tensor, x: torch.Tensor, adapter: torch.Tensor, a: torch.Tensor, spans: torch.Tensor,
             scales: torch.Tensor, bts: Sequence[torch.Tensor], parts: Sequence[int]) -> None:
    """Each row's own LoRA term for one fused projection, added to out [T, N] in place (CPU op,
    csrc/cpu/lora*.cpp: AVX2 or portable bodies, the same bits): for row t with adapter[t] = k >= 0
    (int32 [T], -1: none) and each part p (a PEFT module of the matrix), out[t, row_p : row_p +
    rows_p] += scales[k] · B_p[k] · A_p[k] · x[t], rounded as PEFT in x's dtype (float32,
    bfloat16, float16). a [R, in]: every adapter's A rows stacked; bts[p] [C_p, rows_p]: part p's
    Bᵀ over rows [c0_p, c0_p + C_p) of a; spans int32 [n, P, 2]: adapter k's (first row of a, rank)
    in part p (rank 0: none); scales float32 [n]; parts: (row_p, rows_p, c0_p) per part. A row's
    result depends on its own adapter only, not on the other rows of the call. Off CPU: the same
    sum from torch ops (lora_add_torch)."""
    if x.device.type != "cpu":
        lora_add_torch(out, x, adapter, a, spans, scales, bts, parts)
        return
    torch.ops.pagewire.lora_add(out, x, adapter, a, spans, scales, list(bts), list(parts))


def lora_add_torch(out: torch.Tensor, x: torch.Tensor, adapter: torch.Tensor, a: torch.Tensor, spans: torch.Tensor,
                   scales: torch.Tensor, bts: Sequence[torch.Tensor], parts: Sequence[int]) -> None:
    """lora_add from torch ops, adapter by adapter over its rows (devices without the CPU kernel;
    the rounding of torch's matmuls, not the kernel's)."""
    for k, part_spans in enumerate(spans.tolist()):
        rows = torch.nonzero(adapter == k).view(-1)
        if rows.numel() == 0:
            continue
        xr = x.index_select(0, rows)
        for p, (first, cnt) in enumerate(part_spans):
            if cnt == 0:
                continue
            row, width, c0 = parts[3 * p : 3 * p + 3]
            u = xr @ a[first : first + cnt].t()
            d = (u @ bts[p][first - c0 : first - c0 + cnt]) * float(scales[k])
            out[:, row : row + width].index_add_(0, rows, d)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Args: x [T, 2 * I] = cat(gate, up), contiguous in the last dim. Returns silu(gate) * up [T, I] (CPU op)."""
    return torch.ops.pagewire.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Args: x [T, 2 * I] = cat(gate, up), contiguous in the last dim. Returns
    gelu(gate, approximate="tanh") * up [T, I] (CPU op; Gemma's gelu_pytorch_tanh MLP)."""
    return torch.ops.pagewire.gelu_tanh_and_mul(x)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                gate_up: torch.Tensor | QuantizedExperts, down: torch.Tensor | QuantizedExperts,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer (CPU op, csrc/cpu/moe.cpp): for each token
    t, sum_j topk_weights[t, j] * down_e(act(gate_up_e(x_t))) with e = topk_ids[t, j], where act is
    silu(gate) * up or, with activation "swiglu_oai", gpt-oss's clamped SwiGLU
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

    Tokens are grouped by expert and each expert used runs its matrices once over its rows on the
    small-M kernels (float, or its GGUF blocks); experts no token chose are not read. Each token's
    k results are summed in slot order in fp32, so in batch-invariant mode a token's output does
    not depend on the other tokens of the step.

    Args:
        x: [T, H] float32, bfloat16 or float16.
        topk_ids: int64 [T, k], the chosen experts (-1: an empty slot).
        topk_weights: float32 [T, k], their weights.
        gate_up: [E, 2I, H] in x's dtype (gate rows, then up rows, per expert), or QuantizedExperts.
        down: [E, H, I] in x's dtype, or QuantizedExperts.
        gate_up_bias, down_bias: None, or [E, 2I] / [E, H] in x's dtype (gpt-oss's expert biases).
    Returns:
        [T, H] in x's dtype.
    """
    gk, gw = (gate_up.op_qtype, gate_up.data) if isinstance(gate_up, QuantizedExperts) else ("float", gate_up)
    dk, dw = (down.op_qtype, down.data) if isinstance(down, QuantizedExperts) else ("float", down)
    return torch.ops.pagewire.moe_experts(x, topk_ids, topk_weights, gw, str(gk), dw, str(dk), gate_up_bias,
                                          down_bias, activation, alpha, limit)


def moe_decode(x: torch.Tensor, router_weight: torch.Tensor, router_kind: str, router_bias: torch.Tensor | None,
               router: str, top_k: int, norm_topk_prob: bool,
               gate_up: torch.Tensor | QuantizedExperts, down: torch.Tensor | QuantizedExperts,
               gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, activation: str, alpha: float,
               limit: float, shared: tuple[torch.Tensor, str, torch.Tensor, str, torch.Tensor | None, str] | None = None,
               selection_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
               routed_scaling: float = 1.0) -> torch.Tensor:
    """A mixture-of-experts layer's whole MLP for at most Q8_KERNEL_MAX_ROWS CPU tokens in one
    call (csrc/cpu/moe_decode.cpp): the router (x @ router_weight^T (+ router_bias) by the path
    `router_kind` names, as linear_kind gives it for router_weight's dtype -- x is cast to it when
    they differ (a float32 router in a bf16 model); then router "softmax_topk": fp32 softmax, top_k,
    renormalised when norm_topk_prob, "topk_softmax": gpt-oss's softmax over the top k logits, or
    "sigmoid_topk": fp32 sigmoid scores; for the fp32 scorings `selection_bias` [E] (added to the
    scores to choose, not to the weights), `n_group` / `topk_group` (group-limited choice) and
    `routed_scaling` (multiplies the weights) as server.models.moe_router.route applies them),
    the chosen experts as moe_experts runs them, and optionally a shared expert `shared` =
    (gate_up [2S, H], its kind, down [H, S], its kind, gate [1, H] or None, its kind or ""), added
    times sigmoid(x @ gate^T) (Qwen2-MoE) or as it is (no gate: dots.llm1). Quantised experts on
    AVX2 or better run in one OpenMP region, every thread streaming its share of the chosen
    experts' rows; float experts go through moe_experts.

    Returns [T, H] in x's dtype."""
    gk, gw = (gate_up.op_qtype, gate_up.data) if isinstance(gate_up, QuantizedExperts) else ("float", gate_up)
    dk, dw = (down.op_qtype, down.data) if isinstance(down, QuantizedExperts) else ("float", down)
    sgu, sgu_kind, sdn, sdn_kind, sg, sg_kind = shared if shared is not None else (None, "", None, "", None, "")
    return torch.ops.pagewire.moe_decode(x, router_weight, router_kind, router_bias, router, top_k, norm_topk_prob,
                                         gw, str(gk), dw, str(dk), gate_up_bias, down_bias, activation, alpha, limit,
                                         sgu, sgu_kind, sdn, sdn_kind, sg, sg_kind, selection_bias, n_group,
                                         topk_group, routed_scaling)


def ngram_propose(
    token_ids: Sequence[torch.Tensor], num_tokens: torch.Tensor, k: int, min_n: int, max_n: int
) -> torch.Tensor:
    """Prompt lookup, batched (CPU op): per sequence, find the latest earlier occurrence of its
    longest suffix n-gram (min_n <= n <= max_n) and propose the k tokens that followed it.

    Args:
        token_ids: S contiguous int64 CPU vectors, each a sequence's prompt + output tokens (a
            buffer may be longer than its used part).
        num_tokens: int64 [S], the used length of each vector.
        k: tokens to propose per sequence.
    Returns:
        int64 [S, k]; a row with no match of at least min_n tokens is all -1. A continuation that
        runs past the end of the sequence repeats itself (an overlapping copy), so periodic text
        still gets k tokens.
    """
    return torch.ops.pagewire.ngram_propose(list(token_ids), num_tokens, k, min_n, max_n)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: Optional[torch.Tensor],
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

    S sequences; sequence i has k_i = cu_num_draft[i + 1] - cu_num_draft[i] drafts and k_i + 1
    target rows, starting at row cu_num_draft[i] + i (the last one scores the bonus position).
    Greedy rows accept the longest prefix of drafts equal to the target's argmax and then emit the
    target's token. Sampled rows accept draft d with probability min(1, p(d) / q(d)); the first
    rejection emits a draw from the residual max(p - q, 0) (renormalised), and when every draft
    is accepted the bonus token is drawn from the last target row, so every emitted token is
    distributed exactly as the target's.

    Args:
        draft_token_ids: int64 [ND].
        cu_num_draft: int64 [S + 1], cumulative drafts, starting at 0.
        draft_probs: float32 [ND, V] (a draft model's distributions) or None: each draft is a
            point mass (the n-gram proposer), so q(d) = 1.
        target_probs: float32 [ND + S, V], normalised (after temperature and top-k/top-p/min-p);
            None only when every row is greedy.
        target_argmax: int64 [ND + S], each target row's greedy token.
        is_greedy: bool [S].
        uniform: float64 [ND + S] in [0, 1): draw j of a sequence decides draft j; its last draw
            picks the residual or bonus token. Taken from the request's own generator when seeded.
    Returns:
        (output_token_ids int64 [S, max k_i + 1], -1 padded; num_emitted int64 [S], each in 1..k_i + 1).
    """
    if target_probs is None and not bool(is_greedy.all()):
        raise ValueError("target_probs: required when a row is not greedy")
    out, num_emitted = torch.ops.pagewire.rejection_sample(
        draft_token_ids, cu_num_draft, draft_probs, target_probs, target_argmax, is_greedy, uniform
    )
    return out, num_emitted


# Fake (meta) kernels of every op, for torch.compile and opcheck (registered on import).
import server.kernels.op_fakes  # noqa: E402,F401
