"""Answering admitted generation requests in OpenAI's shapes: one JSON body, or one SSE stream.

A response covers one or more engine requests: chat and single-prompt completions are one;
a batched `prompt` (a list of strings or of token-id lists, as OpenAI's API and vLLM accept) is
one engine request per prompt, each with its own ledger row (an Idempotency-Key `K` becomes
`K#i` for prompt i), admitted in order; if one is refused, the ones already admitted are
cancelled and the refusal is returned naming `prompt[i]`. Choices are numbered
`prompt_index * n + sample_index`, as OpenAI numbers them, and usage is summed. A stream
interleaves the requests' chunks in the order the engine produced them, under one response id.

A client that disconnects detaches its subscriptions, which cancels what still runs (unless
another subscriber, such as an idempotent retry, still follows it).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

from server.api.context import ApiContext
from server.api.http_io import (
    DisconnectWatch,
    Receive,
    Send,
    error_payload,
    send_error,
    send_json,
    send_with_timeout,
    sse_bytes,
)
from server.api.tool_output import ChatToolStream
from server.api.tools import ToolPlan
from server.serving.errors import PagewireError, Unavailable
from server.serving.jobs import GenerationSpec
from server.serving.lifecycle import end_error as lifecycle_error
from server.serving.outbox import Outbox, Subscription
from server.serving.service import Admitted
from server.serving.streams import DeltaEvent, EndEvent, EndWaiter

MAX_BATCH = 64


def end_error(end: EndEvent) -> PagewireError:
    """The error a request that did not finish is reported as (also for idempotent retries)."""
    return lifecycle_error(end.request_id, end.reason, end.message)


async def admit_all(api: ApiContext, specs: list[GenerationSpec]) -> list[Admitted]:
    """Start every spec's request; all or none (earlier ones are cancelled on a refusal)."""
    admitted: list[Admitted] = []
    try:
        for i, spec in enumerate(specs):
            try:
                admitted.append(await api.service.start(spec))
            except PagewireError as e:
                # Say which prompt of the batch was refused: `prompt[2]: ...`.
                if len(specs) > 1 and (e.param == "prompt" or e.param is None):
                    e.message = f"prompt[{i}] of {len(specs)}: {e.message}"
                    e.args = (e.message,)
                raise
    except BaseException:
        for a in admitted:
            api.service.abandon(a)
        raise
    return admitted


def _merge_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    }
    total["completion_tokens_details"] = {
        "reasoning_tokens": sum(u["completion_tokens_details"]["reasoning_tokens"] for u in usages)
    }
    return total


async def whole(api: ApiContext, send: Send, receive: Receive, kind: str, admitted: list[Admitted], n: int,
                tools: Optional[ToolPlan] = None, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Wait for every request, then answer with one (merged) completion or chat completion;
    `tools` is a chat request's tool plan (its text is read for tool calls); `headers` go on the
    200 (the key's x-ratelimit-* as of its admission)."""
    waiters = [EndWaiter() for _ in admitted]

    def cancel_all() -> None:
        for w in waiters:
            w.cancel()

    watch = DisconnectWatch(receive, cancel_all)
    attached: list[tuple[Any, Any]] = []
    try:
        for a, w in zip(admitted, waiters):
            attached.append((await api.service.attach(a.request_id, w, 0, a.record), w))
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
        for stream_, w in attached:
            api.service.detach(stream_, w)
    failed = next((e for e in ends if not e.finished), None)
    if failed is not None:
        await send_error(send, end_error(failed))
        return
    fmt = api.formatter
    parts = [fmt.chat_response(e, tools) if kind == "chat" else fmt.completion_response(e) for e in ends]
    choices = [{**c, "index": i * n + c["index"]} for i, part in enumerate(parts) for c in part["choices"]]
    body = {**parts[0], "choices": choices, "usage": _merge_usage([p["usage"] for p in parts])}
    ids = ",".join(e.request_id for e in ends)
    try:
        await send_json(send, 200, body, [(b"x-request-id", ids.encode()), *headers])
    except OSError:
        pass


async def stream(api: ApiContext, send: Send, receive: Receive, kind: str, admitted: list[Admitted], n: int,
                 include_usage: bool, tools: Optional[ToolPlan] = None,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Stream every request's chunks as one SSE response; [DONE] after the last one ends.
    `headers` go on the response start (the key's x-ratelimit-* as of its admission)."""
    rt = api.rt
    outbox = Outbox(rt.settings.outbox_bytes)
    subs = [Subscription(outbox, a.request_id) for a in admitted]
    offset = {a.request_id: i * n for i, a in enumerate(admitted)}
    response_id = admitted[0].request_id
    # Tool-call parsing keeps state per choice across chunks, so it lives for the whole response.
    tool_stream = ChatToolStream(tools, response_id) if tools is not None and tools.active else None
    watch = DisconnectWatch(receive, outbox.close)
    attached: list[tuple[Any, Subscription]] = []
    timeout = rt.settings.send_timeout
    ok = await send_with_timeout(send, {
        "type": "http.response.start", "status": 200,
        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                    (b"x-request-id", ",".join(a.request_id for a in admitted).encode()), *headers],
    }, timeout)
    try:
        if not ok:
            return
        for a, sub in zip(admitted, subs):
            attached.append((await api.service.attach(a.request_id, sub, 0, a.record), sub))
        ends: dict[str, EndEvent] = {}
        seen: set[int] = set()  # choice indices that already had a chunk (chat sends the role first)
        while ok:
            batch = await outbox.get()
            if outbox.overflowed:
                # Stuck consumer: keep the requests running for an idempotent retry and stop here.
                for a in admitted:
                    api.service.keep_for_resume(a.request_id)
                rt.metrics.slow_consumers.labels(edge="sse").inc()
                err = Unavailable("stream consumer too slow; retry with the same Idempotency-Key "
                                  "to fetch the result", code="slow_consumer")
                await send_with_timeout(send, _final(error_payload(err)), 1.0)
                return
            if not batch:
                return  # the client disconnected
            chunks: list[bytes] = []
            done = False
            for rid, ev in batch:
                done = _render(api, kind, str(rid), ev, response_id, offset, seen, ends, len(admitted),
                               include_usage, chunks, tool_stream)
                if done:
                    break
            ok = await send_with_timeout(send, {"type": "http.response.body", "body": b"".join(chunks),
                                                "more_body": not done}, timeout)
            if done:
                return
    finally:
        watch.stop()
        for s, sub in attached:
            api.service.detach(s, sub)


def _render(api: ApiContext, kind: str, rid: str, ev: object, response_id: str, offset: dict[str, int],
            seen: set[int], ends: dict[str, EndEvent], total: int, include_usage: bool,
            out: list[bytes], tool_stream: Optional[ChatToolStream] = None) -> bool:
    """Append SSE bytes for one event; True once the response is complete."""
    fmt = api.formatter
    if isinstance(ev, DeltaEvent):
        index = offset[rid] + ev.index
        if kind == "chat":
            chunk = fmt.chat_chunk(response_id, ev, index not in seen, include_usage, tool_stream)
        else:
            chunk = fmt.completion_chunk(response_id, ev, include_usage)
        for c in chunk["choices"]:
            c["index"] = index
        seen.add(index)
        out.append(sse_bytes(chunk))
        return False
    if not isinstance(ev, EndEvent):
        return False
    ends[rid] = ev
    if not ev.finished:
        out.append(sse_bytes(error_payload(end_error(ev))) + b"data: [DONE]\n\n")
        return True
    if len(ends) < total:
        return False
    if include_usage:
        usage = fmt.usage_chunk(kind, ends[response_id])
        usage["usage"] = _merge_usage([fmt.usage_chunk(kind, e)["usage"] for e in ends.values()])
        out.append(sse_bytes(usage))
    out.append(b"data: [DONE]\n\n")
    return True


def _final(payload: Any) -> dict[str, Any]:
    return {"type": "http.response.body", "body": sse_bytes(payload) + b"data: [DONE]\n\n", "more_body": False}
