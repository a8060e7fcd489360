"""Batch-invariant mode: the switch that deterministic inference (EngineConfig.deterministic) flips.

While it is on, every reduction a forward and the sampler run has an order that is a function of
the row alone, never of how many rows share the step or where the row sits among them:

- linear (`ops.linear`): every row count goes through pagewire's own kernels, whose per-output
  accumulation (one FMA chain over K in fixed 16- or 32-wide blocks, a fixed horizontal sum) does
  not depend on M, the row's position or the thread count: bf16 through the bf16 kernel (instead of
  F.linear above LINEAR_KERNEL_MAX_M rows on AVX512-BF16 CPUs), fp32 through the fp32 AVX2 kernel (instead of
  F.linear), Q8_0 through the Q8 kernel in blocks of at most its row limit (instead of dequantising
  for large M). Off the CPU, or on a CPU without AVX2, F.linear runs over fixed blocks of
  BLOCK_ROWS rows, zero-padded, so every call has one shape;
- top-p's sort is stable (ties keep their vocabulary order, not an order the sort's partitioning
  happens to leave).

The other reductions are per row by construction in every mode (RMSNorm, rotary, the paged
attention's fixed KV spans, torch's last-dim softmax / log_softmax / cumsum on CPU), see
docs/determinism.md.

The flag is thread-local: the engine sets it around each step on its own thread, so two engines in
one process (one deterministic, one not) do not disturb each other.
"""
from __future__ import annotations

import threading

import torch  # noqa: F401  (loads libc10 before the extension)

import server._C

__all__ = ["enabled", "mode", "cheap_here", "BLOCK_ROWS"]

# Rows per F.linear call in the padded fallback: the largest decode batch the small-batch kernels
# serve, so a decode step pays at most one block.
BLOCK_ROWS = 16

_state = threading.local()


def cheap_here(device: str, dtype: str, quantization: str, cpu_isa: str) -> bool:
    """Where the mode costs under 5 % (so `deterministic=None`, "auto", turns it on).

    Measured (bench/determinism.py, bench/RESULTS.md): CPU bf16 and fp32 weights on an AVX2 CPU,
    and bf16 weights on an AVX512-BF16 CPU without AMX (the `avx512bf16` family). In bf16 the bf16
    kernel serves every row count up to 256 in both modes, so the mode changes only longer prefill
    chunks (the x8 kernel in place of oneDNN's GEMM on de-interleaved chunks: prefill on / off
    0.95-1.04 on a Zen 5 once the kernel prefetched its next span, session 26) and top-p's sort;
    in fp32 the mode's fp32 AVX2 kernel was 2.2x faster than torch's GEMM offline and in serving. Not here: quantised
    weights (the 16-row kernel blocks in place of dequantise-and-GEMM slow prefill), AMX CPUs (the
    mode gives up AMX tiles: 70 % of prefill), fp32 on AVX-512 and AVX-512 without BF16
    (unmeasured), fp16, and CUDA (unmeasured).
    """
    if device != "cpu" or quantization != "none":
        return False
    return (cpu_isa == "avx2" and dtype in ("bfloat16", "float32")) or (cpu_isa == "avx512bf16" and dtype == "bfloat16")


def enabled() -> bool:
    """Whether batch-invariant mode is on for the calling thread."""
    return bool(getattr(_state, "on", False))


class mode:
    """Turn batch-invariant mode on (or off) for the calling thread inside the block.

    A class rather than a generator context: the engine enters it around every step, and a
    generator's setup is a measurable share of a small model's decode step on the host (issue 31)."""

    __slots__ = ("on", "prev")

    def __init__(self, on: bool) -> None:
        self.on = on
        self.prev = False

    def __enter__(self) -> None:
        self.prev = enabled()
        _state.on = self.on
        # The C++ ops' own thread-local copy: where their kernel choice depends on the row count (AMX
        # from 4 rows), batch-invariant mode keeps one kernel for every M.
        server._C.set_batch_invariant(self.on)

    def __exit__(self, *exc: object) -> None:
        _state.on = self.prev
        server._C.set_batch_invariant(self.prev)
