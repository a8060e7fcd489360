"""The decode crew (csrc/cpu/crew.h, PAGEWIRE_DECODE_CREW=1) against the per-kernel OpenMP regions,
one-token steps, in one process.

The two modes alternate step by step (A B, B A, ...) on the same model, KV cache and kernel rules,
so a shared host's drift falls on both alike; each pair's ratio crew / regions is kept. The pairs
are then binned by the regions step's time (quarters): on a host whose memory speed swings, this
shows the crew's effect where memory was fast apart from where it was slow, which a single median
hides. `--env NAME=A,B` compares two values of another switch instead (read per call by the stack,
e.g. PAGEWIRE_CREW_AHEAD=0,1048576 with the crew on).

Examples:
    .venv/bin/python -m bench.decode_crew --model default --steps 1500
    PAGEWIRE_DECODE_CREW=1 .venv/bin/python -m bench.decode_crew --model default --env PAGEWIRE_CREW_AHEAD=0,1048576
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a GGUF file or HF folder; 'default': the built-in SmolLM2")
    p.add_argument("--quantization", default="gguf", help="as bench.decode_step ('none' for a bf16 file)")
    p.add_argument("--steps", type=int, default=1500, help="pairs of steps")
    p.add_argument("--context", type=int, default=128, help="cached tokens of the one sequence")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--env", default="PAGEWIRE_DECODE_CREW=0,1", help="NAME=A,B: the switch and its two values")
    a = p.parse_args()
    print("command:", shlex.join([sys.executable, "-m", "bench.decode_crew", *sys.argv[1:]]))
    name, values = a.env.split("=", 1)
    off, on = values.split(",", 1)

    from bench.decode_step import decode_batch
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine
    from server.kernels import autotune, batch_invariant
    from server.models.default_model import find_default_model

    path = str(find_default_model()) if a.model == "default" else a.model
    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", quantization=a.quantization,
                                    num_threads=a.threads, enable_prefix_caching=False, max_num_seqs=8))
    model = engine.model
    ids, positions, kv, meta = decode_batch(model, 1, a.context)
    pairs: list[tuple[float, float]] = []
    with torch.inference_mode(), batch_invariant.mode(engine.deterministic), autotune.active(engine.linear_table):
        for i in range(a.steps):
            t: dict[str, float] = {}
            for v in (off, on) if i % 2 == 0 else (on, off):
                os.environ[name] = v
                t0 = time.perf_counter()
                model.compute_logits(model(ids, positions, kv, meta))
                t[v] = time.perf_counter() - t0
            pairs.append((t[off], t[on]))
    os.environ.pop(name, None)
    print(f"{path}  {a.quantization}  context {a.context}  threads {a.threads}  {name}: {off} -> {on}")
    pairs.sort()
    quarter = max(1, len(pairs) // 4)
    for k in range(0, len(pairs), quarter):
        chunk = pairs[k:k + quarter]
        ratios = sorted(b / x for x, b in chunk)
        print(f"  {name}={off} steps {chunk[0][0] * 1e3:6.2f}-{chunk[-1][0] * 1e3:6.2f} ms: {on}/{off} median "
              f"{ratios[len(ratios) // 2]:.3f}")
    ratios = sorted(b / x for x, b in pairs)
    total = sum(b for _, b in pairs) / sum(x for x, _ in pairs)
    m_off, m_on = statistics.median(x for x, _ in pairs), statistics.median(b for _, b in pairs)
    print(f"  all {len(pairs)} pairs: {on}/{off} median {ratios[len(ratios) // 2]:.3f}, total time {total:.3f}; "
          f"medians {m_off * 1e3:.3f} / {m_on * 1e3:.3f} ms; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
