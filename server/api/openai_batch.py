"""Batched prompts for POST /v1/completions: several prompts in one request, one OpenAI response.

As in OpenAI's API and vLLM, `prompt` may be a list of strings or of token-id lists. Each prompt
becomes its own engine request with its own ledger row (an Idempotency-Key `K` becomes `K#i`
for prompt i), admitted in order; if one is refused, the ones already admitted are cancelled
and the refusal is returned. Choices are numbered `prompt_index * n + sample_index`, as OpenAI
numbers them, and usage is summed over the prompts. Streams interleave the prompts' chunks in
the order the engine produced them, under one response id.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from server.api.http_io import (DisconnectWatch, Receive, Send, error_payload, send_error,
                                send_json, send_with_timeout, sse_bytes)
from server.errors import PagewireError, Unavailable
from server.jobs import GenerationSpec
from server.streams import DeltaEvent, EndEvent, Outbox, Subscription

if TYPE_CHECKING:
    from server.runtime import Runtime

MAX_BATCH = 64


async def admit_all(rt: "Runtime", specs: list[GenerationSpec]) -> list[Any]:
    """Start every prompt's request; all or none (earlier ones are cancelled on a refusal)."""
    admitted: list[Any] = []
    try:
        for i, spec in enumerate(specs):
            try:
                admitted.append(await rt.service.start(spec))
            except PagewireError as e:
                # Say which prompt of the batch was refused: `prompt[2]: ...`.
                if e.param == "prompt" or e.param is None:
                    e.message = f"prompt[{i}] of {len(specs)}: {e.message}"
                    e.args = (e.message,)
                raise
    except BaseException:
        for a in admitted:
            if a.job is not None and not a.existing:
                rt.service.cancel(a.job, "client")
        raise
    return admitted


def _merge_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    }
    return total


async def whole(rt: "Runtime", send: Send, receive: Receive, admitted: list[Any], n: int,
                end_error: Callable[[EndEvent], PagewireError], waiter_factory: Callable[[], Any]) -> None:
    """Wait for every prompt's request, then answer with one merged completion."""
    waiters = [waiter_factory() for _ in admitted]

    def cancel_all() -> None:
        for w in waiters:
            w.cancel()

    watch = DisconnectWatch(receive, cancel_all)
    attached: list[tuple[Any, Any]] = []
    try:
        for a, w in zip(admitted, waiters):
            attached.append((await rt.service.attach(a.request_id, w, 0, a.record), w))
        ends: list[EndEvent] = list(await asyncio.gather(*(w.future for w in waiters)))
    except asyncio.CancelledError:
        if not watch.disconnected:
            raise
        return  # the client left; `finally` detaches, which cancels what still runs
    except PagewireError as e:
        await send_error(send, e)
        return
    finally:
        watch.stop()
        for stream, w in attached:
            rt.service.detach(stream, w)
    failed = next((e for e in ends if e.state != "finished"), None)
    if failed is not None:
        await send_error(send, end_error(failed))
        return
    parts = [rt.formatter.completion_response(e) for e in ends]
    choices = []
    for i, part in enumerate(parts):
        for c in part["choices"]:
            choices.append({**c, "index": i * n + c["index"]})
    body = {**parts[0], "choices": choices, "usage": _merge_usage([p["usage"] for p in parts])}
    ids = ",".join(e.request_id for e in ends)
    try:
        await send_json(send, 200, body, [(b"x-request-id", ids.encode())])
    except OSError:
        pass


async def stream(rt: "Runtime", send: Send, receive: Receive, admitted: list[Any], n: int,
                 include_usage: bool, end_error: Callable[[EndEvent], PagewireError]) -> None:
    """Stream every prompt's chunks as one SSE response; [DONE] after the last prompt ends."""
    outbox = Outbox(rt.settings.outbox_bytes)
    subs = [Subscription(outbox, a.request_id) for a in admitted]
    offset = {a.request_id: i * n for i, a in enumerate(admitted)}
    response_id = admitted[0].request_id
    watch = DisconnectWatch(receive, outbox.close)
    attached: list[tuple[Any, Subscription]] = []
    timeout = rt.settings.send_timeout
    ok = await send_with_timeout(send, {
        "type": "http.response.start", "status": 200,
        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                    (b"x-request-id", ",".join(a.request_id for a in admitted).encode())],
    }, timeout)
    try:
        if not ok:
            return
        for a, sub in zip(admitted, subs):
            attached.append((await rt.service.attach(a.request_id, sub, 0, a.record), sub))
        ends: dict[str, EndEvent] = {}
        while ok:
            batch = await outbox.get()
            if outbox.overflowed:
                for a in admitted:  # keep them running for an idempotent retry
                    job = rt.service.jobs.get(a.request_id)
                    if job is not None:
                        job.detached = True
                err = Unavailable("stream consumer too slow; retry with the same Idempotency-Key "
                                  "to fetch the result", code="slow_consumer")
                await send_with_timeout(send, _final(error_payload(err)), 1.0)
                return
            if not batch:
                return  # the client disconnected
            chunks: list[bytes] = []
            done = False
            for rid, ev in batch:
                if isinstance(ev, DeltaEvent):
                    chunk = rt.formatter.completion_chunk(response_id, ev, include_usage)
                    for c in chunk["choices"]:
                        c["index"] += offset[rid]
                    chunks.append(sse_bytes(chunk))
                elif isinstance(ev, EndEvent):
                    ends[rid] = ev
                    if ev.state != "finished":
                        chunks.append(sse_bytes(error_payload(end_error(ev))) + b"data: [DONE]\n\n")
                        done = True
                        break
                    if len(ends) == len(admitted):
                        if include_usage:
                            usage = rt.formatter.usage_chunk("completion", ends[response_id])
                            usage["usage"] = _merge_usage([
                                rt.formatter.usage_chunk("completion", e)["usage"] for e in ends.values()
                            ])
                            chunks.append(sse_bytes(usage))
                        chunks.append(b"data: [DONE]\n\n")
                        done = True
            ok = await send_with_timeout(send, {"type": "http.response.body", "body": b"".join(chunks),
                                                "more_body": not done}, timeout)
            if done:
                return
    finally:
        watch.stop()
        for s, sub in attached:
            rt.service.detach(s, sub)



def _final(payload: Any) -> dict[str, Any]:
    return {"type": "http.response.body", "body": sse_bytes(payload) + b"data: [DONE]\n\n", "more_body": False}
