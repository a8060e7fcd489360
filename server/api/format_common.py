"""What the non-OpenAI format layers (server.api.anthropic_format, server.api.ollama_format) share:
reading a sample's text as content and tool calls, and renaming the OpenAI field names that the
shared spec builders use in their errors to the names of the API the client spoke.

Both layers build their GenerationSpec with the OpenAI edge's builders (`openai_format.
generation_spec`, `apply_tool_plan`, `tools.plan_request`), so their checks, and the grammar
constraint behind `required` and named tool choices, are the same code; only the names in an
error message differ (`tools[0].function.parameters` is `tools[0].input_schema` to an Anthropic
client), which `renamed` fixes.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from server.api.tools import ToolPlan
from server.serving.errors import InvalidRequest, PagewireError
from server.text.tool_parsers import Content, Piece, ToolCallParser


class TextOnly(ToolCallParser):
    """Plain content: no tools, tool_choice none, or auto on a model whose format has no parser."""

    def feed(self, text: str) -> list[Piece]:
        return [Content(text)] if text else []

    def finish(self) -> list[Piece]:
        return []


def piece_parser(plan: Optional[ToolPlan]) -> ToolCallParser:
    """A fresh parser of one sample's text into content and call pieces."""
    parser = plan.new_parser() if plan is not None and plan.active else None
    return parser if parser is not None else TextOnly()


def renamed(exc: PagewireError, table: Sequence[tuple[str, str]]) -> PagewireError:
    """`exc` with its field named as the client's API names it: the first (old, new) prefix pair
    that matches `exc.param` is replaced in the param and in the message (which starts with it)."""
    param = exc.param
    if not isinstance(exc, InvalidRequest) or param is None:
        return exc
    for old, new in table:
        if param == old or param.startswith(old + ".") or param.startswith(old + "["):
            wire = new + param[len(old):]
            exc.param = wire
            if exc.message.startswith(param):
                exc.message = wire + exc.message[len(param):]
                exc.args = (exc.message,)
            break
    return exc


def call_arguments(text: str) -> Optional[dict[str, Any]]:
    """A call's arguments text as an object, or None when it is not one (cut by max_tokens)."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
