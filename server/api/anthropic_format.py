"""Anthropic's Messages API shapes: request Structs → the one GenerationSpec, and outputs → a
`message` body or the stream's events.

The request becomes the same spec an OpenAI chat request does (`openai_format.generation_spec`):
  - `system` (a string or text blocks) becomes the first, system message;
  - content blocks: `text` is the turn's text; an assistant's `tool_use` blocks become its
    `tool_calls` (`input` as the arguments); a user's `tool_result` blocks become tool messages
    (`tool_use_id` as the call id), placed before the rest of that user turn, as Anthropic
    requires them first; `thinking` / `redacted_thinking` blocks of earlier turns are dropped;
    blocks the text-only engine cannot read (`image`, `document`, ...) are a 400 naming them;
  - `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`, `any`, `tool`,
    `none`, `disable_parallel_tool_use`) become a ToolPlan (`tools.plan_request`), so `any` and
    `tool` are enforced by the grammar engine and `auto` reads the model's own call format;
  - `output_config.format` (and the older `output_format`) `{"type": "json_schema", "schema"}`
    becomes a JSON-schema constraint, as OpenAI's `response_format` does;
  - `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens`, `metadata.user_id` map to
    the same sampling fields; `seed` is accepted as a pagewire extension.
  - `thinking` (`{"type": "enabled", "budget_tokens"}`, `"adaptive"` or `"disabled"`) turns a
    reasoning model's thinking on or off through the chat template (`enable_thinking`, the
    Qwen3 switch), and on, asks for `thinking` blocks in the answer (server.api.anthropic_output).
Errors name Anthropic's fields (`tools[0].input_schema`, `tool_choice.name`), in Anthropic's
error shape (`anthropic_error`). The answer's shapes are server.api.anthropic_output's.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from msgspec import Meta, Struct

from server.api.format_common import renamed
from server.api.openai_format import apply_tool_plan, generation_spec, params_record
from server.api.protocol import PosInt, SamplingFields, Seed
from server.api.tools import ToolPlan, check_messages, plan_request
from server.serving.errors import InvalidRequest, PagewireError
from server.serving.jobs import GenerationSpec

# -- requests ---------------------------------------------------------------------------------------


class AnthropicMessage(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: Union[str, list[Any]]


class Metadata(Struct, kw_only=True):
    user_id: Optional[Annotated[str, Meta(max_length=256)]] = None


class PromptFields(Struct, kw_only=True):
    """What both /v1/messages and /v1/messages/count_tokens read: the prompt and its tools."""

    model: str
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: Union[None, str, list[Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    # Extended thinking: `thinking_mode` reads it.
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    output_format: Optional[dict[str, Any]] = None


class MessagesRequest(PromptFields, kw_only=True):
    """POST /v1/messages."""

    max_tokens: PosInt
    stop_sequences: Optional[Annotated[list[str], Meta(max_length=64)]] = None
    stream: bool = False
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Meta(ge=1)]] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None
    seed: Optional[Seed] = None  # a pagewire extension (Anthropic has none)


class CountTokensRequest(PromptFields, kw_only=True):
    """POST /v1/messages/count_tokens."""


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", param=field)


_UNREADABLE = ("image", "document", "search_result", "container_upload")
_DROPPED = ("thinking", "redacted_thinking")


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of `text` blocks (system, tool_result content), as one text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, "must be a string or a list of text blocks")
    parts: list[str] = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(block, dict):
            raise _bad(at, "must be a content block object")
        kind = block.get("type")
        if kind != "text":
            raise _bad(f"{at}.type", f"only 'text' blocks are supported here, got {kind!r}")
        text = block.get("text")
        if not isinstance(text, str):
            raise _bad(f"{at}.text", "is required and must be a string")
        parts.append(text)
    return "\n".join(parts) if where == "system" else "".join(parts)


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    bid, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(bid, str) or not bid:
        raise _bad(f"{at}.id", "is required and must be a string")
    if not isinstance(name, str) or not name:
        raise _bad(f"{at}.name", "is required and must be a string")
    if not isinstance(args, dict):
        raise _bad(f"{at}.input", "must be an object")
    return {"id": bid, "type": "function", "function": {"name": name, "arguments": args}}


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    tid = block.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise _bad(f"{at}.tool_use_id", "is required and must be a string")
    content = block.get("content", "")
    if block.get("is_error") not in (None, True, False):
        raise _bad(f"{at}.is_error", "must be true or false")
    return {"role": "tool", "tool_call_id": tid, "content": _text_blocks(content, f"{at}.content")}


def chat_messages(req: PromptFields) -> list[dict[str, Any]]:
    """The conversation as OpenAI-shaped chat messages (for `generation_spec`)."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = _text_blocks(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if i == last and m.role == "assistant":
            # A prefill: the model continues this text (GenerationSpec.continue_final_message).
            # Anthropic refuses one that ends in whitespace, and so do we, with its message.
            final = m.content if isinstance(m.content, str) else "".join(
                b["text"] for b in m.content
                if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))
            if final != final.rstrip():
                raise _bad(f"{where}.content", "final assistant content cannot end with trailing whitespace")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            at = f"{where}.content[{j}]"
            if not isinstance(block, dict):
                raise _bad(at, "must be a content block object")
            kind = block.get("type")
            if kind == "text":
                text = block.get("text")
                if not isinstance(text, str):
                    raise _bad(f"{at}.text", "is required and must be a string")
                texts.append(text)
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and m.role == "user":
                results.append(_tool_result(block, at))
            elif kind in _DROPPED and m.role == "assistant":
                continue  # earlier thinking: not shown to the model again
            elif kind in ("tool_use", "tool_result"):
                raise _bad(f"{at}.type", f"{kind!r} blocks belong in "
                           f"{'assistant' if kind == 'tool_use' else 'user'} messages, not {m.role!r} ones")
            elif kind in _UNREADABLE:
                raise _bad(f"{at}.type", f"{kind!r} blocks are not supported: the served model reads text only")
            else:
                raise _bad(f"{at}.type", f"unknown content block type {kind!r}")
        out.extend(results)
        text = "".join(texts)
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif texts or not results:
            out.append({"role": m.role, "content": text})
    return out


def _openai_tools(tools: Optional[list[Any]]) -> Optional[list[dict[str, Any]]]:
    """Anthropic's client tools in OpenAI's shape (checked by `tools.check_tools`, renamed back)."""
    if tools is None:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(at, "must be an object")
        kind = tool.get("type", "custom")
        if kind not in (None, "custom"):
            raise _bad(f"{at}.type", f"server tools ({kind!r}) are not supported; give client tools "
                       "with name, description and input_schema")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{at}.input_schema", "is required and must be a JSON schema object")
        fn: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
        if "description" in tool:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Optional[dict[str, Any]], has_tools: bool) -> tuple[Any, Optional[bool]]:
    """(OpenAI tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}")
    if kind != "none" and not has_tools:
        raise _bad("tool_choice", f"{kind!r} needs `tools`, which this request does not give")
    no_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(no_parallel, bool):
        raise _bad("tool_choice.disable_parallel_tool_use", "must be true or false")
    parallel = None if kind == "none" else not no_parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _bad("tool_choice.name", "is required when type is 'tool'")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _response_format(req: PromptFields) -> tuple[Optional[dict[str, Any]], str]:
    """(OpenAI response_format, the Anthropic field it came from)."""
    found = []
    if req.output_config is not None and req.output_config.get("format") is not None:
        found.append(("output_config.format", req.output_config["format"]))
    if req.output_format is not None:
        found.append(("output_format", req.output_format))
    if not found:
        return None, ""
    if len(found) > 1:
        raise _bad("output_format", "cannot be combined with output_config.format; give one")
    name, fmt = found[0]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise _bad(f"{name}.type", f"must be 'json_schema', got {got!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise _bad(f"{name}.schema", "is required and must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}, name


def _renames(req: PromptFields, format_field: str) -> list[tuple[str, str]]:
    """OpenAI field names in the shared builders' errors → this request's Anthropic names."""
    table: list[tuple[str, str]] = [("tool_choice.function.name", "tool_choice.name")]
    for i in range(len(req.tools or [])):
        table += [(f"tools[{i}].function.parameters", f"tools[{i}].input_schema"),
                  (f"tools[{i}].function.name", f"tools[{i}].name"),
                  (f"tools[{i}].function.description", f"tools[{i}].description")]
    if format_field:
        table += [("response_format.json_schema.schema", f"{format_field}.schema"),
                  ("response_format", format_field)]
    return table


def _rename_names(names: dict[str, str], table: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for k, v in names.items():
        probe = InvalidRequest(v, param=v)
        out[k] = renamed(probe, table).param or v
    return out


def thinking_mode(req: PromptFields, max_tokens: Optional[int] = None) -> Optional[bool]:
    """Whether the request turns thinking on (True: `enabled` or `adaptive`), off (False:
    `disabled`) or leaves the model's default (None: no `thinking`); a 400 naming the field for a
    malformed one. `budget_tokens` must be a positive integer below `max_tokens`, as Anthropic
    requires; its floor of 1024 is Claude's and is not applied (a small local model thinks in far
    fewer tokens). The budget itself is not enforced: `max_tokens` bounds the thinking and the
    answer together, as it does in Anthropic's API (docs/apis.md)."""
    t = req.thinking
    if t is None:
        return None
    kind = t.get("type")
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise _bad("thinking.type", f"must be 'enabled', 'adaptive' or 'disabled', got {kind!r}")
    budget = t.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise _bad("thinking.budget_tokens", f"required with type 'enabled', a positive integer; got {budget!r}")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")
    return True


def prompt_spec(req: PromptFields, peer: str, model: str, tool_parser: str, marker_special: bool,
                fields: Optional[SamplingFields] = None, idem: Optional[str] = None,
                record: Optional[dict[str, Any]] = None) -> tuple[GenerationSpec, ToolPlan]:
    """The GenerationSpec and ToolPlan of a Messages request (count_tokens passes no `fields`)."""
    fmt, fmt_field = _response_format(req)
    table = _renames(req, fmt_field)
    try:
        tools = _openai_tools(req.tools)
        choice, parallel = _tool_choice(req.tool_choice, bool(tools))
        plan = plan_request(tools, choice, parallel, tool_parser, marker_special)
        messages = chat_messages(req)
        thinking = thinking_mode(req, fields.max_tokens if fields is not None else None)
        spec = generation_spec(kind="chat", api="anthropic", peer=peer, model=model,
                               fields=fields if fields is not None else SamplingFields(),
                               messages=None, idempotency_key=idem, params_record=record,
                               response_format=fmt,
                               chat_template_kwargs=None if thinking is None else {"enable_thinking": thinking})
        spec.messages = check_messages(messages)
        if req.messages and req.messages[-1].role == "assistant":
            spec.continue_final_message, spec.add_generation_prompt = True, False
        if plan.tools:
            apply_tool_plan(spec, plan, "tool_choice")
    except PagewireError as e:
        raise renamed(e, table) from None
    # Errors found at admission (SamplingParams' checks) name the sampling field as Anthropic does.
    spec.field_names = {"stop": "stop_sequences", **_rename_names(spec.field_names, table)}
    return spec, plan


def messages_spec(req: MessagesRequest, peer: str, model: str, tool_parser: str, marker_special: bool,
                  idem: Optional[str]) -> tuple[GenerationSpec, ToolPlan]:
    fields = SamplingFields(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                            top_k=req.top_k, stop=req.stop_sequences, seed=req.seed,
                            user=req.metadata.user_id if req.metadata is not None else None)
    return prompt_spec(req, peer, model, tool_parser, marker_special, fields, idem,
                       params_record(req, ("messages", "system")))


# -- errors -----------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error(exc: PagewireError) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}
