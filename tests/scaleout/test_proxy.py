"""The shipped HAProxy configuration (examples/scale-out/haproxy.cfg), run by a real HAProxy in
front of two real replicas on one PostgreSQL: a conversation key (X-Session-Id, the body's
`user`, a WebSocket's `session` parameter) always reaches the same replica, different keys spread
over both, and a replica that starts draining (SIGTERM: /health 503 first) is taken out while its
in-flight request still finishes."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.scaleout.test_faults_pg import replica, wait_until
from tests.server.harness import free_port

CFG = Path(__file__).resolve().parents[2] / "examples" / "scale-out" / "haproxy.cfg"


class Proxy:
    def __init__(self, a: str, b: str) -> None:
        self.port = free_port()
        env = {"PAGEWIRE_PROXY_BIND": f"127.0.0.1:{self.port}", "PAGEWIRE_A": a, "PAGEWIRE_B": b, "PATH": "/usr/sbin:/usr/bin"}
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(CFG)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def cluster(demo_model: Path, tmp_path: Path, pg_url: str) -> Iterator[Any]:
    if shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists():
        pytest.skip("HAProxy is not installed (apt-get install haproxy; .ci/run and `make sysdeps` do)")
    a = replica(demo_model, tmp_path, pg_url, "a", "--shutdown-grace", "120").start()
    b = replica(demo_model, tmp_path, pg_url, "b").start()
    proxy = Proxy(f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")
    wait_until(lambda: _up(proxy.base), 60, "the proxy to see both replicas healthy")
    yield a, b, proxy
    proxy.stop()
    a.kill()
    a.stop()
    b.stop()


def _up(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _post(base: str, headers: dict[str, str], body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(base + "/v1/completions", headers=headers, timeout=300,
                   json={"model": "demo", "prompt": [1, 2, 3], "max_tokens": 2, **body})
    assert r.status_code == 200, r.text
    return r


def test_affinity_spread_and_drain(cluster: Any) -> None:
    a, b, proxy = cluster
    served: dict[str, set[str]] = {}
    for i in range(12):
        for _ in range(3):
            r = _post(proxy.base, {"X-Session-Id": f"conv-{i}"}, {})
            served.setdefault(f"conv-{i}", set()).add(r.headers["x-pagewire-replica"])
    assert all(len(v) == 1 for v in served.values()), served  # one replica per conversation
    assert {next(iter(v)) for v in served.values()} == {"a", "b"}  # and both replicas used
    # The body's `user` is a conversation key too (no header).
    users = {_post(proxy.base, {}, {"user": "alice"}).headers["x-pagewire-replica"] for _ in range(3)}
    assert len(users) == 1
    # A WebSocket is routed once, at its upgrade, by its `session` parameter; it stays put.
    on_a = next(k for k, v in served.items() if v == {"a"})
    from websockets.sync.client import connect

    for _ in range(2):
        with connect(f"ws://127.0.0.1:{proxy.port}/v1/ws?session={on_a}", proxy=None) as ws:
            assert ws.response.headers["x-pagewire-replica"] == "a"
            ws.send(json.dumps({"type": "generate", "id": "w", "prompt": "hi", "params": {"max_tokens": 2}}))
            while json.loads(ws.recv(timeout=120))["type"] not in ("done", "error"):
                pass

    # Drain: a long request keeps `a` draining; meanwhile the proxy must take it out.
    long: dict[str, Any] = {}

    def run_long() -> None:
        long["r"] = httpx.post(proxy.base + "/v1/completions", headers={"X-Session-Id": on_a}, timeout=600,
                               json={"model": "demo", "prompt": [4, 5, 6], "max_tokens": 300, "ignore_eos": True})
    t = threading.Thread(target=run_long)
    t.start()
    wait_until(lambda: _running(a.base), 120, "the long request to run on a")
    a.signal(signal.SIGTERM)
    wait_until(lambda: _health(a.base) == 503, 60, "a's /health to turn 503")
    # Once the proxy's checks fail twice, a's conversations go to b; nothing is refused meanwhile.
    deadline = time.monotonic() + 60
    while _post(proxy.base, {"X-Session-Id": on_a}, {}).headers["x-pagewire-replica"] != "b":
        assert time.monotonic() < deadline, "the draining replica was not taken out"
    # b's own conversations did not move (consistent hashing).
    for k, v in served.items():
        if v == {"b"}:
            assert _post(proxy.base, {"X-Session-Id": k}, {}).headers["x-pagewire-replica"] == "b"
    t.join(600)
    assert long["r"].status_code == 200 and long["r"].json()["usage"]["completion_tokens"] == 300
    assert long["r"].headers["x-pagewire-replica"] == "a"  # it finished where it ran


def _running(base: str) -> bool:
    try:
        load = httpx.get(base + "/health", timeout=2).json().get("load", {})
    except (httpx.HTTPError, json.JSONDecodeError):
        return False
    return bool(load.get("running_sequences"))


def _health(base: str) -> int:
    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return -1
