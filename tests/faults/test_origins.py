"""Browser-origin safety: a page from another origin cannot drive the server (no simple POST, no
WebSocket), loopback pages and same-origin requests can, preflights are answered properly, and
`--allowed-origins` opens exact origins. Also the policy's parsing and matching rules."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import websockets

from server.serving.origin_policy import OriginPolicy
from tests.server.harness import ServerProcess, WsClient, ledger_rows

EVIL = "http://evil.example"
APP = "https://app.example:8443"


@pytest.fixture(scope="module")
def srv(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(demo_model, tmp_path_factory.mktemp("origins") / "o.db",
                         "--allowed-origins", f"loopback,{APP}").start()
    try:
        yield proc
    finally:
        proc.stop()


def _text_plain_post(srv: ServerProcess, origin: str) -> httpx.Response:
    # What a page can send with no preflight: a form-like text/plain body holding JSON.
    body = b'{"model": "demo", "prompt": "from a page", "max_tokens": 2}'
    return httpx.post(srv.base + "/v1/completions", content=body, timeout=60,
                      headers={"origin": origin, "content-type": "text/plain"})


def test_a_foreign_page_cannot_run_a_request(srv: ServerProcess) -> None:
    before = len(ledger_rows(srv.db))
    r = _text_plain_post(srv, EVIL)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "origin_not_allowed" and r.json()["error"]["param"] == "Origin"
    assert "access-control-allow-origin" not in r.headers
    assert len(ledger_rows(srv.db)) == before  # nothing ran, nothing was recorded
    assert httpx.get(srv.base + "/metrics", headers={"origin": "null"}).status_code == 403


def test_loopback_listed_and_non_browser_callers_may(srv: ServerProcess) -> None:
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:8080", APP):
        r = _text_plain_post(srv, origin)
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin
        assert "x-request-id" in r.headers["access-control-expose-headers"]
    assert _text_plain_post(srv, "https://app.example").status_code == 403  # another port: another origin
    r = httpx.post(srv.base + "/v1/completions", json={"model": "demo", "prompt": "cli", "max_tokens": 2})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_preflight(srv: ServerProcess) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(srv.base + "/v1/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type, idempotency-key"})

    ok = preflight(APP)
    assert ok.status_code == 204
    assert ok.headers["access-control-allow-origin"] == APP
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "idempotency-key" in ok.headers["access-control-allow-headers"]
    assert "origin" in ok.headers["vary"].lower()
    bad = preflight(EVIL)
    assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers


def test_websocket_upgrade_checks_origin(srv: ServerProcess) -> None:
    async def connect(origin: str) -> str:
        async with websockets.connect(srv.ws_url, origin=origin, proxy=None) as ws:  # type: ignore[arg-type]
            await ws.send('{"type": "generate", "id": "a", "prompt": "p", "params": {"max_tokens": 2}}')
            return str(await ws.recv())

    with pytest.raises(websockets.InvalidStatus) as info:
        asyncio.run(connect(EVIL))
    assert info.value.response.status_code == 403
    assert "accepted" in asyncio.run(connect("http://localhost:9999"))

    async def no_origin() -> str:
        async with WsClient(srv.ws_url) as ws:
            got = await ws.run({"x": {"prompt": "p", "params": {"max_tokens": 2}}})
            return got["x"][-1]["type"]
    assert asyncio.run(no_origin()) == "done"


def test_default_policy_is_same_origin_and_loopback(demo_model: Path, tmp_path: Path) -> None:
    with ServerProcess(demo_model, tmp_path / "d.db") as srv:
        assert _text_plain_post(srv, EVIL).status_code == 403
        assert _text_plain_post(srv, APP).status_code == 403
        assert _text_plain_post(srv, "http://localhost:1234").status_code == 200
        assert _text_plain_post(srv, srv.base).status_code == 200  # same origin


def test_policy_rules() -> None:
    p = OriginPolicy.parse("loopback")
    assert p.allows("http://127.0.0.2:1", None) and p.allows("http://app.localhost", None)
    assert not p.allows("http://127.0.0.1.evil.example", None)
    assert not p.allows("null", None) and not p.allows("not an origin", None)
    # Same origin counts only for a loopback Host or the bind address, never a rebinding name.
    assert not OriginPolicy.parse("").allows("http://evil.example:8000", "evil.example:8000")
    assert OriginPolicy.parse("", "10.0.0.5").allows("http://10.0.0.5:8000", "10.0.0.5:8000")
    assert not OriginPolicy.parse("").allows("http://localhost:8001", "localhost:8000")
    star = OriginPolicy.parse("*")
    assert star.allows(EVIL, None) and not star.allows("null", None)
    assert OriginPolicy.parse("null").allows("null", None)
    with pytest.raises(ValueError, match="ftp://x"):
        OriginPolicy.parse("loopback, ftp://x")
