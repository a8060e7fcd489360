"""Anthropic's Messages API answers: a finished request as a `message` body, or a stream as
Anthropic's events (the request side is server.api.anthropic_format).

Text and tool calls are read from the sample's answer by the request's tool parser
(server.text.tool_parsers), as the OpenAI edge does, into `text` and `tool_use` blocks. With
`thinking` on and a reasoning parser (docs/reasoning.md), the model's thinking comes first as a
`thinking` block: `{"type": "thinking", "thinking", "signature"}`. Its `signature` is the
base64 SHA-256 of the thinking text: Anthropic's is an opaque encrypted check that the SDK only
carries back; pagewire's is a plain digest, and pagewire does not check the ones sent back (earlier
turns' thinking is dropped from the prompt, as Qwen3's template drops it). A stream is Anthropic's
event sequence: message_start, then per block content_block_start / content_block_delta
(thinking_delta, then one signature_delta before the block stops; text_delta; input_json_delta) /
content_block_stop, a ping after the first block starts, then message_delta (stop_reason,
stop_sequence, usage) and message_stop. `output_tokens` counts the thinking too, as Anthropic's
does.
"""
from __future__ import annotations

import base64
import hashlib
from typing import Any, Optional

import msgspec

from server.api.anthropic_format import anthropic_error
from server.api.format_common import call_arguments, piece_parser
from server.api.tools import ToolPlan, call_id
from server.serving.errors import PagewireError
from server.serving.lifecycle import end_error
from server.serving.streams import DeltaEvent, EndEvent, Usage
from server.text.tool_parsers import ArgsDelta, CallStart, Content, Piece, ToolCallParser


def thinking_signature(thinking: str) -> str:
    """The `signature` of a thinking block: a digest of its text (see the module docstring)."""
    return base64.b64encode(hashlib.sha256(thinking.encode("utf-8")).digest()).decode("ascii")


def message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("req-")


def tool_use_id(request_id: str, call: int) -> str:
    """Derived from the request, as OpenAI call ids are, so an idempotent retry sees the same ids."""
    return "toolu_" + call_id(request_id, 0, call).removeprefix("call_")


def usage_dict(u: Usage) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the (prefix) cache apart from the rest."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def stop_fields(sample: dict[str, Any], made_calls: bool, stop_sequences: Optional[list[str]]
                ) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) of the finished sample."""
    reason = sample.get("finish_reason")
    if reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    matched = sample.get("stop_reason")
    if isinstance(matched, str) and stop_sequences and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


class _Blocks:
    """A sample's pieces as Anthropic content blocks (text and tool_use), in order."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.blocks: list[dict[str, Any]] = []
        self._args: list[str] = []  # per tool_use block, its arguments text so far

    @property
    def calls(self) -> int:
        return len(self._args)

    def add(self, pieces: list[Piece]) -> None:
        for p in pieces:
            if isinstance(p, Content):
                if self.blocks and self.blocks[-1]["type"] == "text":
                    self.blocks[-1]["text"] += p.text
                else:
                    self.blocks.append({"type": "text", "text": p.text})
            elif isinstance(p, CallStart):
                self.blocks.append({"type": "tool_use", "id": tool_use_id(self.request_id, p.index),
                                    "name": p.name, "input": {}})
                self._args.append(p.arguments)
            elif isinstance(p, ArgsDelta):
                self._args[p.index] += p.text

    def final(self) -> list[dict[str, Any]]:
        k = 0
        for b in self.blocks:
            if b["type"] == "tool_use":
                b["input"] = call_arguments(self._args[k]) or {}
                k += 1
        return self.blocks or [{"type": "text", "text": ""}]


def message_body(end: EndEvent, plan: Optional[ToolPlan], model: str,
                 stop_sequences: Optional[list[str]], thinking: bool = False) -> dict[str, Any]:
    """The whole `message` of a finished request; with `thinking`, the model's thinking (when it
    thought) as a first `thinking` block."""
    sample = (end.output or {}).get("samples", [{}])[0]
    parser = piece_parser(plan)
    blocks = _Blocks(end.request_id)
    blocks.add(parser.feed(sample.get("text", "")) + parser.finish())
    reason, seq = stop_fields(sample, blocks.calls > 0, stop_sequences)
    thought = sample.get("reasoning") or "" if thinking else ""
    first = [{"type": "thinking", "thinking": thought, "signature": thinking_signature(thought)}] if thought else []
    content = first + blocks.final() if not first or blocks.blocks else first
    return {"id": message_id(end.request_id), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage_dict(end.usage)}


_enc = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event named by its payload's type, as Anthropic sends them."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + _enc.encode(payload) + b"\n\n"


class MessageStream:
    """The events of one streamed message (a server.api.follow.StreamRenderer); with `thinking`,
    the model's thinking streams first as a thinking block."""

    def __init__(self, request_id: str, model: str, plan: Optional[ToolPlan], stop_sequences: Optional[list[str]],
                 input_tokens: Optional[int], thinking: bool = False) -> None:
        self.request_id = request_id
        self.thinking = thinking  # show the model's thinking as a thinking block
        self.thought: list[str] = []  # the thinking block's text so far (for its signature)
        self.model = model
        self.stop_sequences = stop_sequences
        self.input_tokens = input_tokens
        self.parser: ToolCallParser = piece_parser(plan)
        self.index = -1  # the open block's index; -1 before the first
        self.open: Optional[str] = None  # the open block's type
        self.calls = 0
        self.finished_parsing = False
        self.pinged = False

    def start(self) -> bytes:
        return sse_event({"type": "message_start", "message": {
            "id": message_id(self.request_id), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens or 0, "output_tokens": 0}}})

    def _open(self, block: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        self.index += 1
        self.open = block["type"]
        out.append(sse_event({"type": "content_block_start", "index": self.index, "content_block": block}))
        if not self.pinged:  # Anthropic's streams carry a ping after the first block starts
            self.pinged = True
            out.append(sse_event({"type": "ping"}))

    def _close(self, out: list[bytes]) -> None:
        if self.open == "thinking":  # Anthropic's SDK expects the signature before the block stops
            out.append(sse_event({"type": "content_block_delta", "index": self.index, "delta": {
                "type": "signature_delta", "signature": thinking_signature("".join(self.thought))}}))
        if self.open is not None:
            out.append(sse_event({"type": "content_block_stop", "index": self.index}))
            self.open = None

    def _thinking(self, text: str, out: list[bytes]) -> None:
        if self.open != "thinking":
            self._open({"type": "thinking", "thinking": "", "signature": ""}, out)
        self.thought.append(text)
        out.append(sse_event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "thinking_delta", "thinking": text}}))

    def _pieces(self, pieces: list[Piece], out: list[bytes]) -> None:
        for p in pieces:
            if isinstance(p, Content):
                if not p.text:
                    continue
                if self.open != "text":
                    self._open({"type": "text", "text": ""}, out)
                out.append(sse_event({"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "text_delta", "text": p.text}}))
            elif isinstance(p, CallStart):
                self.calls += 1
                self._open({"type": "tool_use", "id": tool_use_id(self.request_id, p.index), "name": p.name,
                            "input": {}}, out)
                if p.arguments:
                    out.append(self._json_delta(p.arguments))
            elif isinstance(p, ArgsDelta) and p.text:
                out.append(self._json_delta(p.text))

    def _json_delta(self, text: str) -> bytes:
        return sse_event({"type": "content_block_delta", "index": self.index,
                          "delta": {"type": "input_json_delta", "partial_json": text}})

    def delta(self, ev: DeltaEvent) -> bytes:
        out: list[bytes] = []
        if ev.reasoning and self.thinking:  # the thinking comes before the answer
            self._thinking(ev.reasoning, out)
        pieces = self.parser.feed(ev.text)
        if ev.finish_reason is not None and not self.finished_parsing:
            self.finished_parsing = True
            pieces += self.parser.finish()
        self._pieces(pieces, out)
        return b"".join(out)

    def end(self, ev: EndEvent) -> bytes:
        if not ev.finished:
            return self.error(end_error(ev.request_id, ev.reason, ev.message))
        out: list[bytes] = []
        if not self.finished_parsing:
            self.finished_parsing = True
            self._pieces(self.parser.finish(), out)
        if self.index < 0:  # nothing was written: one empty text block, as a whole response has
            self._open({"type": "text", "text": ""}, out)
        self._close(out)
        sample = (ev.output or {}).get("samples", [{}])[0]
        reason, seq = stop_fields(sample, self.calls > 0, self.stop_sequences)
        out.append(sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                              "usage": usage_dict(ev.usage)}))
        out.append(sse_event({"type": "message_stop"}))
        return b"".join(out)

    def error(self, err: PagewireError) -> bytes:
        return sse_event(anthropic_error(err))
