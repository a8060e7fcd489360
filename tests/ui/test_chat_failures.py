"""The chat page when the server fails it: a SIGKILL and restart mid-answer, and overload (429).

Each test starts its own server (these kill it or shrink its limits).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.server.harness import ServerProcess, ledger_rows
from tests.ui.page import UI_ENGINE, ChatPage, greedy_chat
from tests.ui.proxy import CuttableProxy

STORY = "Tell me a story"  # SmolLM2 answers it with several hundred tokens (greedy)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    """A list holding the test's server(s); every one is stopped at the end."""
    procs: list[ServerProcess] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.stop()


def test_server_killed_mid_answer_shows_interrupted_and_regenerate_works(
        real_model: Path, tmp_path: Path, own_server: list[ServerProcess],
        open_page: Callable[[str], ChatPage]) -> None:
    db = tmp_path / "ledger.db"
    first = ServerProcess(real_model, db, *UI_ENGINE)
    own_server.append(first)
    first.start()
    proxy = CuttableProxy(first.port)
    try:
        page = open_page(proxy.base)
        page.set_params(max_tokens="1500")
        proxy.hold_after(4)
        page.send(STORY)  # a long answer: still generating when the server is killed
        page.wait_seq(3)
        rid = page.last_answer()["gen"]["request_id"]
        assert ledger_rows(db)[rid]["state"] in ("queued", "running")  # still generating
        first.kill()  # SIGKILL: no drain, the ledger row stays open

        second = ServerProcess(real_model, db, *UI_ENGINE)
        second.port = first.port  # same address, so the page finds it again
        own_server.append(second)
        second.start()
        # The page reconnects with backoff, resumes, and the restarted server's ledger says
        # the request was interrupted.
        page.wait_state("interrupted")
        assert ledger_rows(db)[rid]["state"] == "interrupted"
        note = page.last_part(".notice")
        assert "Interrupted" in str(note["text"]) and note["role"] == "alert"
        partial = page.last_answer()["content"]
        assert partial  # what was shown stays shown

        page.set_field("max-tokens", "24")
        page.wait(lambda d: page.store()["settings"]["max_tokens"] == 24, "the setting to save")
        page.click_action("Regenerate this answer")
        page.wait_state("done")
        ref = greedy_chat(second.base, [{"role": "user", "content": STORY}], 24)
        conv = page.conversation()
        assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
        assert conv["messages"][1]["content"] == ref["text"]
        assert ledger_rows(db)[conv["messages"][1]["gen"]["request_id"]]["state"] == "finished"
    finally:
        proxy.close()


def test_overloaded_shows_retry_then_queued_then_answers(
        real_model: Path, tmp_path: Path, own_server: list[ServerProcess],
        open_page: Callable[[str], ChatPage]) -> None:
    from websockets.sync.client import connect

    # One request in the engine, one in the queue, and the next one is refused with 429.
    server = ServerProcess(real_model, tmp_path / "ledger.db", *UI_ENGINE, "--max-num-seqs", "1", "--engine-margin", "0",
                           "--max-queue", "1")
    own_server.append(server)
    server.start()
    page = open_page(server.base)
    page.set_params(max_tokens="16")

    long = {"kind": "completion", "prompt": "x", "params": {"max_tokens": 1800, "temperature": 0, "ignore_eos": True}}
    with connect(server.ws_url, proxy=None) as ws:
        def until(cid: str, ftype: str) -> dict:
            while True:
                f = json.loads(ws.recv(timeout=120))
                if f.get("id") == cid and f["type"] == ftype:
                    return f
        ws.send(json.dumps({"type": "generate", "id": "running", **long}))
        until("running", "delta")
        ws.send(json.dumps({"type": "generate", "id": "queued", **long}))
        until("queued", "accepted")

        page.send("Hello")
        page.wait_state("busy")
        note = page.last_part(".notice")
        assert "Server busy (429)" in str(note["text"]) and "Retrying in" in str(note["text"])
        assert note["role"] == "status"

        # A queue slot frees up: the page's retry is accepted and waits behind the running one.
        ws.send(json.dumps({"type": "cancel", "id": "queued"}))
        until("queued", "done")
        page.wait_state("queued")
        assert "Queued" in str(page.last_part(".body")["text"])
        ws.send(json.dumps({"type": "cancel", "id": "running"}))
        until("running", "done")
        page.wait_state("done")
    ref = greedy_chat(server.base, [{"role": "user", "content": "Hello"}], 16)
    assert page.last_answer()["content"] == ref["text"]
    assert page.last_answer()["gen"]["request_id"] in ledger_rows(server.db)
