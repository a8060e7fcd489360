"""The batch tier (OpenAI's Batch API subset): batches of JSONL request lines, run as background work.
A batch's endpoint is /v1/chat/completions, /v1/completions or /v1/embeddings; each line is one
engine request (one prompt, or one embeddings input).

Where state lives (all durable in the ledger, so a batch resumes after a crash or a restart):
- `batches`: one row per batch, its status, timestamps and request counts;
- `batch_lines`: one row per input line: `pending` → `running` (with the attempt number and the
  request id) → `done` / `error` with its rendered output line (`result_json`);
- `requests`: each line's generation, a normal ledger row whose idempotency key is
  `batch-<batch_id>-<line>-<attempt>`.

Why nothing runs twice: a line is (re)started with its idempotency key, so after a crash a line
whose request already finished is found by that key and its stored output is used (never
re-run, never billed again). Only a line whose request was interrupted (the crash stopped it)
gets a new attempt, with a new key. The output and error files are rendered from
`batch_lines.result_json` in line order when the batch ends, so they never hold a line twice.

Ownership: a batch records the API key that created it (`batches.key_id`), and its lines run as
requests of that key: billed to it, and reserved against its token rate limits and daily quota
like its interactive requests. A line refused by the key's per-minute limits waits (the batch
fills idle capacity, it does not fail for being throttled); one refused by the daily quota, or
whose key was revoked or expired, goes to the error file with that error. A key sees only its own
batches and files (another key's id gets the same 404 as an unknown one); the admin sees all.

Lines run at BACKGROUND_PRIORITY in the admission queue's batch class: the engine runs them only
in steps with no interactive work and preempts them first (server.engine.scheduler). At most
`concurrency` lines of all batches are in flight, so the admission queue and the engine's seats
always have room for interactive requests. Everything runs on the event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from server.engine.priority import BACKGROUND_PRIORITY
from server.serving.access import Caller
from server.serving.admission import BATCH
from server.serving.errors import InvalidRequest, NotFound, Overloaded, PagewireError, RateLimited
from server.serving.files import OUTPUT_PURPOSE, FileStore
from server.serving.jobs import GenerationSpec
from server.serving.ledger import Ledger
from server.serving.lifecycle import CancelReason, EndReason
from server.serving.service import RequestService
from server.serving.streams import EndEvent, EndWaiter

log = logging.getLogger("pagewire.batch")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS = ("24h",)
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
LINE_TIMEOUT_S = 24 * 3600.0  # a line may wait in the queue as long as the completion window

BATCH_COLUMNS = ("batch_id, input_file_id, endpoint, completion_window, status, metadata_json, errors_json, "
                 "created_at, in_progress_at, finalizing_at, completed_at, failed_at, cancelling_at, "
                 "cancelled_at, output_file_id, error_file_id, total, completed, failed, key_id")


@dataclass
class BatchRecord:
    batch_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    metadata: Optional[dict[str, Any]]
    errors: Optional[dict[str, Any]]
    created_at: float
    in_progress_at: Optional[float]
    finalizing_at: Optional[float]
    completed_at: Optional[float]
    failed_at: Optional[float]
    cancelling_at: Optional[float]
    cancelled_at: Optional[float]
    output_file_id: Optional[str]
    error_file_id: Optional[str]
    total: int
    completed: int
    failed: int
    key_id: Optional[str] = None  # the owning API key (None: created with authentication off)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> "BatchRecord":
        vals = list(row)
        vals[5] = json.loads(vals[5]) if vals[5] else None
        vals[6] = json.loads(vals[6]) if vals[6] else None
        return cls(*vals)

    def to_json(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        t = lambda v: int(v) if v is not None else None  # noqa: E731
        return {
            "id": self.batch_id, "object": "batch", "endpoint": self.endpoint, "errors": self.errors,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": t(self.created_at), "in_progress_at": t(self.in_progress_at),
            "expires_at": t(self.created_at + 24 * 3600), "finalizing_at": t(self.finalizing_at),
            "completed_at": t(self.completed_at), "failed_at": t(self.failed_at), "expired_at": None,
            "cancelling_at": t(self.cancelling_at), "cancelled_at": t(self.cancelled_at),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }


class LineInvalid(Exception):
    """A line that cannot become a request (bad JSON, missing custom_id, wrong url, bad body)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# (kind, body bytes, client, idempotency key, owning key id) → a GenerationSpec owned by that key;
# raises PagewireError naming the field (or InvalidApiKey when the owner can no longer spend).
SpecBuilder = Callable[[str, bytes, str, Optional[str], Optional[str]], GenerationSpec]
# (kind, the line's body, end) → the response body of a finished request (the body says how: an
# embeddings line's encoding_format).
Renderer = Callable[[str, bytes, EndEvent], dict[str, Any]]
# PagewireError → OpenAI's error body.
ErrorBody = Callable[[PagewireError], dict[str, Any]]


def _kind(endpoint: str) -> str:
    return {"/v1/chat/completions": "chat", "/v1/embeddings": "embedding"}.get(endpoint, "completion")


def parse_line(raw: str, endpoint: str, seen: set[str]) -> tuple[str, bytes]:
    """(custom_id, body bytes) of one input line, or LineInvalid naming what is wrong."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LineInvalid("invalid_json", f"line is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LineInvalid("invalid_request", "line must be a JSON object with custom_id, method, url and body")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineInvalid("missing_custom_id", "custom_id: required, a non-empty string")
    if cid in seen:
        raise LineInvalid("duplicate_custom_id", f"custom_id: {cid!r} appears on an earlier line")
    seen.add(cid)
    if obj.get("method", "POST") != "POST":
        raise LineInvalid("invalid_method", f"method: must be POST, got {obj.get('method')!r}")
    if obj.get("url") != endpoint:
        raise LineInvalid("invalid_url", f"url: must be the batch's endpoint {endpoint}, got {obj.get('url')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineInvalid("invalid_body", "body: required, a JSON object")
    if body.get("stream"):
        raise LineInvalid("invalid_body", "body.stream: streaming is not available in a batch")
    return cid, json.dumps(body).encode()


class BatchManager:
    """Creates, runs, resumes and cancels batches. `start()` resumes the open ones; `stop()` stops."""

    def __init__(self, ledger: Ledger, files: FileStore, service: RequestService, build_spec: SpecBuilder,
                 render: Renderer, error_body: ErrorBody, concurrency: int) -> None:
        self.ledger = ledger
        self.files = files
        self.service = service
        self.build_spec = build_spec
        self.render = render
        self.error_body = error_body
        self.concurrency = max(1, concurrency)
        self._slots = asyncio.Semaphore(self.concurrency)
        self._runs: dict[str, asyncio.Task[None]] = {}
        # Every line task in flight, so stop() reaches them too: one started while its batch's run
        # was waiting for a slot is not yet inside the run's gather, and cancelling the run alone
        # left it running past shutdown, against a closed ledger (the SIGTERM crash sweep).
        self._line_tasks: set[asyncio.Task[None]] = set()
        self._live: dict[str, dict[int, str]] = {}  # batch id → line → request id in flight
        self._stopping = False

    # -- API ------------------------------------------------------------------------------------
    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: Optional[dict[str, Any]], who: Optional[Caller] = None) -> BatchRecord:
        """A new batch owned by `who` (None: authentication is off), from one of its own files."""
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                                 param="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise InvalidRequest(f"completion_window: must be one of {', '.join(COMPLETION_WINDOWS)}, "
                                 f"got {completion_window!r}", param="completion_window")
        f = await self.files.get(input_file_id, "input_file_id", who)
        if f.purpose != "batch":
            raise InvalidRequest(f"input_file_id: {input_file_id!r} has purpose {f.purpose!r}, not 'batch'",
                                 param="input_file_id")
        bid = f"batch_{uuid.uuid4().hex[:24]}"
        await self.ledger.execute(
            "INSERT INTO batches (batch_id, input_file_id, endpoint, completion_window, status, metadata_json, "
            "created_at, key_id) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
            (bid, input_file_id, endpoint, completion_window, json.dumps(metadata) if metadata else None,
             time.time(), who.key_id if who is not None else None))
        self._spawn(bid)
        return await self.get(bid)

    async def get(self, batch_id: str, who: Optional[Caller] = None) -> BatchRecord:
        """The batch, if `who` may see it (None: no check); another key's gets an unknown id's 404."""
        rows = await self.ledger.query(f"SELECT {BATCH_COLUMNS} FROM batches WHERE batch_id = ?", (batch_id,))
        b = BatchRecord.from_row(rows[0]) if rows else None
        if b is None or (who is not None and not who.may_see(b.key_id)):
            raise NotFound(f"batch_id: no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return b

    async def list_batches(self, limit: int, after: Optional[str], who: Optional[Caller] = None) -> list[BatchRecord]:
        """Newest first; a key lists only its own batches, the admin (or no auth) every one."""
        where: list[str] = []
        args: list[Any] = []
        if who is not None and not who.admin:
            where.append("key_id = ?")
            args.append(who.key_id)
        if after:
            where.append("created_at < (SELECT created_at FROM batches WHERE batch_id = ?)")
            args.append(after)
        sql = f"SELECT {BATCH_COLUMNS} FROM batches" + (" WHERE " + " AND ".join(where) if where else "")
        rows = await self.ledger.query(sql + " ORDER BY created_at DESC LIMIT ?", (*args, limit))
        return [BatchRecord.from_row(r) for r in rows]

    async def cancel(self, batch_id: str, who: Optional[Caller] = None) -> BatchRecord:
        b = await self.get(batch_id, who)
        if b.status in ("validating", "in_progress", "finalizing"):
            await self.ledger.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE batch_id = ? "
                "AND status IN ('validating', 'in_progress', 'finalizing')", (time.time(), batch_id))
            for rid in list(self._live.get(batch_id, {}).values()):
                self.service.cancel(rid, CancelReason.CLIENT)
            if batch_id not in self._runs:
                self._spawn(batch_id)
        return await self.get(batch_id)

    # -- running --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume every batch a previous process left open."""
        rows = await self.ledger.query(
            f"SELECT batch_id FROM batches WHERE status IN ({', '.join('?' * len(OPEN_STATUSES))}) "
            "ORDER BY created_at", OPEN_STATUSES)
        for (bid,) in rows:
            log.info("resuming batch %s", bid)
            self._spawn(bid)

    async def pick_up(self) -> None:
        """Run the open batches no task here is running (a shared ledger: batches created on
        another replica, or lines left by one whose lease lapsed). Called on each lease tick."""
        if self._stopping:
            return
        rows = await self.ledger.query(
            f"SELECT batch_id FROM batches WHERE status IN ({', '.join('?' * len(OPEN_STATUSES))}) "
            "ORDER BY created_at", OPEN_STATUSES)
        for (bid,) in rows:
            if bid not in self._runs:
                self._spawn(bid)

    async def stop(self) -> None:
        """Stop running batches (shutdown). Their lines in flight end as `interrupted` with the
        server's drain and are resumed by the next start."""
        self._stopping = True
        for t in [*self._runs.values(), *self._line_tasks]:
            t.cancel()
        await asyncio.gather(*self._runs.values(), *self._line_tasks, return_exceptions=True)

    async def wait(self, batch_id: str) -> None:
        """Until the batch's run task ends (tests, CLI-free waits)."""
        t = self._runs.get(batch_id)
        if t is not None:
            await asyncio.gather(t, return_exceptions=True)

    def _spawn(self, batch_id: str) -> None:
        if self._stopping:
            return
        task = asyncio.get_running_loop().create_task(self._run(batch_id), name=f"batch-{batch_id}")
        self._runs[batch_id] = task
        task.add_done_callback(lambda t: self._finished_run(batch_id, t))

    def _finished_run(self, batch_id: str, task: "asyncio.Task[None]") -> None:
        self._runs.pop(batch_id, None)
        self._live.pop(batch_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s stopped by an error: %s", batch_id, task.exception())

    async def _run(self, batch_id: str) -> None:
        b = await self.get(batch_id)
        if b.status == "validating":
            await self._validate(b)
            b = await self.get(batch_id)
        if b.status == "in_progress":
            # Open lines no live replica holds (with SQLite, no instance is registered: all of them).
            lines = await self.ledger.query(
                "SELECT line_no, status, attempt FROM batch_lines WHERE batch_id = ? AND (status = 'pending' OR "
                "(status = 'running' AND (lease_owner IS NULL OR lease_owner NOT IN "
                "(SELECT instance_id FROM instances WHERE lease_until >= ?)))) ORDER BY line_no",
                (batch_id, time.time()))
            if lines:
                raw = (await self.files.content(b.input_file_id)).decode("utf-8")
                texts = [ln for ln in raw.splitlines() if ln.strip()]
                self._live[batch_id] = {}
                tasks = []
                for line_no, _status, attempt in lines:
                    await self._slots.acquire()
                    if (await self._status(batch_id)) == "cancelling":
                        self._slots.release()
                        break
                    task = asyncio.get_running_loop().create_task(self._run_line(b, line_no, texts[line_no], attempt))
                    self._line_tasks.add(task)
                    task.add_done_callback(self._line_tasks.discard)
                    tasks.append(task)
                await asyncio.gather(*tasks)
        # Lines still open mean the server is stopping (they resume with the next start), unless
        # the batch is being cancelled: then what finished is final.
        if await self._status(batch_id) != "cancelling" and await self.ledger.query(
                "SELECT 1 FROM batch_lines WHERE batch_id = ? AND status IN ('pending', 'running') LIMIT 1",
                (batch_id,)):
            return
        await self._finalize(batch_id)

    async def _status(self, batch_id: str) -> str:
        rows = await self.ledger.query("SELECT status FROM batches WHERE batch_id = ?", (batch_id,))
        return str(rows[0][0])

    async def _validate(self, b: BatchRecord) -> None:
        """Split the input into lines; invalid ones get their error result now."""
        raw = (await self.files.content(b.input_file_id)).decode("utf-8")
        texts = [ln for ln in raw.splitlines() if ln.strip()]
        seen: set[str] = set()
        stmts: list[tuple[str, tuple[Any, ...]]] = []
        failed = 0
        for i, text in enumerate(texts):
            try:
                cid, _body = parse_line(text, b.endpoint, seen)
                stmts.append(("INSERT INTO batch_lines (batch_id, line_no, custom_id, status) "
                              "VALUES (?, ?, ?, 'pending') ON CONFLICT DO NOTHING", (b.batch_id, i, cid)))
            except LineInvalid as e:
                failed += 1
                cid_any = _custom_id_of(text)
                result = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": cid_any, "response": None,
                          "error": {"code": e.code, "message": f"line {i + 1}: {e.message}"}}
                stmts.append(("INSERT INTO batch_lines (batch_id, line_no, custom_id, status, "
                              "result_json) VALUES (?, ?, ?, 'error', ?) ON CONFLICT DO NOTHING",
                              (b.batch_id, i, cid_any, json.dumps(result))))
        stmts.append(("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, failed = ? "
                      "WHERE batch_id = ? AND status = 'validating'", (time.time(), len(texts), failed, b.batch_id)))
        await self.ledger.execute_many(stmts)

    async def _run_line(self, b: BatchRecord, line_no: int, text: str, attempt: int) -> None:
        try:
            await self._run_line_inner(b, line_no, text, attempt)
        finally:
            self._slots.release()

    async def _run_line_inner(self, b: BatchRecord, line_no: int, text: str, attempt: int) -> None:
        kind = _kind(b.endpoint)
        cid, body = parse_line(text, b.endpoint, set())
        # The line's lease: this replica's claim, which no other takes while this one's lease holds
        # (on a shared ledger another replica may run it: then it is not ours). Claimed before
        # the prior attempt is read, so an attempt of a lapsed owner is already `interrupted`.
        if not await self.ledger.claim_batch_line(b.batch_id, line_no, attempt):
            return
        first = attempt
        while True:
            key = f"batch-{b.batch_id}-{line_no}-{attempt}"
            prior = await self.ledger.find_by_idempotency_key(key)
            # Interrupted by a crash or shutdown: that attempt is over; the line runs again under a
            # new key (what the interrupted attempt emitted stays billed on its own row).
            if prior is not None and prior.state == "interrupted":
                attempt += 1
                continue
            break
        try:
            spec = self.build_spec(kind, body, f"batch:{b.batch_id}", key, b.key_id)
        except PagewireError as e:
            await self._record(b.batch_id, line_no, cid, None, e.status, self.error_body(e), ok=False)
            return
        spec.priority = BACKGROUND_PRIORITY
        spec.klass = BATCH
        spec.detach = True  # nobody follows a batch line; it must not be cancelled for that
        spec.timeout_s = LINE_TIMEOUT_S
        if attempt != first:
            await self.ledger.execute("UPDATE batch_lines SET attempt = ? WHERE batch_id = ? AND line_no = ?",
                                      (attempt, b.batch_id, line_no))
        if await self._status(b.batch_id) == "cancelling":  # cancelled while this line was being set up
            await self.ledger.execute("UPDATE batch_lines SET status = 'cancelled' WHERE batch_id = ? AND "
                                      "line_no = ?", (b.batch_id, line_no))
            return
        while True:
            try:
                admitted = await self.service.start(spec)
                break
            except (Overloaded, RateLimited) as e:
                # The queue is full of interactive work, or the owner's per-minute limits are spent:
                # wait, never fail a line for it (unless the batch is cancelled meanwhile).
                if isinstance(e, Overloaded) or e.code == "rate_limit_exceeded":
                    await asyncio.sleep(max(0.05, e.retry_after_s or 1.0))
                    if await self._status(b.batch_id) == "cancelling":
                        await self.ledger.execute("UPDATE batch_lines SET status = 'cancelled' WHERE batch_id = ? "
                                                  "AND line_no = ?", (b.batch_id, line_no))
                        return
                    continue
                # The daily quota, or a line that can never fit the key's TPM: the error file.
                await self._record(b.batch_id, line_no, cid, None, e.status, self.error_body(e), ok=False)
                return
            except PagewireError as e:
                if e.code in ("starting", "ledger_unavailable"):  # model still loading / ledger recovering
                    await asyncio.sleep(0.1 if e.code == "starting" else 1.0)
                    continue
                if e.code in ("shutting_down", "model_load_failed"):
                    return  # the line stays `running` and resumes with the next start
                await self._record(b.batch_id, line_no, cid, None, e.status, self.error_body(e), ok=False)
                return
        live = self._live.setdefault(b.batch_id, {})
        live[line_no] = admitted.request_id
        waiter = EndWaiter()
        stream = await self.service.attach(admitted.request_id, waiter, 0, admitted.record)
        try:
            end = await waiter.future
        finally:
            self.service.detach(stream, waiter)
            live.pop(line_no, None)
        if end.reason is EndReason.FINISHED:
            await self._record(b.batch_id, line_no, cid, end.request_id, 200, self.render(kind, body, end), ok=True)
        elif end.reason is EndReason.CANCELLED:
            await self.ledger.execute("UPDATE batch_lines SET status = 'cancelled' WHERE batch_id = ? AND "
                                      "line_no = ?", (b.batch_id, line_no))
        elif end.reason is EndReason.INTERRUPTED:
            return  # shutdown: resumed (with a new attempt) by the next start
        else:
            from server.serving.lifecycle import end_error

            err = end_error(end.request_id, end.reason, end.message)
            await self._record(b.batch_id, line_no, cid, end.request_id, err.status, self.error_body(err), ok=False)

    async def _record(self, batch_id: str, line_no: int, cid: str, request_id: Optional[str], status: int,
                      body: dict[str, Any], ok: bool) -> None:
        result = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": cid,
                  "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
        # One transaction (queued back to back): the line's result and the batch's counts, which
        # are recounted from the lines, so they can never drift from what the files will hold.
        await self.ledger.execute_many([
            ("UPDATE batch_lines SET status = ?, request_id = ?, result_json = ? WHERE batch_id = ? AND line_no = ? "
             "AND status IN ('pending', 'running')",
             ("done" if ok else "error", request_id, json.dumps(result), batch_id, line_no)),
            ("UPDATE batches SET completed = (SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND "
             "status = 'done'), failed = (SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND status = 'error') "
             "WHERE batch_id = ?", (batch_id, batch_id, batch_id)),
        ])

    async def _finalize(self, batch_id: str) -> None:
        """Render the output and error files from the recorded lines, then close the batch."""
        status = await self._status(batch_id)
        if status not in ("in_progress", "finalizing", "cancelling"):
            return
        cancelling = status == "cancelling"
        if not cancelling:
            won = await self.ledger.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? "
                                            "WHERE batch_id = ? AND status = 'in_progress'", (time.time(), batch_id))
            if not won and status == "in_progress":
                return  # another replica finished the last line at the same moment and finalizes
        rows = await self.ledger.query("SELECT status, result_json FROM batch_lines WHERE batch_id = ? "
                                       "ORDER BY line_no", (batch_id,))
        owner = (await self.get(batch_id)).key_id
        out = [r[1] for r in rows if r[0] == "done"]
        err = [r[1] for r in rows if r[0] == "error"]
        # Fixed ids per batch: a finalize repeated after a crash rewrites the same files.
        out_id = err_id = None
        if out:
            out_id = (await self.files.write(OUTPUT_PURPOSE, f"{batch_id}_output.jsonl",
                                             ("\n".join(out) + "\n").encode(), f"file-{batch_id}-output",
                                             key_id=owner)).file_id
        if err:
            err_id = (await self.files.write(OUTPUT_PURPOSE, f"{batch_id}_error.jsonl",
                                             ("\n".join(err) + "\n").encode(), f"file-{batch_id}-error",
                                             key_id=owner)).file_id
        final, col = ("cancelled", "cancelled_at") if cancelling else ("completed", "completed_at")
        await self.ledger.execute(
            f"UPDATE batches SET status = ?, {col} = ?, output_file_id = ?, error_file_id = ? WHERE batch_id = ?",
            (final, time.time(), out_id, err_id, batch_id))
        log.info("batch %s %s", batch_id, final)


def _custom_id_of(text: str) -> Optional[str]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None
