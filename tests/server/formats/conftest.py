"""One live server for the Anthropic and Ollama API tests, with authentication on.

The model is the random-weight demo model with a tool-aware chat template
(tests.tiny_models.HERMES_TOOL_TEMPLATE) and `--tool-call-parser llama3_json`: auto-mode calls are
then a bare JSON object `{"name": ..., "parameters": {...}}`, which a JSON-schema constraint can
make the random model write, so the auto path (the model's own output read for calls) is tested
too, not only the grammar-forced `required` / named modes. Two API keys: `key` has no limits and
is used throughout (so every request also tests the key headers), `tight` has a daily quota that
no request fits, for the 429 checks; the admin key reads /metrics.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.server.harness import REPO, ServerProcess, db_arg, ledger_rows
from tests.tiny_models import HERMES_TOOL_TEMPLATE, with_chat_template

ADMIN = "admin-" + "k" * 32
DAILY = 40  # tokens per day for `tight`: less than any prompt + max_tokens below


def _create_key(db: Path, name: str, *extra: str) -> str:
    out = subprocess.run([sys.executable, "-m", "server.cli", "keys", "create", "--name", name, "--db", db_arg(db),
                          "--json", *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout)["secret"])


@dataclass
class FormatServer:
    proc: ServerProcess
    key: str
    tight: str

    @property
    def base(self) -> str:
        return self.proc.base

    @property
    def db(self) -> Path:
        return self.proc.db

    def bearer(self, secret: str = "") -> dict[str, str]:
        return {"Authorization": f"Bearer {secret or self.key}"}

    def row(self, request_id: str) -> dict[str, Any]:
        return ledger_rows(self.db)[request_id]

    def wait_state(self, request_id: str, timeout: float = 300.0) -> str:
        """Poll the ledger until the row is terminal (the deadline only guards against a hang)."""
        import time

        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = ledger_rows(self.db).get(request_id, {}).get("state", "")
            if state not in ("", "queued", "running"):
                return state
            time.sleep(0.05)
        return state

    def running(self) -> float:
        """pagewire_requests_running, read as the admin."""
        text = httpx.get(self.base + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
        for line in text.splitlines():
            if line.startswith("pagewire_requests_running "):
                return float(line.split()[1])
        raise AssertionError("no pagewire_requests_running")

    def wait_idle(self, timeout: float = 300.0) -> float:
        import time

        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.running()


@pytest.fixture(scope="session")
def fmt_server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FormatServer]:
    tmp = tmp_path_factory.mktemp("formats")
    model = with_chat_template(demo_model, tmp / "model", HERMES_TOOL_TEMPLATE)
    db = tmp / "ledger.db"
    key = _create_key(db, "formats")
    tight = _create_key(db, "tight", "--daily-tokens", str(DAILY))
    admin = tmp / "admin.key"
    admin.write_text(ADMIN + "\n")
    proc = ServerProcess(model, db, "--tool-call-parser", "llama3_json", "--admin-key-file", str(admin),
                         "--max-request-bytes", "65536")
    proc.start()
    try:
        yield FormatServer(proc, key, tight)
    finally:
        proc.stop()
