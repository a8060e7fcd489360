"""Interactive ITL with and without a running batch, in one run against one server.

Starts `pagewire serve` (the default model, or --model PATH) on a free port, then measures the same
interactive streaming workload (bench/serving.py's load generator) three times:
  1. baseline: nothing else running;
  2. with a batch: a batch of --batch-lines chat lines (each --batch-output-len tokens, ignore_eos)
     is submitted through /v1/files + /v1/batches and is in progress for the whole phase;
  3. baseline again (the machine is shared: a drift between 1 and 3 shows the noise floor).
It prints the exact command, the ITL/TTFT percentiles of each phase and the ratio of ITL p99 with
the batch to the mean of the two baselines (the issue's target: <= 1.10), and how many batch lines
completed during phase 2 (the batch really ran in the idle gaps).

    .venv/bin/python bench/batch_itl.py --concurrency 1 --num-requests 12 --input-len 64 --output-len 64
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (bench/serving.py, the load generator)


def _start(model: str, extra: list[str], db: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "server.cli", "serve", *([] if model == "default" else [model]),
           "--port", str(port), "--db", str(db), "--log-level", "warning", *extra]
    print(f"server: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"pagewire serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def _submit_batch(url: str, lines: int, output_len: int) -> str:
    text = "\n".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}],
        "max_tokens": output_len, "ignore_eos": True, "temperature": 0}}) for i in range(lines))
    f = httpx.post(url + "/v1/files", files={"file": ("b.jsonl", text.encode())}, data={"purpose": "batch"}).json()
    b = httpx.post(url + "/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions"}).json()
    return str(b["id"])


def _batch(url: str, bid: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/v1/batches/{bid}").json())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--serve-arg", action="append", default=[])
    p.add_argument("--batch-lines", type=int, default=200)
    p.add_argument("--batch-output-len", type=int, default=256)
    ns, rest = p.parse_known_args()
    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(ns.model, ns.serve_arg, Path(tmp) / "ledger.db")
        try:
            phases: dict[str, dict[str, Any]] = {}
            for seed, phase in ((1, "baseline"), (2, "with batch"), (3, "baseline again")):
                args = serving.parse_args(["--base-url", url, "--mode", "sse", "--endpoint", "chat",
                                           "--seed", str(seed), "--no-progress", *rest])
                bid = None
                if phase == "with batch":
                    bid = _submit_batch(url, ns.batch_lines, ns.batch_output_len)
                    deadline = time.monotonic() + 120
                    while _batch(url, bid)["status"] != "in_progress":  # the batch is running first
                        assert time.monotonic() < deadline, "batch did not start"
                        time.sleep(0.1)
                    before = _batch(url, bid)["request_counts"]["completed"]
                res = asyncio.run(serving.bench_server(args, url))["summary"]
                if bid is not None:
                    b = _batch(url, bid)
                    res["batch_status"] = b["status"]
                    res["batch_lines_done_during_phase"] = b["request_counts"]["completed"] - before
                    httpx.post(f"{url}/v1/batches/{bid}/cancel")
                phases[phase] = res
        finally:
            proc.terminate()
            proc.wait(120)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\n{'phase':<16} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'out tok/s':>9}  batch lines done")
    for name, r in phases.items():
        print(f"{name:<16} {r['itl_ms']['p50']:>10.1f} {r['itl_ms']['p99']:>10.1f} {r['ttft_ms']['p50']:>11.1f} "
              f"{r['ttft_ms']['p99']:>11.1f} {r['output_tok_s']:>9.1f}  "
              f"{r.get('batch_lines_done_during_phase', '-')}")
    base = (phases["baseline"]["itl_ms"]["p99"] + phases["baseline again"]["itl_ms"]["p99"]) / 2
    ratio = phases["with batch"]["itl_ms"]["p99"] / base
    print(f"\nITL p99 with a batch / baseline mean: {ratio:.3f} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
