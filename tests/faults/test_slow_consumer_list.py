"""Bug 5 of issue 13: when a consumer is cut for not reading, the `slow_consumer` error frame must
list every request the client can resume — the live ones, and the ones that ended while their
`done` (and maybe deltas) sat unsent. It used to list only live ones, so 20 lost `done`s were
listed as nothing. Each listed request is then resumed on a new connection to its end."""
from __future__ import annotations

import asyncio
from pathlib import Path

from tests.faults.inproc import FakeSocket, connect, running, until, ws_endpoint
from tests.server.harness import ledger_rows

SHORT = 20
LONG = 2


def test_cut_lists_ended_requests_whose_done_was_lost(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "cut.db"

    async def scenario() -> None:
        async with running(demo_model, db) as rt:
            assert rt.service is not None
            ep = ws_endpoint(rt)
            sock = FakeSocket(stall=True)  # the client reads nothing from the first frame on
            conn = connect(ep, sock)
            params = {"temperature": 0, "ignore_eos": True}
            # The long ones take the first engine slots and outlive the short ones by many steps.
            for i in range(LONG):
                sock.send_frame({"type": "generate", "id": f"long{i}", "prompt": "keep going",
                                 "params": {**params, "max_tokens": 400}})
            for i in range(SHORT):
                sock.send_frame({"type": "generate", "id": f"s{i}", "prompt": f"short {i}",
                                 "params": {**params, "max_tokens": 6}})
            service = rt.service
            # The short ones have ended (terminal rows committed; their `done`s queued, unsent)
            # while the long ones still run.
            await until(lambda: len(ledger_rows(db)) == SHORT + LONG and len(service._jobs) == LONG,
                        "the short requests to end")
            assert sum(r["state"] == "finished" for r in ledger_rows(db).values()) == SHORT
            sock.time_out_stalled_send()  # the writer's blocked send now counts as timed out
            await until(lambda: sock.close_code is not None, "the cut")
            assert sock.close_code == 1013
            [err] = [f for f in sock.frames if f.get("code") == "slow_consumer"]
            listed = {r["id"]: r["request_id"] for r in err["requests"]}
            assert set(listed) == {f"s{i}" for i in range(SHORT)} | {f"long{i}" for i in range(LONG)}
            assert len(err["requests"]) == SHORT + LONG
            sock.disconnect()
            await conn

            # Every listed request resumes to its end on a new connection, complete from seq 0.
            again = FakeSocket()
            conn2 = connect(ep, again)
            for cid, rid in listed.items():
                again.send_frame({"type": "resume", "id": cid, "request_id": rid, "after_seq": 0})
            await until(lambda: sum(f["type"] == "done" for f in again.frames) == len(listed), "every done")
            for cid in listed:
                frames = again.of(cid)
                tokens = [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]
                done = frames[-1]
                assert done["type"] == "done"
                assert len(tokens) == done["usage"]["completion_tokens"] == (400 if cid.startswith("long") else 6)
            again.disconnect()
            await conn2

    asyncio.run(scenario())
    rows = ledger_rows(db)
    assert len(rows) == SHORT + LONG and all(r["state"] == "finished" for r in rows.values())
