"""Bad input gets a 4xx in OpenAI's error shape (HTTP) or an error frame (WebSocket) that names the
field, and the server keeps serving afterwards."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.server.harness import ServerProcess, WsClient

GOOD = {"model": "demo", "prompt": "Hello", "max_tokens": 2}


def _post(server: ServerProcess, body: Any, path: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.base + path, content=body, headers={"content-type": "application/json"},
                          timeout=30)
    return httpx.post(server.base + path, json=body, timeout=30)


@pytest.mark.parametrize("body, status, param, code", [
    (b'{"prompt": "x", ', 400, None, "invalid_json"),
    ({**GOOD, "max_tokens": "many"}, 400, "max_tokens", "invalid_request"),
    ({**GOOD, "temperature": [1]}, 400, "temperature", "invalid_request"),
    ({**GOOD, "prompt": 42}, 400, "prompt", "invalid_request"),
    ({**GOOD, "max_tokens": -5}, 400, "max_tokens", "invalid_request"),
    (b'{"model": "demo", "prompt": "x", "temperature": NaN}', 400, "temperature", "invalid_request"),
    ({**GOOD, "top_p": 0}, 400, "top_p", "invalid_request"),
    ({**GOOD, "n": 0}, 400, "n", "invalid_request"),
    ({**GOOD, "stop": [""]}, 400, "stop", "invalid_request"),
    ({**GOOD, "min_tokens": 5}, 400, "min_tokens", "invalid_request"),
    ({**GOOD, "prompt": ["a", [1, 2]]}, 400, "prompt", "invalid_request"),  # mixed batch
    ({**GOOD, "prompt": [1, 99999]}, 400, "prompt", "invalid_request"),
])
def test_http_bad_completion_bodies(server: ServerProcess, body: Any, status: int, param: Any, code: str) -> None:
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["message"]
    if param:
        assert param in err["message"]


def test_http_chat_bad_messages_and_oversize_and_context(server: ServerProcess) -> None:
    r = _post(server, {"model": "demo", "messages": [{"content": "no role"}]}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = _post(server, {"model": "demo", "messages": []}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server, {**GOOD, "prompt": "x" * 70000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # /tokenize and /detokenize read through the same bounded reader, declared length or not.
    for path, body in (("/tokenize", {"model": "demo", "prompt": "x" * 70000}),
                       ("/detokenize", {"model": "demo", "tokens": [5] * 40000})):
        r = _post(server, body, path)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", (path, r.text)
        raw = json.dumps(body).encode()
        chunked = (raw[i:i + 8192] for i in range(0, len(raw), 8192))  # a generator: no content-length
        r = httpx.post(server.base + path, content=chunked, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", (path, r.text)
    # A prompt over the context: both numbers in the message, never truncated.
    r = _post(server, {**GOOD, "prompt": [5] * 2100})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "2100" in err["message"] and "2048" in err["message"]
    r = _post(server, {**GOOD, "prompt": [5] * 2000, "max_tokens": 100})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens"
    assert "2048" in err["message"] and "2100" in err["message"]
    r = httpx.get(server.base + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"
    # Still serving.
    ok = _post(server, GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_websocket_bad_frames_get_error_frames_and_socket_keeps_serving(server: ServerProcess) -> None:
    async def main() -> None:
        async with WsClient(server.ws_url) as ws:
            cases: list[tuple[Any, str, Any]] = [
                ("{not json", "invalid_json", None),
                ({"type": "explode", "id": "a"}, "unknown_frame_type", "type"),
                ({"type": "generate", "id": "b", "prompt": "x", "params": {"max_tokens": "lots"}},
                 "invalid_request", "params.max_tokens"),
                ({"type": "generate", "id": "c", "prompt": "x", "params": {"max_tokens": -1}},
                 "invalid_request", "params.max_tokens"),
                ('{"type": "generate", "id": "d", "prompt": "x", "params": {"temperature": NaN}}',
                 "invalid_request", "params.temperature"),
                ({"type": "generate", "id": "e", "prompt": "x" * 70000}, "message_too_large", None),
                ({"type": "generate", "id": "f", "prompt": [7] * 2100, "params": {"max_tokens": 1}},
                 "context_length_exceeded", "prompt"),
                ({"type": "generate", "id": "g", "kind": "chat"}, "invalid_request", "messages"),
                ({"type": "cancel", "id": "nobody"}, "request_not_found", "id"),
                ({"type": "generate", "prompt": "no id"}, "invalid_request", "id"),
            ]
            for frame, code, param in cases:
                await ws.send(frame)
                err = await ws.recv()
                assert err["type"] == "error" and err["code"] == code, (frame, err)
                assert err.get("param") == param, (frame, err)
                assert err["message"]
            got = await ws.run({"ok": {"prompt": "Still here", "params": {"max_tokens": 3}}})
            assert got["ok"][-1]["type"] == "done"

    asyncio.run(main())


def test_websocket_duplicate_live_id_is_rejected(server: ServerProcess) -> None:
    async def main() -> None:
        async with WsClient(server.ws_url) as ws:
            gen = {"type": "generate", "id": "dup", "prompt": "x", "params": {"max_tokens": 200, "ignore_eos": True}}
            await ws.send(gen)
            await ws.send(gen)
            seen: list[dict[str, Any]] = []
            while not any(f["type"] == "error" for f in seen):
                seen.append(await ws.recv())
            err = next(f for f in seen if f["type"] == "error")
            assert err["code"] == "duplicate_id" and err["id"] == "dup"
            await ws.send({"type": "cancel", "id": "dup"})
            while seen[-1]["type"] != "done":
                seen.append(await ws.recv())

    asyncio.run(main())
