"""Bug 6 of issue 13: one client must not grow server memory without bound. A client sends 40
generates of 2,000 tokens with 20 top logprobs and reads nothing. The bytes the server holds for
them — the resume buffers of live requests, the output reservations, the ended streams kept for
resume and the connection's outbox — are measured after every engine step and must stay within
the byte settings; the requests over the budget are refused (429 `output_budget_exceeded`); the
ended streams beyond the retention budget go early, and a resume of one still gets it all from
the ledger."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from server.engine.sampling_params import SamplingParams
from server.serving.output_budget import worst_case_bytes
from tests.faults.inproc import FakeSocket, connect, running, until, ws_endpoint
from tests.server.harness import ledger_rows

N = 40
MAX_TOKENS = 2000
TOP = 20
PER_REQUEST = worst_case_bytes(SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP))
CLIENT_BUDGET = PER_REQUEST + PER_REQUEST // 2  # room for one of them (the suite's time budget)
OUTBOX = 256 * 1024


def test_a_client_that_does_not_read_cannot_grow_memory(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "mem.db"
    # Less than the ended stream holds (its deltas and its stored output): it goes at once, and a
    # resume reads the ledger. (Eviction order under the byte budget: test_stream_retention.py.)
    retention = PER_REQUEST // 2

    async def scenario() -> None:
        async with running(demo_model, db, max_client_output_bytes=CLIENT_BUDGET, outbox_bytes=OUTBOX,
                           stream_retention_bytes=retention, send_timeout=3600.0) as rt:
            service = rt.service
            assert service is not None
            reg = service.registry
            ep = ws_endpoint(rt)
            peak: dict[str, int] = {"live": 0, "reserved": 0, "retained": 0, "outbox": 0}
            per_stream_ok: list[bool] = []
            on_step = service.on_step

            def measured(deltas: list[Any]) -> None:  # after each engine step, on the loop
                on_step(deltas)
                conn = next(iter(ep.connections), None)
                now = {"live": reg.live_bytes(), "reserved": service.budget.reserved,
                       "retained": reg.retained_bytes, "outbox": conn.outbox.pending_bytes if conn else 0}
                for k, v in now.items():
                    peak[k] = max(peak[k], v)
                per_stream_ok.append(all(j.stream.bytes <= j.output_bytes for j in service._jobs.values()))

            service.on_step = measured  # type: ignore[method-assign]
            sock = FakeSocket(stall=True)  # reads nothing, ever
            conn = connect(ep, sock)
            params = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                      "logprobs": True, "top_logprobs": TOP}
            for i in range(N):
                sock.send_frame({"type": "generate", "id": f"g{i}", "prompt": f"hoard {i}", "params": params})
            rejected = rt.metrics.rejected.labels(code="output_budget_exceeded")
            # The metric first: reading the ledger file on every poll would cost the loop.
            await until(lambda: rejected._value.get() == N - 1 and len(ledger_rows(db)) == 1,
                        "admission of all 40")
            # Not just "no jobs": under load the admitted request can still wait in the admission
            # queue (row `queued`, not yet a job). The ledger is read only while no job runs.
            await until(lambda: not service._jobs
                        and all(r["state"] == "finished" for r in ledger_rows(db).values()),
                        "the admitted request to end")

            assert peak["reserved"] <= CLIENT_BUDGET and peak["live"] <= CLIENT_BUDGET
            assert peak["live"] > PER_REQUEST // 2  # it did measure a big live output
            assert all(per_stream_ok)  # no request held more than it reserved
            assert peak["outbox"] <= OUTBOX
            assert peak["retained"] <= retention and reg.retained_bytes == 0 and reg.ended_count == 0
            assert service.budget.reserved == 0 and len(service.budget) == 0
            sock.disconnect()
            sock.time_out_stalled_send()
            await conn

            # The evicted stream is resumed from the ledger, complete.
            rows = ledger_rows(db)
            assert all(r["state"] == "finished" for r in rows.values())
            evicted = [rid for rid in rows if reg.get(rid) is None]
            assert len(evicted) == 1
            again = FakeSocket()
            conn2 = connect(ep, again)
            again.send_frame({"type": "resume", "id": "r", "request_id": evicted[0], "after_seq": 0})
            await until(lambda: any(f["type"] == "done" for f in again.frames), "the resumed done")
            deltas = [f for f in again.of("r") if f["type"] == "delta"]
            assert sum(len(f["token_ids"]) for f in deltas) == MAX_TOKENS
            assert sum(len(f["logprobs"]) for f in deltas) == MAX_TOKENS
            assert all(len(lp["top_logprobs"]) == TOP for f in deltas for lp in f["logprobs"])
            again.disconnect()
            await conn2

    asyncio.run(scenario())


def test_a_request_larger_than_the_budget_alone_is_a_400_naming_the_field(demo_model: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(demo_model, tmp_path / "big.db", max_client_output_bytes=PER_REQUEST - 1) as rt:
            ep = ws_endpoint(rt)
            sock = FakeSocket()
            conn = connect(ep, sock)
            sock.send_frame({"type": "generate", "id": "big", "prompt": "x",
                             "params": {"max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": TOP}})
            await until(lambda: bool(sock.of("big")), "an answer")
            [err] = sock.of("big")
            assert err["type"] == "error" and err["code"] == "output_budget_exceeded"
            assert err["param"] == "top_logprobs" and "retry_after_ms" not in err
            assert str(PER_REQUEST) in err["message"]
            sock.disconnect()
            await conn

    asyncio.run(scenario())
