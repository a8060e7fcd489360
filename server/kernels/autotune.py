"""Start-up autotune of linear's path: per weight shape and row-count bucket, pagewire's kernel or torch's.

`ops.linear` has two paths for the weights pagewire has kernels for:

    weight                 "kernel"                                  "torch"
    bf16 / fp32 tensor     pagewire::linear (the CPU family's kernel) F.linear (oneDNN / ATen GEMM)
    QuantizedWeight        the format's integer kernel (in blocks of  dequantise + ATen GEMM
                           Q8_KERNEL_MAX_ROWS rows above that)

Its fixed rules (kernel up to 16 rows on AVX512-BF16, at every M on AVX2, torch for fp32, integer
kernel up to 16 rows for quantised weights) are right on the CPUs they were measured on and wrong
elsewhere (on Intel AMX, oneDNN's bf16 GEMM beats the AVX512-BF16 kernel from M = 8). `tune` times
both paths once at engine start, per distinct (weight kind, N, K) and M bucket (1, 2, 4, 8, 16, 32
and "large" > 32, timed at LARGE_M rows) on random inputs against the real weights, and returns a
`LinearTable`: one tuple of per-bucket choices per shape. The engine makes it active around each of
its steps (`active`, thread-local like batch_invariant.mode), and `ops.linear` reads it with one
dict lookup; a shape or bucket not in the table, or no active table, keeps the fixed rule.

Every (shape, bucket) is timed, quantised weights' 17-32 and large buckets included (the integer
kernel in blocks of 16 rows against the op's dequantise-a-chunk-of-rows + GEMM path; at 17-32 rows
the kernel is the path to beat, QUANT_SHORT_BUCKET). A CPU without the float
kernels (the portable family, ARM) has nothing to tune for float weights. When the fixed rule's
path is more than CLEAR_RATIO faster after one sample each, it is kept there; otherwise each path
gets SAMPLES samples, and the fixed rule's path is kept unless every sample of the other is at
least MARGIN faster than the fixed rule's best -- or the fixed rule's best is more than TOLERANCE
times the other's best: no kept choice is ever measured that much slower than the alternative. A
loaded machine (another process on a core the intra-op threads need) stalls calls by whole
scheduler slices: tune on the machine as it will serve.
The whole model shares one time budget; buckets are tuned smallest first, so a budget that runs
out leaves the large buckets on their fixed rule (logged). Quantised weights' buckets below 16
rows come last: dequantising a whole matrix per call moves several times the bytes the kernel
reads (6-20x slower measured), so their fixed rule is the one least likely to change; they are
still timed (one sample each, "clear") while the budget lasts.

The one-row bucket (single-sequence decode) switches by the TOLERANCE rule alone. A speculative
verify step runs in batch-invariant mode (LLMEngine._verify_step), whose path is the kernel, and
greedy speculation gives plain decoding's text only while single-row decode takes that path too: a
path a few percent faster in every sample (the MARGIN rule; or a loaded machine's stalls ordering
the samples so) must not replace it there. On an AMX Xeon under the test suite's load, that flip
changed the default model's bf16 text under n-gram speculation at token 26 (bench/RESULTS.md,
session 21); at one row the two paths were within 1-7 % of each other on every shape measured.

On an AMX CPU (family "amx") the kernel path itself has two bodies from 4 rows for bf16 and Q8_0,
and from 6 for Q4_0 and Q4_1 in the x8 layout (csrc/cpu/dispatch_mode.h): the AMX tiles (the
default) and the AVX-512 dot products. For every bucket of 4 rows and more whose choice is
the kernel, `tune` also times the kernel with AMX allowed and with it off (server._C.set_amx_allowed),
by the same rule (AMX stays unless every sample without it is MARGIN faster); the plan then holds
KERNEL_NO_AMX there, and ops.linear turns AMX off around that call.

Deterministic (batch-invariant) mode does not use the table: ops.linear takes its batch-invariant
path before looking here, so the path never depends on M there, and the engine does not tune.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterable, Optional

import torch

from server.kernels import linear_route, ops
from server.kernels.kinds import Qtype
from server.kernels.linear_plan import (
    BUCKETS,
    KERNEL,
    KERNEL_NO_AMX,
    LARGE,
    LARGE_M,
    TORCH,
    Choice,
    Key,
    LinearTable,
    Plan,
    Weight,
    active,
    active_table,
    bucket,
    table_key,
)
from server.kernels.quant import QuantizedWeight
from server.kernels.quant_parts import QuantizedParts

# The table and its thread-local lookup live in server.kernels.linear_plan (linear_route reads them there);
# re-exported so the engine and the tests name one module.
__all__ = [
    "BUCKETS", "LARGE", "LARGE_M", "LinearTable", "Choice", "Site", "bucket", "active", "active_table", "table_key",
    "tune", "sites_of", "TORCH", "KERNEL", "KERNEL_NO_AMX", "Key", "Plan", "Weight",
]

logger = logging.getLogger("pagewire.autotune")

QUANT_FIRST_BUCKET = 4  # quantised weights: buckets below it (M < 16) are timed last (see above)
# Quantised weights' 17-32 row bucket starts from the integer kernel: timed here, on one cache-hot
# copy of the weight, dequantise + GEMM comes within 10 % of it on Q5_K (0.60 against 0.66 ms at
# 1536 x 1024), so the MARGIN rule kept the fixed rule's GEMM, which is 1.2x slower on weights
# streamed from memory as in a real step (bench.kernels quant: 0.68 against 0.57 ms; every format's
# kernel wins at 32 rows there). Timing still replaces it when the GEMM wins clearly.
QUANT_SHORT_BUCKET = BUCKETS.index(32)
CLEAR_RATIO = 1.5  # one sample each this far apart decides
TOLERANCE = 1.2  # never keep a path whose best sample is more than this times the other's best
SAMPLES = 4  # per path, for a close pair
MARGIN = 0.03  # the non-default path must be this much faster to replace the fixed rule
MIN_SAMPLE_S = 1e-3  # a sample repeats the call until it lasts about this long (timer resolution, noise)
DEFAULT_BUDGET_S = 2.0

AMX_FIRST_BUCKET = 2  # BUCKETS[2] = 4 rows: where the linear ops start to use AMX (kAmxMinRows)
# The quantised formats with an AMX body (linear_amx.cpp, linear_x8_amx.cpp).
AMX_QTYPES = (Qtype.Q8_0, Qtype.Q4_0, Qtype.Q4_1)
# (timed path "kernel", "torch" or "kernel-noamx", the call, most repetitions) -> seconds per call.
Timer = Callable[[str, Callable[[], object], int], float]


@dataclass(frozen=True)
class Site:
    """One linear of a model: a name for the log (e.g. "qkv"), its weight, and its activations' dtype."""

    name: str
    weight: Weight
    x_dtype: torch.dtype


def sites_of(name: str, weight: Weight | QuantizedParts, x_dtype: torch.dtype) -> list[Site]:
    """The Sites of one of a model's linears: a QuantizedParts' parts one by one (ops.linear runs
    each part by the plan of its own shape), any other weight as it is."""
    if isinstance(weight, QuantizedParts):
        return [Site(name, p, x_dtype) for p in weight.parts]
    return [Site(name, weight, x_dtype)]


def _perf_timer(path: str, fn: Callable[[], object], reps: int) -> float:
    """Wall time per call over up to `reps` calls, stopping once MIN_SAMPLE_S has passed (so a path
    much slower than the warm-up suggested, e.g. stalled by another process, cannot run long)."""
    t0 = time.perf_counter()
    n = 0
    while n < reps:
        fn()
        n += 1
        if time.perf_counter() - t0 >= MIN_SAMPLE_S:
            break
    return (time.perf_counter() - t0) / n


def tune(
    sites: Iterable[Site],
    budget_s: float = DEFAULT_BUDGET_S,
    max_rows: Optional[int] = None,
    timer: Timer = _perf_timer,
    log: bool = True,
) -> LinearTable:
    """Time both paths of every distinct linear shape in `sites`, per bucket, and return the table.

    Args:
        sites: the model's linears (shapes are deduplicated; weights off the CPU are skipped).
        budget_s: wall time for the whole tune; (shape, bucket) pairs whose predicted cost does not
            fit what is left keep their fixed rule.
        max_rows: the most rows one linear can see (the engine's token budget); a bucket is timed
            at min(its rows, max_rows) rows, and not at all when no row count it holds can occur.
        timer: measures one sample (injectable for tests); the default is wall time.
        log: log one line per shape group and a summary (logger pagewire.autotune).
    """
    t_start = time.perf_counter()
    isa = ops.cpu_isa()  # the live family (PAGEWIRE_CPU_ISA may lower it)
    # The large bucket at LARGE_M rows, or the most a step can pass when that is fewer.
    table = LinearTable(large_m=min(LARGE_M, max_rows) if max_rows is not None else LARGE_M)
    groups: dict[Key, Site] = {}
    for site in sites:
        w = site.weight
        if isinstance(w, torch.Tensor):
            if w.device.type != "cpu" or w.dim() != 2 or w.dtype != site.x_dtype or w.shape[1] == 0:
                continue
            if not (w.dtype == torch.bfloat16 and isa != "portable"
                    or w.dtype == torch.float32 and isa != "portable"):
                continue  # no kernel for it here: F.linear, nothing to choose
        key = table_key(w, site.x_dtype)
        table.names.setdefault(key, []).append(site.name)
        groups.setdefault(key, site)
    for key, site in groups.items():
        table.choices[key] = [Choice(linear_route.fixed_rule_takes_kernel(site.weight, _rows(b, LARGE_M)), "fixed")
                              for b in range(LARGE + 1)]
        if isinstance(site.weight, QuantizedWeight):
            # 17-32 rows: the integer kernel (in blocks of 16) is the path to beat, not the fixed
            # rule's dequantise + GEMM (see QUANT_SHORT_BUCKET).
            table.choices[key][QUANT_SHORT_BUCKET] = Choice(True, "fixed")

    gen = torch.Generator().manual_seed(0)  # its own stream: the global RNG is the sampler's business
    last: dict[Key, tuple[int, float, float]] = {}  # key -> (rows, kernel s, torch s) of its latest timed bucket
    # Every bucket smallest first, then quantised weights' small buckets (`late`).
    order = [(b, False) for b in range(LARGE + 1)] + [(b, True) for b in range(QUANT_FIRST_BUCKET)]
    with torch.inference_mode():
        for b, late in order:
            if max_rows is not None and b > 0 and max_rows <= BUCKETS[b - 1]:
                continue  # no step passes that many rows
            m = _rows(b, table.large_m, max_rows)
            for key, site in groups.items():
                if (isinstance(site.weight, QuantizedWeight) and b < QUANT_FIRST_BUCKET) != late:
                    continue
                if time.perf_counter() - t_start + _predicted_s(last.get(key), m) > budget_s:
                    table.choices[key][b].how = "budget"
                    continue
                choice = _time_pair(linear_route, site, m, table.choices[key][b].kernel, gen, timer,
                                    margin_rule=b != 0)
                table.choices[key][b] = choice
                assert choice.kernel_s is not None and choice.torch_s is not None
                last[key] = (m, choice.kernel_s, choice.torch_s)
        if isa == "amx":
            _tune_amx(linear_route, table, groups, t_start, budget_s, gen, timer)
    table.plans = {key: tuple(c.plan for c in cs) for key, cs in table.choices.items()}
    table.seconds = time.perf_counter() - t_start
    if log:
        for line in table.lines():
            logger.info("%s", line)
        logger.info("linear autotune: %d shape(s) in %.2f s (budget %.1f s, CPU kernels %s)",
                    len(table.plans), table.seconds, budget_s, isa)
    return table


def _tune_amx(route: ModuleType, table: LinearTable, groups: dict[Key, Site], t_start: float, budget_s: float,
              gen: torch.Generator, timer: Timer) -> None:
    """AMX CPUs: where the kernel path was chosen from 4 rows on, AMX tiles or the AVX-512 kernel."""
    for b in range(AMX_FIRST_BUCKET, LARGE + 1):
        m = _rows(b, table.large_m)
        for key, site in groups.items():
            choice = table.choices[key][b]
            if not choice.kernel or choice.how == "budget":
                continue
            if isinstance(site.weight, QuantizedWeight) and site.weight.qtype not in AMX_QTYPES:
                continue  # the K-quants and MXFP4 have no AMX body
            seen = choice.kernel_s if choice.kernel_s is not None else 0.0
            if time.perf_counter() - t_start + 2 * (1 + SAMPLES) * max(seen, MIN_SAMPLE_S) > budget_s:
                continue  # AMX stays: the default from 4 rows
            choice.no_amx, choice.no_amx_s = _time_amx(route, site, m, gen, timer)


def _time_amx(route: ModuleType, site: Site, m: int, gen: torch.Generator, timer: Timer) -> tuple[bool, float]:
    """The kernel path with AMX (the default) against it without; returns (AMX off wins, its best time)."""
    w = site.weight
    x = torch.randn((m, int(w.shape[1])), generator=gen).to(site.x_dtype)
    path = route._quant_kernel_path if isinstance(w, QuantizedWeight) else route._float_kernel_path
    paths: dict[str, Callable[[], object]] = {
        "kernel": lambda: path(x, w, None),
        "kernel-noamx": lambda: route.without_amx(path, x, w, None),
    }
    warm = {name: timer(name, fn, 1) for name, fn in paths.items()}
    reps = max(1, min(100, math.ceil(MIN_SAMPLE_S / max(min(warm.values()), 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(SAMPLES):
        for name, fn in paths.items():
            samples[name].append(timer(name, fn, reps))
    off_wins = max(samples["kernel-noamx"]) < min(samples["kernel"]) * (1 - MARGIN)
    return off_wins, min(samples["kernel-noamx"])


def _rows(b: int, large_m: int, max_rows: Optional[int] = None) -> int:
    """The rows bucket b is timed at: its upper edge (LARGE: large_m), at most max_rows."""
    m = BUCKETS[b] if b < LARGE else large_m
    return m if max_rows is None else min(m, max_rows)


def _predicted_s(last: Optional[tuple[int, float, float]], m: int) -> float:
    """The cost of timing a pair at m rows, from its previous bucket's times scaled by rows (linear
    in M: an upper bound while memory-bound, about right once compute-bound); 0 for the first."""
    if last is None:
        return 0.0
    m0, tk, tt = last
    calls = 2 if max(tk, tt) > CLEAR_RATIO * min(tk, tt) else 1 + SAMPLES  # warm-up + samples
    return sum(max(t * m / m0, MIN_SAMPLE_S) * calls for t in (tk, tt))


def _time_pair(route: ModuleType, site: Site, m: int, default_kernel: bool, gen: torch.Generator, timer: Timer,
               margin_rule: bool = True) -> Choice:
    """Times both paths at m rows and returns the choice (module docstring's rules); margin_rule
    False (the one-row bucket): only the TOLERANCE rule may replace the fixed rule's path."""
    w = site.weight
    k = int(w.shape[1])
    x = torch.randn((m, k), generator=gen).to(site.x_dtype)
    if isinstance(w, QuantizedWeight):
        kernel_path, torch_path = route._quant_kernel_path, route._quant_gemm_path
    else:
        kernel_path, torch_path = route._float_kernel_path, route._float_torch_path
    paths: dict[str, Callable[[], object]] = {
        "kernel": lambda: kernel_path(x, w, None),
        "torch": lambda: torch_path(x, w, None),
    }
    # Warm-up (first-call costs: allocation, oneDNN primitive creation), timed to size the samples.
    warm = {name: timer(name, fn, 1) for name, fn in paths.items()}
    reps = max(1, min(100, math.ceil(MIN_SAMPLE_S / max(min(warm.values()), 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in paths}
    default, other = ("kernel", "torch") if default_kernel else ("torch", "kernel")
    how = "timed"
    for i in range(SAMPLES):
        for name, fn in paths.items():  # interleaved, so drift (another process, turbo) hits both
            samples[name].append(timer(name, fn, reps))
        if i == 0 and samples[other][0] > CLEAR_RATIO * samples[default][0]:
            how = "clear"  # replacing the default always takes every sample
            break
    # Replace the fixed rule only when every sample of the other path beats the default's best by
    # MARGIN: random stalls (a loaded machine) order 4 + 4 samples that way 1 time in 70. Or when
    # the default's best is over TOLERANCE times the other's best, however the samples interleave.
    margin_win = margin_rule and max(samples[other]) < min(samples[default]) * (1 - MARGIN)
    switch = how == "timed" and (margin_win or min(samples[default]) > TOLERANCE * min(samples[other]))
    kernel = default_kernel != switch
    tk, tt = min(samples["kernel"]), min(samples["torch"])
    return Choice(kernel, how, tk, tt)
