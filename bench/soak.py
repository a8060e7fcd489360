"""Soak: steady load on one pagewire server, with its memory sampled as it goes (issue 13, bug 9).

Starts `pagewire serve` (the demo model by default) on a free port with a temporary ledger, sends
--num-requests short completions at --concurrency (half over HTTP SSE, half non-streamed, each
with a different prompt so nothing is cached by text), and every --sample-every requests records:
the server's RSS (from /proc/PID/status), and what its bounded in-memory structures hold, read
from /metrics (live requests, output bytes reserved, ended streams retained and their bytes).
With --retention-wait, it then waits out the stream retention window and samples once more.
With --idle-sockets N, N WebSocket connections are opened before the load and left idle beside it
(issue 29: the 10,000-request soak with 1,000 idle sockets open); at the end each must still
answer a ping, and the count that did is printed.

The curve must flatten: after the first samples (allocator warm-up, the retention window filling)
RSS should stay within a band, and `streams_retained` at the end equals what the window (or the
byte budget) allows, not the number of requests sent.

Example (what bench/RESULTS.md records; under `nice`, on a shared machine):
    nice .venv/bin/python bench/soak.py --num-requests 10000 --concurrency 16 --max-tokens 4 \
        --serve-arg=--stream-retention=60 --json-out soak.json
    nice .venv/bin/python bench/soak.py --num-requests 10000 --idle-sockets 1000
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
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

REPO = Path(__file__).resolve().parents[1]
GAUGES = ("pagewire_live_requests", "pagewire_output_bytes_reserved", "pagewire_stream_live_bytes",
          "pagewire_streams_retained", "pagewire_stream_retained_bytes")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def gauges(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (await client.get(base + "/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES:
            out[name.removeprefix("pagewire_")] = float(value)
    return out


async def open_idle(base: str, n: int) -> list[Any]:
    """n WebSocket connections that send nothing (the client library answers the server's pings)."""
    from websockets.asyncio.client import connect

    url = base.replace("http://", "ws://") + "/v1/ws"
    sockets: list[Any] = []
    for start in range(0, n, 50):  # fifty handshakes at a time
        sockets += await asyncio.gather(*(connect(url, open_timeout=120) for _ in range(min(50, n - start))))
    return sockets


async def still_open(sockets: list[Any]) -> int:
    """How many of the idle sockets answer a ping now."""
    async def alive(ws: Any) -> bool:
        try:
            await asyncio.wait_for(await ws.ping(), 60)
            return True
        except Exception:  # noqa: BLE001 - closed, or no pong: not alive
            return False
    return sum(await asyncio.gather(*(alive(ws) for ws in sockets)))


async def soak(args: argparse.Namespace, base: str, pid: int) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    done = 0
    failures = 0
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    idle = await open_idle(base, args.idle_sockets) if args.idle_sockets else []
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def sample(label: str) -> None:
            s = {"requests": done, "rss_mb": round(rss_mb(pid), 1), "elapsed_s": round(time.monotonic() - t0, 1),
                 "failures": failures, "at": label, **(await gauges(client, base))}
            samples.append(s)
            print(json.dumps(s), flush=True)

        async def one(i: int) -> None:
            nonlocal done, failures
            body = {"model": "demo", "prompt": f"soak request {i}: tell me about {i * 7919 % 10007}",
                    "max_tokens": args.max_tokens, "temperature": 0.7, "stream": i % 2 == 0}
            try:
                if body["stream"]:
                    async with client.stream("POST", base + "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                        ok = r.status_code == 200
                else:
                    ok = (await client.post(base + "/v1/completions", json=body)).status_code == 200
            except httpx.HTTPError:
                ok = False
            failures += not ok
            done += 1

        await sample("start")
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.num_requests):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                await one(i)
                if done % args.sample_every == 0:
                    await sample("load")

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        if args.retention_wait > 0:
            await asyncio.sleep(args.retention_wait)
            await sample(f"after {args.retention_wait:g}s idle")
    if idle:
        print(f"idle sockets still open at the end: {await still_open(idle)} of {len(idle)}", flush=True)
        await asyncio.gather(*(ws.close() for ws in idle))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--sample-every", type=int, default=500)
    p.add_argument("--retention-wait", type=float, default=0.0,
                   help="seconds to stay idle after the load before the last sample (the retention window)")
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pagewire serve` option (repeatable)")
    p.add_argument("--idle-sockets", type=int, default=0, help="WebSocket connections held open and idle beside the load")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    print("date:", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "load average:", os.getloadavg(), flush=True)

    model: Optional[str] = args.model
    if model is None:
        from server.models.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "server.cli", "serve", model, "--port", str(port),
               "--db", str(Path(tmp) / "soak.db"), "--served-model-name", "demo", "--log-level", "warning",
               "--max-queue", str(max(256, args.concurrency * 2)), *args.serve_arg]
        print("server:", shlex.join(cmd), flush=True)
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"server exited with {proc.returncode}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            samples = asyncio.run(soak(args, base, proc.pid))
        finally:
            proc.terminate()
            proc.wait(60)
    print("load average at the end:", os.getloadavg())
    load = [s["rss_mb"] for s in samples if s["at"] == "load"]
    if len(load) >= 4:
        half = load[len(load) // 2:]
        print(f"RSS: start {samples[0]['rss_mb']} MB, first sample under load {load[0]} MB, "
              f"second half min {min(half)} / max {max(half)} MB, last {samples[-1]['rss_mb']} MB; "
              f"slope over the second half {(half[-1] - half[0]) / max(1, len(half) - 1):+.1f} MB per "
              f"{args.sample_every} requests")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
