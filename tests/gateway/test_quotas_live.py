"""Token rate limits on a live (in-process) server with the quota clock injected: 429 with
OpenAI's headers, the openai SDK's automatic retry honouring them, and reservations reconciled on
completion, cancel and failure. No test sleeps: the clock is moved by the SDK's retry hook."""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import FakeClock

PROMPT = [1, 2, 3]  # token ids: exactly 3 prompt tokens


def _client(base: str, secret: str, retries: int, clock: FakeClock, sleeps: list[float]) -> openai.OpenAI:
    client = openai.OpenAI(base_url=base + "/v1", api_key=secret, max_retries=retries, timeout=120)

    def sleep_for_retry(*, retries_taken: int, max_retries: int, options: Any, response: Any) -> None:
        # The SDK's own delay computation from our headers; instead of sleeping, move the clock.
        t = client._calculate_retry_timeout(max_retries - retries_taken, options,
                                            response.headers if response else None)
        sleeps.append(t)
        clock.t += t

    client._sleep_for_retry = sleep_for_retry  # type: ignore[method-assign]
    return client


async def _ws_generate(port: int, secret: str, max_tokens: int) -> dict[str, Any]:
    """The frame that ends one WebSocket generate (done or error)."""
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{port}/v1/ws", proxy=None,
                       additional_headers={"Authorization": f"Bearer {secret}"}) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "w", "kind": "completion", "prompt": PROMPT,
                                  "params": {"max_tokens": max_tokens}}))
        while True:
            f: dict[str, Any] = json.loads(await ws.recv())
            if f["type"] in ("done", "error"):
                return f


def test_tpm_429_headers_and_the_openai_sdk_retry(in_process: Any, make_key: Any, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    db = tmp_path / "l.db"
    key_id, secret = make_key(db, "tpm", tpm=100)
    srv = in_process(db)
    clock = FakeClock()
    assert srv.gateway.quotas is not None
    srv.gateway.quotas.clock = clock
    sleeps: list[float] = []
    c = _client(srv.base, secret, 0, clock, sleeps)
    ok = c.completions.with_raw_response.create(model="demo", prompt=PROMPT, max_tokens=57,
                                                extra_body={"ignore_eos": True})
    # Like OpenAI, a 200 carries the key's limits too: the state right after its reservation.
    assert (ok.headers["x-ratelimit-limit-tokens"], ok.headers["x-ratelimit-remaining-tokens"]) == ("100", "40")
    r = ok.parse()
    assert r.usage is not None and r.usage.total_tokens == 60  # reserved 60, used 60
    # 40 left; another 60 needs 20 more tokens at 100/60 per second: 12 s.
    raw = httpx.post(srv.base + "/v1/completions", headers={"Authorization": f"Bearer {secret}"},
                     json={"model": "demo", "prompt": PROMPT, "max_tokens": 57})
    assert raw.status_code == 429, raw.text
    h = raw.headers
    assert raw.json()["error"]["code"] == "rate_limit_exceeded"
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("100", "40")
    assert h["x-ratelimit-reset-tokens"] == "36s" and h["retry-after"] == "12" and h["retry-after-ms"] == "12000"
    # The same refusal on the WebSocket: an `error` frame with retry_after_ms.
    frame = asyncio.run(_ws_generate(srv.port, secret, 57))
    assert frame["type"] == "error" and frame["code"] == "rate_limit_exceeded", frame
    assert frame["retry_after_ms"] == 12000
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="demo", prompt=PROMPT, max_tokens=57)
    assert e.value.status_code == 429 and sleeps == []
    # With retries, the SDK waits exactly what we advertised and its retry is admitted.
    c2 = _client(srv.base, secret, 2, clock, sleeps)
    r2 = c2.completions.create(model="demo", prompt=PROMPT, max_tokens=57, extra_body={"ignore_eos": True})
    assert sleeps == [pytest.approx(12.0)] and r2.usage is not None and r2.usage.total_tokens == 60
    # A request that can never fit is refused with x-should-retry: false; the SDK does not retry.
    sleeps.clear()
    with pytest.raises(openai.RateLimitError, match="more than this key's limit"):
        c2.completions.create(model="demo", prompt=PROMPT, max_tokens=98)
    assert sleeps == []
    # The log names the key id at most, never its secret.
    assert secret not in caplog.text and secret.split(".")[1] not in caplog.text


def test_reservations_are_released_on_cancel_and_failure(in_process: Any, make_key: Any, tmp_path: Path) -> None:
    import asyncio

    from server.engine import isolation

    db = tmp_path / "l.db"
    key_id, secret = make_key(db, "rec", tpm=1000)
    srv = in_process(db)
    clock = FakeClock()
    assert srv.gateway.quotas is not None
    srv.gateway.quotas.clock = clock
    book = srv.gateway.quotas

    async def cancel_after_first_delta() -> dict[str, Any]:
        from websockets.asyncio.client import connect

        async with connect(f"ws://127.0.0.1:{srv.port}/v1/ws", proxy=None,
                           additional_headers={"Authorization": f"Bearer {secret}"}) as ws:
            import json

            await ws.send(json.dumps({"type": "generate", "id": "a", "kind": "completion", "prompt": PROMPT,
                                      "params": {"max_tokens": 900, "ignore_eos": True}}))
            while True:
                f = json.loads(await ws.recv())
                if f["type"] == "delta":
                    await ws.send(json.dumps({"type": "cancel", "id": "a"}))
                if f["type"] in ("done", "error") and f.get("id") == "a":
                    return dict(f)

    end = asyncio.run(cancel_after_first_delta())
    assert end["type"] == "done" and end["finish_reason"] == "cancelled", end
    used = end["usage"]["prompt_tokens"] + end["usage"]["completion_tokens"]
    assert 3 < used < 903
    # Only what it used stays spent: 1000 - used is available again at the same instant.
    st = book._keys[key_id]
    assert st.reserved == 0 and st.tokens is not None and round(st.tokens.level) == 1000 - used
    assert book.used_today(key_id) == used

    # A request that fails in the engine is settled the same way.
    before = book.used_today(key_id)

    def fail(ids: list[str]) -> None:
        raise RuntimeError("injected fault")

    isolation.fault_hook = fail
    try:
        r = httpx.post(srv.base + "/v1/completions", headers={"Authorization": f"Bearer {secret}"},
                       json={"model": "demo", "prompt": PROMPT, "max_tokens": 500}, timeout=120)
    finally:
        isolation.fault_hook = None
    assert r.status_code >= 500, r.text
    assert st.reserved == 0 and round(st.tokens.level) == 1000 - used - (book.used_today(key_id) - before)
    assert book.used_today(key_id) - before <= 3  # the prompt at most; never its 500 reserved tokens
