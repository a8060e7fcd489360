"""`linear`'s routing rules: which path y = x @ W.T + b takes for each weight kind, row count and
mode, and the paths themselves.

It owns `linear` (re-exported as server.kernels.ops.linear), `linear_kind` (the same rules named
for pagewire::decode_layer and pagewire::moe_decode), `fixed_rule_takes_kernel` (the rule without an
autotune table), `without_amx`, the kernel / GEMM paths of each weight kind that
server.kernels.autotune times, the batch-invariant linear, and `embedding` (a table in the float or
x8 bf16 layout). The paths: the pagewire linear kernels of the CPU's instruction set, the GGUF
formats' integer kernels (QuantizedWeight), each part of a QuantizedParts by these same rules, or
torch's F.linear / dequantise + GEMM; an active autotune table (server.kernels.linear_plan) or
batch-invariant mode (server.kernels.batch_invariant) can change the choice. The typed wrappers of
the other pagewire ops are server.kernels.ops's.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import server._C  # (also loads the TORCH_LIBRARY(pagewire) registrations)
from server.kernels import batch_invariant, linear_plan, quant_embedding
from server.kernels.kinds import LinearKind, Qtype
from server.kernels.quant import KERNEL_MAX_ROWS, QuantizedWeight
from server.kernels.quant_parts import QuantizedParts

__all__ = [
    "linear", "linear_kind", "fixed_rule_takes_kernel", "without_amx", "embedding",
    "LINEAR_KERNEL_MAX_M", "BF16_KERNEL_EVERY_M", "Q8_KERNEL_MAX_ROWS",
]

# The CPU kernel family the linear ops use (server.kernels.ops.cpu_isa), fixed at load like the C++
# side's choice.
_ACTIVE_ISA = str(server._C.cpu_isa())


# Largest row count (tokens) for which the AVX512-BF16 kernel is used; above it oneDNN's native
# bf16 GEMM wins. AVX2 CPUs have no native bf16 dot product and torch's bf16 GEMM there is 4-10x
# slower than the AVX2 kernel at every M measured (8-16 rows in bench/kernels.py linear, whole
# prefills in bench/determinism.py: bench/RESULTS.md), so on AVX2 the kernel takes every row count.
LINEAR_KERNEL_MAX_M = 16
BF16_KERNEL_EVERY_M = _ACTIVE_ISA == "avx2"
# Rows the integer kernels take per call (kQ8KernelMaxRows in csrc/ops.h); beyond it the op
# dequantises and runs ATen's GEMM, so the kernel path (batch-invariant mode's included) runs them
# in blocks of this size (QuantizedWeight.linear_rows).
Q8_KERNEL_MAX_ROWS = KERNEL_MAX_ROWS


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
        if table.qtype is Qtype.BF16Z:
            return torch.ops.pagewire.embedding_bf16z(ids, table.data, table.shape[1])
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
    if isinstance(weight, QuantizedWeight):  # (an x8 bf16 weight: its op picks kernel or GEMM by M)
        return m <= Q8_KERNEL_MAX_ROWS or weight.is_bf16
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
    """The format's integer kernel at every row count: in blocks of Q8_KERNEL_MAX_ROWS rows above it,
    one call into one output (QuantizedWeight.linear_rows; an x8 bf16 weight's op takes any row count
    in one call: on AVX2 the kernel streaming the weight once, on AVX512-BF16 the kernel up to 256
    rows and ATen's GEMM above)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m <= Q8_KERNEL_MAX_ROWS or weight.is_bf16:
        out = weight.linear(x2, bias)
    else:
        out = weight.linear_rows(x2, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _quant_gemm_path(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Dequantise + ATen's GEMM at every row count (above Q8_KERNEL_MAX_ROWS the op does it itself,
    a chunk of weight rows at a time)."""
    if x.numel() > Q8_KERNEL_MAX_ROWS * x.shape[-1] and not weight.is_bf16:
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
        x.is_cpu
        and weight.is_cpu
        and x.dtype in (torch.bfloat16, torch.float32)
        and weight.dtype == x.dtype
        and (bias is None or (bias.dtype == x.dtype and bias.is_cpu))
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
