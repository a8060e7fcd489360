"""OpenAI's Responses API shapes: a `POST /v1/responses` body → the same GenerationSpec a chat
completion makes, and a finished request → the response object (its output items, usage).

Input → conversation (the chat messages the model's template renders):
    instructions                      a system message first (not carried to later turns, as OpenAI)
    "text" / message items            user / assistant / system (`developer` is system) messages
    function_call items               an assistant message's `tool_calls`
    function_call_output items        `tool` messages (by `call_id`)
    reasoning items                   dropped (templates do not show past thinking)
    previous_response_id              the stored conversation of that response, then this input
Tools are Responses function tools ({type, name, description, parameters}) turned into chat tools,
so `tool_choice` and the call parsers are chat's (server.api.tools); `text.format` is chat's
`response_format`; `max_output_tokens` is max_tokens (thinking included).

Output items, in order: `reasoning` (the thinking, when a reasoning parser is on), `message`
(the answer's `output_text`), `function_call`s. Ids derive from the request id, so an idempotent
retry (Idempotency-Key) sees the same response and item ids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from msgspec import Meta, Struct

from server.api.openai_format import apply_tool_plan, generation_spec, klass_of
from server.api.protocol import PosInt, Priority, SamplingFields, Seconds
from server.api.tool_output import whole_message
from server.api.tools import ToolPlan, check_messages, plan_request
from server.serving.errors import InvalidRequest, PagewireError
from server.serving.jobs import GenerationSpec
from server.serving.streams import EndEvent, Usage


class ResponsesRequest(Struct, kw_only=True):
    """POST /v1/responses (the fields pagewire reads; unknown ones are ignored, as OpenAI's are)."""

    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    stream: bool = False
    tools: Optional[list[Any]] = None
    tool_choice: Union[None, str, dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    previous_response_id: Optional[Annotated[str, Meta(min_length=1, max_length=128)]] = None
    store: bool = True
    max_output_tokens: Optional[PosInt] = None
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    background: bool = False
    service_tier: Optional[str] = None
    priority: Priority = 0
    timeout: Optional[Seconds] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def response_id_of(request_id: str) -> str:
    return "resp_" + request_id.removeprefix("req-")


def _suffix(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def _text_of(content: Any, where: str) -> str:
    """A message item's content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"{at}: must be an object", param=at)
        kind = part.get("type")
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequest(f"{at}.type: only input_text and output_text parts are supported, got {kind!r}",
                                 param=f"{at}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{at}.text: must be a string", param=f"{at}.text")
        out.append(text)
    return "".join(out)


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def input_messages(raw: Union[str, list[Any]]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (module docstring), naming `input[i]…` on errors."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not raw:
        raise InvalidRequest("input: must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{at}: must be an object", param=at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequest(f"{at}.role: must be one of user, assistant, system, developer, got {role!r}",
                                     param=f"{at}.role")
            out.append({"role": _ROLES[role], "content": _text_of(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            call = {}
            for key in ("call_id", "name", "arguments"):
                v = item.get(key)
                if not isinstance(v, str) or (key != "arguments" and not v):
                    raise InvalidRequest(f"{at}.{key}: must be a non-empty string", param=f"{at}.{key}")
                call[key] = v
            tc = {"id": call["call_id"], "type": "function",
                  "function": {"name": call["name"], "arguments": call["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(tc)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [tc]})
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str) or not cid:
                raise InvalidRequest(f"{at}.call_id: must be a non-empty string", param=f"{at}.call_id")
            if not isinstance(output, str):
                output = _text_of(output, f"{at}.output")
            out.append({"role": "tool", "tool_call_id": cid, "content": output})
        elif kind == "reasoning":
            continue  # past thinking is not shown to the model again
        else:
            raise InvalidRequest(f"{at}.type: {kind!r} items are not supported (message, function_call, "
                                 "function_call_output, reasoning)", param=f"{at}.type")
    return out


def chat_tools(tools: Optional[list[Any]]) -> Optional[list[dict[str, Any]]]:
    """Responses function tools → chat tools; other tool types are refused naming them."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidRequest(f"{at}: must be an object", param=at)
        if t.get("type") != "function":
            raise InvalidRequest(f"{at}.type: only function tools are supported, got {t.get('type')!r}",
                                 param=f"{at}.type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t and t[k] is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """`text.format` → chat's response_format (text → none)."""
    if text is None:
        return None
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format: must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema: must be a JSON schema object", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response",
                                                       "schema": fmt["schema"], "strict": fmt.get("strict")}}
    raise InvalidRequest(f"text.format.type: must be text, json_object or json_schema, got {kind!r}",
                         param="text.format.type")


def _responses_names(e: PagewireError) -> PagewireError:
    """Chat's tool field names (`tools[0].function.parameters`) as the Responses API spells them."""
    for attr in ("param", "message"):
        v = getattr(e, attr)
        if isinstance(v, str):
            setattr(e, attr, v.replace("].function.", "].").replace("response_format.json_schema", "text.format"))
    e.args = (e.message,)
    return e


@dataclass
class ResponsesPlan:
    """What the edge needs after parsing: the spec, the tool plan, and the request as echoed back."""

    spec: GenerationSpec
    tools: ToolPlan
    req: ResponsesRequest
    conversation: list[dict[str, Any]]  # the messages before this turn's output (no instructions)
    created_at: float = field(default_factory=time.time)


def responses_spec(req: ResponsesRequest, peer: str, model: str, idem: Optional[str], parser: str,
                   marker_special: bool, history: list[dict[str, Any]]) -> ResponsesPlan:
    """The GenerationSpec of a Responses request; `history` is the previous response's stored
    conversation (empty without previous_response_id)."""
    if req.background:
        raise InvalidRequest("background: background responses are not supported", param="background")
    if req.truncation == "auto":
        raise InvalidRequest("truncation: 'auto' is not supported; a prompt that does not fit is refused",
                             param="truncation")
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    try:
        plan = plan_request(chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls,
                            parser, marker_special)
        fields = SamplingFields(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                                user=req.user)
        record: dict[str, Any] = {"endpoint": "responses", "instructions": req.instructions,
                                  "previous_response_id": req.previous_response_id,
                                  "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
                                  "top_p": req.top_p, "text": req.text, "tools": req.tools,
                                  "tool_choice": req.tool_choice, "store": req.store}
        spec = generation_spec(kind="chat", api="http", peer=peer, model=model, fields=fields,
                               priority=req.priority, service_tier=req.service_tier, idempotency_key=idem,
                               timeout=req.timeout, params_record={k: v for k, v in record.items() if v is not None},
                               response_format=response_format(req.text),
                               chat_template_kwargs=req.chat_template_kwargs)
        spec.messages = check_messages(messages)
        spec.max_tokens_field = "max_output_tokens"
        spec.messages_field = "input"
        spec.klass = klass_of(req.priority, req.service_tier)
        if plan.tools:
            apply_tool_plan(spec, plan, "tool_choice")
    except PagewireError as e:
        raise _responses_names(e) from None
    return ResponsesPlan(spec, plan, req, conversation)


def usage_of(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens}


def response_body(p: ResponsesPlan, response_id: str, created_at: float, status: str,
                  output: list[dict[str, Any]], usage: Optional[Usage], finish: Optional[str] = None,
                  error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The response object (status in_progress, completed, incomplete or failed)."""
    req = p.req
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "model": p.spec.model, "output": output, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" and finish == "length"
        else None,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "parallel_tool_calls": p.tools.parallel, "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "tools": req.tools or [], "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "text": {"format": fmt}, "truncation": req.truncation or "disabled", "user": req.user,
        "usage": usage_of(usage) if usage is not None else None,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
    }


def status_of(finish: Optional[str]) -> str:
    return "incomplete" if finish == "length" else "completed"


def reasoning_item(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": "rs_" + _suffix(response_id), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + _suffix(response_id), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(response_id: str, k: int, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{_suffix(response_id)}_{k}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def whole_output(p: ResponsesPlan, end: EndEvent, response_id: str) -> list[dict[str, Any]]:
    """The output items of a finished request."""
    samples = (end.output or {}).get("samples") or [{"text": "", "finish_reason": end.finish_reason}]
    s = samples[0]
    text, finish = s.get("text", ""), s.get("finish_reason")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if p.tools.active:
        message, finish = whole_message(p.tools, end.request_id, 0, text, finish)
    items: list[dict[str, Any]] = []
    if s.get("reasoning"):
        items.append(reasoning_item(response_id, s["reasoning"]))
    if message.get("content"):
        items.append(message_item(response_id, message["content"], "incomplete" if finish == "length" else "completed"))
    for k, tc in enumerate(message.get("tool_calls") or []):
        items.append(call_item(response_id, k, tc["id"], tc["function"]["name"], tc["function"]["arguments"]))
    return items
