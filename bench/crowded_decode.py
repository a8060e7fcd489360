"""Decode beside other busy processes: the engine's thread count fixed against following the load
(server.engine.thread_governor, `--adapt-threads`), in one process on one engine.

Phases, each a set of --rounds generations of --batch greedy streams of --tokens tokens (prefix
caching off, the same prompts every time), timed as decode tok/s over the whole call:
  1. quiet, adaptive threads (the default);
  2. crowded by --crowd busy processes (a spinning Python loop each, started before and stopped
     after the phase): fixed threads (the governor taken out of the engine for the phase, the
     count put back to --threads), then adaptive, alternating round by round so the host's drift
     falls on both alike;
  3. quiet again, adaptive: whether the count went back to --threads (its step rate against phase 1).
Each adaptive round prints the thread count it ended on and the governor's switches so far.
Ratios are taken within the run: crowded adaptive / crowded fixed, and phase 3 / phase 1.

Examples:
    .venv/bin/python -m bench.crowded_decode --model default --threads 2 --crowd 1
    .venv/bin/python -m bench.crowded_decode --model /tmp/smol/smol-Q4_1.gguf --batch 8 --crowd 2
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import statistics
import sys
import time
from typing import Any

from bench.model_arg import resolve_model
from bench.spec_decode import cpu_model


def _spin(stop: Any) -> None:
    """A busy process: spins until told to stop (the crowd)."""
    n = 0
    while not stop.is_set():
        for _ in range(100_000):
            n += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a GGUF file or HF folder; 'default': the built-in SmolLM2")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--crowd", type=int, default=1, help="busy processes in the crowded phase")
    a = p.parse_args()
    print("command:", shlex.join([sys.executable, "-m", "bench.crowded_decode", *sys.argv[1:]]))
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}   CPU: {cpu_model()}   "
          f"cores: {os.cpu_count()}   load average: {os.getloadavg()[0]:.2f}")

    from server.engine.sampling_params import SamplingParams
    from server.llm import LLM

    path = resolve_model(a.model)
    llm = LLM(path, dtype=a.dtype, quantization=a.quantization, num_threads=a.threads,
              enable_prefix_caching=False, max_num_seqs=max(8, a.batch), adapt_threads=True)
    engine = llm.engine
    governor = engine.thread_governor
    if governor is None:
        raise SystemExit("the thread governor is off here (one thread, or a CPU without AVX2 in deterministic mode)")
    prompts = [[1 + i, 17, 23, 42, 7, 99, 5, 64] for i in range(a.batch)]
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    llm.generate(prompts, sp)  # warm-up

    def run(adaptive: bool) -> float:
        engine.thread_governor = governor if adaptive else None  # None: every step on --threads
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        return a.batch * a.tokens / (time.perf_counter() - t0)

    def show(phase: str, rates: list[float], adaptive: bool) -> float:
        med = statistics.median(rates)
        extra = f"   threads now {governor.threads}, switches {governor.switches}" if adaptive else ""
        print(f"{phase:<34} {' / '.join(f'{r:7.1f}' for r in rates)} tok/s   median {med:7.1f}{extra}")
        return med

    quiet = show("quiet, adaptive", [run(True) for _ in range(a.rounds)], True)
    stop = multiprocessing.Event()
    crowd = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.crowd)]
    for proc in crowd:
        proc.start()
    fixed: list[float] = []
    adaptive: list[float] = []
    try:
        for r in range(a.rounds):
            for mode in (False, True) if r % 2 == 0 else (True, False):
                (adaptive if mode else fixed).append(run(mode))
    finally:
        stop.set()
        for proc in crowd:
            proc.join()
    f = show(f"crowded by {a.crowd}, fixed {a.threads} threads", fixed, False)
    c = show(f"crowded by {a.crowd}, adaptive", adaptive, True)
    after = show("quiet again, adaptive", [run(True) for _ in range(a.rounds)], True)
    print(f"crowded: adaptive / fixed {c / f:.2f}x   quiet again / quiet {after / quiet:.2f}x   "
          f"(threads now {governor.threads} of {a.threads})")


if __name__ == "__main__":
    main()
