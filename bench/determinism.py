"""The cost of deterministic mode: the offline and the serving benchmark, each with
`deterministic` off and on, in one run, and the on/off ratio of every figure.

Offline: bench/offline_throughput.py (pagewire only, --skip-hf) with --engine-arg deterministic=false
and =true, same workload, each in a fresh process. Serving: bench/serving.py with --model (or the
--shape folder in --dtype), starting
`pagewire serve --deterministic off` and then `on`, same workload and seed. With --rounds N the
pairs alternate (off, on, off, on, ...) and the medians are compared, which evens out drift in a
shared machine's load. Ratios are on / off: below 1 for a throughput means deterministic mode
costs that much. The default becomes on only if every throughput ratio is >= 0.95 (issue 14).

Example (a quiet-machine run on the default model, bf16):
    .venv/bin/python bench/determinism.py --model default --dtype bfloat16 --threads 2 --rounds 2
Smoke run (a few seconds of work per leg):
    .venv/bin/python bench/determinism.py --shape llama-246m --dtype bfloat16 --num-seqs 4 \
        --input-len-range 32 32 --output-len-range 8 8 --only throughput --serving-requests 4 \
        --serving-input-len 32 --serving-output-len 8 --skip-serving
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench.*` and `server` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench import offline_throughput, serving  # noqa: E402
from bench.shapes import is_built, make_random_model, model_dir_for  # noqa: E402

# (label, path into the offline result's "pagewire" entry, higher is better)
OFFLINE_FIGURES: list[tuple[str, tuple[str, ...], bool]] = [
    ("offline throughput, output tok/s", ("throughput", "output_tok_s"), True),
    ("offline throughput, total tok/s", ("throughput", "total_tok_s"), True),
    ("offline prefill tok/s", ("prefill", "tok_s"), True),
    ("offline decode tok/s", ("decode", "decode_tok_s"), True),
]
SERVING_FIGURES: list[tuple[str, tuple[str, ...], bool]] = [
    ("serving output tok/s", ("output_tok_s",), True),
    ("serving request/s", ("request_throughput",), True),
    ("serving TTFT p50 ms", ("ttft_ms", "p50"), False),
    ("serving ITL p50 ms", ("itl_ms", "p50"), False),
    ("serving ITL p99 ms", ("itl_ms", "p99"), False),
]


def _get(d: Any, path: tuple[str, ...]) -> Optional[float]:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return float(d) if isinstance(d, (int, float)) else None


def offline_argv(args: argparse.Namespace, on: bool, out: Path) -> list[str]:
    argv = ["--dtype", args.dtype, "--num-seqs", str(args.num_seqs), "--only", args.only, "--skip-hf",
            "--input-len-range", *map(str, args.input_len_range), "--output-len-range", *map(str, args.output_len_range),
            "--threads", str(args.threads), "--repeats", str(args.repeats), "--seed", str(args.seed),
            "--engine-arg", f"deterministic={'true' if on else 'false'}", "--json-out", str(out)]
    argv += ["--model", args.model] if args.model else ["--shape", args.shape]
    return argv


def shape_model(shape: str, dtype: str) -> Path:
    """The random-weight folder of --shape in --dtype, built if missing (what the offline run uses)."""
    model_dir = model_dir_for(shape, dtype)
    if not is_built(model_dir, shape, dtype):
        make_random_model(shape, model_dir, dtype)
    return model_dir


def serving_argv(args: argparse.Namespace, on: bool, out: Path, round_no: int) -> list[str]:
    model = args.model or str(shape_model(args.shape, args.dtype))
    argv = ["--model", model, f"--serve-arg=--dtype={args.dtype}", f"--serve-arg=--deterministic={'on' if on else 'off'}",
            "--num-requests", str(args.serving_requests), "--concurrency", str(args.serving_concurrency),
            "--input-len", str(args.serving_input_len), "--output-len", str(args.serving_output_len),
            "--seed", str(args.seed + round_no), "--no-progress", "--json-out", str(out)]
    if args.threads:
        argv.append(f"--serve-arg=--num-threads={args.threads}")
    return argv


def compare(figures: list[tuple[str, tuple[str, ...], bool]], off: list[dict[str, Any]],
            on: list[dict[str, Any]]) -> list[tuple[str, Optional[float], Optional[float], Optional[float], bool]]:
    rows = []
    for label, path, higher_better in figures:
        a = [v for v in (_get(r, path) for r in off) if v is not None]
        b = [v for v in (_get(r, path) for r in on) if v is not None]
        ma = statistics.median(a) if a else None
        mb = statistics.median(b) if b else None
        ratio = mb / ma if ma and mb is not None else None
        rows.append((label, ma, mb, ratio, higher_better))
    return rows


def fmt(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.1f}"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder, .gguf file, or 'default' (else --shape)")
    p.add_argument("--shape", default="llama-246m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs per benchmark (medians compared)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--input-len-range", type=int, nargs=2, default=[32, 256])
    p.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256])
    p.add_argument("--only", default="all", choices=["all", "throughput", "prefill", "decode"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serving-requests", type=int, default=16)
    p.add_argument("--serving-concurrency", type=int, default=8)
    p.add_argument("--serving-input-len", type=int, default=128)
    p.add_argument("--serving-output-len", type=int, default=128)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, __file__, *argv])
    print(f"command: {command}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {offline_throughput.machine_line()}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    results: dict[str, dict[bool, list[dict[str, Any]]]] = {"offline": {False: [], True: []},
                                                             "serving": {False: [], True: []}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="pagewire-determinism-") as tmp:
        for r in range(args.rounds):
            for on in (False, True):
                tag = f"round {r + 1}, deterministic {'on' if on else 'off'}"
                if not args.skip_offline:
                    out = Path(tmp) / f"offline-{r}-{on}.json"
                    print(f"\n== offline, {tag}", flush=True)
                    failed |= offline_throughput.main(offline_argv(args, on, out)) != 0
                    if out.exists():
                        results["offline"][on].append(json.loads(out.read_text())["results"].get("pagewire", {}))
                if not args.skip_serving:
                    out = Path(tmp) / f"serving-{r}-{on}.json"
                    print(f"\n== serving, {tag}", flush=True)
                    failed |= serving.main(serving_argv(args, on, out, r)) != 0
                    if out.exists():
                        servers = json.loads(out.read_text())["servers"]
                        results["serving"][on].append(servers[0].get("summary", {}) if servers else {})

    rows = []
    if not args.skip_offline:
        rows += compare(OFFLINE_FIGURES, results["offline"][False], results["offline"][True])
    if not args.skip_serving:
        rows += compare(SERVING_FIGURES, results["serving"][False], results["serving"][True])
    print(f"\nmedians over {args.rounds} round(s); ratio = on / off")
    print("| figure | off | on | on/off |\n|---|---:|---:|---:|")
    worst: Optional[float] = None
    for label, a, b, ratio, higher_better in rows:
        print(f"| {label} | {fmt(a)} | {fmt(b)} | {'–' if ratio is None else f'{ratio:.3f}'} |")
        if ratio is not None and higher_better:
            worst = ratio if worst is None else min(worst, ratio)
    if worst is not None:
        verdict = "under" if worst >= 0.95 else "over"
        cost = f"costs {100 * (1 - worst):.1f}%" if worst < 1 else f"gains {100 * (worst - 1):.1f}% at worst"
        print(f"worst throughput ratio {worst:.3f}: deterministic mode {cost}, "
              f"{verdict} the 5% bar for making it the default")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"command": command, "results": {
            k: {("on" if on else "off"): v for on, v in d.items()} for k, d in results.items()},
            "rows": rows}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
