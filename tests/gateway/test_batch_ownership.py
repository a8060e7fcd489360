"""The batch tier owned per API key, against a real server with keys and an admin key: a key creates,
lists, reads and cancels only its own batches and files (another key gets an unknown id's 404),
the admin sees all, and a batch's lines run as requests of its key: billed to it, throttled by its
tokens-per-minute limit (waiting, not failing) and refused by its daily quota into the error file."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.test_isolation_live import _create, _h
from tests.server.harness import ServerProcess, ledger_rows

COMPLETIONS = "/v1/completions"
PROMPT = [1, 2, 3]  # token ids: exactly 3 prompt tokens, so a line's reservation is 3 + max_tokens


def _line(cid: str, max_tokens: int) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": COMPLETIONS,
                       "body": {"model": "demo", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}})


def _upload(base: str, secret: str, text: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", text.encode(), "application/jsonl")},
                      data={"purpose": "batch"}, headers=_h(secret), timeout=60)


def _create_batch(base: str, secret: str, fid: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/batches", json={"input_file_id": fid, "endpoint": COMPLETIONS},
                      headers=_h(secret), timeout=60)


def _wait_done(base: str, secret: str, bid: str, timeout: float = 600.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        b: dict[str, Any] = httpx.get(f"{base}/v1/batches/{bid}", headers=_h(secret), timeout=30).json()
        if b["status"] in ("completed", "failed", "cancelled"):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.1)


def _jsonl(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in raw.decode().splitlines() if ln.strip()]


@pytest.mark.slow
def test_batches_and_files_are_owned_per_key_and_billed_to_it(demo_model: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "l.db"
    # alice: a TPM limit that holds two of her 420-token lines at once, not three (the third
    # waits (3 × 420 - 1200) / 20 per second = 3 s for the bucket).
    a_id, a = _create(db, "alice", "--tpm", "1200")
    b_id, b = _create(db, "bob")
    # carol: a daily quota that fits one 13-token line, not two.
    c_id, c = _create(db, "carol", "--daily-tokens", "20")
    admin = "admin-" + "y" * 40
    (tmp_path / "admin.key").write_text(admin)
    srv = ServerProcess(demo_model, db, "--admin-key-file", str(tmp_path / "admin.key")).start()
    try:
        base = srv.base
        fa = _upload(base, a, "\n".join(_line(f"a-{i}", 417) for i in range(3))).json()
        assert fa["purpose"] == "batch"
        fid = fa["id"]
        # Bob: every read of alice's file is an unknown id's 404, and he cannot batch it.
        nobody = "file-" + "0" * 24
        for path in (f"/v1/files/{fid}", f"/v1/files/{fid}/content"):
            r = httpx.get(base + path, headers=_h(b))
            u = httpx.get(base + path.replace(fid, nobody), headers=_h(b))
            assert r.status_code == u.status_code == 404, r.text
            assert r.json()["error"]["message"].replace(fid, "ID") == u.json()["error"]["message"].replace(nobody, "ID")
        r = _create_batch(base, b, fid)
        assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
        assert httpx.get(f"{base}/v1/files/{fid}", headers=_h(admin)).status_code == 200

        bid = _create_batch(base, a, fid).json()["id"]
        for method, path in (("GET", f"/v1/batches/{bid}"), ("POST", f"/v1/batches/{bid}/cancel")):
            r = httpx.request(method, base + path, headers=_h(b))
            assert r.status_code == 404 and r.json()["error"]["code"] == "batch_not_found", r.text
        assert httpx.get(base + "/v1/batches", headers=_h(b)).json()["data"] == []
        assert [x["id"] for x in httpx.get(base + "/v1/batches", headers=_h(a)).json()["data"]] == [bid]

        done = _wait_done(base, a, bid)
        # Three 420-token lines against 1200 tokens per minute: the third waited for the bucket
        # to refill (refused at admission, retried) instead of failing.
        assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        out_id = done["output_file_id"]
        out = _jsonl(httpx.get(f"{base}/v1/files/{out_id}/content", headers=_h(a)).content)
        assert sorted(o["custom_id"] for o in out) == ["a-0", "a-1", "a-2"]
        assert httpx.get(f"{base}/v1/files/{out_id}/content", headers=_h(b)).status_code == 404
        assert httpx.get(f"{base}/v1/files/{out_id}/content", headers=_h(admin)).status_code == 200
        assert httpx.get(f"{base}/v1/batches/{bid}", headers=_h(admin)).json()["id"] == bid
        # `pagewire batch` sends its key: --api-key, else $PAGEWIRE_API_KEY.
        from server.cli import main

        assert main(["batch", "show", bid, "--url", base, "--api-key", b]) == 1
        assert "404" in capsys.readouterr().err
        monkeypatch.setenv("PAGEWIRE_API_KEY", a)
        assert main(["batch", "show", bid, "--url", base]) == 0
        assert json.loads(capsys.readouterr().out)["id"] == bid
        prom = httpx.get(base + "/metrics", headers=_h(admin)).text
        limited = [ln for ln in prom.splitlines() if ln.startswith(f'pagewire_key_rate_limited_total{{key="{a_id}"}}')]
        assert limited and float(limited[0].split()[-1]) >= 1, limited

        # Carol's daily quota: one line runs, the others go to the error file with the 429.
        fc = _upload(base, c, "\n".join(_line(f"c-{i}", 10) for i in range(3))).json()["id"]
        cb = _wait_done(base, c, _create_batch(base, c, fc).json()["id"])
        assert cb["status"] == "completed" and cb["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
        err = _jsonl(httpx.get(f"{base}/v1/files/{cb['error_file_id']}/content", headers=_h(c)).content)
        assert [e["response"]["status_code"] for e in err] == [429, 429]
        assert {e["response"]["body"]["error"]["code"] for e in err} == {"daily_quota_exceeded"}

        # The admin lists every key's batches; each line's row belongs to its batch's key.
        listed = {x["id"] for x in httpx.get(base + "/v1/batches", headers=_h(admin)).json()["data"]}
        assert listed == {bid, cb["id"]}
        rows = ledger_rows(db)
        lines = {r["idempotency_key"]: r for r in rows.values() if (r["idempotency_key"] or "").startswith("batch-")}
        assert {r["key_id"] for k, r in lines.items() if k.startswith(f"batch-{bid}-")} == {a_id}
        assert {r["key_id"] for k, r in lines.items() if k.startswith(f"batch-{cb['id']}-")} == {c_id}
        usage = httpx.get(base + "/v1/usage", headers=_h(a)).json()["data"]
        assert usage[0]["billable_tokens"] == 3 * 420
        assert httpx.get(base + "/v1/usage", headers=_h(c)).json()["data"][0]["billable_tokens"] == 13
    finally:
        srv.stop()
