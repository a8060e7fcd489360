"""Neighbours of the normal streams: does a client that stops reading, or a crowd of idle
WebSockets, hurt the ITL of the streams that are working? (issue 13's fault-suite bars)

Starts `pagewire serve` (the demo model by default) and runs --rounds rounds, the arms of each
round back to back (so load from other work falls on all arms alike), ITL pooled per arm.

Default mode (a slow consumer next to --streams normal WebSocket streams of --max-tokens tokens):
  0. baseline: the normal streams alone;
  A. next to one large request (--slow-tokens tokens with 20 top logprobs, several MB of frames)
     whose client reads normally;
  B. the same, but the large request's client has a tiny receive buffer and never reads.
A and B give the engine the same work and differ only in whether one client reads, so B/A is the
slow consumer's own effect (issue 13's bar: p99 up by less than 10%); B/0 also counts the large
request's engine work. The large request is cancelled at the end of each round (its socket
closes; the send timeout is raised so the server does not cut the stalled client first).

--idle N (idle-sockets mode): 0 = the --streams normal streams alone, B = the same with N idle
WebSockets open (opened before the streams, closed after). The server's RSS is reported with and
without the idle sockets (issue 13: "1,000 idle and 64 active WebSockets: RSS bounded and the
active streams' ITL unaffected").

ITL is measured at the clients: the gap between arrivals of consecutive delta frames of one
stream, divided by the tokens the later frame carries.

Quiet-machine commands (what bench/RESULTS.md records):
    .venv/bin/python bench/slow_consumer.py --rounds 6 --streams 8 --max-tokens 256 --slow-tokens 4000
    .venv/bin/python bench/slow_consumer.py --rounds 4 --streams 64 --max-tokens 128 --idle 1000
"""
from __future__ import annotations

import argparse
import asyncio
import base64
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
from typing import Optional

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def masked_text_frame(obj: dict[str, object]) -> bytes:
    data = json.dumps(obj).encode()
    mask = os.urandom(4)
    n = len(data)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def stalled_client(port: int, tokens: int) -> socket.socket:
    """A WebSocket client with a tiny receive buffer that asks for a lot and never reads."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(f"GET /v1/ws HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    s.sendall(masked_text_frame({"type": "generate", "id": "slow", "prompt": "never read", "params": {
        "max_tokens": tokens, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}}))
    return s


async def one_stream(url: str, i: int, tokens: int) -> list[float]:
    from websockets.asyncio.client import connect

    itls: list[float] = []
    async with connect(url, proxy=None, max_size=16 * 1024 * 1024) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "n", "prompt": f"normal stream {i}",
                                  "params": {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}}))
        last: Optional[float] = None
        while True:
            f = json.loads(await ws.recv())
            now = time.perf_counter()
            if f["type"] == "delta":
                n = len(f["token_ids"])
                if last is not None and n:
                    itls.extend([(now - last) / n] * n)
                last = now
            elif f["type"] in ("done", "error"):
                return itls


async def big_reader(url: str, tokens: int) -> None:
    """The large request, read as fast as it comes (until cancelled: closing cancels it)."""
    from websockets.asyncio.client import connect

    async with connect(url, proxy=None, max_size=16 * 1024 * 1024) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": "never read", "params": {
            "max_tokens": tokens, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}}))
        while True:
            await ws.recv()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def round_(url: str, args: argparse.Namespace, reading: Optional[bool]) -> list[float]:
    """reading None: no large request; True: it is read; False: a stalled client asks for it."""
    port = int(url.split(":")[2].split("/")[0])
    big = asyncio.ensure_future(big_reader(url, args.slow_tokens)) if reading else None
    slow = stalled_client(port, args.slow_tokens) if reading is False else None
    try:
        per = await asyncio.gather(*(one_stream(url, i, args.max_tokens) for i in range(args.streams)))
    finally:
        if big is not None:
            big.cancel()
            await asyncio.gather(big, return_exceptions=True)
        if slow is not None:
            slow.close()
    return [x for p in per for x in p]


async def idle_round(url: str, args: argparse.Namespace, pid: int) -> tuple[list[float], float, float]:
    """The normal streams next to --idle open, silent WebSockets; returns (ITLs, RSS with the idle
    sockets open, RSS after the streams)."""
    from websockets.asyncio.client import connect

    idle = []
    try:
        for _ in range(args.idle):
            idle.append(await connect(url, proxy=None, open_timeout=120, ping_interval=None))
        with_idle = rss_mb(pid)
        per = await asyncio.gather(*(one_stream(url, i, args.max_tokens) for i in range(args.streams)))
        after = rss_mb(pid)
    finally:
        await asyncio.gather(*(ws.close() for ws in idle), return_exceptions=True)
    return [x for p in per for x in p], with_idle, after


def summary(name: str, v: list[float]) -> str:
    return (f"{name}: ITL p50 {percentile(v, 0.5) * 1e3:.1f} ms, p90 {percentile(v, 0.9) * 1e3:.1f} ms, "
            f"p99 {percentile(v, 0.99) * 1e3:.1f} ms ({len(v)} gaps)")


def ratio(name: str, num: list[float], den: list[float]) -> str:
    return (f"{name}: p50 {percentile(num, 0.5) / percentile(den, 0.5):.3f}, "
            f"p90 {percentile(num, 0.9) / percentile(den, 0.9):.3f}, p99 {percentile(num, 0.99) / percentile(den, 0.99):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--slow-tokens", type=int, default=4000)
    p.add_argument("--idle", type=int, default=0, help="idle-sockets mode: this many idle WebSockets")
    p.add_argument("--model", default=None)
    p.add_argument("--serve-arg", action="append", default=[])
    args = p.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("date:", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "load average:", os.getloadavg(), flush=True)
    model = args.model
    if model is None:
        from server.models.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    port = free_port()
    base0: list[float] = []
    a: list[float] = []
    b: list[float] = []
    rss: list[tuple[float, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "server.cli", "serve", model, "--port", str(port), "--db",
               str(Path(tmp) / "b.db"), "--served-model-name", "demo", "--log-level", "warning",
               "--max-num-seqs", str(args.streams + 2), "--send-timeout", "3600", *args.serve_arg]
        print("server:", shlex.join(cmd), flush=True)
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        base = f"http://127.0.0.1:{port}"
        url = f"ws://127.0.0.1:{port}/v1/ws"
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
            asyncio.run(round_(url, args, None))  # warm-up, not counted
            for r in range(args.rounds):
                base0 += asyncio.run(round_(url, args, None))
                if args.idle:
                    before = rss_mb(proc.pid)
                    itl, with_idle, after = asyncio.run(idle_round(url, args, proc.pid))
                    b += itl
                    rss.append((before, with_idle, after))
                    print(f"round {r + 1}: 0 p99 {percentile(base0, 0.99) * 1e3:.1f} ms, "
                          f"B p99 {percentile(b, 0.99) * 1e3:.1f} ms; RSS {before:.1f} MB -> {with_idle:.1f} MB "
                          f"with {args.idle} idle -> {after:.1f} MB after the streams", flush=True)
                    continue
                a += asyncio.run(round_(url, args, True))
                b += asyncio.run(round_(url, args, False))
                print(f"round {r + 1}: 0 p99 {percentile(base0, 0.99) * 1e3:.1f} ms, A p99 {percentile(a, 0.99) * 1e3:.1f} ms, "
                      f"B p99 {percentile(b, 0.99) * 1e3:.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(summary("0 (normal streams alone)", base0))
    if args.idle:
        print(summary(f"B (with {args.idle} idle WebSockets)", b))
        print(ratio("ratio B/0", b, base0))
        per_idle = [(w - bf) * 1024 / args.idle for bf, w, _ in rss]
        print(f"RSS per idle WebSocket: {min(per_idle):.1f}-{max(per_idle):.1f} KB; "
              f"server RSS at the end {rss[-1][2]:.1f} MB" if rss else "no rounds")
    else:
        print(summary("A (large one read)", a))
        print(summary("B (large one stalled)", b))
        print(ratio("ratio B/A (the slow consumer's own effect; bar: p99 < 1.10)", b, a))
        print(ratio("ratio B/0", b, base0))
    print("load average at the end:", os.getloadavg())


if __name__ == "__main__":
    main()
