"""Unit tests of the edge's building blocks, without a server: outboxes and streams, admission
order and bounds, the ledger, the bridge's one-hop-per-step rule, decoding, settings, and the
torch-free edge."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from server.api.decode import decode
from server.api.protocol import CompletionRequest, GenerateFrame
from server.engine.outputs import RequestDelta, SampleDelta, TokenLogprob
from server.serving.admission import BATCH, INTERACTIVE, AdmissionQueue
from server.serving.errors import InvalidRequest, Overloaded
from server.serving.jobs import events_from_output
from server.serving.ledger import IdempotencyConflict, Ledger, NewRequest, Terminal
from server.serving.outbox import REPLAY_CHUNK_BYTES, Outbox, Subscription
from server.serving.streams import DeltaEvent, EndEvent, Replay, RequestStream, Usage

REPO = Path(__file__).resolve().parents[2]


def _samples(*texts: str, index: int = 0) -> list[SampleDelta]:
    return [SampleDelta(index=index, token_ids=[len(t)], text=t) for t in texts]


# -- streams ---------------------------------------------------------------------------------------


def test_outbox_coalesces_consecutive_deltas_of_one_sample_keeping_the_newest_seq() -> None:
    async def main() -> None:
        box = Outbox(max_bytes=1 << 20)
        stream = RequestStream("r")
        stream.attach(Subscription(box, "k"))
        for t in ("a", "b", "c"):
            stream.publish(_samples(t), want_logprobs=False)
        stream.publish(_samples("x", index=1), want_logprobs=False)
        stream.publish(_samples("d"), want_logprobs=False)
        batch = await box.get()
        assert [(e.seq, e.index, e.text, e.token_ids) for _, e in batch] == [
            (3, 0, "abc", [1, 1, 1]), (4, 1, "x", [1]), (5, 0, "d", [1])]
        # The stream's own resume buffer is untouched by the connection's merges.
        assert [e.text for e in stream.deltas] == ["a", "b", "c", "x", "d"]

    asyncio.run(main())


def test_merging_in_the_outbox_keeps_its_byte_count_exact_and_the_stream_untouched() -> None:
    # A lagging consumer merges every step's delta into one pending delta, in place: the outbox's
    # byte count must still equal the merged delta's size, logprobs included, and the stream's
    # resume buffer (which the merge copied from) must not change.
    async def main() -> None:
        box = Outbox(max_bytes=1 << 30)
        stream = RequestStream("r")
        stream.attach(Subscription(box, "k"))
        for i in range(300):
            lp = [TokenLogprob(i, -0.5, [(i, -0.5), (i + 1, -1.0)])] if i % 3 else None
            stream.publish([SampleDelta(index=0, token_ids=[i], text="t", logprobs=lp)], want_logprobs=True)
        [(_, merged)] = box.take()
        assert merged.token_ids == list(range(300)) and merged.text == "t" * 300
        assert merged.logprobs is not None and len(merged.logprobs) == 200
        # take() zeroed the count, so check it on a fresh outbox fed the same way.
        box2 = Outbox(max_bytes=1 << 30)
        for ev in stream.deltas:
            box2.push("k", ev)
        assert box2.pending_bytes == box2.take()[0][1].size()
        assert [len(e.token_ids) for e in stream.deltas] == [1] * 300
        assert all(e.logprobs is None or len(e.logprobs) == 1 for e in stream.deltas)

    asyncio.run(main())


def test_a_backlog_past_the_bound_is_replayed_from_the_stream_instead_of_growing() -> None:
    async def main() -> None:
        box = Outbox(max_bytes=2000)
        stream = RequestStream("r")
        box.push("k", "accepted")
        stream.attach(Subscription(box, "k"))
        for _ in range(100):  # 100 x ~164 B with nobody taking: far past the bound
            stream.publish(_samples("y" * 50), want_logprobs=False)
            assert box.pending_bytes <= 2000
        assert not box.overflowed and box.replaying == 1
        got = await box.get()
        assert got[0] == ("k", "accepted")  # control frames keep their place
        deltas = [e for _, e in got if isinstance(e, DeltaEvent)]
        assert [e.seq for e in deltas] == [100] and deltas[0].text == "y" * 5000  # nothing lost or doubled
        assert box.replaying == 0  # caught up: live again
        stream.publish(_samples("z"), want_logprobs=False)
        assert [(e.seq, e.text) for _, e in box.take()] == [(101, "z")]

    asyncio.run(main())


def test_a_fallback_replay_resumes_after_what_the_writer_already_took() -> None:
    async def main() -> None:
        box = Outbox(max_bytes=1000)
        stream = RequestStream("r")
        ended: list[EndEvent] = []
        stream.attach(Subscription(box, "k", on_end=ended.append))
        stream.publish(_samples("a" * 100), want_logprobs=False)
        first = await box.get()  # the writer took seq 1 and is busy sending it
        for _ in range(20):
            stream.publish(_samples("b" * 100), want_logprobs=False)
        stream.finish(EndEvent("r", "finished", ["length"], Usage(1, 21), 21))
        rest = await box.get()
        texts = [e.text for _, e in first + rest if isinstance(e, DeltaEvent)]
        assert "".join(texts) == "a" * 100 + "b" * 2000
        assert isinstance(rest[-1][1], EndEvent) and len(ended) == 1

    asyncio.run(main())


def test_a_large_replay_does_not_count_as_a_stuck_consumer() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        for _ in range(100):
            stream.publish(_samples("z" * 50), want_logprobs=False)
        box = Outbox(max_bytes=2000)
        stream.attach(Subscription(box, "k"))  # 5 kB of backlog into a 2 kB outbox
        assert not box.overflowed
        stream.publish(_samples("live"), want_logprobs=False)
        assert not box.overflowed
        assert [e.seq for _, e in await box.get()] == [101]

    asyncio.run(main())


def test_attach_replays_after_seq_then_goes_live_without_gap_or_duplicate() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        for t in "abcde":
            stream.publish(_samples(t), want_logprobs=False)
        box = Outbox(1 << 20)
        stream.attach(Subscription(box, "k"), after_seq=3)
        stream.publish(_samples("f"), want_logprobs=False)
        stream.finish(EndEvent("r", "finished", ["length"], Usage(1, 6), 6))
        got = box.take()
        assert [e.seq for _, e in got if isinstance(e, DeltaEvent)] == [6]  # d, e, f merged; newest seq
        assert [e.text for _, e in got if isinstance(e, DeltaEvent)] == ["def"]
        assert isinstance(got[-1][1], EndEvent) and not stream.subscribers

    asyncio.run(main())


def test_a_replay_is_paced_by_the_writer_and_live_events_queue_behind_it() -> None:
    """The resume case: a multi-chunk replay, with the request still publishing while the writer
    sends it. Nothing counts against the small outbox, the replay comes a chunk per turn, live
    events arrive after it in seq order, and the subscription then goes live."""
    async def main() -> None:
        stream = RequestStream("r")
        big = "w" * 2000
        for _ in range(200):  # ~800 kB of backlog into a 2 kB outbox
            stream.publish(_samples(big), want_logprobs=False)
        box = Outbox(max_bytes=2000)
        sub = Subscription(box, "k")
        box.push("k", "accepted")  # a control frame queued before the replay stays first
        stream.attach(sub)
        seen: list[object] = []
        turns = 0
        while True:
            batch = await box.get()  # the writer is now busy "sending" this batch
            turns += 1
            assert sum(e.size() for _, e in batch if isinstance(e, DeltaEvent)) <= REPLAY_CHUNK_BYTES + 5000
            seen.extend(e for _, e in batch)
            if box.replaying == 0:
                break
            for _ in range(3):  # live output while the writer is busy with the replay
                stream.publish(_samples("x" * 600), want_logprobs=False)
            assert not box.overflowed
        assert turns > 5 and sub.replay is None
        deltas = [e for e in seen if isinstance(e, DeltaEvent)]
        assert seen[0] == "accepted"
        assert [e.seq for e in deltas] == sorted(e.seq for e in deltas)
        assert "".join(e.text for e in deltas) == "".join(e.text for e in stream.deltas[:deltas[-1].seq])
        # Live from here: the next step goes straight to the outbox.
        stream.publish(_samples("live"), want_logprobs=False)
        assert [(e.seq, e.text) for _, e in box.take()][-1] == (stream.last_seq, "live")

    asyncio.run(main())


def test_the_outbox_bound_counts_only_backlog_built_while_the_writer_is_busy() -> None:
    async def main() -> None:
        box = Outbox(max_bytes=1000)
        stream = RequestStream("r")
        stream.attach(Subscription(box, "k"))
        stream.publish(_samples("a"), want_logprobs=False)
        waiter = asyncio.get_running_loop().create_task(box.get())
        await asyncio.sleep(0)  # the writer parks in get() after taking "a"
        first = await waiter
        assert [e.text for _, e in first] == ["a"]
        waiter = asyncio.get_running_loop().create_task(box.get())
        await asyncio.sleep(0)  # parked, with nothing pending
        # One engine step's burst while the writer is parked: taken at once, not a lag.
        stream.publish([SampleDelta(index=i, token_ids=[1], text="b" * 400) for i in range(4)],
                       want_logprobs=False)
        assert not box.overflowed
        assert len(await waiter) == 4
        # The writer is busy with that batch: the same burst now is a backlog beyond the bound,
        # which the outbox does not hold: the subscription catches up from the stream instead.
        stream.publish([SampleDelta(index=i, token_ids=[1], text="c" * 400) for i in range(4)],
                       want_logprobs=False)
        assert box.pending_bytes <= 1000 and box.replaying == 1 and not box.overflowed
        assert sorted(e.text for _, e in await box.get()) == ["c" * 400] * 4

    asyncio.run(main())


def test_a_ledger_replay_ends_with_the_rows_end() -> None:
    async def main() -> None:
        output = {"last_seq": 2, "samples": [{"index": 0, "text": "ab", "token_ids": [1, 2], "logprobs": None,
                                              "finish_reason": "length", "marks": [[1, 1, 1], [2, 2, 2]]}]}
        end = EndEvent("r", "finished", ["length"], Usage(1, 2), 2, output=output)
        box = Outbox(10)
        ended: list[EndEvent] = []
        Subscription(box, "k", on_end=ended.append).catch_up(Replay(events_from_output(output, 1), end=end))
        assert not ended  # nothing is delivered before the writer pulls it
        got = await box.get()
        assert [(e.seq, e.text) for _, e in got if isinstance(e, DeltaEvent)] == [(2, "b")]
        assert got[-1][1] is end and ended == [end] and box.replaying == 0

    asyncio.run(main())


def test_events_from_stored_output_resume_exactly_after_a_seq() -> None:
    output = {"last_seq": 4, "samples": [
        {"index": 0, "text": "abcd", "token_ids": [1, 2, 3, 4], "logprobs": None, "finish_reason": "length",
         "marks": [[1, 1, 1], [2, 2, 2], [4, 4, 4]]},
        {"index": 1, "text": "z", "token_ids": [9], "logprobs": None, "finish_reason": "stop",
         "marks": [[3, 1, 1]]},
    ]}
    evs = events_from_output(output, after_seq=2)
    assert [(e.seq, e.index, e.text, e.token_ids) for e in evs] == [(3, 1, "z", [9]), (4, 0, "cd", [3, 4])]
    assert events_from_output(output, after_seq=4) == []
    assert events_from_output(output, after_seq=0)[1].text == "abcd"


# -- admission -------------------------------------------------------------------------------------


def test_admission_interactive_first_then_round_robin_across_clients() -> None:
    handed: list[str] = []
    q: AdmissionQueue[str] = AdmissionQueue(max_queued=100, max_queued_per_client=100, max_in_engine=1,
                                            submit=handed.append)
    for job, client, klass, prio in [
        ("blocker", "z", INTERACTIVE, 0),
        ("a1", "a", INTERACTIVE, 0), ("a2", "a", INTERACTIVE, 0), ("a3", "a", INTERACTIVE, 0),
        ("b1", "b", INTERACTIVE, 0), ("batch1", "c", BATCH, 0), ("b2", "b", INTERACTIVE, 0),
        ("a0", "a", INTERACTIVE, -5),
    ]:
        q.reserve(client)
        q.enqueue(job, client, klass, prio)
    assert handed == ["blocker"]
    for job in list(handed):
        q.done(job)
    while q.in_engine:
        q.done(next(iter(q.in_engine)))
    # a0 jumps a's queue (lower priority value first); clients alternate; batch goes last.
    assert handed == ["blocker", "a0", "b1", "a1", "b2", "a2", "a3", "batch1"]


def test_admission_bounds_total_and_per_client_with_a_retry_hint() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(max_queued=3, max_queued_per_client=2, max_in_engine=0,
                                            submit=lambda j: None)
    q.reserve("a")
    q.reserve("a")
    with pytest.raises(Overloaded) as e:
        q.reserve("a")
    assert e.value.status == 429 and e.value.retry_after_s >= 1
    q.reserve("b")
    with pytest.raises(Overloaded):
        q.reserve("c")
    q.release("b")
    q.reserve("c")


# -- ledger ----------------------------------------------------------------------------------------


def test_ledger_group_commits_recovers_open_rows_and_keeps_keys_unique(tmp_path: Path) -> None:
    async def main() -> None:
        db = tmp_path / "l.db"
        led = await Ledger.open(db)
        reqs = [NewRequest(f"r{i}", "completion", "ws", "c", "m", 0, {}, "p", 2, time.time(), f"k{i}")
                for i in range(20)]
        await asyncio.gather(*(led.insert(r) for r in reqs))
        assert led.commits <= 2  # twenty inserts, grouped
        with pytest.raises(IdempotencyConflict):  # the idempotency key is unique (the constraint decides)
            await led.insert(NewRequest("dup", "completion", "ws", "c", "m", 0, {}, "p", 2, time.time(), "k1"))
        led.mark_running("r0", time.time())
        await led.finish("r0", Terminal("finished", "stop", None, 2, 3, 0, "abc", {"samples": []}, None, time.time()))
        assert (await led.find_by_idempotency_key("k0")).state == "finished"
        await led.close()
        led = await Ledger.open(db)
        assert led.interrupted_at_start == 19
        assert (await led.get("r5")).state == "interrupted"
        assert (await led.get("r0")).state == "finished"
        await led.close()

    asyncio.run(main())


# -- bridge ----------------------------------------------------------------------------------------


def test_bridge_posts_one_loop_callback_per_engine_step() -> None:
    from server.engine.config import EngineConfig
    from server.serving.bridge import EngineBridge

    async def main() -> None:
        dispatched: list[list[RequestDelta]] = []
        bridge = EngineBridge(EngineConfig(model="unused"), dispatched.append)
        bridge._loop = asyncio.get_running_loop()  # what start() records, without loading a model
        calls = 0
        real = bridge._loop.call_soon_threadsafe

        def counting(*a: object) -> object:
            nonlocal calls
            calls += 1
            return real(*a)

        bridge._loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def engine_thread() -> None:  # three steps, many requests and tokens each
            for _step in range(3):
                bridge._on_step([RequestDelta(f"r{i}", _samples("t", "u"), False, 1, 0, 0.0) for i in range(10)])
            bridge._on_step([])  # an idle step posts nothing

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        # Every callback was posted before join returned; a marker posted now runs after them all.
        flushed = asyncio.Event()
        real(flushed.set)
        await flushed.wait()
        assert calls == 3 and len(dispatched) == 3 and all(len(d) == 10 for d in dispatched)

    asyncio.run(main())


# -- decoding and settings -------------------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "x", "stop": 3}', "stop"),
    (b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
])
def test_decode_names_the_offending_field(body: bytes, field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        decode(body, CompletionRequest)
    assert e.value.param == field and e.value.message.startswith(field)


def test_decode_ws_params_path() -> None:
    with pytest.raises(InvalidRequest) as e:
        decode(b'{"type": "generate", "id": "a", "prompt": "x", "params": {"top_p": 2}}', GenerateFrame)
    assert e.value.param == "params.top_p"


def test_serve_options_read_pagewire_env_vars_and_flags_win() -> None:
    import argparse

    from server.serving.settings import add_serve_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    env = {"PAGEWIRE_PORT": "9001", "PAGEWIRE_MAX_NUM_SEQS": "3", "PAGEWIRE_ENABLE_PREFIX_CACHING": "false",
           "PAGEWIRE_MODEL": "/models/x"}
    s = settings_from_args(p.parse_args(["--max-num-seqs", "5"]), env)
    assert (s.port, s.max_num_seqs, s.enable_prefix_caching, s.model_dir) == (9001, 5, False, "/models/x")
    assert s.engine_config("/m").max_num_seqs == 5
    with pytest.raises(ValueError, match="PAGEWIRE_PORT"):
        settings_from_args(p.parse_args([]), {"PAGEWIRE_PORT": "eighty"})


def test_the_edge_never_imports_torch() -> None:
    """Importing the edge, building the served app and answering one request on every route
    loads no torch (the engine thread, not started here, is what loads it; see edge_routes)."""
    code = ("import sys, server.api.app, server.cli, server.serve, server.serving.runtime; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


def test_every_route_answers_without_importing_torch(demo_model: Path, tmp_path: Path) -> None:
    import json

    run = subprocess.run([sys.executable, "-m", "tests.server.edge_routes", str(demo_model), str(tmp_path / "e.db")],
                         cwd=REPO, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["torch_after_build_app"] is False
    # Each route's answer while the weights load: generation refused with 503 `starting`, the
    # rest served (an unknown request id: the 404 for it).
    assert seen["statuses"] == {
        "GET /health": 503, "GET /v1/models": 200, "POST /v1/completions": 503, "POST /v1/chat/completions": 503,
        "POST /v1/embeddings": 503, "POST /tokenize": 200, "POST /detokenize": 200, "GET /metrics": 200, "GET /v1/usage": 200,
        "GET /v1/requests/{id}": 404, "POST /v1/files": 200, "GET /v1/files/{id}": 200,
        "GET /v1/files/{id}/content": 200, "POST /v1/batches": 200, "GET /v1/batches": 200,
        "GET /v1/batches/{id}": 200, "POST /v1/batches/{id}/cancel": 200, "GET /": 200, "GET /ui/{file}": 200,
    }, seen["statuses"]
    assert seen["codes"]["POST /v1/completions"] == seen["codes"]["POST /v1/chat/completions"] == "starting"
    assert seen["codes"]["POST /v1/embeddings"] == "starting"
    assert seen["codes"]["GET /v1/requests/{id}"] == "request_not_found"
    assert seen["ws_frame"]["type"] == "error" and seen["ws_frame"]["code"] == "starting", seen["ws_frame"]
    assert seen["torch"] is False


def test_the_small_endpoints_answer_when_called_directly(tmp_path: Path) -> None:
    """build_app's handlers are importable methods: called here without an app or a server."""
    import json

    from starlette.requests import Request

    from server.api.context import ApiContext
    from server.api.endpoints import StatusEndpoints, UsageEndpoint, report_bound
    from server.gateway.policy import Gateway
    from server.serving.runtime import Runtime
    from server.serving.settings import ServeSettings

    settings = ServeSettings(db=str(tmp_path / "l.db"))
    api = ApiContext(Runtime(settings, tmp_path, "demo"), Gateway(settings))  # built, never started

    def get(path: str, query: bytes = b"") -> Request:
        return Request({"type": "http", "method": "GET", "path": path, "query_string": query, "headers": []})

    async def main() -> None:
        health = await StatusEndpoints(api).health(get("/health"))
        assert health.status_code == 503 and json.loads(bytes(health.body)) == {"status": "loading"}
        models = await StatusEndpoints(api).models(get("/v1/models"))
        assert json.loads(bytes(models.body))["data"][0]["id"] == "demo"
        usage = await UsageEndpoint(api).usage(get("/v1/usage"))  # no ledger yet: 503, not a 500
        assert usage.status_code == 503 and json.loads(bytes(usage.body))["error"]["code"] == "starting"
        bad = await UsageEndpoint(api).usage(get("/v1/usage", b"start=yesterday"))
        assert bad.status_code == 400 and json.loads(bytes(bad.body))["error"]["param"] == "start"

    asyncio.run(main())
    assert report_bound("2026-12-01", "start") == 1796083200.0
    assert report_bound("1796083200.5", "end") == 1796083200.5 and report_bound("", "end") is None


def test_a_refused_request_does_not_keep_its_parse_alive_through_the_traceback() -> None:
    """Issue 29: a refusal's traceback reached the frames holding the request's body and parse in
    reference cycles, so sixteen refused 7.5 MB prompts kept RSS +218 MiB until the cyclic
    collector ran. read_and_admit drops those frames' locals once the refusal is answered."""
    import asyncio
    import gc
    import weakref
    from types import SimpleNamespace

    from server.api.admission import read_and_admit
    from server.serving.errors import InvalidRequest

    class Parsed:  # stands for a parsed request (weakref-able, unlike str)
        pass

    refs: list[weakref.ref[Parsed]] = []
    sent: list[InvalidRequest] = []

    async def admit(body: bytes) -> None:
        parsed = Parsed()
        refs.append(weakref.ref(parsed))
        try:
            raise InvalidRequest("prompt: too long", param="prompt")
        except InvalidRequest as e:
            failure = e  # this frame -> the exception -> its traceback -> this frame: a cycle
            raise failure from None

    async def send_error(send: object, exc: InvalidRequest) -> None:
        sent.append(exc)

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    api = SimpleNamespace(rt=SimpleNamespace(settings=SimpleNamespace(max_request_bytes=1 << 20)))
    gc.disable()  # only reference counting may free it
    try:
        out = asyncio.run(read_and_admit(api, {"headers": []}, receive, None, send_error, admit))  # type: ignore[arg-type]
        assert out is None and [e.param for e in sent] == ["prompt"]
        sent.clear()
        assert refs[0]() is None
    finally:
        gc.enable()
