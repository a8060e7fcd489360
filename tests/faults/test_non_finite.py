"""Issue 29, break 4: a non-finite number anywhere in a query or a body is a 400 naming the field.

`/v1/usage?start=1e309` answered 500 ("Out of range float values are not JSON compliant"):
`float()` takes "1e309" (inf), "nan" and "inf", and the bound reached the JSON answer. JSON
bodies are parsed so that 1e309 becomes inf too, which must be refused as well, wherever it sits.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.server.harness import REPO, ServerProcess, WsClient, db_arg

NON_FINITE = ["1e309", "-1e309", "nan", "NaN", "inf", "-Infinity"]


@pytest.fixture(scope="module")
def srv(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(demo_model, tmp_path_factory.mktemp("nonfinite") / "nf.db").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("field", ["start", "end"])
@pytest.mark.parametrize("value", NON_FINITE)
def test_usage_query_bounds(srv: ServerProcess, field: str, value: str) -> None:
    r = httpx.get(srv.base + "/v1/usage", params={field: value}, timeout=30)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_usage_query_finite_bounds_still_work(srv: ServerProcess) -> None:
    r = httpx.get(srv.base + "/v1/usage", params={"start": "0", "end": "1e12"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["start"] == 0.0


# A JSON number too large for a double: the raw text, so no client library rewrites it.
BODIES = [
    ("/v1/completions", '{"model": "demo", "prompt": "x", "temperature": 1e309}', "temperature"),
    ("/v1/completions", '{"model": "demo", "prompt": "x", "presence_penalty": -1e309}', "presence_penalty"),
    ("/v1/completions", '{"model": "demo", "prompt": "x", "extra": {"deep": [1, 1e309]}}', "extra.deep[1]"),
    ("/v1/chat/completions", '{"model": "demo", "messages": [{"role": "user", "content": "x"}], '
     '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
     '"properties": {"a": {"type": "number", "maximum": 1e309}}}}}]}',
     "tools[0].function.parameters.properties.a.maximum"),
    ("/v1/chat/completions", '{"model": "demo", "messages": [{"role": "user", "content": "x"}, '
     '{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", '
     '"arguments": "{\\"a\\": 1e309}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "1"}]}',
     "messages[1].tool_calls[0].function.arguments"),
    ("/tokenize", '{"model": "demo", "prompt": "x", "add_special_tokens": true, "extra": NaN}', "extra"),
]


@pytest.mark.parametrize("path,body,field", BODIES, ids=[f"{p}:{f}" for p, _, f in BODIES])
def test_bodies(srv: ServerProcess, path: str, body: str, field: str) -> None:
    r = httpx.post(srv.base + path, content=body.encode(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:400])
    err = r.json()["error"]
    assert err.get("param") == field and field in err["message"], err


def test_websocket_frame(srv: ServerProcess) -> None:
    async def go() -> dict[str, object]:
        async with WsClient(srv.ws_url) as ws:
            await ws.send('{"type": "generate", "id": "a", "prompt": "x", "params": {"top_p": 1e309}}')
            return await ws.recv()

    frame = asyncio.run(go())
    assert frame["type"] == "error" and frame["param"] == "params.top_p", frame


@pytest.mark.parametrize("value", ["nan", "1e309", "-inf"])
def test_usage_cli_bound(tmp_path: Path, value: str) -> None:
    db = tmp_path / "cli.db"
    r = subprocess.run([sys.executable, "-m", "server.cli", "usage", "--db", db_arg(db), f"--since={value}",
                        "--format", "json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "--since" in r.stderr and "finite" in r.stderr, r.stderr
    json.dumps(r.stderr)  # plain text
