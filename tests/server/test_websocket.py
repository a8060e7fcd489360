"""The WebSocket protocol against a live server: multiplexing, cancel, drop/reconnect/resume,
resume from the ledger after completion, and idempotent retries (in flight and finished)."""
from __future__ import annotations

import asyncio
from typing import Any

from tests.server.harness import ServerProcess, WsClient, ledger_rows, text_of, tokens_of

PROMPTS = [
    "The lighthouse", "Baking bread", "Every morning", "A small garden", "The conductor", "Fishing boats",
    "Salt and diesel", "The kitchen", "Nurses going", "Students who", "A thunderstorm", "The moon",
    "Swallows flying", "The oven", "Two decades", "Seaweed drying",
]


def _gen(prompt: str, max_tokens: int = 8, **params: Any) -> dict[str, Any]:
    return {"kind": "completion", "prompt": prompt,
            "params": {"max_tokens": max_tokens, "temperature": 0, **params}}


def test_sixteen_multiplexed_requests_equal_each_alone(server: ServerProcess) -> None:
    async def main() -> None:
        async with WsClient(server.ws_url) as ws:
            together = await ws.run({f"r{i}": _gen(p) for i, p in enumerate(PROMPTS)})
            alone = {}
            for i, p in enumerate(PROMPTS):
                alone.update(await ws.run({f"a{i}": _gen(p)}))
        for i in range(len(PROMPTS)):
            t, a = together[f"r{i}"], alone[f"a{i}"]
            assert t[0]["type"] == "accepted" and t[-1]["type"] == "done"
            assert tokens_of(t) == tokens_of(a), PROMPTS[i]
            assert text_of(t) == text_of(a)
            seqs = [f["seq"] for f in t if f["type"] == "delta"]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            assert t[-1]["usage"]["completion_tokens"] == len(tokens_of(t))

    asyncio.run(main())


def test_cancel_ends_with_cancelled_and_ledger_says_so(server: ServerProcess) -> None:
    async def main() -> str:
        async with WsClient(server.ws_url) as ws:
            await ws.send({"type": "generate", "id": "long", **_gen("x", 1500, ignore_eos=True)})
            accepted = await ws.recv()
            assert accepted["type"] == "accepted"
            while (await ws.recv())["type"] != "delta":
                pass
            await ws.send({"type": "cancel", "id": "long"})
            while True:
                f = await ws.recv()
                if f["type"] == "done":
                    assert f["finish_reason"] == "cancelled"
                    assert f["usage"]["completion_tokens"] < 1500
                    return accepted["request_id"]

    rid = asyncio.run(main())
    assert ledger_rows(server.db)[rid]["state"] == "cancelled"


def test_drop_reconnect_resume_has_no_gap_or_duplicate(server: ServerProcess) -> None:
    async def main() -> None:
        async with WsClient(server.ws_url) as ws:
            await ws.send({"type": "generate", "id": "d", "detach": True, **_gen("Resume me", 40, ignore_eos=True)})
            rid = (await ws.recv())["request_id"]
            first = []
            while len(first) < 3:
                f = await ws.recv()
                if f["type"] == "delta":
                    first.append(f)
        # Socket dropped mid-stream; the detached request keeps running.
        await asyncio.sleep(0.3)
        async with WsClient(server.ws_url) as ws:
            await ws.send({"type": "resume", "request_id": rid, "after_seq": first[-1]["seq"], "id": "again"})
            rest: list[dict[str, Any]] = []
            while True:
                f = await ws.recv()
                rest.append(f)
                if f["type"] in ("done", "error"):
                    break
        assert rest[0] == {"type": "accepted", "id": "again", "request_id": rid}
        deltas = first + [f for f in rest if f["type"] == "delta"]
        seqs = [f["seq"] for f in deltas]
        assert seqs == sorted(set(seqs)), seqs
        done = rest[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert len(tokens_of(deltas)) == done["usage"]["completion_tokens"] == 40
        row = ledger_rows(server.db)[rid]
        assert row["output_text"] == text_of(deltas)

    asyncio.run(main())


def test_resume_after_completion_reads_the_ledger(server: ServerProcess) -> None:
    async def main() -> None:
        async with WsClient(server.ws_url) as ws:
            got = (await ws.run({"f": _gen("From the ledger", 12, ignore_eos=True)}))["f"]
        rid = got[0]["request_id"]
        deltas = [f for f in got if f["type"] == "delta"]
        cut = deltas[len(deltas) // 2]["seq"]
        await asyncio.sleep(1.5)  # past the shared server's 1 s stream retention
        async with WsClient(server.ws_url) as ws:
            await ws.send({"type": "resume", "request_id": rid, "after_seq": cut})
            rest = []
            while not rest or rest[-1]["type"] not in ("done", "error"):
                rest.append(await ws.recv())
            await ws.send({"type": "resume", "request_id": "req-does-not-exist", "after_seq": 0})
            missing = await ws.recv()
        assert missing["type"] == "error" and missing["code"] == "request_not_found"
        before = "".join(f["text"] for f in deltas if f["seq"] <= cut)
        assert before + text_of(rest) == text_of(got)
        assert tokens_of([f for f in deltas if f["seq"] <= cut]) + tokens_of(rest) == tokens_of(got)
        assert rest[-1]["type"] == "done" and rest[-1]["usage"] == got[-1]["usage"]

    asyncio.run(main())


def test_idempotent_retry_in_flight_attaches_and_finished_replays(server: ServerProcess) -> None:
    frame = {"type": "generate", "idempotency_key": "ws-key-1", **_gen("Same key", 30, ignore_eos=True,
                                                                          temperature=1.0, seed=5)}

    async def main() -> None:
        async with WsClient(server.ws_url) as a, WsClient(server.ws_url) as b:
            await a.send({**frame, "id": "one"})
            acc_a = await a.recv()
            while (await a.recv())["type"] != "delta":
                pass
            await b.send({**frame, "id": "two"})  # in flight: attaches to the live stream
            got_b = []
            while not got_b or got_b[-1]["type"] not in ("done", "error"):
                got_b.append(await b.recv())
            got_a = []
            while not got_a or got_a[-1]["type"] not in ("done", "error"):
                got_a.append(await a.recv())
        assert got_b[0]["request_id"] == acc_a["request_id"]
        assert got_b[-1]["type"] == "done" and got_b[-1]["usage"]["completion_tokens"] == 30
        assert len(tokens_of(got_b)) == 30  # replayed from seq 1, then live
        async with WsClient(server.ws_url) as c:  # finished: replays the stored output
            await c.send({**frame, "id": "three"})
            got_c = []
            while not got_c or got_c[-1]["type"] not in ("done", "error"):
                got_c.append(await c.recv())
        assert got_c[0]["request_id"] == acc_a["request_id"]
        assert text_of(got_c) == text_of(got_b)
        rows = [r for r in ledger_rows(server.db).values() if r["idempotency_key"] == "ws-key-1"]
        assert len(rows) == 1 and rows[0]["completion_tokens"] == 30

    asyncio.run(main())


def test_chat_kind_and_logprobs_over_websocket(server: ServerProcess) -> None:
    async def main() -> list[dict[str, Any]]:
        async with WsClient(server.ws_url) as ws:
            return (await ws.run({"c": {"kind": "chat", "messages": [{"role": "user", "content": "hi"}],
                                        "params": {"max_tokens": 4, "temperature": 0, "logprobs": True,
                                                   "top_logprobs": 2}}}))["c"]

    got = asyncio.run(main())
    lps = [lp for f in got if f["type"] == "delta" for lp in f.get("logprobs", [])]
    assert len(lps) == got[-1]["usage"]["completion_tokens"]
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in lps)
