"""What authentication and rate limiting cost per request on the event loop (issue 9: < 1 ms).

Measures, on uvloop, one HTTP request's pass through the gateway against a baseline without it:
- baseline: the ASGI app alone (a no-op endpoint) called with a request scope;
- gateway: the same app behind `AuthGuard` (key-cache freshness read, SHA-256 + constant-time
  compare), plus what admission adds for a key: `bind`, `QuotaBook.reserve` + `settle` (TPM,
  RPM and daily limits all set) and the x-ratelimit-* headers a 200 carries.
The ledger holds `--keys` keys. Prints its command, the machine, the load average, and per-request
microseconds (median of `--rounds` rounds of `--requests` requests each).

    .venv/bin/python bench/auth_cost.py --keys 1000 --requests 5000 --rounds 7
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.gateway.auth import Authenticator, AuthGuard, bind, principal_of  # noqa: E402
from server.gateway.keys import KeyStore  # noqa: E402
from server.gateway.quotas import QuotaBook  # noqa: E402
from server.serving.jobs import GenerationSpec  # noqa: E402
from server.serving.ledger import Ledger  # noqa: E402


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


async def endpoint(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The no-op route both variants end in; with a caller it does admission's gateway work."""
    who = principal_of(scope)
    if who is not None:
        spec = GenerationSpec(kind="completion", api="http", client="peer", model="m", idempotency_key="k")
        bind(spec, who)
        book: QuotaBook = scope["book"]
        res = book.reserve(who.key_id, 64)
        limits = [(k.encode(), v.encode()) for k, v in book.headers(who.key_id).items()]  # on the 200
        book.settle(res, 48)
        await send({"type": "http.response.start", "status": 200, "headers": limits})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})


async def run(args: argparse.Namespace) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="pagewire-auth-bench-"))
    led = await Ledger.open(tmp / "l.db")
    conn = sqlite3.connect(str(tmp / "l.db"), check_same_thread=False, isolation_level=None)
    store = KeyStore(conn)
    secrets = [store.create(f"k{i}", tpm=10**9, rpm=10**9, daily_tokens=10**12)[1] for i in range(args.keys)]
    auth = Authenticator(conn, "on")
    book = QuotaBook(auth.limits_of)
    guarded = AuthGuard(endpoint, auth=lambda: auth)

    async def send(msg: dict[str, Any]) -> None:
        return None

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    def scope_for(i: int) -> dict[str, Any]:
        s = secrets[i % len(secrets)]
        return {"type": "http", "path": "/v1/completions", "method": "POST", "book": book,
                "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {s}".encode())]}

    scopes = [scope_for(i) for i in range(args.requests)]
    results: dict[str, list[float]] = {"baseline": [], "gateway": []}
    for _ in range(args.rounds):
        for name, app in (("baseline", endpoint), ("gateway", guarded)):
            t0 = time.perf_counter()
            for sc in scopes:
                sc.pop("pagewire.principal", None)
                await app(sc, receive, send)
            results[name].append((time.perf_counter() - t0) / len(scopes) * 1e6)
    await led.close()
    conn.close()
    return {k: statistics.median(v) for k, v in results.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("date:", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print("cpu:", cpu_model(), f"({os.cpu_count()} logical CPUs)")
    print("load average (1/5/15 min): %.2f %.2f %.2f" % os.getloadavg())
    import uvloop

    r = uvloop.run(run(args))
    extra = r["gateway"] - r["baseline"]
    print(f"baseline (no gateway):                  {r['baseline']:8.1f} us/request")
    print(f"auth + bind + reserve/settle + headers: {r['gateway']:8.1f} us/request  "
          f"(gateway adds {extra:.1f} us = {extra / 1000:.3f} ms; target < 1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
