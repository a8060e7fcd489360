"""`pagewire batch submit|show|cancel`: the batch tier from the command line, as a client of a running server.

It speaks the same HTTP API as the openai SDK (/v1/files, /v1/batches), so it works against any
pagewire server it can reach; the server owns the batch (durable in its ledger), this command only
uploads, creates, polls and downloads. With authentication on it sends a key (`--api-key`, else
$PAGEWIRE_API_KEY, else $OPENAI_API_KEY) as `Authorization: Bearer`; the batch then belongs to that
key, and only it (or the admin key) can show, cancel or download it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a batch command runs, so `pagewire --help` stays instant
    import httpx

TERMINAL = ("completed", "failed", "cancelled", "expired")


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    url_help = "server base URL [env PAGEWIRE_URL; default http://127.0.0.1:8000]"
    submit = sub.add_parser("submit", help="upload a JSONL batch file and create a batch")
    submit.add_argument("file", type=Path, help="JSONL: one {custom_id, method, url, body} per line")
    submit.add_argument("--endpoint", default="/v1/chat/completions",
                        choices=["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
    submit.add_argument("--wait", action="store_true", help="wait for the batch to end and download its files")
    submit.add_argument("--output-dir", type=Path, default=Path("."),
                        help="with --wait: where <batch id>_output.jsonl and _error.jsonl are written")
    for name in ("show", "cancel"):
        q = sub.add_parser(name, help=f"{name} a batch")
        q.add_argument("batch_id")
    for q in sub.choices.values():
        q.add_argument("--url", default=None, help=url_help)
        q.add_argument("--api-key", default=None,
                       help="API key to send as a Bearer token [env PAGEWIRE_API_KEY, then OPENAI_API_KEY]; "
                            "prefer the environment, which other users cannot read from the process list")


def _fail(r: "httpx.Response") -> int:
    try:
        msg = r.json()["error"]["message"]
    except Exception:
        msg = r.text[:500]
    print(f"pagewire: HTTP {r.status_code}: {msg}", file=sys.stderr)
    return 1


def run_batch(ns: argparse.Namespace) -> int:
    import httpx

    base = (ns.url or os.environ.get("PAGEWIRE_URL") or "http://127.0.0.1:8000").rstrip("/")
    key = ns.api_key or os.environ.get("PAGEWIRE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=base, timeout=120.0, headers=headers) as client:
            return _run(ns, client)
    except httpx.HTTPError as e:
        print(f"pagewire: cannot reach the server at {base}: {e}", file=sys.stderr)
        return 1


def _run(ns: argparse.Namespace, client: "httpx.Client") -> int:
    if ns.action in ("show", "cancel"):
        r = client.get(f"/v1/batches/{ns.batch_id}") if ns.action == "show" else \
            client.post(f"/v1/batches/{ns.batch_id}/cancel")
        if r.status_code != 200:
            return _fail(r)
        print(json.dumps(r.json(), indent=2))
        return 0
    path: Path = ns.file
    if not path.is_file():
        print(f"pagewire: file: no such file {path}", file=sys.stderr)
        return 2
    r = client.post("/v1/files", files={"file": (path.name, path.read_bytes(), "application/jsonl")},
                    data={"purpose": "batch"})
    if r.status_code != 200:
        return _fail(r)
    file_id = r.json()["id"]
    r = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": ns.endpoint,
                                         "completion_window": "24h"})
    if r.status_code != 200:
        return _fail(r)
    batch: dict[str, Any] = r.json()
    print(f"batch {batch['id']} created from {path} ({file_id})", flush=True)
    if not ns.wait:
        return 0
    shown = None
    while batch["status"] not in TERMINAL:
        time.sleep(1.0)  # a human-facing progress poll
        r = client.get(f"/v1/batches/{batch['id']}")
        if r.status_code != 200:
            return _fail(r)
        batch = r.json()
        c = batch["request_counts"]
        line = f"{batch['status']}: {c['completed']} completed, {c['failed']} failed of {c['total']}"
        if line != shown:
            print(line, flush=True)
            shown = line
    ns.output_dir.mkdir(parents=True, exist_ok=True)
    for key, suffix in (("output_file_id", "output"), ("error_file_id", "error")):
        if batch.get(key):
            r = client.get(f"/v1/files/{batch[key]}/content")
            if r.status_code != 200:
                return _fail(r)
            out = ns.output_dir / f"{batch['id']}_{suffix}.jsonl"
            out.write_bytes(r.content)
            print(f"{suffix}: {out}")
    return 0 if batch["status"] == "completed" else 1
