"""OpenAI shapes: request Structs and WebSocket frames → GenerationSpec (one builder for both
edges), and outputs → response bodies and SSE chunks.

Both logprob formats live here: the legacy completions shape (`tokens`, `token_logprobs`,
`top_logprobs` as {token: logprob}, `text_offset`) and the chat shape (`content` entries with
`token`, `logprob`, `bytes`, `top_logprobs`).
"""
from __future__ import annotations

import time
from typing import Any, Optional

from server.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerateFrame, SamplingFields
from server.api.structured_fields import structured_outputs
from server.api.tool_output import ChatToolStream, whole_message
from server.api.tools import ToolPlan, check_messages
from server.engine.outputs import TokenLogprob
from server.engine.sampling_params import StructuredOutputsParams
from server.serving.admission import BATCH, INTERACTIVE
from server.serving.errors import InvalidRequest
from server.serving.idempotency import check_header_key
from server.serving.jobs import GenerationSpec, logprobs_from_stored
from server.serving.prompts import check_template_kwargs
from server.serving.streams import DeltaEvent, EndEvent, Usage
from server.text.tokenizer import Tokenizer

_SAMPLING_NAMES = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids",
)


def sampling_kwargs(req: SamplingFields) -> dict[str, Any]:
    """SamplingParams keywords for the fields the client set (None means "server default")."""
    kw: dict[str, Any] = {k: getattr(req, k) for k in _SAMPLING_NAMES if getattr(req, k) is not None}
    kw.update(ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
              skip_special_tokens=req.skip_special_tokens,
              include_stop_str_in_output=req.include_stop_str_in_output)
    return kw


def params_record(req: Any, exclude: tuple[str, ...]) -> dict[str, Any]:
    """The client's parameters as sent (for the ledger), without the prompt itself."""
    out: dict[str, Any] = {}
    for name in req.__struct_fields__:
        if name in exclude:
            continue
        v = getattr(req, name)
        if v is None or v is False:
            continue
        out[name] = v if isinstance(v, (int, float, str, list, bool, dict)) else str(v)
    return out


def klass_of(priority: int, service_tier: Optional[str]) -> int:
    """Admission class: positive priority (vLLM: larger = later) or service_tier "flex" is batch."""
    return BATCH if priority > 0 or service_tier == "flex" else INTERACTIVE


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        content: Any = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}].type: only 'text' parts are supported, got {part.type!r}",
                        param=f"messages[{i}].content[{j}].type")
            content = [{"type": "text", "text": p.text or ""} for p in content]
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls is not None:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return check_messages(out)


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(req: CompletionRequest) -> list[Any]:
    """The request's prompts: one string or token-id list, or a batch (a list of either)."""
    prompt: Any = req.prompt
    if isinstance(prompt, str) or _is_token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (
        all(isinstance(p, str) for p in prompt) or all(_is_token_list(p) for p in prompt)
    ):
        return list(prompt)
    raise InvalidRequest(
        "prompt: must be a string, a list of token ids, or a non-empty list of strings or of "
        "token-id lists", param="prompt")


def completion_specs(req: CompletionRequest, api: str, client: str, model: str,
                     idem: Optional[str], max_batch: int) -> list[GenerationSpec]:
    """One GenerationSpec per prompt; a batch's idempotency key gets a `#i` suffix per prompt."""
    prompts = completion_prompts(req)
    if len(prompts) > max_batch:
        raise InvalidRequest(f"prompt: at most {max_batch} prompts per request, got {len(prompts)}",
                             param="prompt")
    if len(prompts) == 1:
        return [completion_spec(req, api, client, model, idem, prompts[0])]
    return [completion_spec(req, api, client, model, f"{idem}#{i}" if idem else None, p)
            for i, p in enumerate(prompts)]


def logprobs_count(logprobs: bool, top_logprobs: Optional[int], prefix: str = "") -> Optional[int]:
    """The chat-style pair (`logprobs: true`, `top_logprobs: k`) as SamplingParams.logprobs."""
    if top_logprobs is not None and not logprobs:
        raise InvalidRequest(f"{prefix}top_logprobs: requires {prefix}logprobs to be true",
                             param=f"{prefix}top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def generation_spec(*, kind: str, api: str, peer: str, model: str, fields: SamplingFields,
                    prompt: Any = None, messages: Optional[list[ChatMessage]] = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    logprobs: Optional[int] = None,
                    max_completion_tokens: Optional[int] = None, priority: int = 0,
                    service_tier: Optional[str] = None, idempotency_key: Optional[str] = None,
                    detach: bool = False, timeout: Optional[float] = None,
                    params_record: Optional[dict[str, Any]] = None, field_prefix: str = "",
                    response_format: Optional[dict[str, Any]] = None,
                    chat_template_kwargs: Optional[dict[str, Any]] = None) -> GenerationSpec:
    """The one builder of a GenerationSpec, for both HTTP endpoints and the WebSocket.

    `fields` carries the shared sampling knobs; `field_prefix` is how the edge names them in
    errors (`params.` on the WebSocket). A completion defaults to 16 output tokens, as OpenAI's
    does; a chat to the rest of the context.
    """
    kw = sampling_kwargs(fields)
    so, so_names = structured_outputs(fields, response_format, field_prefix)
    if so is not None:
        kw["structured_outputs"] = so
    if logprobs is not None:
        kw["logprobs"] = logprobs
    max_tokens: Optional[int] = fields.max_tokens
    max_field = "max_tokens"
    if max_completion_tokens is not None:
        max_tokens, max_field = max_completion_tokens, "max_completion_tokens"
    return GenerationSpec(
        kind=kind, api=api, client=fields.user or peer, model=model, prompt=prompt,
        messages=messages_to_dicts(messages) if messages is not None else None,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        sampling=kw, max_tokens=max_tokens,
        max_tokens_field=field_prefix + max_field, default_max_tokens=16 if kind == "completion" else None,
        priority=priority, klass=klass_of(priority, service_tier), idempotency_key=idempotency_key,
        detach=detach, timeout_s=timeout, params_record=params_record or {}, field_names=so_names,
        chat_template_kwargs=check_template_kwargs(chat_template_kwargs),
    )


def check_continuation(continue_final_message: bool, add_generation_prompt: bool,
                       messages: Optional[list[ChatMessage]]) -> None:
    """vLLM's rule for `continue_final_message`: not with `add_generation_prompt`, and only when the
    conversation ends with an assistant message to continue."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise InvalidRequest("continue_final_message: cannot be combined with add_generation_prompt (set it to "
                             "false)", param="continue_final_message")
    if messages and messages[-1].role != "assistant":
        raise InvalidRequest(f"messages[{len(messages) - 1}].role: continue_final_message needs a final "
                             f"assistant message to continue, not {messages[-1].role!r}",
                             param=f"messages[{len(messages) - 1}].role")


def completion_spec(req: CompletionRequest, api: str, client: str, model: str, idem: Optional[str],
                    prompt: Any) -> GenerationSpec:
    """The spec for one of the request's prompts (see completion_prompts)."""
    if req.echo:
        raise InvalidRequest("echo: not supported", param="echo")
    if req.suffix is not None:
        raise InvalidRequest("suffix: not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest(f"best_of: must equal n ({req.n}) when given", param="best_of")
    return generation_spec(
        kind="completion", api=api, peer=client, model=model, fields=req, prompt=prompt,
        logprobs=req.logprobs, priority=req.priority, service_tier=req.service_tier,
        idempotency_key=idem, timeout=req.timeout, params_record=params_record(req, ("prompt",)),
        response_format=req.response_format,
    )


def chat_spec(req: ChatCompletionRequest, api: str, client: str, model: str, idem: Optional[str],
              tools: Optional[ToolPlan] = None) -> GenerationSpec:
    """The spec of a chat request; `tools` is its validated tool plan (server.api.tools)."""
    check_continuation(req.continue_final_message, req.add_generation_prompt, req.messages)
    spec = generation_spec(
        kind="chat", api=api, peer=client, model=model, fields=req, messages=req.messages,
        add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
        logprobs=logprobs_count(req.logprobs, req.top_logprobs),
        max_completion_tokens=req.max_completion_tokens, priority=req.priority,
        service_tier=req.service_tier, idempotency_key=idem, timeout=req.timeout,
        params_record=params_record(req, ("messages",)), response_format=req.response_format,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    if tools is not None and tools.tools:
        apply_tool_plan(spec, tools, "tool_choice")
    return spec


def apply_tool_plan(spec: GenerationSpec, plan: ToolPlan, field_name: str) -> None:
    """Give the spec the request's tools, and for `required` or a named function the JSON-schema
    constraint that makes the output a valid call."""
    spec.tools = plan.tools
    spec.tool_format = plan.parser
    if plan.mode == "auto" and plan.keep_special_tokens:
        spec.sampling["skip_special_tokens"] = False
    schema = plan.schema()
    if schema is None:
        return
    if spec.sampling.get("structured_outputs") is not None:
        raise InvalidRequest(f"{field_name}: {plan.mode!r} tool choice cannot be combined with "
                             "another output constraint (response_format, structured_outputs or guided_*)",
                             param=field_name)
    spec.sampling["structured_outputs"] = StructuredOutputsParams(json=schema)
    # A schema llguidance cannot compile is reported (at admission) against the tool it came from.
    wire = plan.schema_field()
    spec.field_names.update({"structured_outputs": wire, "structured_outputs.json": wire})


def ws_spec(frame: GenerateFrame, peer: str, model: str, tools: Optional[ToolPlan] = None) -> GenerationSpec:
    """The spec of a WebSocket `generate` frame (see docs/websocket.md); `tools` is a chat frame's
    validated tool plan (server.api.tools.plan_request of its tool fields)."""
    p = frame.params
    if frame.kind == "chat":
        if frame.messages is None:
            raise InvalidRequest("messages: required when kind is 'chat'", param="messages")
    elif frame.prompt is None:
        raise InvalidRequest("prompt: required when kind is 'completion'", param="prompt")
    elif frame.tools is not None or frame.tool_choice is not None:
        field_name = "tools" if frame.tools is not None else "tool_choice"
        raise InvalidRequest(f"{field_name}: tools are for kind 'chat' only", param=field_name)
    spec = generation_spec(
        kind=frame.kind, api="ws", peer=peer, model=model, fields=p, prompt=frame.prompt,
        messages=frame.messages, add_generation_prompt=frame.add_generation_prompt,
        logprobs=logprobs_count(p.logprobs, p.top_logprobs, "params."),
        max_completion_tokens=p.max_completion_tokens, priority=frame.priority,
        idempotency_key=check_header_key(frame.idempotency_key, "idempotency_key"), detach=frame.detach,
        timeout=frame.timeout,
        params_record=params_record(p, ()), field_prefix="params.", response_format=p.response_format,
        chat_template_kwargs=frame.chat_template_kwargs,
    )
    if tools is not None and tools.tools:
        apply_tool_plan(spec, tools, "tool_choice")
    return spec


def usage_dict(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


class Formatter:
    """Renders outputs for one served model; caches token strings for logprobs."""

    def __init__(self, tokenizer: Tokenizer, model: str) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = t
        return t

    # -- logprobs -------------------------------------------------------------------------------
    def completion_logprobs(self, lps: Optional[list[TokenLogprob]], offset: int = 0) -> Optional[dict[str, Any]]:
        if lps is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(lp.logprob)
            tops.append({self.token_text(t): v for t, v in lp.top} if lp.top else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, lps: Optional[list[TokenLogprob]]) -> Optional[dict[str, Any]]:
        if lps is None:
            return None

        def entry(tid: int, lp: float) -> dict[str, Any]:
            text = self.token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]}

    # -- whole responses ------------------------------------------------------------------------
    def completion_response(self, end: EndEvent) -> dict[str, Any]:
        choices = []
        for s in (end.output or {}).get("samples", []):
            choices.append({
                "index": s["index"], "text": s["text"],
                "logprobs": self.completion_logprobs(logprobs_from_stored(s.get("logprobs"))),
                "finish_reason": s.get("finish_reason"), "stop_reason": s.get("stop_reason"),
            })
        return {"id": f"cmpl-{end.request_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.model, "choices": choices, "usage": usage_dict(end.usage)}

    def chat_response(self, end: EndEvent, tools: Optional[ToolPlan] = None) -> dict[str, Any]:
        """The whole chat completion; with an active tool plan the text is read for tool calls."""
        choices = []
        for s in (end.output or {}).get("samples", []):
            message: dict[str, Any] = {"role": "assistant", "content": s["text"]}
            finish = s.get("finish_reason")
            if tools is not None and tools.active:  # tool calls are read from the answer, after any thinking
                message, finish = whole_message(tools, end.request_id, s["index"], s["text"], finish)
            if "reasoning" in s:  # a reasoning parser is on (docs/reasoning.md)
                message["reasoning_content"] = s["reasoning"] or None
            choices.append({
                "index": s["index"], "message": message,
                "logprobs": self.chat_logprobs(logprobs_from_stored(s.get("logprobs"))),
                "finish_reason": finish, "stop_reason": s.get("stop_reason"),
            })
        return {"id": f"chatcmpl-{end.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "choices": choices, "usage": usage_dict(end.usage)}

    # -- stream chunks --------------------------------------------------------------------------
    def completion_chunk(self, request_id: str, ev: DeltaEvent, include_usage: bool) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": ev.index, "text": ev.text, "logprobs": self.completion_logprobs(ev.logprobs),
                         "finish_reason": ev.finish_reason}],
        }
        if include_usage:
            chunk["usage"] = None
        return chunk

    def chat_chunk(self, request_id: str, ev: DeltaEvent, first: bool, include_usage: bool,
                   tools: Optional[ChatToolStream] = None) -> dict[str, Any]:
        """One SSE chunk; with `tools`, text that may be (or is) a tool call becomes tool-call deltas."""
        finish = ev.finish_reason
        if tools is None:
            delta: dict[str, Any] = {"content": ev.text}
        else:
            delta, finish = tools.delta(ev.index, ev.text, ev.finish_reason)
        if ev.reasoning:
            delta["reasoning_content"] = ev.reasoning
        if first:
            delta = {"role": "assistant", "content": None, **delta} if tools is not None else \
                {"role": "assistant", **delta}
        chunk: dict[str, Any] = {
            "id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": ev.index, "delta": delta, "logprobs": self.chat_logprobs(ev.logprobs),
                         "finish_reason": finish}],
        }
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, kind: str, end: EndEvent) -> dict[str, Any]:
        prefix, obj = ("chatcmpl", "chat.completion.chunk") if kind == "chat" else ("cmpl", "text_completion")
        return {"id": f"{prefix}-{end.request_id}", "object": obj, "created": int(time.time()),
                "model": self.model, "choices": [], "usage": usage_dict(end.usage)}
