"""`--ledger-text none|prompt|all`: what the ledger keeps of a request's text; usage always."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.harness import ledger_rows


@pytest.mark.parametrize("mode", ["none", "prompt"])
def test_ledger_text_setting_drops_text_but_keeps_usage(in_process: Any, tmp_path: Path, mode: str) -> None:
    db = tmp_path / f"{mode}.db"
    srv = in_process(db, ledger_text=mode)
    r = httpx.post(srv.base + "/v1/completions", timeout=120,
                   json={"model": "demo", "prompt": "a secret prompt", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("cmpl-")
    row = ledger_rows(db)[rid]
    assert row["state"] == "finished" and row["completion_tokens"] == 5 and row["prompt_tokens"] > 0
    assert row["output_text"] is None and row["output"] in (None, {})
    if mode == "none":
        assert row["prompt_json"] is None
    else:
        assert "a secret prompt" in row["prompt_json"]
