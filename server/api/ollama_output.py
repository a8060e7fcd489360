"""Ollama's answers: a finished request as /api/chat's or /api/generate's whole response, a
streamed one as the lines of a newline-delimited JSON stream (`NdjsonStream`, a
follow.StreamRenderer), and the empty request's load/unload answer. Tool calls are read from the
text in the model's own call format (the request's ToolPlan) and written as Ollama writes them
(no ids, arguments as an object); `logprobs` per token with its text; the timing fields
(`total_duration`, `eval_count`, ...) from the edge's clock (`Timing`). The request side is
ollama_format.py.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import msgspec

from server.api.format_common import call_arguments, piece_parser
from server.api.ollama_format import KeepAlive, ollama_error, unloads
from server.api.tools import ToolPlan
from server.engine.outputs import TokenLogprob
from server.serving.errors import PagewireError
from server.serving.jobs import logprobs_from_stored
from server.serving.lifecycle import end_error
from server.serving.streams import DeltaEvent, EndEvent
from server.text.tool_parsers import ArgsDelta, CallStart, Content, Piece, ToolCallParser


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def done_reason(sample: dict[str, Any]) -> str:
    return "length" if sample.get("finish_reason") == "length" else "stop"


class Timing:
    """Wall-clock nanoseconds at the edge: arrival, first output, end (Ollama's *_duration)."""

    def __init__(self, start_ns: int) -> None:
        self.start_ns = start_ns
        self.first_ns: Optional[int] = None

    def stats(self, end: EndEvent, end_ns: int) -> dict[str, Any]:
        first = self.first_ns if self.first_ns is not None else end_ns
        return {"total_duration": end_ns - self.start_ns, "load_duration": 0,
                "prompt_eval_count": end.usage.prompt_tokens, "prompt_eval_duration": first - self.start_ns,
                "eval_count": end.usage.completion_tokens, "eval_duration": end_ns - first}


def ollama_calls(names_args: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Calls as Ollama writes them: no ids, arguments as an object."""
    return [{"function": {"name": n, "arguments": call_arguments(a) or {}}} for n, a in names_args]


def _read(plan: Optional[ToolPlan], text: str) -> tuple[str, list[tuple[str, str]]]:
    parser = piece_parser(plan)
    content: list[str] = []
    calls: list[list[str]] = []
    for p in parser.feed(text) + parser.finish():
        if isinstance(p, Content):
            content.append(p.text)
        elif isinstance(p, CallStart):
            calls.append([p.name, p.arguments])
        elif isinstance(p, ArgsDelta):
            calls[p.index][1] += p.text
    return "".join(content), [(n, a) for n, a in calls]


TokenText = Callable[[int], str]


def logprobs_list(lps: Optional[list[TokenLogprob]], token_text: TokenText) -> Optional[list[dict[str, Any]]]:
    """Ollama's `logprobs`: per generated token its text, logprob and the top alternatives."""
    if lps is None:
        return None
    return [{"token": token_text(lp.token_id), "logprob": lp.logprob,
             "top_logprobs": [{"token": token_text(t), "logprob": v} for t, v in lp.top]} for lp in lps]


def _with_logprobs(body: dict[str, Any], sample: dict[str, Any], token_text: TokenText) -> dict[str, Any]:
    lps = logprobs_list(logprobs_from_stored(sample.get("logprobs")), token_text)
    if lps is not None:
        body["logprobs"] = lps
    return body


def chat_body(model: str, end: EndEvent, plan: Optional[ToolPlan], stats: dict[str, Any],
              token_text: TokenText) -> dict[str, Any]:
    sample = (end.output or {}).get("samples", [{}])[0]
    content, calls = _read(plan, sample.get("text", ""))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = ollama_calls(calls)
    return _with_logprobs({"model": model, "created_at": created_at(), "message": message,
                           "done_reason": done_reason(sample), "done": True, **stats}, sample, token_text)


def generate_body(model: str, end: EndEvent, stats: dict[str, Any], token_text: TokenText) -> dict[str, Any]:
    sample = (end.output or {}).get("samples", [{}])[0]
    return _with_logprobs({"model": model, "created_at": created_at(), "response": sample.get("text", ""),
                           "done_reason": done_reason(sample), "done": True, **stats}, sample, token_text)


def load_body(model: str, kind: str, keep_alive: KeepAlive) -> dict[str, Any]:
    """An empty request: Ollama's way to load (or, with keep_alive 0, unload) a model."""
    body: dict[str, Any] = {"model": model, "created_at": created_at()}
    if kind == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    body.update(done_reason="unload" if unloads(keep_alive) else "load", done=True)
    return body


_enc = msgspec.json.Encoder()


def ndjson(obj: Any) -> bytes:
    """One line of a newline-delimited JSON stream."""
    return _enc.encode(obj) + b"\n"


class NdjsonStream:
    """The lines of one streamed /api/chat or /api/generate response (a follow.StreamRenderer)."""

    def __init__(self, model: str, kind: str, plan: Optional[ToolPlan], timing: Timing, clock: Any,
                 token_text: TokenText) -> None:
        self.token_text = token_text
        self.model = model
        self.kind = kind
        self.timing = timing
        self.clock = clock
        self.parser: ToolCallParser = piece_parser(plan)
        self.calls: list[list[str]] = []
        self.finished_parsing = False

    def start(self) -> bytes:
        return b""

    def _line(self, text: str, done: bool = False, **extra: Any) -> bytes:
        body: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.kind == "chat":
            body["message"] = {"role": "assistant", "content": text, **extra.pop("message", {})}
        else:
            body["response"] = text
        body["done"] = done
        body.update(extra)
        return ndjson(body)

    def _content(self, pieces: list[Piece]) -> str:
        out: list[str] = []
        for p in pieces:
            if isinstance(p, Content):
                out.append(p.text)
            elif isinstance(p, CallStart):
                self.calls.append([p.name, p.arguments])
            elif isinstance(p, ArgsDelta):
                self.calls[p.index][1] += p.text
        return "".join(out)

    def delta(self, ev: DeltaEvent) -> bytes:
        if self.timing.first_ns is None:
            self.timing.first_ns = self.clock()
        pieces = self.parser.feed(ev.text)
        if ev.finish_reason is not None and not self.finished_parsing:
            self.finished_parsing = True
            pieces += self.parser.finish()
        text = self._content(pieces)
        # A token's logprobs go on the line of its delta, even while a possible call holds its text.
        lps = logprobs_list(ev.logprobs, self.token_text)
        if lps:
            return self._line(text, logprobs=lps)
        return self._line(text) if text else b""

    def end(self, ev: EndEvent) -> bytes:
        if not ev.finished:
            return self.error(end_error(ev.request_id, ev.reason, ev.message))
        out: list[bytes] = []
        if not self.finished_parsing:
            self.finished_parsing = True
            text = self._content(self.parser.finish())
            if text:
                out.append(self._line(text))
        if self.calls:  # Ollama sends each call whole, in a chunk of its own before the last
            out.append(self._line("", message={"tool_calls": ollama_calls([(n, a) for n, a in self.calls])}))
        sample = (ev.output or {}).get("samples", [{}])[0]
        out.append(self._line("", True, done_reason=done_reason(sample), **self.timing.stats(ev, self.clock())))
        return b"".join(out)

    def error(self, err: PagewireError) -> bytes:
        return ndjson(ollama_error(err))
