"""Chat output with tool calls in OpenAI's shapes: the whole `message` and the streamed `delta`s.

Both read a sample's text through the same `ToolPlan` parser (server.text.tool_parsers), so a
stream adds up to the whole response. A stream follows what the openai SDK's accumulator
expects (`openai.lib.streaming._deltas.accumulate_delta` concatenates strings per key and merges
list entries by `index`): a call's first delta carries `index`, `id`, `type` and
`function.name` with the first arguments text; later deltas carry only `index` and
`function.arguments` fragments, since repeating `id` or `name` would be concatenated onto them.

A choice that made calls and stopped normally finishes with `tool_calls`; one cut by
max_tokens keeps `length` (its arguments may be incomplete, as with OpenAI).
"""
from __future__ import annotations

from typing import Any, Optional

from server.api.tools import ToolPlan, call_id
from server.serving.lifecycle import FinishReason
from server.text.tool_parsers import ArgsDelta, CallStart, Content, Piece, ToolCallParser, fold


def finish_reason(engine_reason: Optional[str], made_calls: bool) -> Optional[str]:
    """OpenAI's finish reason for a choice: a normal stop with calls is `tool_calls`."""
    if made_calls and engine_reason == FinishReason.STOP:
        return FinishReason.TOOL_CALLS.value
    return engine_reason


def whole_message(plan: ToolPlan, request_id: str, index: int, text: str,
                  engine_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
    """(message, finish_reason) of one finished choice."""
    parser = plan.new_parser()
    if parser is None:
        return {"role": "assistant", "content": text}, engine_reason
    content, calls = fold(parser.feed(text) + parser.finish())
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [
            {"id": call_id(request_id, index, k), "type": "function", "function": {"name": n, "arguments": a}}
            for k, (n, a) in enumerate(calls)
        ]
    return message, finish_reason(engine_reason, bool(calls))


class ChatToolStream:
    """Per-choice parsers of one streamed chat response."""

    def __init__(self, plan: ToolPlan, request_id: str) -> None:
        self.plan = plan
        self.request_id = request_id
        self._parsers: dict[int, ToolCallParser] = {}

    def delta(self, index: int, text: str, engine_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """(delta fields, finish_reason) for one sample's new text; `engine_reason` set on its last."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self.plan.new_parser() or _Passthrough()
        pieces = parser.feed(text)
        if engine_reason is not None:
            pieces += parser.finish()
        fields = self._fields(index, pieces)
        return fields, finish_reason(engine_reason, parser.num_calls > 0)

    def finish_reason(self, index: int, engine_reason: Optional[str]) -> Optional[str]:
        """A choice's finish reason once its stream has been read: `tool_calls` for a normal
        stop that made calls (the WebSocket's `done` frame)."""
        parser = self._parsers.get(index)
        return finish_reason(engine_reason, parser is not None and parser.num_calls > 0)

    def _fields(self, index: int, pieces: list[Piece]) -> dict[str, Any]:
        content = "".join(p.text for p in pieces if isinstance(p, Content))
        calls: list[dict[str, Any]] = []
        for p in pieces:
            if isinstance(p, CallStart):
                calls.append({"index": p.index, "id": call_id(self.request_id, index, p.index), "type": "function",
                              "function": {"name": p.name, "arguments": p.arguments}})
            elif isinstance(p, ArgsDelta):
                if calls and calls[-1]["index"] == p.index:
                    calls[-1]["function"]["arguments"] += p.text
                else:
                    calls.append({"index": p.index, "function": {"arguments": p.text}})
        fields: dict[str, Any] = {}
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = calls
        return fields


class _Passthrough(ToolCallParser):
    """Plain content (tool_choice none, or auto with no parser)."""

    def feed(self, text: str) -> list[Piece]:
        return [Content(text)] if text else []

    def finish(self) -> list[Piece]:
        return []
