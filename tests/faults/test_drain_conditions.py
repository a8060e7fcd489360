"""Bug 1 (graceful shutdown stalled once), the conditions that could stall a drain, all at once in
one drain of a real Runtime (demo model, engine thread, ledger) behind the real WebSocket and
HTTP endpoints:
- a WebSocket client that has stopped reading (its send is held), with a request long enough to
  overflow its outbox;
- an SSE client that has stopped reading, the same way;
- a WebSocket client that disconnects as the drain begins;
- CPU load: two processes that keep both cores busy for the whole drain, and a thread that
  competes for the GIL while the event loop is stalled;
- a stalled event loop: right after the drain starts, the loop thread is blocked until the engine
  thread has taken more steps, which it must do without the loop.
The GIL competitor stops once the loop runs again. Kept for the whole drain it made the test's
length a matter of luck, not of the drain: every torch op releases the GIL, and taking it back from
a thread that never blocks waits for CPython's switch interval (5 ms), so on a quiet machine (the
competitor alone on a core) a decode step of the demo model's few hundred ops took about a second
and the long requests ran past the test's limit; under load the OS scheduler hid it.
The promise checked: the engine keeps stepping, every request ends within the grace (none is
`interrupted`), the normal streams get every token and `done`, and the ledger agrees. Waits on
events (the engine's steps, the service going idle, the streams' ends), never on time.

`tests/faults/test_shutdown_drain.py` does the same through a real SIGTERM to a server process."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from server.api.openai_http import GenerateEndpoint
from server.engine.outputs import RequestDelta
from tests.faults.inproc import FakeSocket, api_of, connect, running, until, ws_endpoint
from tests.server.harness import ledger_rows

NORMAL = 8
TOKENS = 64
# The stalled consumers' requests: far past their outbox bound with logprobs, and long enough to
# be still running when the drain starts even on a fast, quiet machine (the leaver's is 2 * LONG,
# within the demo model's 2,048 positions).
LONG = 400
STEPS_WITH_LOOP_BLOCKED = 5


class ClosingSocket(FakeSocket):
    """A WebSocket client that answers the server's close, as a real one does."""

    async def send(self, msg: dict[str, Any]) -> None:
        await super().send(msg)
        if msg["type"] == "websocket.close":
            self.disconnect()


class StalledSse:
    """An HTTP client that sends a streamed request, takes the response headers, then never reads:
    every body send blocks (as on a full socket) until the test lets go."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = json.dumps(body).encode()
        self._sent_body = False
        self.started = asyncio.Event()
        self._never = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._never.wait()  # no disconnect: the client is there, it just does not read
        return {"type": "http.disconnect"}

    async def send(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            assert msg["status"] == 200, msg
            self.started.set()
            return
        await self._never.wait()


def test_drain_finishes_every_request_despite_stalled_clients_leavers_and_load(demo_model: Path,
                                                                               tmp_path: Path) -> None:
    db = tmp_path / "drain.db"
    loop_blocked_steps_seen = threading.Event()

    async def scenario() -> None:
        async with running(demo_model, db, max_num_seqs=16, outbox_bytes=16 * 1024, send_timeout=3600.0,
                           shutdown_grace=600.0) as rt:
            service = rt.service
            engine = rt.bridge._engine if rt.bridge is not None else None
            assert service is not None and engine is not None
            ep = ws_endpoint(rt)  # registers its close-all hook on the drain

            normals = [ClosingSocket() for _ in range(NORMAL)]
            stalled_ws = ClosingSocket(stall=True)
            leaver = ClosingSocket()
            conns = [connect(ep, s) for s in [*normals, stalled_ws, leaver]]
            for i, s in enumerate(normals):
                s.send_frame({"type": "generate", "id": "n", "prompt": f"normal {i}",
                              "params": {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}})
            heavy = {"max_tokens": LONG, "ignore_eos": True, "logprobs": True, "top_logprobs": 10}
            stalled_ws.send_frame({"type": "generate", "id": "s", "prompt": "never read", "params": heavy})
            leaver.send_frame({"type": "generate", "id": "l", "prompt": "going away",
                               "params": {**heavy, "max_tokens": 2 * LONG}})
            sse = StalledSse({"model": "demo", "prompt": "never read sse", "max_tokens": LONG,
                              "ignore_eos": True, "stream": True, "logprobs": 10})
            scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
                (b"content-type", b"application/json")], "client": ("127.0.0.1", 50001)}
            sse_task = asyncio.get_running_loop().create_task(
                GenerateEndpoint(api_of(rt), "completion")(scope, sse.receive, sse.send))
            await sse.started.wait()
            # The long ones producing (a normal one may already have finished on a slow machine:
            # the drain must then still deliver its `done`, which is checked below all the same).
            # Accumulated, so one that already ended still counts (the wait cannot miss it).
            produced: set[str] = set()

            def long_ones_produced() -> bool:
                produced.update(j.request_id for j in service._jobs.values()
                                if j.params.max_tokens >= LONG and j.stream.last_seq > 0)
                return len(produced) == 3

            await until(long_ones_produced, "the stalled consumers' and the leaver's requests to produce")

            # CPU load: both cores kept busy by other processes for the whole drain, and a thread
            # that competes for the GIL while the loop is stalled (see the module docstring).
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
            stop_burning = threading.Event()

            def burn() -> None:
                while not stop_burning.is_set():
                    sum(range(5000))

            burner = threading.Thread(target=burn, name="burn", daemon=True)
            burner.start()

            # Count the engine's steps from its own thread, to block the loop on them.
            steps = 0
            post = engine._on_step

            def counting(deltas: list[RequestDelta]) -> None:
                nonlocal steps
                steps += 1
                if steps >= STEPS_WITH_LOOP_BLOCKED:
                    loop_blocked_steps_seen.set()
                post(deltas)

            try:
                drain = asyncio.get_running_loop().create_task(rt.drain())
                await asyncio.sleep(0)  # the drain task runs up to its first wait: draining is set
                assert service.draining
                leaver.disconnect()
                engine._on_step = counting
                # The loop thread stops here (as under a load that starves it); the engine thread
                # must go on stepping without it.
                # It waits for the steps, or for the engine to have nothing left (every request
                # already ended: then there is nothing to step, and the rows below still tell).
                # (The limit only turns a hang into a failure.)
                llm = engine._engine
                give_up = time.monotonic() + 600
                while not loop_blocked_steps_seen.wait(0.01):
                    assert llm is not None and time.monotonic() < give_up, \
                        "the engine stopped while the loop was blocked"
                    if not llm.has_unfinished_requests():
                        break
                stop_burning.set()
                await service._idle.wait()  # every request ended and its row committed
                stalled_ws.time_out_stalled_send()  # let the close-all hook finish promptly
                await drain
            finally:
                engine._on_step = post
                stop_burning.set()
                burner.join()
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            sse_task.cancel()
            await asyncio.gather(sse_task, return_exceptions=True)
            await asyncio.gather(*conns)  # every socket was closed by the drain (and answered)

            for s in normals:
                frames = s.of("n")
                assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "length", frames[-1]
                assert sum(len(f["token_ids"]) for f in frames if f["type"] == "delta") == TOKENS
                assert s.close_code == 1001  # closed by the drain, after its `done`

    asyncio.run(scenario())
    rows = ledger_rows(db)
    assert len(rows) == NORMAL + 3
    states = [(r["state"], r["completion_tokens"]) for r in rows.values()]
    # None interrupted: every request ended within the grace. The stalled consumers' requests ran
    # to the end as if their clients were reading; the leaver's was cancelled by its disconnect.
    assert states.count(("finished", TOKENS)) == NORMAL, states
    assert states.count(("finished", LONG)) == 2, states
    assert [st for st, _ in states].count("cancelled") == 1, states
