"""Tool calling at the chat edge: validating `tools`, `tool_choice`, `parallel_tool_calls` and the
tool parts of `messages`, and the `ToolPlan` that says how one request's calls are produced.

`tool_choice` decides how calls come about:
  - `none`: no calls; the text is the answer (the tools are still shown to the template).
  - `auto` (the default when tools are given): the model decides; its own format is parsed
    (`server.text.tool_parsers`, chosen from the chat template or `--tool-call-parser`).
  - `required` and a named function: the grammar engine constrains the output
    (`SamplingParams.structured_outputs` with a JSON schema built here), so the calls are
    valid JSON matching the tools' parameter schemas even on a model that never saw tools.

Errors are InvalidRequest (400) naming the field, e.g. `tools[2].function.name`.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from server.serving.errors import InvalidRequest
from server.text.harmony import HarmonyToolParser
from server.text.tool_parsers import (
    HermesParser,
    JsonCallsParser,
    Llama3JsonParser,
    NamedCallParser,
    ToolCallParser,
)

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
# Keys of a call in the constrained `required` output, in the order the grammar makes them.
CALL_NAME_KEY = "name"
CALL_ARGS_KEY = "parameters"


def _finite(text: str) -> float:
    """json's parse_float for arguments: 1e309 would become inf, which no JSON can carry on."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(name: str) -> Any:
    """json's parse_constant: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _bad(field_name: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field_name}: {message}", param=field_name)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Validate OpenAI function tools; return them normalised (`parameters` always present)."""
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of tools")
    if not tools:
        raise _bad("tools", "must not be empty when given (leave it out instead)")
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, "must be an object")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f"must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "is required and must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name",
                       f"must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-', got {name!r}")
        if name in seen:
            raise _bad(f"{where}.function.name", f"duplicate tool name {name!r}")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description", "must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters.type",
                       f"must be 'object' (arguments are a JSON object), got {params.get('type')!r}")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"{where}.function.strict", "must be true or false")
        clean: dict[str, Any] = {"name": name}
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params
        if strict is not None:
            clean["strict"] = strict
        out.append({"type": "function", "function": clean})
    return out


def check_tool_choice(choice: Any, tools: Optional[list[dict[str, Any]]]) -> tuple[str, Optional[str]]:
    """(mode, function name): mode is none, auto, required or named."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"must be 'none', 'auto', 'required' or a function object, got {choice!r}")
        if choice != "none" and not tools:
            raise _bad("tool_choice", f"{choice!r} needs `tools`, which this request does not give")
        return choice, None
    if not isinstance(choice, dict):
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if choice.get("type") != "function":
        raise _bad("tool_choice.type", f"must be 'function', got {choice.get('type')!r}")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice.function.name", "is required and must be a string")
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        known = ", ".join(repr(n) for n in names) or "none"
        raise _bad("tool_choice.function.name", f"{name!r} is not one of the request's tools ({known})")
    return "named", name


def check_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate the tool parts of a conversation and normalise them for chat templates:
    assistant `tool_calls` get their `arguments` parsed into objects (Hub templates render them
    with `tojson`, as transformers and vLLM pass them); `role: "tool"` needs `tool_call_id`."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m["role"]
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", f"only assistant messages carry tool calls, not {role!r}")
            m = {**m, "tool_calls": [_check_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]}
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise _bad(f"messages[{i}].tool_call_id", "is required for role 'tool'")
            if m.get("content") is None:
                raise _bad(f"messages[{i}].content", "is required for role 'tool'")
        elif m.get("tool_call_id") is not None:
            raise _bad(f"messages[{i}].tool_call_id", f"only tool messages carry it, not {role!r}")
        out.append(m)
    return out


def _check_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    if call.get("type", "function") != "function":
        raise _bad(f"{where}.type", f"must be 'function', got {call.get('type')!r}")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise _bad(f"{where}.id", "is required")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{where}.function", "is required and must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.function.name", "is required")
    args: Any = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_float=_finite, parse_constant=_no_constant) if args.strip() else {}
        except ValueError as e:
            raise _bad(f"{where}.function.arguments", f"is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments", "must be a JSON object")
    return {"id": call["id"], "type": "function", "function": {"name": name, "arguments": args}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tool calls are produced and read back.

    mode: none, auto, required or named; parser: the auto-mode format (hermes, llama3_json, openai
    or none); parallel: whether several calls may be made; keep_special_tokens: the format's marker
    is a special token, so auto mode must keep special tokens in the text to see it.
    """

    tools: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "none"
    named: Optional[str] = None
    parallel: bool = True
    parser: str = "none"
    keep_special_tokens: bool = False

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def active(self) -> bool:
        """Whether the output is read for tool calls at all."""
        return self.mode in ("required", "named") or (self.mode == "auto" and self.parser != "none")

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def _params(self, name: str) -> dict[str, Any]:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == name)

    def schema(self) -> Optional[dict[str, Any]]:
        """The JSON schema the grammar engine enforces, or None when unconstrained."""
        if self.mode == "named":
            assert self.named is not None
            return self._params(self.named)
        if self.mode != "required":
            return None
        one_call: dict[str, Any] = {"anyOf": [
            {"type": "object",
             "properties": {CALL_NAME_KEY: {"type": "string", "enum": [n]}, CALL_ARGS_KEY: self._params(n)},
             "required": [CALL_NAME_KEY, CALL_ARGS_KEY], "additionalProperties": False}
            for n in self.names
        ]}
        if not self.parallel:
            return one_call
        return {"type": "array", "minItems": 1, "items": one_call}

    def schema_field(self) -> str:
        """The request field a constraint error should name: the named tool's parameters, or
        `tools` for the combined `required` schema."""
        if self.mode == "named":
            i = self.names.index(self.named or "")
            return f"tools[{i}].function.parameters"
        return "tools"

    def new_parser(self) -> Optional[ToolCallParser]:
        """A fresh parser for one sample, or None when the text is plain content."""
        if self.mode == "named":
            assert self.named is not None
            return NamedCallParser(self.named)
        if self.mode == "required":
            return JsonCallsParser(array=self.parallel)
        if self.mode == "auto" and self.parser == "hermes":
            return HermesParser(self.names)
        if self.mode == "auto" and self.parser == "llama3_json":
            return Llama3JsonParser(self.names)
        if self.mode == "auto" and self.parser == "openai":
            return HarmonyToolParser(self.names)
        return None


def plan_request(tools: Any, tool_choice: Any, parallel_tool_calls: Optional[bool], parser: str,
                 keep_special_tokens: bool = False) -> ToolPlan:
    """Validate a chat request's tool fields into a ToolPlan."""
    checked = check_tools(tools) if tools is not None else []
    mode, named = check_tool_choice(tool_choice, checked)
    return ToolPlan(tools=checked, mode=mode, named=named,
                    parallel=True if parallel_tool_calls is None else parallel_tool_calls, parser=parser,
                    keep_special_tokens=keep_special_tokens)


def call_id(request_id: str, choice: int, call: int) -> str:
    """A tool call's id: derived from the request, so an idempotent retry sees the same ids."""
    digest = hashlib.sha256(f"{request_id}:{choice}:{call}".encode()).hexdigest()
    return f"call_{digest[:24]}"
