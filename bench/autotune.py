"""The start-up linear autotune (server.kernels.autotune) of one model: its table, its cost, its effect.

It loads the model as the engine does, runs the tune the engine runs at start-up (same sites, same
budget, same row limit), prints one line per weight shape (each bucket's choice and the kernel/torch
times) and the tune's wall time; then, for each --batch, a decode step (forward + logits, best of
--repeats) with the table active against the fixed rules. --engine also times a whole LLMEngine
start with autotune on and off (deterministic mode off, since it disables the tune).

Examples:
    .venv/bin/python -m bench.autotune --shape llama-246m --dtype bfloat16
    .venv/bin/python -m bench.autotune --model default --batch 1 8 12 16 --engine
    .venv/bin/python -m bench.autotune --shape llama-246m --quantization int8
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from bench.decode_step import best_and_median, decode_batch
from bench.shapes import SHAPES, is_built, make_random_model, model_dir_for
from server.kernels import autotune, ops
from server.models.default_model import find_default_model
from server.models.loader import load_model


def resolve_model(a: argparse.Namespace) -> Path:
    if a.model is None:
        model_dir: Path = model_dir_for(a.shape, a.dtype)
        if not is_built(model_dir, a.shape, a.dtype):
            make_random_model(a.shape, model_dir, a.dtype)
        return model_dir
    if a.model == "default":
        found = find_default_model()
        if found is None:
            raise SystemExit("--model default: the default model package is not installed")
        return Path(found.path)
    return Path(a.model)


def engine_start_s(model_dir: Path, a: argparse.Namespace, on: bool) -> float:
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine

    t0 = time.perf_counter()
    LLMEngine(EngineConfig(model=str(model_dir), dtype=a.dtype, quantization=a.quantization, kv_cache_tokens=4096,
                           max_num_batched_tokens=a.max_rows, deterministic=False, autotune=on))
    return time.perf_counter() - t0


def main() -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-246m", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None,
                   help="a Hugging Face folder or .gguf file instead of --shape ('default': the default model)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "gguf"])
    p.add_argument("--budget", type=float, default=autotune.DEFAULT_BUDGET_S, help="the tune's time budget, s")
    p.add_argument("--max-rows", type=int, default=256, help="the engine's max_num_batched_tokens")
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8, 16], help="decode batches to time (none: skip)")
    p.add_argument("--context", type=int, default=96)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--engine", action="store_true", help="also time LLMEngine start-up with autotune on and off")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.WARNING)

    model_dir = resolve_model(a)
    model, _ = load_model(model_dir, a.dtype, keep_gguf_blocks=a.quantization == "gguf")
    if a.quantization in ("int8", "int4"):
        model.quantize_weights(a.quantization)
    model.interleave_bf16()  # as the engine does: bf16 matrices in the x8 layout on AVX2
    print(f"{a.model or a.shape} {a.dtype} quantization={a.quantization}  CPU kernels {ops.cpu_isa()}  "
          f"threads {torch.get_num_threads()}  load average {os.getloadavg()[0]:.2f}")
    sites = [autotune.Site(name, w, model.dtype) for name, w in model.linear_weights()]
    table = autotune.tune(sites, budget_s=a.budget, max_rows=a.max_rows, log=False)
    for line in table.lines():
        print(line)
    print(f"tune: {len(table.plans)} shape(s) of {len(sites)} linears in {table.seconds:.2f} s (budget {a.budget} s)")

    for batch in a.batch:
        ids, positions, kv, meta = decode_batch(model, batch, a.context)

        def step() -> None:
            model.compute_logits(model(ids, positions, kv, meta))

        with torch.inference_mode():
            fixed, _ = best_and_median(step, a.repeats)
            with autotune.active(table):
                tuned, _ = best_and_median(step, a.repeats)
        print(f"batch {batch:3d}: decode step fixed rules {fixed * 1e3:7.2f} ms  autotuned {tuned * 1e3:7.2f} ms  "
              f"({fixed / tuned:.2f}x)")
    if a.engine:
        del model
        off = engine_start_s(model_dir, a, False)
        on = engine_start_s(model_dir, a, True)
        print(f"LLMEngine start: autotune off {off:.2f} s, on {on:.2f} s (+{on - off:.2f} s)")


if __name__ == "__main__":
    main()
