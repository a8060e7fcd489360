"""The batch tier over HTTP against a real server (demo model): lifecycle with the openai SDK, per-line
errors, cancel, and a SIGKILL mid-batch (a key's batch, authentication on) followed by a restart in
which no line runs twice and every attempt is billed to the batch's key."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import pytest

from tests.server.harness import ServerProcess, ledger_query, ledger_rows

CHAT = "/v1/chat/completions"


def _line(cid: str, content: str, max_tokens: int = 8, **body: Any) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT,
                       "body": {"model": "demo", "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens, "temperature": 0, **body}})


def _wait_batch(base: str, bid: str, done: Any, timeout: float = 600.0,
                headers: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Poll the batch until `done(batch)` holds (a deadline, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        b = httpx.get(f"{base}/v1/batches/{bid}", timeout=30, headers=headers).json()
        if done(b):
            return b
        assert time.monotonic() < deadline, f"batch never reached the state: {b}"
        time.sleep(0.1)


def _upload(base: str, text: str, purpose: str = "batch", headers: Optional[dict[str, str]] = None) -> httpx.Response:
    return httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", text.encode(), "application/jsonl")},
                      data={"purpose": purpose}, timeout=60, headers=headers)


def _jsonl(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in raw.decode().splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(demo_model, tmp_path_factory.mktemp("batch") / "ledger.db")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def test_lifecycle_with_the_openai_sdk(server: ServerProcess) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    lines = [_line(f"ok-{i}", f"tell me about {i}") for i in range(4)]
    lines += [
        "{not json",
        json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        _line("ok-0", "duplicate custom id"),
        _line("bad-field", "x", temperature="hot"),
        _line("too-long", "x", max_tokens=10**6),
    ]
    f = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                              metadata={"job": "test"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "test"}
    deadline = time.monotonic() + 600
    while b.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
        b = client.batches.retrieve(b.id)
    assert b.status == "completed"
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (9, 4, 5)
    assert b.output_file_id and b.error_file_id
    out = _jsonl(client.files.content(b.output_file_id).content)
    err = _jsonl(client.files.content(b.error_file_id).content)
    assert [o["custom_id"] for o in out] == [f"ok-{i}" for i in range(4)]
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
        assert o["response"]["request_id"].startswith("req-")
    # The same request made directly gives the same (greedy) answer.
    direct = httpx.post(server.base + CHAT, json=json.loads(lines[2])["body"], timeout=300).json()
    assert out[2]["response"]["body"]["choices"][0]["message"]["content"] == \
        direct["choices"][0]["message"]["content"]
    codes = {(e.get("custom_id"), (e["error"] or {}).get("code"),
              (e["response"] or {}).get("status_code")) for e in err}
    assert (None, "invalid_json", None) in codes
    assert ("wrong-url", "invalid_url", None) in codes
    assert ("ok-0", "duplicate_custom_id", None) in codes
    assert ("bad-field", None, 400) in codes
    assert ("too-long", None, 400) in codes
    bad = next(e for e in err if e["custom_id"] == "bad-field")
    assert "temperature" in bad["response"]["body"]["error"]["message"]
    # Listing shows it; each line ran at the lowest priority, in the batch class.
    listed = client.batches.list(limit=10)
    assert b.id in [x.id for x in listed.data]
    rows = [r for r in ledger_rows(server.db).values() if (r["idempotency_key"] or "").startswith(f"batch-{b.id}-")]
    assert len(rows) == 4 and all(r["state"] == "finished" and r["priority"] >= 1 << 30 for r in rows)


def test_bad_uploads_and_ids_are_4xx_naming_the_field(server: ServerProcess) -> None:
    r = _upload(server.base, _line("a", "b"), purpose="fine-tune")
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = httpx.post(server.base + "/v1/files", content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(server.base + "/v1/files", files={"file": ("e.jsonl", b"\n\n")}, data={"purpose": "batch"})
    assert r.status_code == 400 and "no lines" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/files", data={"purpose": "batch"})
    assert r.status_code == 400
    assert httpx.get(server.base + "/v1/files/file-nope/content").status_code == 404
    assert httpx.get(server.base + "/v1/batches/batch_nope").status_code == 404
    assert httpx.post(server.base + "/v1/batches/batch_nope/cancel").status_code == 404
    fid = _upload(server.base, _line("a", "b")).json()["id"]
    r = httpx.post(server.base + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/moderations",
                                                      "completion_window": "24h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
    r = httpx.post(server.base + "/v1/batches", json={"input_file_id": "file-x", "endpoint": CHAT})
    assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
    r = httpx.post(server.base + "/v1/batches", json={"endpoint": CHAT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id"
    assert httpx.get(server.base + "/v1/batches?limit=0").status_code == 400


def test_cancel_keeps_what_finished(server: ServerProcess) -> None:
    text = "\n".join(_line(f"c-{i}", f"item {i}", max_tokens=48, ignore_eos=True) for i in range(40))
    fid = _upload(server.base, text).json()["id"]
    bid = httpx.post(server.base + "/v1/batches", json={"input_file_id": fid, "endpoint": CHAT}).json()["id"]
    _wait_batch(server.base, bid, lambda b: b["request_counts"]["completed"] >= 1)
    r = httpx.post(f"{server.base}/v1/batches/{bid}/cancel")
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    b = _wait_batch(server.base, bid, lambda b: b["status"] == "cancelled")
    done = b["request_counts"]["completed"]
    assert 1 <= done < 40 and b["cancelled_at"] is not None
    out = _jsonl(httpx.get(f"{server.base}/v1/files/{b['output_file_id']}/content").content)
    assert len(out) == done and len({o["custom_id"] for o in out}) == done
    rows = [r for r in ledger_rows(server.db).values() if (r["idempotency_key"] or "").startswith(f"batch-{bid}-")]
    assert not [r for r in rows if r["state"] in ("queued", "running")]
    assert len([r for r in rows if r["state"] == "finished"]) == done


def test_sigkill_mid_batch_then_restart_runs_no_line_twice(demo_model: Path, tmp_path: Path) -> None:
    from tests.gateway.test_isolation_live import _create

    db = tmp_path / "ledger.db"
    key_id, secret = _create(db, "owner")  # with authentication on: the batch is the key's
    h = {"Authorization": f"Bearer {secret}"}
    n = 16
    text = "\n".join(_line(f"k-{i}", f"line {i}", max_tokens=24, ignore_eos=True) for i in range(n))
    srv = ServerProcess(demo_model, db).start()
    try:
        fid = _upload(srv.base, text, headers=h).json()["id"]
        bid = httpx.post(srv.base + "/v1/batches", json={"input_file_id": fid, "endpoint": CHAT},
                         headers=h).json()["id"]
        _wait_batch(srv.base, bid, lambda b: b["request_counts"]["completed"] >= 3, headers=h)
        srv.kill()  # SIGKILL: no drain, no shutdown sweep
    finally:
        srv.stop()
    before = {r["request_id"]: r for r in ledger_rows(db).values() if r["state"] == "finished"}
    assert len(before) >= 3
    srv = ServerProcess(demo_model, db).start()
    try:
        b = _wait_batch(srv.base, bid, lambda b: b["status"] in ("completed", "failed", "cancelled"), headers=h)
        assert b["status"] == "completed"
        assert b["request_counts"] == {"total": n, "completed": n, "failed": 0}
        out = _jsonl(httpx.get(f"{srv.base}/v1/files/{b['output_file_id']}/content", headers=h).content)
        usage = httpx.get(srv.base + "/v1/usage", headers=h).json()["data"]
    finally:
        srv.stop()
    assert sorted(o["custom_id"] for o in out) == sorted(f"k-{i}" for i in range(n))
    rows = list(ledger_rows(db).values())
    # Every attempt, before and after the kill, was billed to the batch's key, exactly as its rows say.
    assert {r["key_id"] for r in rows} == {key_id}
    assert usage[0]["billable_tokens"] == sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows
                                              if r["admitted_at"] is not None)
    finished: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        key = r["idempotency_key"] or ""
        assert key.startswith(f"batch-{bid}-")
        line = int(key.split("-")[-2])
        if r["state"] == "finished":
            finished.setdefault(line, []).append(r)
        else:  # only the attempts the kill cut short, none of them billed as finished
            assert r["state"] == "interrupted"
    # Every line finished exactly once, across both processes.
    assert sorted(finished) == list(range(n)) and all(len(v) == 1 for v in finished.values())
    # Lines finished before the kill were not re-run: their rows are the ones in the output.
    out_ids = {o["response"]["request_id"] for o in out}
    assert set(before) <= out_ids
    for rid, r in before.items():
        assert ledger_rows(db)[rid]["finished_at"] == r["finished_at"]
    statuses = {s for (s,) in ledger_query(db, "SELECT status FROM batch_lines WHERE batch_id = ?", (bid,))}
    assert statuses == {"done"}


def test_cli_batch_submit_wait(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_line("cli-0", "hello"), _line("cli-1", "world"), "{broken"]) + "\n")
    rc = main(["batch", "submit", str(src), "--wait", "--url", server.base, "--output-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    bid = printed.split()[1]
    out = _jsonl((tmp_path / f"{bid}_output.jsonl").read_bytes())
    err = _jsonl((tmp_path / f"{bid}_error.jsonl").read_bytes())
    assert [o["custom_id"] for o in out] == ["cli-0", "cli-1"] and len(err) == 1
    assert main(["batch", "show", bid, "--url", server.base]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
    assert main(["batch", "show", "batch_missing", "--url", server.base]) == 1
    assert "batch_id" in capsys.readouterr().err
