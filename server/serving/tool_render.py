"""Fitting tool definitions, assistant tool calls and tool results to a chat template that may not
know about them.

Templates written for tool use (Qwen, Hermes, Llama 3.1) get the conversation as transformers
would pass it: `tools` as a template variable, assistant `tool_calls` (arguments as objects) and
`role: "tool"` messages. A template that lacks one of these features would drop it silently or
fail (SmolLM2's concatenates `content`, which a tool-calling assistant turn leaves empty), so
for each missing feature the conversation is rewritten into plain messages it can render:

  - no `tools` in the template: the tool definitions and the expected call format go into the
    system message (prepended to the client's, or a new first message);
  - no `tool_calls`: an assistant turn's calls are appended to its text in the call format;
  - no tool role: consecutive tool results become one user message, each result wrapped in
    `<tool_response>` tags.

The call format is the one the request's output is parsed in (`hermes` or `llama3_json`), so a
model shown its earlier calls is shown the format it is asked to answer in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class TemplateTools:
    """Which tool features a chat template's source handles."""

    tools: bool
    calls: bool
    tool_role: bool

    @classmethod
    def of(cls, source: str) -> "TemplateTools":
        return cls(
            tools="tools" in source,
            calls="tool_calls" in source,
            tool_role=any(s in source for s in ("'tool'", '"tool"', "tool_call_id", "ipython")),
        )


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


def tools_instructions(tools: list[dict[str, Any]], fmt: str) -> str:
    """The system text that shows a tool-unaware model the tools and how to call them."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if fmt == "llama3_json":
        how = ("To call a tool, answer with only a JSON object of the form "
               '{"name": "<tool name>", "parameters": {<arguments>}}; separate several calls with "; ".')
    else:
        how = ("To call a tool, answer with one block per call:\n<tool_call>\n"
               '{"name": "<tool name>", "arguments": {<arguments>}}\n</tool_call>')
    return f"You can use these tools (one JSON definition per line):\n<tools>\n{lines}\n</tools>\n{how}"


def calls_text(calls: list[dict[str, Any]], fmt: str) -> str:
    """Earlier tool calls (OpenAI shape, arguments already objects) written in the call format."""
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": c["function"]["name"], "parameters": c["function"]["arguments"]},
                                    ensure_ascii=False) for c in calls)
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                     ensure_ascii=False) + "\n</tool_call>"
        for c in calls
    )


def fit_to_template(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]], source: str,
                    fmt: str) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """(messages, tools) rewritten for what the template `source` supports (see module doc).
    `fmt` is the request's call format; `none` falls back to hermes for the rewriting."""
    feats = TemplateTools.of(source)
    fmt = fmt if fmt in ("hermes", "llama3_json") else "hermes"
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls") and not feats.calls:
            text = _text(m.get("content"))
            calls = calls_text(m["tool_calls"], fmt)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{text}\n{calls}" if text else calls
        if m.get("role") == "tool" and not feats.tool_role:
            wrapped = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + wrapped
            else:
                out.append({"role": "user", "content": wrapped, "_tool_results": True})
            continue
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools and not feats.tools:
        intro = tools_instructions(tools, fmt)
        if out and out[0].get("role") == "system":
            first = _text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{intro}\n\n{first}" if first else intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out, tools
