"""A slow consumer next to 8 normal streams (issue 13's fault suite): while one client has stopped
reading (its send is held, as a full socket holds it), 8 streams on other connections keep
progressing and complete, token for token; the stalled client's connection holds no more than its
outbox bound meanwhile, and its own request keeps running in the engine. The latency side (ITL p99
of the 8 within 10% of a run without the slow one) is a benchmark: bench/slow_consumer.py."""
from __future__ import annotations

import asyncio
from pathlib import Path

from tests.faults.inproc import FakeSocket, connect, running, until, ws_endpoint

NORMAL = 8
TOKENS = 64
OUTBOX = 64 * 1024


def test_normal_streams_complete_while_a_neighbour_is_stalled(demo_model: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(demo_model, tmp_path / "n.db", max_num_seqs=16, outbox_bytes=OUTBOX,
                           send_timeout=3600.0) as rt:
            service = rt.service
            assert service is not None
            ep = ws_endpoint(rt)
            slow = FakeSocket(stall=True)
            slow_conn = connect(ep, slow)
            slow.send_frame({"type": "generate", "id": "slow", "prompt": "never read",
                             "params": {"max_tokens": 1500, "ignore_eos": True, "logprobs": True,
                                        "top_logprobs": 10}})
            await until(lambda: any(j.stream.last_seq > 0 for j in service._jobs.values()), "the slow one to start")
            peak = 0
            normals = [FakeSocket() for _ in range(NORMAL)]
            conns = [connect(ep, s) for s in normals]
            for i, s in enumerate(normals):
                s.send_frame({"type": "generate", "id": "n", "prompt": f"normal {i}",
                              "params": {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}})

            def all_done() -> bool:
                nonlocal peak
                slow_c = next((c for c in ep.connections if c.aliases.get("slow")), None)
                if slow_c is not None:
                    peak = max(peak, slow_c.outbox.pending_bytes)
                return all(any(f["type"] == "done" for f in s.frames) for s in normals)

            await until(all_done, "the 8 normal streams")
            for s in normals:
                tokens = [t for f in s.of("n") if f["type"] == "delta" for t in f["token_ids"]]
                assert len(tokens) == TOKENS and s.of("n")[-1]["usage"]["completion_tokens"] == TOKENS
            # Still stalled: it has received nothing, and its request is still live and producing.
            assert slow.frames == [] and slow.stalled
            [job] = [j for j in service._jobs.values()]
            assert job.stream.last_seq > TOKENS
            assert peak <= OUTBOX
            for s in normals:
                s.disconnect()
            await asyncio.gather(*conns)
            slow.disconnect()
            slow.time_out_stalled_send()
            await slow_conn

    asyncio.run(scenario())
