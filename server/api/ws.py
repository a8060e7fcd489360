"""One /v1/ws WebSocket connection: many requests multiplexed on one socket (see docs/websocket.md).

Each connection has two tasks. The reader parses client frames and starts each `generate` in
its own task (admission awaits the ledger commit, and one slow admission must not block the
socket's other requests). The writer is the only task that sends: it drains the connection's
Outbox, so frames of one request keep their order (accepted → deltas → done), and a slow client
is paced: a resume's replay, or a request whose backlog passes the outbox's bound, is pulled from
the request's resume buffer as the socket drains (see `server.serving.streams`). The writer also
sends the connection's pings (see `ws_watchdog`, which owns liveness). If one send stays blocked
past `send_timeout`, a ping goes unanswered that long, the transport stays paused that long, or
control frames alone overflow the outbox, the connection is cut: a resumable `slow_consumer`
error, close 1013, and its requests keep running for a later `resume`.

Closing the socket cancels its requests, except those generated with `detach: true`.

The caller is authenticated at the upgrade (`gateway.auth.AuthGuard`) and re-checked on every
`generate` and `resume` and once a second (`ws_endpoint.WsEndpoint._recheck_keys`): a revoked or expired key,
or a key-less socket once auth has turned on, gets an `invalid_api_key` error and close 1008,
and every request it started is cancelled, detached ones included (no one may resume them).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import msgspec

from server import heap
from server.api import ws_watchdog
from server.api.context import ApiContext
from server.api.decode import convert, parse_json
from server.api.embeddings_format import ws_embedding_spec
from server.api.openai_format import ws_spec
from server.api.protocol import CLIENT_FRAMES, CancelFrame, GenerateFrame, ResumeFrame
from server.api.tool_output import ChatToolStream
from server.api.tools import ToolPlan, plan_request
from server.gateway.auth import bind, principal_of, ws_subprotocol
from server.serving.errors import InvalidRequest, PagewireError, TooLarge
from server.serving.jobs import GenerationSpec
from server.serving.outbox import Outbox, Subscription
from server.serving.streams import DeltaEvent, EndEvent, RequestStream

log = logging.getLogger("pagewire.ws")
_enc = msgspec.json.Encoder()

CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013


@dataclass
class Frame:
    """A control frame (accepted, error) queued behind a request's earlier frames."""

    data: dict[str, Any]


@dataclass(eq=False)
class _Alias:
    request_id: Optional[str]
    sub: Optional[Subscription] = None
    stream: Optional[RequestStream] = None
    cancel_requested: bool = False


def resumable_requests(aliases: dict[str, _Alias], unsent_ends: dict[tuple[str, str], None]) -> list[dict[str, str]]:
    """What a cut connection's client can resume: every request still live on it, and every
    ended one whose terminal frame had not been written, each once, live ones first."""
    out = [{"id": cid, "request_id": a.request_id} for cid, a in aliases.items() if a.request_id]
    seen = {r["request_id"] for r in out}
    out += [{"id": cid, "request_id": rid} for cid, rid in unsent_ends if rid not in seen]
    return out


class Endpoint(Protocol):
    """What a connection needs of its endpoint (ws_endpoint.WsEndpoint, which imports this module):
    the API's shared state, and to be told when the socket joins and leaves."""

    api: ApiContext

    def joined(self, conn: "WsConnection") -> None: ...

    def left(self, conn: "WsConnection") -> None: ...


class WsConnection:
    def __init__(self, endpoint: Endpoint, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.endpoint = endpoint
        self.api = endpoint.api
        self.rt = endpoint.api.rt
        self.scope = scope
        self._receive = receive
        self._send = send
        self.outbox = Outbox(self.rt.settings.outbox_bytes)
        self.aliases: dict[str, _Alias] = {}  # client id → request on this socket
        self._model_of: dict[str, str] = {}  # client id → the model its generate frame named
        # Chat requests with tools (tool_choice not none): their deltas' text is read for tool
        # calls, as SSE chunks are (server.api.tool_output), until their terminal frame is written.
        self._tool_streams: dict[str, ChatToolStream] = {}
        # Requests that have ended but whose terminal frame the writer has not yet written to the
        # socket: an alias goes when its end is *queued*, so a cut must still name these (their
        # `done`, and maybe deltas, were lost with the connection) for the client to resume them.
        self._unsent_ends: dict[tuple[str, str], None] = {}
        self.close_code = 1000
        self._client_gone = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cutting: Optional[asyncio.Task[None]] = None  # the slow-consumer close, once begun
        self._cut_reason: Optional[str] = None  # set by request_cut; the writer performs the cut
        self._cut_asked = asyncio.Event()
        client = scope.get("client")
        self.peer = str(client[0]) if client else "unknown"
        self.principal = principal_of(scope)  # the caller (None: auth off), re-checked (check_auth)
        self._revoked = False

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        msg = await self._receive()
        if msg["type"] != "websocket.connect":
            return
        accept: dict[str, Any] = {"type": "websocket.accept"}
        sub = ws_subprotocol(self.scope)  # browsers send their key as a subprotocol (gateway.auth)
        if sub is not None:
            accept["subprotocol"] = sub
        await self._send(accept)
        self.endpoint.joined(self)
        s = self.rt.settings
        self.liveness = ws_watchdog.Liveness(self.scope.get(ws_watchdog.SCOPE_KEY), s.send_timeout,
                                             s.ws_ping_interval, self.peer, self.request_cut)
        writer = asyncio.get_running_loop().create_task(self._writer())
        watchdog = asyncio.get_running_loop().create_task(self.liveness.watch())
        try:
            while True:
                msg = await self._receive()
                if msg["type"] == "websocket.disconnect":
                    self._client_gone = True
                    break
                text = msg.get("text")
                if text is None:
                    self._error(None, "invalid_request", "binary frames are not supported; send JSON text")
                    continue
                self._on_text(text)
        finally:
            watchdog.cancel()
            self.endpoint.left(self)
            for t in list(self._tasks):
                t.cancel()
            # Leaving cancels every request of this socket that was not started with detach.
            for alias in list(self.aliases.values()):
                if alias.sub is not None:
                    self.api.service.detach(alias.stream, alias.sub)
            self.aliases.clear()
            self.outbox.close()
            await writer

    def check_auth(self, refresh: bool = True) -> bool:
        """Whether this socket's caller may still act; if not, close it (see module)."""
        auth = self.api.gateway.auth
        if self._revoked:
            return False
        if auth is None:
            return True
        try:
            self.principal = auth.recheck(self.principal, refresh)
        except PagewireError as e:
            self._revoke(e)
            return False
        return True

    def _revoke(self, e: PagewireError) -> None:
        self._revoked = True
        log.info("ws %s: %s; closing with %d", self.peer, e.message, CLOSE_POLICY_VIOLATION)
        for alias in list(self.aliases.values()):
            if alias.request_id is not None:
                self.api.service.cancel(alias.request_id)
            else:
                alias.cancel_requested = True  # still being admitted
        self.outbox.push(("err", None), Frame({"type": "error", "code": e.code, "status": e.status,
                                              "message": e.message}))
        self.shutdown(CLOSE_POLICY_VIOLATION)

    def shutdown(self, code: int = CLOSE_GOING_AWAY) -> None:
        """Server stopping: flush what is queued, then close with `code`."""
        self.close_code = code
        self.outbox.close()

    def request_cut(self, why: str) -> None:
        """Cut this consumer as stuck (see `ws_watchdog`). The writer does it: it is the only task
        that writes, and it may be blocked in a send that must be abandoned first."""
        if self._cut_reason is None:
            self._cut_reason = why
            self._cut_asked.set()

    # -- writer ---------------------------------------------------------------------------------
    async def _writer(self) -> None:
        loop = asyncio.get_running_loop()
        cut_asked = loop.create_task(self._cut_asked.wait())
        get: Optional[asyncio.Task[Any]] = None
        try:
            while True:
                if get is None:
                    get = loop.create_task(self.outbox.get())
                await asyncio.wait({get, cut_asked}, timeout=self._ping_wait(),
                                   return_when=asyncio.FIRST_COMPLETED)
                if self._cut_reason is not None:
                    await self._stuck(self._cut_reason)
                    return
                if not get.done():  # a ping is due and nothing to send
                    if not await self._send_bounded(self.liveness.ping(), cut_asked):
                        return
                    continue
                batch, get = get.result(), None
                if self.outbox.overflowed:
                    await self._stuck("its buffer is full")
                    return
                for key, ev in batch:
                    if self._client_gone:
                        return
                    msg = {"type": "websocket.send", "text": self._render(key, ev)}
                    if not await self._send_bounded(self._send(msg), cut_asked):
                        return
                    if isinstance(ev, EndEvent):
                        self._unsent_ends.pop((str(key), ev.request_id), None)
                    wait = self._ping_wait()
                    if wait is not None and wait <= 0:  # a busy socket is pinged too
                        if not await self._send_bounded(self.liveness.ping(), cut_asked):
                            return
                if not batch and self.outbox.closed:
                    break
            if not self._client_gone:
                await self._send({"type": "websocket.close", "code": self.close_code})
        except (OSError, RuntimeError, AssertionError):  # the peer vanished mid-send
            self._client_gone = True
        except asyncio.CancelledError:
            raise
        finally:
            cut_asked.cancel()
            if get is not None:
                get.cancel()

    def _ping_wait(self) -> Optional[float]:
        wait = self.liveness.ping_delay()
        return None if wait is None else max(0.0, wait)

    async def _send_bounded(self, send: Any, cut_asked: "asyncio.Task[Any]") -> bool:
        """Run one send (a frame or a ping) until it completes (True), or until it has stayed
        blocked for `send_timeout` or a cut is asked for: then abandon it, cut, and return False."""
        timeout = self.rt.settings.send_timeout
        task = asyncio.get_running_loop().create_task(send)
        try:
            await asyncio.wait({task, cut_asked}, timeout=timeout if timeout > 0 else None,
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            exc = task.exception()
            if isinstance(exc, asyncio.TimeoutError):  # the ASGI server's own send timeout
                await self._stuck(f"a send stayed blocked for {timeout:g}s")
                return False
            if exc is not None:
                raise exc
            return True
        # Abandon the blocked send: its frame is already in the transport's buffer whole (the
        # protocol writes a frame before it waits for the drain), so nothing is torn.
        task.cancel()
        await asyncio.wait({task})
        await self._stuck(self._cut_reason or f"a send stayed blocked for {timeout:g}s")
        return False

    async def _stuck(self, why: str) -> None:
        """Close a consumer that cannot keep up; its requests keep running for `resume`."""
        self.liveness.cutting()
        resumable = resumable_requests(self.aliases, self._unsent_ends)
        for r in resumable:
            self.api.service.keep_for_resume(r["request_id"])
        frame = {"type": "error", "code": "slow_consumer", "resumable": True,
                 "message": f"connection closed because the client is not reading fast enough ({why}); "
                            "reconnect and resume each request from the last seq received",
                 "requests": resumable}
        log.warning("ws %s: slow consumer (%s); closing with %d", self.peer, why, CLOSE_TRY_AGAIN_LATER)
        self.rt.metrics.slow_consumers.labels(edge="ws").inc()
        # The error frame and the close are written in one task that is never cancelled: a send
        # cancelled half-way (its bytes queued, the close handshake not begun) would leave the
        # socket open for good. The writer waits a moment for it; the rest happens as soon as
        # the client reads again (within `send_timeout`: then the watchdog aborts the transport).
        self._cutting = asyncio.get_running_loop().create_task(self._cut(_enc.encode(frame).decode()))
        try:
            await asyncio.wait_for(asyncio.shield(self._cutting), 2.0)
        except asyncio.TimeoutError:
            pass

    async def _cut(self, text: str) -> None:
        try:
            await self._send({"type": "websocket.send", "text": text})
            await self._send({"type": "websocket.close", "code": CLOSE_TRY_AGAIN_LATER})
        except (OSError, RuntimeError, AssertionError):
            # AssertionError: the protocol's reader was itself waiting on the drain (answering a
            # ping flood); the watchdog aborts the transport after the client's window.
            pass

    def _render(self, key: Any, ev: Any) -> str:
        cid = key
        if isinstance(ev, Frame):
            return _enc.encode(ev.data).decode()
        tools = self._tool_streams.get(cid)
        if isinstance(ev, DeltaEvent):
            d: dict[str, Any] = {"type": "delta", "id": cid, "seq": ev.seq, "index": ev.index,
                                 "text": ev.text, "token_ids": ev.token_ids}
            finish = ev.finish_reason
            if tools is not None:  # calls leave the text and come as `tool_calls` (docs/websocket.md)
                fields, finish = tools.delta(ev.index, ev.text, ev.finish_reason)
                d["text"] = fields.get("content", "")
                if "tool_calls" in fields:
                    d["tool_calls"] = fields["tool_calls"]
            if ev.reasoning:  # the model's thinking (a reasoning parser is on: docs/reasoning.md)
                d["reasoning_content"] = ev.reasoning
            if finish is not None:
                d["finish_reason"] = finish
            if ev.logprobs is not None:
                tt = self.api.for_model(self._model_of.get(cid)).formatter.token_text
                d["logprobs"] = [{"token_id": lp.token_id, "token": tt(lp.token_id), "logprob": lp.logprob,
                                  "top_logprobs": [{"token_id": t, "token": tt(t), "logprob": v} for t, v in lp.top]}
                                 for lp in ev.logprobs]
            return _enc.encode(d).decode()
        assert isinstance(ev, EndEvent)
        u = ev.usage
        usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                 "total_tokens": u.total_tokens, "cached_tokens": u.cached_tokens,
                 "reasoning_tokens": u.reasoning_tokens}
        rule = ev.rule
        if tools is not None:
            del self._tool_streams[cid]
        self._model_of.pop(cid, None)  # its last frame: a later request may reuse the id
        if rule.ws_frame == "done":
            reasons: list[Optional[str]] = list(ev.finish_reasons)
            if rule.ws_finish_reason is not None:
                reasons = [rule.ws_finish_reason] * len(reasons)
            elif tools is not None:
                reasons = [tools.finish_reason(i, r) for i, r in enumerate(reasons)]
            vector = (ev.output or {}).get("embedding")  # an embedding request's (kept with its output)
            return _enc.encode({"type": "done", "id": cid, "request_id": ev.request_id,
                                "finish_reason": reasons[0] if reasons else None, "finish_reasons": reasons,
                                "usage": usage, "last_seq": ev.last_seq,
                                **({"embedding": vector} if vector is not None else {})}).decode()
        return _enc.encode({"type": "error", "id": cid, "request_id": ev.request_id, "code": ev.code,
                            "message": ev.message, "usage": usage, "last_seq": ev.last_seq}).decode()

    # -- reader ---------------------------------------------------------------------------------
    def _error(self, cid: Optional[str], code: str, message: str, param: Optional[str] = None,
               retry_after_s: Optional[float] = None) -> None:
        frame: dict[str, Any] = {"type": "error", "code": code, "message": message}
        if cid is not None:
            frame["id"] = cid
        if param is not None:
            frame["param"] = param
        if retry_after_s is not None:
            frame["retry_after_ms"] = int(retry_after_s * 1000)
        self.outbox.push(("err", cid), Frame(frame))

    def _on_text(self, text: str) -> None:
        limit = self.rt.settings.max_request_bytes
        if len(text) > limit or (len(text) * 4 > limit and len(text.encode("utf-8")) > limit):
            e = TooLarge(f"message exceeds the limit of {limit} bytes")
            self._error(None, "message_too_large", e.message)
            return
        cid: Optional[str] = None
        try:
            obj = parse_json(text)
            if isinstance(obj, dict) and isinstance(obj.get("id"), str):
                cid = obj["id"]
            ftype = obj.get("type") if isinstance(obj, dict) else None
            # A non-string type (a list, an object) must be a 400 too, not a TypeError from `in`.
            if not isinstance(ftype, str) or ftype not in CLIENT_FRAMES:
                raise InvalidRequest(
                    f"type: unknown frame type {ftype!r}; expected one of {', '.join(CLIENT_FRAMES)}",
                    param="type", code="unknown_frame_type")
            frame = convert(obj, CLIENT_FRAMES[ftype])
            if self._revoked or (isinstance(frame, (GenerateFrame, ResumeFrame)) and not self.check_auth()):
                return  # closing with 1008 (see check_auth)
            if isinstance(frame, GenerateFrame):
                self._on_generate(frame)
            elif isinstance(frame, CancelFrame):
                self._on_cancel(frame)
            elif isinstance(frame, ResumeFrame):
                self._on_resume(frame)
        except PagewireError as e:
            self._error(cid, e.code, e.message, e.param, e.retry_after_s)
        except Exception as e:  # a bug must cost this frame, never the socket and its live requests
            log.exception("ws %s: handling a frame failed", self.peer)
            self._error(cid, "internal_error", f"internal error: {e}")

    def _claim(self, cid: str, request_id: Optional[str]) -> _Alias:
        if cid in self.aliases:
            raise InvalidRequest(f"id: {cid!r} is already in use on this connection", param="id",
                                 code="duplicate_id")
        alias = _Alias(request_id)
        self.aliases[cid] = alias
        return alias

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_generate(self, f: GenerateFrame) -> None:
        api = self.api.for_model(f.model)  # 404 model_not_found for an unknown name
        if f.model is not None:
            self._model_of[f.id] = f.model
        plan: Optional[ToolPlan] = None
        if f.kind == "embedding":
            spec = ws_embedding_spec(f, self.peer, api.model_name)
        else:
            if f.kind == "chat" and f.tools is not None:
                plan = plan_request(f.tools, f.tool_choice, f.parallel_tool_calls, api.tool_parser,
                                    api.tool_marker_special)
            spec = ws_spec(f, self.peer, api.model_name, plan)
        bind(spec, self.principal)
        alias = self._claim(f.id, None)
        if plan is not None and plan.active:
            self._tool_streams[f.id] = ChatToolStream(plan, f.id)
        self._spawn(self._generate(f.id, alias, spec))

    async def _generate(self, cid: str, alias: _Alias, spec: GenerationSpec) -> None:
        tools = self._tool_streams.get(cid)
        try:
            admitted = await self.api.service.start(spec)
        except PagewireError as e:
            self._drop_tools(cid, tools)
            if self.aliases.get(cid) is alias:
                del self.aliases[cid]
            if e.status == 429:
                self.rt.metrics.rejected.labels(code=e.code).inc()
            self._error(cid, e.code, e.message, e.param, e.retry_after_s)
            heap.release_frames(e)  # the prompt, held in cycles through the traceback
            return
        except Exception as e:  # a bug or a broken ledger: the client still hears about its id
            log.exception("admitting a request failed")
            self._drop_tools(cid, tools)
            if self.aliases.get(cid) is alias:
                del self.aliases[cid]
            self._error(cid, "internal_error", f"internal error: {e}")
            return
        if self.aliases.get(cid) is not alias:  # the socket closed while we were admitting
            self._drop_tools(cid, tools)
            self.api.service.abandon(admitted)
            return
        if tools is not None:
            tools.request_id = admitted.request_id  # call ids derive from it, as over HTTP
        await self._follow(cid, alias, admitted.request_id, 0, admitted.record)
        if alias.cancel_requested:
            self.api.service.cancel(admitted.request_id)

    def _drop_tools(self, cid: str, tools: Optional[ChatToolStream]) -> None:
        self._model_of.pop(cid, None)
        if tools is not None and self._tool_streams.get(cid) is tools:
            del self._tool_streams[cid]

    async def _follow(self, cid: str, alias: _Alias, request_id: str, after_seq: int, record: Any) -> None:
        alias.request_id = request_id

        def accepted() -> None:
            # Queued before any delta of this id, so the client always sees `accepted` first.
            self.outbox.push(cid, Frame({"type": "accepted", "id": cid, "request_id": request_id}))

        def ended(end: EndEvent) -> None:
            # Called when the end is queued (or replayed), not yet written: see `_unsent_ends`.
            self._unsent_ends[(cid, end.request_id)] = None
            if self.aliases.get(cid) is alias:
                del self.aliases[cid]

        alias.sub = Subscription(self.outbox, cid, on_end=ended)
        try:
            alias.stream = await self.api.service.attach(request_id, alias.sub, after_seq, record, accepted,
                                                         caller=self.principal)
        except PagewireError as e:
            if self.aliases.get(cid) is alias:
                del self.aliases[cid]
            self._error(cid, e.code, e.message, e.param)

    def _on_cancel(self, f: CancelFrame) -> None:
        alias = self.aliases.get(f.id)
        if alias is None:
            raise InvalidRequest(f"id: no active request {f.id!r} on this connection", param="id",
                                 code="request_not_found")
        if alias.request_id is None:
            alias.cancel_requested = True  # still being admitted; cancel once accepted
            return
        self.api.service.cancel(alias.request_id)

    def _on_resume(self, f: ResumeFrame) -> None:
        cid = f.id or f.request_id
        alias = self._claim(cid, f.request_id)
        self._spawn(self._follow(cid, alias, f.request_id, f.after_seq, None))
