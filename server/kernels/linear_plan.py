"""The linear autotune's table and the thread-local lookup `ops.linear` (server.kernels.linear_route) follows.

`server.kernels.autotune.tune` fills a `LinearTable` (per weight shape and row-count bucket:
pagewire's kernel or torch's GEMM); the engine makes it active around each step (`active`,
thread-local like batch_invariant.mode) and `ops.linear` reads it with one dict lookup
(`active_table`, `bucket`). Kept apart from the tuner, which times linear_route's own paths, so
that linear_route reads the table without importing the tuner (no import circle).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from server.kernels.quant import QuantizedWeight

# Upper edges of the row-count buckets (decode batches, then short prefill chunks and verify
# steps); index len(BUCKETS) is "large" (> 32 rows). 17-32 rows has its own bucket because the
# quantised paths cross there: the integer kernel in 16-row blocks against dequantise + GEMM tied at
# 64 rows on Q5_K / Q6_K while the kernel was 1.31x faster at 32 (bench/RESULTS.md, session 22).
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
LARGE = len(BUCKETS)
# Rows the large bucket is timed at: a prefill chunk's scale without the cost of a full 256-row step.
LARGE_M = 64
# A weight's table key: (dtype, (N, K)) for a float tensor (x has its dtype); (qtype, x dtype, (N, K))
# for a QuantizedWeight. torch.Size hashes and compares as the plain tuple, so ops.linear builds
# the key from weight.shape directly.
Key = tuple[Any, ...]
Plan = tuple[int, ...]  # per bucket: TORCH, KERNEL or KERNEL_NO_AMX (True / False read as KERNEL / TORCH)
TORCH, KERNEL, KERNEL_NO_AMX = 0, 1, 2
Weight = Union[torch.Tensor, QuantizedWeight]


@dataclass
class Choice:
    """The outcome of one (shape, bucket): the path, how it was decided, and the times (s per call)."""

    kernel: bool
    how: str  # "timed" (SAMPLES each), "clear" (one each, the default > CLEAR_RATIO faster), "fixed", "budget"
    kernel_s: Optional[float] = None
    torch_s: Optional[float] = None
    no_amx: bool = False  # AMX CPUs: the kernel path with AMX off (timed faster)
    no_amx_s: Optional[float] = None  # the kernel path's time with AMX off, when timed

    @property
    def plan(self) -> int:
        return (KERNEL_NO_AMX if self.no_amx else KERNEL) if self.kernel else TORCH


@dataclass
class LinearTable:
    """The tuned choices: `plans` is what ops.linear reads; `choices` and `names` are for logs and tests."""

    plans: dict[Key, Plan] = field(default_factory=dict)
    choices: dict[Key, list[Choice]] = field(default_factory=dict)
    names: dict[Key, list[str]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the tune
    large_m: int = LARGE_M  # rows the large bucket was timed at

    def lines(self) -> list[str]:
        """One line per shape group: its choice per bucket and the measured times (kernel/torch)."""
        return [_format_line(key, self.names[key], self.choices[key], self.large_m) for key in self.choices]


def table_key(weight: Weight, x_dtype: torch.dtype) -> Key:
    if isinstance(weight, QuantizedWeight):
        return (weight.qtype, x_dtype, (int(weight.shape[0]), int(weight.shape[1])))
    return (weight.dtype, (int(weight.shape[0]), int(weight.shape[1])))


def bucket(m: int) -> int:
    """The bucket index of a row count: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, 17-32 -> 5,
    > 32 -> LARGE."""
    return (m - 1).bit_length() if m <= 32 else LARGE


_state = threading.local()


def active_table() -> Optional[dict[Key, Plan]]:
    """The plans ops.linear follows on the calling thread (None: the fixed rules)."""
    return getattr(_state, "plans", None)


class active:
    """Make `table` the one ops.linear follows on the calling thread inside the block (None: fixed
    rules). A class, not a generator context: the engine enters it around every step (see
    batch_invariant.mode)."""

    __slots__ = ("plans", "prev")

    def __init__(self, table: Optional[LinearTable]) -> None:
        self.plans = table.plans if table is not None else None
        self.prev: Optional[dict[Key, Plan]] = None

    def __enter__(self) -> None:
        self.prev = active_table()
        _state.plans = self.plans

    def __exit__(self, *exc: object) -> None:
        _state.plans = self.prev




def _format_line(key: Key, names: list[str], choices: list[Choice], large_m: int) -> str:
    if len(key) == 3:
        kind = f"{key[0]}/{str(key[1]).replace('torch.', '')}"
    else:
        kind = str(key[0]).replace("torch.", "")
    n, k = key[-1]
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    used = ", ".join(f"{name} x{c}" if c > 1 else name for name, c in counts.items())
    parts = []
    for b, c in enumerate(choices):
        label = f"M{BUCKETS[b]}" if b < LARGE else f"M>{BUCKETS[-1]}({large_m})"
        path = "kernel" if c.kernel else "torch"
        if c.kernel and c.no_amx:
            path = "kernel(no AMX)"
        amx = f" AVX-512 {c.no_amx_s * 1e3:.3g}ms" if c.no_amx_s is not None else ""
        if c.kernel_s is not None and c.torch_s is not None:
            parts.append(f"{label} {path} {c.kernel_s * 1e3:.3g}/{c.torch_s * 1e3:.3g}ms"
                         + (" clear" if c.how == "clear" else "") + amx)
        else:
            parts.append(f"{label} {path} ({c.how})")
    return f"linear autotune {kind} N={n} K={k} [{used}]: " + "; ".join(parts) + " (times kernel/torch)"
