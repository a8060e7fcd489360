"""Scale-out benchmarks (docs/scale-out.md): figures for bench/RESULTS.md, not tests.

    python -m bench.scale_out ledger     commit latency (p50/p99) of the ledger on PostgreSQL vs SQLite
                                         under concurrent writers, and the cost per request of the
                                         database quota reservation (reserve + settle) vs in memory
    python -m bench.scale_out tpm        one key's TPM limit driven from two replicas at once for a
                                         minute: admitted tokens against the bucket's allowance
    python -m bench.scale_out affinity   two replicas behind HAProxy, many 4-turn conversations:
                                         second-turn prefix-hit rate and TTFT p50/p99 with consistent
                                         hashing on X-Session-Id, then with round-robin

Everything runs on this machine over 127.0.0.1: a PostgreSQL initdb'd into a temporary folder
(fsync on, the server's defaults), pagewire replicas serving the random-weight demo model, and
Debian's HAProxy with examples/scale-out/haproxy.cfg (round-robin: the same file with `balance
roundrobin`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.scaleout.postgres import PostgresServer  # noqa: E402  (the tests' launcher: initdb, nobody, free port)
from tests.server.harness import free_port  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))] if xs else float("nan")


# -- ledger commit latency ------------------------------------------------------------------------
async def _ledger_run(led: Any, writers: int, per_writer: int) -> dict[str, Any]:
    from server.serving.ledger import NewRequest, Terminal

    lat: list[float] = []
    c0 = led.commits

    async def writer(w: int) -> None:
        for i in range(per_writer):
            rid = f"b{w}-{i}-{os.urandom(4).hex()}"
            t = time.perf_counter()
            await led.insert(NewRequest(rid, "completion", "http", "c", "m", 0, {"max_tokens": 8}, "hi", 2,
                                        time.time(), key_id="pw-bench"))
            lat.append(time.perf_counter() - t)
            led.mark_running(rid, time.time())
            t = time.perf_counter()
            await led.finish(rid, Terminal("finished", "length", None, 2, 8, 0, "x" * 8, {"samples": []},
                                           time.time(), time.time()))
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[writer(w) for w in range(writers)])
    wall = time.perf_counter() - t0
    n = len(lat)
    return {"awaited_writes": n, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "writes_per_s": n / wall, "commits": led.commits - c0, "writes_per_commit": n / max(1, led.commits - c0)}


async def _quota_run(quotas: Any, n: int) -> dict[str, float]:
    lat: list[float] = []
    for i in range(n):
        t = time.perf_counter()
        res = await quotas.acquire("pw-bench", 40, f"q-{i}-{os.urandom(4).hex()}")
        quotas.settle(res, 40)
        lat.append(time.perf_counter() - t)
    return {"p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


def bench_ledger(ns: argparse.Namespace) -> None:
    from server.gateway.quota_db import DbQuotas
    from server.gateway.quotas import Limits, QuotaBook
    from server.serving.ledger import Ledger
    from server.serving.ledger_pg import PgLedger

    pg = PostgresServer(settings=()).start()  # fsync on: the server's defaults
    tmp = Path(tempfile.mkdtemp(prefix="pagewire-bench-"))
    try:
        async def main() -> None:
            limits = lambda _k: Limits(tpm=10**9, daily_tokens=10**12)  # noqa: E731
            for name in ("sqlite", "postgresql"):
                led: Any = (await Ledger.open(tmp / "bench.db")) if name == "sqlite" else \
                    await PgLedger.open(pg.new_database(), name="bench")
                try:
                    for writers in ([] if ns.quota_only else ns.writers):
                        r = await _ledger_run(led, writers, ns.per_writer)
                        print(json.dumps({"bench": "ledger_commit", "backend": name, "writers": writers, **r}))
                    q = DbQuotas(led, limits) if name == "postgresql" else QuotaBook(limits)
                    await _quota_run(q, 20)  # warm
                    print(json.dumps({"bench": "quota_reserve_settle", "backend": name,
                                      "scheme": "database (advisory lock)" if name == "postgresql" else "in memory",
                                      **await _quota_run(q, ns.quota_n)}))
                finally:
                    await led.close()
        asyncio.run(main())
    finally:
        pg.cleanup()


# -- replicas and the proxy -------------------------------------------------------------------------
class Replica:
    def __init__(self, url: str, model: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve", str(model), "--served-model-name", "demo",
               "--host", "127.0.0.1", "--port", str(self.port), "--db", url, "--log-level", "warning",
               "--max-num-seqs", "8", "--num-threads", "1", *extra]
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "replica exited"
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("replica did not start")

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("pagewire_prefix_cache_") and " " in line:
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _proxy(a: Replica, b: Replica, balance: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    cfg = (ROOT / "examples" / "scale-out" / "haproxy.cfg").read_text()
    if balance == "roundrobin":
        cfg = cfg.replace("    balance hash var(txn.conv)\n", "    balance roundrobin\n")
        assert "balance roundrobin" in cfg
    path = tmp / f"haproxy-{balance}.cfg"
    path.write_text(cfg)
    port = free_port()
    env = {"PAGEWIRE_PROXY_BIND": f"127.0.0.1:{port}", "PAGEWIRE_A": f"127.0.0.1:{a.port}",
           "PAGEWIRE_B": f"127.0.0.1:{b.port}", "PATH": "/usr/sbin:/usr/bin"}
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("haproxy did not come up")


def _cluster(tmp: Path, *extra: str) -> tuple[PostgresServer, str, Replica, Replica]:
    from server.models.demo_model import ensure_demo_model

    model = ensure_demo_model(tmp / "cache")
    pg = PostgresServer(settings=()).start()
    url = pg.new_database()
    a = Replica(url, model, tmp / "a.log", *extra)
    b = Replica(url, model, tmp / "b.log", *extra)
    a.wait_healthy()
    b.wait_healthy()
    return pg, url, a, b


# -- one key's TPM from both replicas -------------------------------------------------------------
def bench_tpm(ns: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pagewire-bench-"))
    pg, url, a, b = _cluster(tmp)
    try:
        from server.gateway.cli import _open_for_keys
        from server.gateway.keys import KeyStore
        from server.serving.db_url import parse_db

        conn, _ = _open_for_keys(parse_db(url))
        _, secret = KeyStore(conn).create("bench", tpm=ns.tpm)
        conn.close()
        cost = 3 + ns.max_tokens
        admitted: list[tuple[float, int]] = []
        refused = 0

        async def client(base: str, stop_at: float) -> None:
            nonlocal refused
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {secret}"}) as c:
                while time.monotonic() < stop_at:
                    r = await c.post(base + "/v1/completions", json={
                        "model": "demo", "prompt": [1, 2, 3], "max_tokens": ns.max_tokens, "ignore_eos": True})
                    if r.status_code == 200:
                        u = r.json()["usage"]
                        admitted.append((time.monotonic(), u["prompt_tokens"] + u["completion_tokens"]))
                    elif r.status_code == 429:
                        refused += 1
                        await asyncio.sleep(0.05)
                    else:
                        raise RuntimeError(r.text)

        async def main() -> float:
            await asyncio.sleep(2)  # key poll (0.5 s) has loaded the key on both
            t0 = time.monotonic()
            stop_at = t0 + ns.seconds
            await asyncio.gather(*[client(base, stop_at) for base in (a.base, b.base) for _ in range(ns.clients)])
            return t0
        t0 = asyncio.run(main())
        total = sum(n for _, n in admitted)
        allowance = ns.tpm + ns.tpm * ns.seconds / 60.0  # a full bucket, plus its refill over the run
        # The worst 60 s window: a bucket can admit at most its capacity plus one minute's refill.
        worst = 0
        for i, (t, _) in enumerate(admitted):
            worst = max(worst, sum(n for s, n in admitted[i:] if s < t + 60.0))
        print(json.dumps({"bench": "tpm_two_replicas", "tpm": ns.tpm, "request_cost": cost,
                          "seconds": ns.seconds, "admitted_requests": len(admitted), "refused_429": refused,
                          "admitted_tokens": total, "bucket_allowance": allowance,
                          "excess_tokens": total - allowance, "excess_in_reservations": (total - allowance) / cost,
                          "worst_60s_window_tokens": worst, "window_allowance": 2 * ns.tpm,
                          "per_replica_started_at": round(t0, 1)}))
    finally:
        a.stop()
        b.stop()
        pg.cleanup()


# -- prefix affinity vs round-robin ---------------------------------------------------------------
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


async def _conversation(base: str, cid: str, rng: random.Random, turns: int, max_tokens: int,
                        out: list[dict[str, Any]]) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]
    async with httpx.AsyncClient(timeout=300) as c:
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30))})
            t0 = time.perf_counter()
            ttft: Optional[float] = None
            text, usage, replica = [], None, None
            async with c.stream("POST", base + "/v1/chat/completions", headers={"X-Session-Id": cid}, json={
                    "model": "demo", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                replica = r.headers.get("x-pagewire-replica")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(ev["choices"][0]["delta"]["content"])
                    if ev.get("usage"):
                        usage = ev["usage"]
            assert usage is not None
            out.append({"conv": cid, "turn": turn, "ttft": ttft if ttft is not None else time.perf_counter() - t0,
                        "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
                        "replica": replica})
            messages.append({"role": "assistant", "content": "".join(text)})


def bench_affinity(ns: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pagewire-bench-"))
    pg, _, a, b = _cluster(tmp, "--kv-cache-tokens", str(ns.kv_cache_tokens), "--max-num-batched-tokens", "512")
    try:
        for mode in ("hash", "roundrobin"):
            proxy, base = _proxy(a, b, mode, tmp)
            try:
                rows: list[dict[str, Any]] = []

                async def main() -> None:
                    sem = asyncio.Semaphore(ns.concurrency)

                    async def one(i: int) -> None:
                        async with sem:
                            await _conversation(base, f"{mode}-conv-{i}", random.Random(f"{mode}-{i}"), 4,
                                                ns.max_tokens, rows)
                    await asyncio.gather(*[one(i) for i in range(ns.conversations)])
                asyncio.run(main())
            finally:
                proxy.terminate()
                proxy.wait(30)
            by = {(r["conv"], r["turn"]): r for r in rows}
            block = 16
            # A second turn "hits" when its previous turn's prompt (whole blocks) came from the cache.
            second = [by[(c, 2)] for c, t in by if t == 2]
            hits = [r for r in second if r["cached"] >= (by[(r["conv"], 1)]["prompt"] // block) * block > 0]
            later = [r for r in rows if r["turn"] >= 2]
            print(json.dumps({
                "bench": "affinity", "routing": "consistent hash on X-Session-Id" if mode == "hash" else "round-robin",
                "conversations": ns.conversations, "turns": 4, "concurrency": ns.concurrency,
                "second_turn_prefix_hit_rate": len(hits) / len(second),
                "turns_2_4_cached_token_share": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
                "ttft_p50_ms": pct([r["ttft"] for r in rows], 50) * 1e3,
                "ttft_p99_ms": pct([r["ttft"] for r in rows], 99) * 1e3,
                "ttft_turns_2_4_p50_ms": pct([r["ttft"] for r in later], 50) * 1e3,
                "ttft_turns_2_4_p99_ms": pct([r["ttft"] for r in later], 99) * 1e3,
                "replicas_used": sorted({str(r["replica"]) for r in rows}),
            }))
    finally:
        a.stop()
        b.stop()
        pg.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    led = sub.add_parser("ledger")
    led.add_argument("--writers", type=int, nargs="+", default=[1, 16])
    led.add_argument("--per-writer", type=int, default=200)
    led.add_argument("--quota-n", type=int, default=500)
    led.add_argument("--quota-only", action="store_true", help="only the quota reservation's cost")
    tpm = sub.add_parser("tpm")
    tpm.add_argument("--tpm", type=int, default=2000)
    tpm.add_argument("--max-tokens", type=int, default=37)
    tpm.add_argument("--seconds", type=float, default=65.0)
    tpm.add_argument("--clients", type=int, default=2, help="per replica")
    aff = sub.add_parser("affinity")
    aff.add_argument("--conversations", type=int, default=24)
    aff.add_argument("--concurrency", type=int, default=6)
    aff.add_argument("--max-tokens", type=int, default=16)
    aff.add_argument("--kv-cache-tokens", type=int, default=32768)
    ns = p.parse_args()
    print(f"# {' '.join(sys.argv)}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", flush=True)
    {"ledger": bench_ledger, "tpm": bench_tpm, "affinity": bench_affinity}[ns.what](ns)


if __name__ == "__main__":
    main()
