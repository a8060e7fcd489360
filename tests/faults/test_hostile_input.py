"""Bug 8 and bug 7: client mistakes answer 400 naming the field (never 500), over HTTP and as
WebSocket error frames, and a hostile frame never costs the socket or its live requests."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.server.harness import ServerProcess, WsClient, ledger_rows, tokens_of

DEEP = 1200  # past Python's default recursion limit of 1000


@pytest.fixture(scope="module")
def srv(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(demo_model, tmp_path_factory.mktemp("hostile") / "hostile.db").start()
    try:
        yield proc
    finally:
        proc.stop()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (name, raw JSON body for /v1/completions, the field the 400 must name)
CASES: list[tuple[str, str, str]] = [
    ("deep array", '{"model": "demo", "prompt": "x", "extra": ' + _nested(DEEP) + "}", "extra"),
    ("deep object", '{"model": "demo", "prompt": "x", "tools": [' + '{"a": ' * DEEP + "1" + "}" * DEEP + "]}", "tools"),
    ("deep prompt", '{"model": "demo", "prompt": ' + _nested(DEEP) + "}", "prompt"),
    ("priority 10**30", '{"model": "demo", "prompt": "x", "priority": ' + str(10**30) + "}", "priority"),
    ("seed 2**70", '{"model": "demo", "prompt": "x", "seed": ' + str(2**70) + "}", "seed"),
    ("seed -2**70", '{"model": "demo", "prompt": "x", "seed": -' + str(2**70) + "}", "seed"),
    ("lone surrogate", '{"model": "demo", "prompt": "hi \\ud800 there"}', "prompt"),
    ("lone low surrogate in a batch", '{"model": "demo", "prompt": ["ok", "\\udc00"]}', "prompt[1]"),
    ("stop_token_ids beyond vocab", '{"model": "demo", "prompt": "x", "stop_token_ids": [5, 1000000]}',
     "stop_token_ids"),
    ("negative stop_token_id", '{"model": "demo", "prompt": "x", "stop_token_ids": [-3]}', "stop_token_ids[0]"),
]


@pytest.mark.parametrize("name,body,field", CASES, ids=[c[0] for c in CASES])
def test_http_client_mistakes_are_400_naming_the_field(srv: ServerProcess, name: str, body: str, field: str) -> None:
    r = httpx.post(srv.base + "/v1/completions", content=body.encode(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, (name, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == field, (name, err)
    assert err["message"].startswith(field), (name, err)


def test_chat_lone_surrogate_and_huge_seed_are_400(srv: ServerProcess) -> None:
    r = httpx.post(srv.base + "/v1/chat/completions", content=(
        '{"model": "demo", "messages": [{"role": "user", "content": "a\\ud83d"}]}').encode(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    r = httpx.post(srv.base + "/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "a"}], "seed": 2**64}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_the_largest_accepted_seed_and_priority_work(srv: ServerProcess) -> None:
    r = httpx.post(srv.base + "/v1/completions", json={
        "model": "demo", "prompt": "x", "seed": 2**63 - 1, "priority": -(2**63), "n": 2, "max_tokens": 3,
        "temperature": 1.0, "stop_token_ids": [0]}, timeout=60)
    assert r.status_code == 200, r.text
    rows = ledger_rows(srv.db)
    assert any(row["priority"] == -(2**63) and row["state"] == "finished" for row in rows.values())


def test_ws_hostile_frames_get_error_frames_and_the_live_request_continues(srv: ServerProcess) -> None:
    # (frame text, the id the error frame carries, the field it must name). A frame that cannot be
    # parsed has no id to echo; it is answered anyway.
    hostile: list[tuple[str, Any, Any]] = [
        ('{"type": "generate", "id": "deep", "prompt": "x", "params": {"x": ' + _nested(DEEP) + "}}", None, "params"),
        ('{"type": "generate", "id": "p", "prompt": "x", "priority": ' + str(10**30) + "}", "p", "priority"),
        ('{"type": "generate", "id": "s", "prompt": "x", "params": {"seed": ' + str(2**70) + "}}", "s", "params.seed"),
        ('{"type": "generate", "id": "u", "prompt": "\\ud800"}', "u", "prompt"),
        ('{"type": "generate", "id": "t", "prompt": "x", "params": {"stop_token_ids": [999999]}}', "t",
         "params.stop_token_ids"),
        (_nested(DEEP), None, None),  # not even an object: still an error frame, not a dropped socket
        # Found by the fuzz (test_fuzz.py): a non-string `type` raised TypeError (unhashable) inside
        # the frame-type lookup and came back as internal_error.
        ('{"type": ["generate"], "id": "tl", "prompt": "x"}', "tl", "type"),
        ('{"type": {"a": 1}, "id": "to"}', "to", "type"),
    ]

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        async with WsClient(srv.ws_url) as ws:
            await ws.send({"type": "generate", "id": "live", "prompt": "Keep going",
                           "params": {"max_tokens": 60, "ignore_eos": True, "temperature": 0}})
            live: list[dict[str, Any]] = []
            while not any(f["type"] == "delta" for f in live):
                live.append(await ws.recv())
            errors: list[dict[str, Any]] = []
            for text, _, _ in hostile:
                await ws.conn.send(text)
            while len(errors) < len(hostile) or live[-1]["type"] not in ("done", "error"):
                f = await ws.recv(timeout=120)
                (live if f.get("id") == "live" else errors).append(f)
            # The socket is still fully usable afterwards.
            after = await ws.run({"after": {"prompt": "again", "params": {"max_tokens": 3, "ignore_eos": True}}})
            return live, errors, after["after"]

    live, errors, after = asyncio.run(main())
    assert live[-1]["type"] == "done" and len(tokens_of(live)) == 60, live[-1]
    assert [e["type"] for e in errors] == ["error"] * len(hostile), errors
    assert all(e["code"] != "internal_error" for e in errors), errors
    got = sorted((e.get("id") or "", e.get("param") or "") for e in errors)
    assert got == sorted((cid or "", field or "") for _, cid, field in hostile), errors
    assert after[-1]["type"] == "done" and len(tokens_of(after)) == 3
