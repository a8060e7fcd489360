"""The crash-point sweep (issue 29): a mixed workload, a kill at a random moment, a restart on the
same ledger, and the ledger's invariants, round after round.

Shared by `tests/faults/test_crash_sweep.py` (a few rounds, in CI) and `bench/crash_sweep.py`
(as many rounds as asked). Each round, against a real `pagewire serve` with API keys on:

* the workload: SSE streams and whole completions with idempotency keys, a WebSocket with three
  keyed generates, an immediate idempotent retry of one key and a retry of a key acknowledged in
  an earlier round (a process ago), requests of a key with a daily token quota, a batch (every
  few rounds; its lines run on across kills), and key churn (create one, revoke the last) through
  the `pagewire keys` CLI while the server runs;
* the fault, at a uniformly random moment of the workload: SIGKILL; or SIGTERM (the server must
  then exit within its grace); or the disk filling under the ledger (a small tmpfs, see
  `diskfull.py`), the workload running on for a moment, then SIGKILL and the space freed;
* the restart on the same ledger, then the invariants:
  1. every acknowledged request has exactly one row (and an idempotency key one row; a retry got
     the original request id);
  2. no row that existed at the kill is left `queued` or `running` (the start-up sweep);
  3. every `done` a client received matches a `finished` row with the same text and usage;
  4. no batch line finished twice;
  5. per-key usage (`/v1/usage`, the server's report) equals the sum of the key's rows
     (recomputed here from the columns: prompt + completion tokens of rows that were admitted);
  6. the quota key's billable tokens today never pass its daily limit;
  7. `PRAGMA integrity_check` is `ok`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx

from tests.server.harness import REPO, ServerProcess, db_arg

QUOTA_TOKENS = 3000
GRACE_S = 3.0
CHAT = "/v1/chat/completions"
TERMINAL = ("finished", "cancelled", "failed", "interrupted")


@dataclass
class Seen:
    """What one client request observed."""

    kind: str
    key: Optional[str]  # idempotency key
    body: dict[str, Any]
    secret: str
    request_id: Optional[str] = None  # set when acknowledged
    text: str = ""
    usage: Optional[dict[str, int]] = None  # set when `done` arrived


@dataclass
class Sweep:
    model: Path
    work: Path
    mode: str  # "sigkill" | "sigterm" | "diskfull"
    seed: int = 0
    db: Path = field(init=False)
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # name → (key id, secret)
    acked: dict[str, Seen] = field(default_factory=dict)  # request id → what its client saw
    by_key: dict[str, str] = field(default_factory=dict)  # idempotency key → request id
    retries: list[tuple[str, str]] = field(default_factory=list)  # (key, request id a retry got)
    batches: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    rounds_done: int = 0
    exit_s: list[float] = field(default_factory=list)  # SIGTERM: time to exit
    churn: list[str] = field(default_factory=list)
    ledger_dir: Optional[Path] = None
    _snapshot: list[str] = field(default_factory=list)  # request ids present at the last kill

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self, ledger_dir: Path) -> None:
        self.ledger_dir = ledger_dir
        self.db = ledger_dir / "sweep.db"
        self.keys["main"] = _create_key(self.db, "main")
        self.keys["quota"] = _create_key(self.db, "quota", "--daily-tokens", str(QUOTA_TOKENS))

    def server(self) -> ServerProcess:
        srv = ServerProcess(self.model, self.db, "--shutdown-grace", str(GRACE_S))
        srv.log_path = self.work / f"server-{self.rounds_done}.log"
        return srv

    # -- one round -----------------------------------------------------------------------------
    def round(self) -> None:
        n = self.rounds_done
        srv = self.server().start()
        try:
            if n:  # the previous round's kill is behind this start: check what it left
                self.check(srv, n - 1)
            churn = n % 3 == 0
            batch = n % 4 == 0
            asyncio.run(self._workload(srv, n, churn, batch))
        finally:
            srv.kill()
            srv.stop(timeout=5)
        self.rounds_done += 1

    def finish(self) -> None:
        """Restart once more, check the last round, let the batches end, then check usage of all keys."""
        srv = self.server().start()
        try:
            self.check(srv, self.rounds_done - 1)
            deadline = time.monotonic() + 600
            main = self.keys["main"][1]
            while any(_batch(srv, b, main)["status"] not in ("completed", "failed", "cancelled", "expired")
                      for b in self.batches):
                if time.monotonic() > deadline:
                    self.violations.append("final: batches did not end within 600 s")
                    break
                time.sleep(0.2)
            for name in self.keys:
                self._check_usage(srv, name, "final")
        finally:
            srv.stop()

    async def _workload(self, srv: ServerProcess, n: int, churn: bool, batch: bool) -> None:
        main, quota = self.keys["main"][1], self.keys["quota"][1]
        seen: list[Seen] = []

        def body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
            b: dict[str, Any] = {"model": "demo", "prompt": f"round {n} {self.rng.random():.6f}", "temperature": 0,
                                 "max_tokens": max_tokens, "ignore_eos": True}
            if stream:
                b |= {"stream": True, "stream_options": {"include_usage": True}}
            return b

        jobs: list[Any] = []
        async with httpx.AsyncClient(timeout=120) as c:
            for i in range(2):
                s = Seen("sse", f"r{n}-sse-{i}", body(self.rng.randint(16, 160), True), main)
                seen.append(s)
                jobs.append(_sse(c, srv.base, s))
            for i in range(2):
                s = Seen("whole", f"r{n}-whole-{i}", body(self.rng.randint(4, 48)), main)
                seen.append(s)
                jobs.append(_whole(c, srv.base, s))
            # An immediate retry of the first whole request: same key, same body.
            retry = Seen("whole", seen[2].key, seen[2].body, main)
            jobs.append(_whole(c, srv.base, retry))
            # A retry of a key acknowledged a process ago.
            old: Optional[Seen] = None
            olds = [s for s in self.acked.values() if s.kind == "whole" and s.usage is not None]
            if olds:
                prev = self.rng.choice(olds)
                # Idempotency keys are scoped to the API key that sent them, so the retry
                # goes out under the original's key (a quota request's retry too).
                old = Seen("whole", prev.key, prev.body, prev.secret)
                jobs.append(_whole(c, srv.base, old))
            ws = [Seen("ws", f"r{n}-ws-{i}", body(self.rng.randint(16, 120)), main) for i in range(3)]
            seen.extend(ws)
            jobs.append(_ws(srv, ws, main))
            for i in range(2):
                s = Seen("whole", f"r{n}-quota-{i}", body(self.rng.randint(40, 200)), quota)
                seen.append(s)
                jobs.append(_whole(c, srv.base, s))
            if batch:
                jobs.append(self._batch(c, srv, n))
            tasks = [asyncio.ensure_future(j) for j in jobs]
            # Key churn runs the CLI as a child process: it is awaited, never cancelled, so it
            # cannot still hold the ledger's lock when the next round's server starts.
            churned = asyncio.ensure_future(self._churn()) if churn else None
            await self._fault(srv, tasks)
            await asyncio.gather(*tasks, return_exceptions=True)
            if churned is not None:
                await asyncio.gather(churned, return_exceptions=True)
        for s in seen + [retry] + ([old] if old else []):
            if s.request_id is None:
                continue
            first = self.by_key.get(s.key or "")
            if first is not None and first != s.request_id:
                self.violations.append(f"round {n}: key {s.key} answered {s.request_id}, first {first}")
            if s.key is not None and first is None:
                self.by_key[s.key] = s.request_id
            if s is retry or s is old:
                self.retries.append((s.key or "", s.request_id))
                prior = self.acked.get(s.request_id)
                if prior is not None and prior.usage is not None and s.usage is not None and (
                        s.text != prior.text or s.usage["completion_tokens"] != prior.usage["completion_tokens"]):
                    self.violations.append(f"round {n}: retry of {s.key} got other output than the original")
                if prior is not None:
                    continue
            cur = self.acked.get(s.request_id)
            if cur is None or (cur.usage is None and s.usage is not None):
                self.acked[s.request_id] = s

    async def _fault(self, srv: ServerProcess, tasks: list[Any]) -> None:
        at = self.rng.uniform(0.2, 3.0)
        await asyncio.sleep(at)  # the random moment (a timer, not a wait for the workload)
        assert srv.proc is not None
        if self.mode == "sigterm":
            t0 = time.monotonic()
            srv.signal(signal.SIGTERM)
            while srv.proc.poll() is None and time.monotonic() - t0 < GRACE_S + 60:
                await asyncio.sleep(0.05)
            self.exit_s.append(time.monotonic() - t0)
            if srv.proc.poll() is None:
                self.violations.append(f"round {self.rounds_done}: SIGTERM: still running after {GRACE_S + 60}s")
        elif self.mode == "diskfull":
            from tests.faults.diskfull import fill

            assert self.ledger_dir is not None
            filler = fill(self.ledger_dir)
            try:
                await asyncio.sleep(self.rng.uniform(0.2, 1.5))  # the workload runs on a full disk
                srv.signal(signal.SIGKILL)
                srv.wait(30)
            finally:
                filler.unlink()
        else:
            srv.signal(signal.SIGKILL)
            srv.wait(30)
        for t in tasks:
            t.cancel()

    async def _batch(self, c: httpx.AsyncClient, srv: ServerProcess, n: int) -> None:
        h = {"Authorization": f"Bearer {self.keys['main'][1]}"}
        lines = "\n".join(json.dumps({
            "custom_id": f"b{n}-{i}", "method": "POST", "url": CHAT,
            "body": {"model": "demo", "messages": [{"role": "user", "content": f"batch {n} line {i}"}],
                     "max_tokens": 24, "temperature": 0, "ignore_eos": True}}) for i in range(6))
        r = await c.post(srv.base + "/v1/files", headers=h, data={"purpose": "batch"},
                         files={"file": ("in.jsonl", lines.encode(), "application/jsonl")})
        if r.status_code != 200:
            return
        r = await c.post(srv.base + "/v1/batches", headers=h, json={"input_file_id": r.json()["id"], "endpoint": CHAT})
        if r.status_code == 200:
            self.batches.append(r.json()["id"])

    async def _churn(self) -> None:
        loop = asyncio.get_running_loop()
        if self.churn:
            victim = self.churn.pop(0)
            await loop.run_in_executor(None, _cli, "keys", "revoke", victim, "--db", db_arg(self.db))
        out = await loop.run_in_executor(None, _cli, "keys", "create", "--name", f"churn-{self.rounds_done}",
                                         "--db", db_arg(self.db), "--json")
        if out.returncode == 0:
            self.churn.append(json.loads(out.stdout)["key_id"])

    # -- the invariants --------------------------------------------------------------------------
    def check(self, srv: ServerProcess, n: int) -> None:
        where = f"after round {n} ({self.mode})"
        rows = _rows(self.db)
        for rid, s in self.acked.items():
            row = rows.get(rid)
            if row is None:
                self.violations.append(f"{where}: acknowledged {rid} ({s.kind} {s.key}) has no row")
                continue
            if s.key is not None and row["idempotency_key"] not in (s.key, f"{self.keys_of(s.secret)}:{s.key}"):
                self.violations.append(f"{where}: {rid} carries key {row['idempotency_key']}, not {s.key}")
            if s.usage is not None:
                if row["state"] != "finished":
                    self.violations.append(f"{where}: {rid} sent done but its row is {row['state']}")
                    continue
                if (row["completion_tokens"], row["prompt_tokens"]) != (s.usage["completion_tokens"],
                                                                        s.usage["prompt_tokens"]):
                    self.violations.append(f"{where}: {rid} usage {s.usage} != row "
                                           f"{row['prompt_tokens']}+{row['completion_tokens']}")
                out = json.loads(row["output_json"]) if row.get("output_json") else None
                text = out["samples"][0]["text"] if out else None
                if text != s.text:
                    self.violations.append(f"{where}: {rid} text differs from its row ({len(s.text)} vs "
                                           f"{len(text or '')} chars)")
        keys = [r["idempotency_key"] for r in rows.values() if r["idempotency_key"]]
        if len(keys) != len(set(keys)):
            self.violations.append(f"{where}: an idempotency key has more than one row")
        for key, rid in self.retries:
            if self.by_key.get(key) not in (None, rid):
                self.violations.append(f"{where}: retry of {key} got {rid}, the original is {self.by_key[key]}")
        # Rows that existed at the kill: the start-up sweep made every one terminal. (Rows of batch
        # lines the new process resumed may be live now, so only the snapshot is checked.)
        for rid in self._snapshot:
            state = rows[rid]["state"] if rid in rows else None
            if state not in TERMINAL:
                self.violations.append(f"{where}: {rid} is left {state}")
        finished: dict[str, int] = {}
        for r in rows.values():
            k = r["idempotency_key"] or ""
            if k.startswith("batch-") and r["state"] == "finished":
                line = k.rsplit("-", 1)[0]
                finished[line] = finished.get(line, 0) + 1
        twice = [k for k, v in finished.items() if v > 1]
        if twice:
            self.violations.append(f"{where}: batch lines finished twice: {twice[:5]}")
        quota_id = self.keys["quota"][0]
        day0 = time.time() // 86400 * 86400
        billed = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values()
                     if r["key_id"] == quota_id and r["admitted_at"] is not None and r["created_at"] >= day0)
        if billed > QUOTA_TOKENS:
            self.violations.append(f"{where}: the quota key is billed {billed} > its daily {QUOTA_TOKENS}")
        self._check_usage(srv, "quota", where)
        with contextlib.closing(sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)) as conn:
            ok = conn.execute("PRAGMA integrity_check").fetchone()[0]
        if ok != "ok":
            self.violations.append(f"{where}: integrity_check: {ok}")

    def keys_of(self, secret: str) -> str:
        return next(kid for kid, s in self.keys.values() if s == secret)

    def snapshot(self) -> None:
        """Remember the rows present right after a kill (before the restart's sweep)."""
        self._snapshot = list(_rows(self.db))

    def _check_usage(self, srv: ServerProcess, name: str, where: str) -> None:
        kid, secret = self.keys[name]
        r = httpx.get(srv.base + "/v1/usage", headers={"Authorization": f"Bearer {secret}"}, timeout=60)
        if r.status_code != 200:
            self.violations.append(f"{where}: /v1/usage for {name}: {r.status_code} {r.text[:200]}")
            return
        reported = sum(int(d.get("billable_tokens") or 0) for d in r.json()["data"])
        rows = _rows(self.db)
        mine = sum(x["prompt_tokens"] + x["completion_tokens"] for x in rows.values()
                   if x["key_id"] == kid and x["admitted_at"] is not None)
        if reported != mine:
            self.violations.append(f"{where}: {name} usage reported {reported}, its rows sum to {mine}")


def run_rounds(sweep: Sweep, rounds: int, ledger_dir: Path, until: Optional[float] = None,
               progress: bool = False) -> None:
    """`rounds` rounds (fewer if the monotonic clock passes `until` first), then the final check."""
    sweep.setup(ledger_dir)
    for _ in range(rounds):
        if until is not None and time.monotonic() > until:
            break
        sweep.round()
        sweep.snapshot()
        if progress:
            print(f"round {sweep.rounds_done}: {len(sweep.acked)} acknowledged, {len(sweep.violations)} "
                  "violation(s) so far", flush=True)
    sweep.finish()


@contextlib.contextmanager
def ledger_folder(sweep: Sweep) -> Iterator[Path]:
    """Where the ledger lives: a small tmpfs for the disk-full mode, else a plain folder."""
    if sweep.mode == "diskfull":
        from tests.faults.diskfull import small_filesystem

        with small_filesystem(sweep.work, size_mb=64) as fs:
            yield fs
    else:
        p = sweep.work / "ledger"
        p.mkdir(exist_ok=True)
        yield p


# -- clients -------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _create_key(db: Path, name: str, *extra: str) -> tuple[str, str]:
    out = _cli("keys", "create", "--name", name, "--db", db_arg(db), "--json", *extra)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    d = json.loads(out.stdout)
    return d["key_id"], d["secret"]


def _rows(db: Path) -> dict[str, dict[str, Any]]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        conn.row_factory = sqlite3.Row
        return {r["request_id"]: dict(r) for r in conn.execute("SELECT * FROM requests")}


def _batch(srv: ServerProcess, bid: str, secret: str) -> dict[str, Any]:
    return dict(httpx.get(f"{srv.base}/v1/batches/{bid}", headers={"Authorization": f"Bearer {secret}"},
                          timeout=60).json())


def _h(s: Seen) -> dict[str, str]:
    h = {"Authorization": f"Bearer {s.secret}"}
    if s.key is not None:
        h["Idempotency-Key"] = s.key
    return h


async def _whole(c: httpx.AsyncClient, base: str, s: Seen) -> None:
    r = await c.post(base + "/v1/completions", json=s.body, headers=_h(s))
    if r.status_code != 200:
        return
    d = r.json()
    s.request_id = r.headers["x-request-id"]
    s.text = d["choices"][0]["text"]
    s.usage = d["usage"]


async def _sse(c: httpx.AsyncClient, base: str, s: Seen) -> None:
    async with c.stream("POST", base + "/v1/completions", json=s.body, headers=_h(s)) as r:
        if r.status_code != 200:
            return
        s.request_id = r.headers["x-request-id"]  # sent once the row is committed
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                s.usage = usage
                return
            d = json.loads(line[6:])
            if "error" in d:
                return
            for ch in d.get("choices") or []:
                s.text += ch.get("text") or ""
            usage = d.get("usage") or usage


async def _ws(srv: ServerProcess, seen: list[Seen], secret: str) -> None:
    from websockets.asyncio.client import connect

    by_id = {s.key: s for s in seen}
    async with connect(srv.ws_url, proxy=None, additional_headers={"Authorization": f"Bearer {secret}"},
                       close_timeout=1) as ws:
        for s in seen:
            await ws.send(json.dumps({"type": "generate", "id": s.key, "prompt": s.body["prompt"],
                                      "idempotency_key": s.key,
                                      "params": {"max_tokens": s.body["max_tokens"], "temperature": 0,
                                                 "ignore_eos": True}}))
        open_ids = set(by_id)
        while open_ids:
            f = json.loads(await ws.recv())
            s = by_id.get(f.get("id"))
            if s is None:
                continue
            if f["type"] == "accepted":
                s.request_id = f["request_id"]
            elif f["type"] == "delta":
                s.text += f["text"]
            elif f["type"] in ("done", "error"):
                if f["type"] == "done":
                    s.usage = f["usage"]
                open_ids.discard(f["id"])
