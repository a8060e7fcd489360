"""ChatReader: what `LLM.chat` reads out of a reply the way the chat APIs do -- the reasoning
(`<think>` blocks, harmony's analysis channel), the answer, and `tool_choice: auto` tool calls in
the model's own format (harmony's `to=functions.NAME` messages, Hermes, Llama 3 JSON).

The parsers are the server's (server.text.reasoning, server.text.harmony, server.api.tools), picked
as `pagewire serve` picks them with `--reasoning-parser auto` and `--tool-call-parser auto`: from
the chat template. Before the run, `prepare` gives a request the sampling the server gives it: the
special tags kept in the text (harmony's tags are special tokens, which the detokenizer would
drop) and structured outputs gated past the reasoning (ReasoningGate). `read` then splits one
finished sample; `CompletionOutput.text` stays the raw text, as vLLM's `LLM.chat` returns it.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

from server.api.tools import ToolPlan, call_id, plan_request
from server.engine.sampling_params import ReasoningGate, SamplingParams
from server.text.harmony import CHANNEL
from server.text.reasoning import ReasoningFormat, detect_reasoning_parser, new_splitter, reasoning_format
from server.text.tokenizer import ChatTemplateError, Tokenizer
from server.text.tool_parsers import HERMES_OPEN, PYTHON_TAG, detect_parser, fold

log = logging.getLogger("pagewire")


class ChatReader:
    """The reasoning format and tool-call format of one served tokenizer's chat template."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        try:
            source: Optional[str] = tokenizer.template_source()
        except ChatTemplateError:
            source = None
        self.reasoning: Optional[ReasoningFormat] = None
        parser = detect_reasoning_parser(source)
        if parser is not None:
            try:
                self.reasoning = reasoning_format(parser, tokenizer.token_to_id,
                                                  lambda t: tokenizer.encode(t, add_special_tokens=False))
            except ValueError as e:  # as `--reasoning-parser auto`: serve without one
                log.info("LLM.chat: no reasoning parser (%s)", e)
        try:
            tool_source: Optional[str] = tokenizer.template_source(tools=[])
        except ChatTemplateError:
            tool_source = None
        self.tool_format = detect_parser(tool_source) if tool_source is not None else "none"
        marker = {"hermes": HERMES_OPEN, "llama3_json": PYTHON_TAG, "openai": CHANNEL}.get(self.tool_format)
        marker_id = tokenizer.token_to_id(marker) if marker is not None else None
        self.marker_special = marker_id is not None and marker_id in tokenizer.all_special_ids

    def plan(self, tools: Optional[list[dict[str, Any]]]) -> Optional[ToolPlan]:
        """`tool_choice: auto` over `tools` (None without tools); InvalidRequest (a ValueError's
        kin) naming a bad tool."""
        return plan_request(tools, None, None, self.tool_format, self.marker_special) if tools else None

    def prepare(self, params: SamplingParams, prompt_ids: list[int], plan: Optional[ToolPlan]) -> SamplingParams:
        """`params` as the server would run them for this chat (a copy when anything changes)."""
        changes: dict[str, Any] = {}
        fmt = self.reasoning
        if fmt is not None:
            if params.structured_outputs is not None and params.reasoning_gate is None:
                changes["reasoning_gate"] = ReasoningGate.for_format(fmt, prompt_ids)
            if set((fmt.start_token_id, fmt.end_token_id)) & self.tokenizer.all_special_ids:
                changes["skip_special_tokens"] = False
        if plan is not None and plan.active and plan.keep_special_tokens:
            changes["skip_special_tokens"] = False
        return replace(params, **changes) if changes else params

    def read(self, text: str, token_ids: list[int], prompt_ids: list[int], plan: Optional[ToolPlan],
             request_id: str, index: int) -> tuple[Optional[str], str, Optional[list[dict[str, Any]]]]:
        """(reasoning_content or None, content, tool_calls or None) of one finished sample."""
        reasoning: Optional[str] = None
        answer = text
        if self.reasoning is not None:
            splitter = new_splitter(self.reasoning, self.reasoning.starts_open(prompt_ids))
            r1, a1 = splitter.feed(text, token_ids)
            r2, a2 = splitter.finish()
            reasoning, answer = (r1 + r2) or None, a1 + a2
        parser = plan.new_parser() if plan is not None else None
        if parser is None:
            return reasoning, answer, None
        content, calls = fold(parser.feed(answer) + parser.finish())
        tool_calls = [{"id": call_id(request_id, index, k), "type": "function",
                       "function": {"name": n, "arguments": a}} for k, (n, a) in enumerate(calls)]
        return reasoning, content, tool_calls or None
