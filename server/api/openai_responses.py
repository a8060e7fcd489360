"""Answering admitted generation requests in OpenAI's shapes: one JSON body, or one SSE stream.

A response covers one or more engine requests: chat and single-prompt completions are one;
a batched `prompt` (a list of strings or of token-id lists, as OpenAI's API and vLLM accept) is
one engine request per prompt, each with its own ledger row (an Idempotency-Key `K` becomes
`K#i` for prompt i), admitted in order; if one is refused, the ones already admitted are
cancelled and the refusal is returned naming `prompt[i]`. Choices are numbered
`prompt_index * n + sample_index`, as OpenAI numbers them, and usage is summed. A stream
interleaves the requests' chunks in the order the engine produced them, under one response id.

Following the requests (waiting, streaming, a client that disconnects detaching and so cancelling
what still runs) is server.api.follow's, as for every API; only the shapes are this module's.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from server.api.context import ApiContext
from server.api.follow import follow_streams, wait_ends
from server.api.http_io import Receive, Send, error_payload, send_error, send_json, sse_bytes
from server.api.tool_output import ChatToolStream
from server.api.tools import ToolPlan
from server.serving.errors import PagewireError
from server.serving.jobs import GenerationSpec
from server.serving.lifecycle import end_error as lifecycle_error
from server.serving.service import Admitted
from server.serving.streams import DeltaEvent, EndEvent

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
    try:
        got = await wait_ends(api, receive, admitted)
    except PagewireError as e:
        await send_error(send, e)
        return
    if got is None:
        return  # the client left; what still ran was cancelled
    ends = got
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
    await follow_streams(api, send, receive, admitted, b"text/event-stream",
                         _ChunkStream(api, kind, admitted, n, include_usage, tools), "sse", headers)


class _ChunkStream:
    """OpenAI's SSE chunks for one (possibly batched) response: the EventsRenderer that
    `follow_streams` drives. Choice indices are offset per prompt; [DONE] follows the last end."""

    def __init__(self, api: ApiContext, kind: str, admitted: list[Admitted], n: int, include_usage: bool,
                 tools: Optional[ToolPlan]) -> None:
        self.fmt = api.formatter
        self.kind = kind
        self.include_usage = include_usage
        self.offset = {a.request_id: i * n for i, a in enumerate(admitted)}
        self.total = len(admitted)
        self.response_id = admitted[0].request_id
        # Tool-call parsing keeps state per choice across chunks, so it lives for the whole response.
        self.tool_stream = ChatToolStream(tools, self.response_id) if tools is not None and tools.active else None
        self.seen: set[int] = set()  # choice indices that already had a chunk (chat sends the role first)
        self.ends: dict[str, EndEvent] = {}

    def start(self) -> bytes:
        return b""

    def delta(self, request_id: str, ev: DeltaEvent) -> bytes:
        index = self.offset[request_id] + ev.index
        if self.kind == "chat":
            chunk = self.fmt.chat_chunk(self.response_id, ev, index not in self.seen, self.include_usage,
                                        self.tool_stream)
        else:
            chunk = self.fmt.completion_chunk(self.response_id, ev, self.include_usage)
        for c in chunk["choices"]:
            c["index"] = index
        self.seen.add(index)
        return sse_bytes(chunk)

    async def end(self, request_id: str, ev: EndEvent) -> tuple[bytes, bool]:
        self.ends[request_id] = ev
        if not ev.finished:
            return sse_bytes(error_payload(end_error(ev))) + _DONE, True
        if len(self.ends) < self.total:
            return b"", False
        out = b""
        if self.include_usage:
            usage = self.fmt.usage_chunk(self.kind, self.ends[self.response_id])
            usage["usage"] = _merge_usage([self.fmt.usage_chunk(self.kind, e)["usage"] for e in self.ends.values()])
            out = sse_bytes(usage)
        return out + _DONE, True

    def error(self, err: PagewireError) -> bytes:
        return sse_bytes(error_payload(err)) + _DONE


_DONE = b"data: [DONE]\n\n"
