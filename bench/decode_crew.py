"""The decode crew (csrc/cpu/crew.h) against the per-kernel OpenMP regions, one-token steps, in one
process.

The two modes alternate step by step (A B, B A, ...) on the same model, KV cache and kernel rules,
so a shared host's drift falls on both alike; each pair's ratio B / A is kept. Every 40 pairs an
untimed step on a forced crew (PAGEWIRE_DECODE_CREW=1) refreshes the stack's probe of how far apart
the two threads' cores are (DecodeStack.crew_handoff_ns: an empty job's handoff, 150-240 ns within
one core complex of the Zen 4 guest, 580-1,040 ns across two), and the pairs are reported by it:
close (under 400 ns, the default mode's line) and far. On that guest the vCPUs move between the two
placements minutes apart, and the crew's verdict flips with them; the default ("auto") follows the
probe. `--env NAME=A,B` compares two values of another switch instead (read per call by the stack,
e.g. PAGEWIRE_CREW_AHEAD=0,1048576 with the crew forced on).

Examples:
    .venv/bin/python -m bench.decode_crew --model default --steps 1500                 # regions vs auto
    .venv/bin/python -m bench.decode_crew --model default --env PAGEWIRE_DECODE_CREW=0,1  # vs a forced crew
    PAGEWIRE_DECODE_CREW=1 .venv/bin/python -m bench.decode_crew --model default --env PAGEWIRE_CREW_AHEAD=0,1048576
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a GGUF file or HF folder; 'default': the built-in SmolLM2")
    p.add_argument("--quantization", default="gguf", help="as bench.decode_step ('none' for a bf16 file)")
    p.add_argument("--steps", type=int, default=1500, help="pairs of steps")
    p.add_argument("--context", type=int, default=128, help="cached tokens of the one sequence")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--env", default="PAGEWIRE_DECODE_CREW=0,auto", help="NAME=A,B: the switch and its two values")
    a = p.parse_args()
    print("command:", shlex.join([sys.executable, "-m", "bench.decode_crew", *sys.argv[1:]]))
    name, values = a.env.split("=", 1)
    off, on = values.split(",", 1)

    from bench.decode_step import decode_batch
    from bench.model_arg import resolve_model
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine
    from server.kernels import autotune, batch_invariant

    path = resolve_model(a.model)
    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", quantization=a.quantization,
                                    num_threads=a.threads, enable_prefix_caching=False, max_num_seqs=8))
    model = engine.model
    ids, positions, kv, meta = decode_batch(model, 1, a.context)
    stack: Any = None  # the model's DecodeStack, made by its first one-token step
    pairs: list[tuple[float, float, int]] = []
    probe = -1
    crew_env = os.environ.get("PAGEWIRE_DECODE_CREW")
    with torch.inference_mode(), batch_invariant.mode(engine.deterministic), autotune.active(engine.linear_table):
        for i in range(a.steps):
            if i % 40 == 0:
                os.environ["PAGEWIRE_DECODE_CREW"] = "1"  # an untimed crew step: the probe now
                model.compute_logits(model(ids, positions, kv, meta))
                if stack is None:
                    stack = next((e[2] for e in getattr(model, "_stacks", {}).values() if e[2] is not None), None)
                probe = stack.crew_handoff_ns() if stack is not None else -1
                if crew_env is None:
                    os.environ.pop("PAGEWIRE_DECODE_CREW")
                else:
                    os.environ["PAGEWIRE_DECODE_CREW"] = crew_env
            t: dict[str, float] = {}
            for v in (off, on) if i % 2 == 0 else (on, off):
                os.environ[name] = v
                t0 = time.perf_counter()
                model.compute_logits(model(ids, positions, kv, meta))
                t[v] = time.perf_counter() - t0
            pairs.append((t[off], t[on], probe))
    os.environ.pop(name, None)
    if crew_env is not None:
        os.environ["PAGEWIRE_DECODE_CREW"] = crew_env
    print(f"{path}  {a.quantization}  context {a.context}  threads {a.threads}  {name}: {off} -> {on}")
    groups = {"close (probe < 400 ns)": [p for p in pairs if 0 <= p[2] < 400],
              "far (probe >= 400 ns)": [p for p in pairs if p[2] >= 400],
              "no probe (no crew here)": [p for p in pairs if p[2] < 0]}
    for label, chunk in groups.items():
        if not chunk:
            continue
        ratios = sorted(b / x for x, b, _ in chunk)
        probes = sorted(pr for _, _, pr in chunk)
        print(f"  {label}: {len(chunk)} pairs, probe median {probes[len(probes) // 2]} ns; {name}={off} median "
              f"{statistics.median(x for x, _, _ in chunk) * 1e3:.3f} ms, {name}={on} "
              f"{statistics.median(b for _, b, _ in chunk) * 1e3:.3f} ms; {on}/{off} paired median "
              f"{ratios[len(ratios) // 2]:.3f} (p25 {ratios[len(ratios) // 4]:.3f}, p75 {ratios[3 * len(ratios) // 4]:.3f})")
    ratios = sorted(b / x for x, b, _ in pairs)
    total = sum(b for _, b, _ in pairs) / sum(x for x, _, _ in pairs)
    m_off, m_on = statistics.median(x for x, _, _ in pairs), statistics.median(b for _, b, _ in pairs)
    print(f"  all {len(pairs)} pairs: {on}/{off} median {ratios[len(ratios) // 2]:.3f}, total time {total:.3f}; "
          f"medians {m_off * 1e3:.3f} / {m_on * 1e3:.3f} ms; load average {os.getloadavg()[0]:.2f}")

if __name__ == "__main__":
    main()
