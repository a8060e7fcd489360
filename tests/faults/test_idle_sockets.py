"""1,000 idle WebSockets next to 64 active ones (issue 13's fault suite): the server's RSS growth
per idle connection stays bounded (the figures are printed, and recorded in bench/RESULTS.md),
and all 64 active streams complete, token for token, while the idle ones stay open. ITL under
this load is a benchmark matter (bench/slow_consumer.py measures the neighbour effect); this test
checks only what must hold on any machine."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.server.harness import ServerProcess, WsClient

IDLE = 1000
ACTIVE = 64
TOKENS = 16
OPEN_AT_ONCE = 50  # divides IDLE
# A generous per-connection ceiling: an idle socket costs the server a transport, a protocol, an
# outbox and two tasks — tens of KB at most. 200 KB each would mean something is buffered.
MAX_BYTES_PER_IDLE = 200 * 1024


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_1000_idle_and_64_active_websockets(demo_model: Path, tmp_path: Path) -> None:
    srv = ServerProcess(demo_model, tmp_path / "idle.db", "--max-num-seqs", "16").start()
    try:
        assert srv.proc is not None
        pid = srv.proc.pid

        async def scenario() -> dict[str, Any]:
            from websockets.asyncio.client import connect

            # Warm the server's paths once (first request allocations are not per-connection).
            async with WsClient(srv.ws_url) as ws:
                await ws.run({"w": {"prompt": "warm", "params": {"max_tokens": 2}}})
            before = _rss(pid)
            idle = []
            for _ in range(0, IDLE, OPEN_AT_ONCE):  # handshakes in parallel, a bounded number at a time
                idle += await asyncio.gather(*(connect(srv.ws_url, proxy=None, open_timeout=120)
                                               for _ in range(OPEN_AT_ONCE)))
            assert len(idle) == IDLE
            with_idle = _rss(pid)

            async def active(i: int) -> list[dict[str, Any]]:
                async with WsClient(srv.ws_url) as ws:
                    got = await ws.run({f"a{i}": {"prompt": f"active {i}", "params": {
                        "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}}, timeout=600)
                    return got[f"a{i}"]

            results = await asyncio.gather(*(active(i) for i in range(ACTIVE)))
            after = _rss(pid)
            # The idle ones are still open and answer (a bad frame gets its error frame).
            for ws in idle[:: IDLE // 10]:
                await ws.send("not json")
                err = json.loads(await asyncio.wait_for(ws.recv(), 120))
                assert err["type"] == "error"
            for ws in idle:
                await ws.close()
            return {"before": before, "with_idle": with_idle, "after": after, "results": results}

        out = asyncio.run(scenario())
        for frames in out["results"]:
            deltas = [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]
            assert frames[-1]["type"] == "done" and len(deltas) == TOKENS
        per_idle = (out["with_idle"] - out["before"]) / IDLE
        print(f"\nRSS: {out['before'] / 2**20:.1f} MB before, {out['with_idle'] / 2**20:.1f} MB with {IDLE} idle "
              f"WebSockets ({per_idle / 1024:.1f} KB each), {out['after'] / 2**20:.1f} MB after {ACTIVE} active streams")
        assert per_idle < MAX_BYTES_PER_IDLE
    finally:
        srv.stop()
