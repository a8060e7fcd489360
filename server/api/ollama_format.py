"""Ollama's API shapes, the request side: /api/chat and /api/generate requests → the one
GenerationSpec, and Ollama's error body (the answers are ollama_output.py's).

Requests become the spec an OpenAI request does (`openai_format.generation_spec`):
  - /api/chat `messages` are chat messages: an assistant's `tool_calls` (arguments as objects)
    get call ids, and a `tool` message's `tool_name` is matched to the latest call of that
    name (Ollama has no call ids); `images` are refused (the engine reads text), `thinking` of
    earlier turns is dropped;
  - /api/generate's `prompt` (with `system`) goes through the chat template as one user turn,
    as Ollama does; `raw: true` sends it as is (a completion);
  - `options` map to sampling fields (OPTION_MAP); options that tune the model load (num_ctx,
    num_gpu, ...) are accepted and have no effect, since pagewire loads its model once at start;
    sampling methods pagewire does not implement are refused unless given their neutral value
    (mirostat 0, tfs_z 1, typical_p 1);
  - `format`: "json" (any JSON object) or a JSON schema, through the grammar engine;
  - `tools` (OpenAI's function shape, as Ollama's) become a ToolPlan in `auto` mode, read in the
    model's own call format (server.text.tool_parsers) and answered as Ollama's `tool_calls`;
  - `keep_alive` is validated (seconds, or a Go duration such as "5m") and accepted: the model
    stays loaded for the life of the process.
Errors are Ollama's `{"error": "..."}`, the message naming the field.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Optional, Union

from msgspec import Meta, Struct

from server.api.format_common import renamed
from server.api.openai_format import apply_tool_plan, generation_spec, logprobs_count
from server.api.protocol import Penalty, SamplingFields, Seed, TopLogprobs
from server.api.tools import ToolPlan, check_messages, plan_request
from server.serving.errors import InvalidRequest, PagewireError
from server.serving.jobs import GenerationSpec


class Options(Struct, kw_only=True):
    """`options`: the sampling knobs pagewire has, and the rest of Ollama's (see the module doc)."""

    temperature: Optional[Annotated[float, Meta(ge=0.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Meta(ge=0)]] = None
    min_p: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    num_predict: Optional[Annotated[int, Meta(ge=-2, le=2**31 - 1)]] = None
    stop: Union[None, str, list[str]] = None
    seed: Optional[Seed] = None
    repeat_penalty: Optional[Annotated[float, Meta(gt=0.0)]] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    # Sampling methods pagewire does not implement: only their neutral values are accepted.
    mirostat: Optional[int] = None
    mirostat_tau: Optional[float] = None
    mirostat_eta: Optional[float] = None
    tfs_z: Optional[float] = None
    typical_p: Optional[float] = None
    # Accepted without effect (docs/apis.md): the penalty covers the whole sequence, and the
    # model's load settings are the server's.
    repeat_last_n: Optional[int] = None
    penalize_newline: Optional[bool] = None
    num_keep: Optional[int] = None
    num_ctx: Optional[int] = None
    num_batch: Optional[int] = None
    num_gpu: Optional[int] = None
    main_gpu: Optional[int] = None
    low_vram: Optional[bool] = None
    f16_kv: Optional[bool] = None
    logits_all: Optional[bool] = None
    vocab_only: Optional[bool] = None
    use_mmap: Optional[bool] = None
    use_mlock: Optional[bool] = None
    embedding_only: Optional[bool] = None
    numa: Optional[bool] = None
    num_thread: Optional[int] = None


KeepAlive = Union[None, int, float, str]
Format = Union[None, str, dict[str, Any]]


class OllamaMessage(Struct, kw_only=True):
    role: Annotated[str, Meta(min_length=1)]
    content: Optional[str] = ""
    images: Optional[list[Any]] = None
    tool_calls: Optional[list[Any]] = None
    tool_name: Optional[str] = None
    thinking: Optional[str] = None


class _GenerationFields(Struct, kw_only=True):
    """The fields /api/chat and /api/generate share."""

    model: Annotated[str, Meta(min_length=1)]
    format: Format = None
    options: Optional[Options] = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: Union[None, bool, str] = None
    logprobs: bool = False
    top_logprobs: Optional[TopLogprobs] = None


class ChatRequest(_GenerationFields, kw_only=True):
    """POST /api/chat."""

    messages: list[OllamaMessage] = []
    tools: Optional[list[Any]] = None


class GenerateRequest(_GenerationFields, kw_only=True):
    """POST /api/generate."""

    prompt: Optional[str] = None
    system: Optional[str] = None
    raw: bool = False
    suffix: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[Any]] = None
    images: Optional[list[Any]] = None


class ModelRequest(Struct, kw_only=True):
    """POST /api/show (`name` is the older spelling)."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: bool = False


class EmbedRequest(Struct, kw_only=True):
    """POST /api/embed (and the older /api/embeddings, whose text is `prompt`)."""

    model: Annotated[str, Meta(min_length=1)]
    input: Union[None, str, list[str]] = None
    prompt: Optional[str] = None
    truncate: Optional[bool] = None
    dimensions: Optional[Annotated[int, Meta(ge=1)]] = None
    options: Optional[Options] = None
    keep_alive: KeepAlive = None


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {message}", param=field)


# A number of seconds, or a Go duration ("5m", "1h30m", "-1s", "300ms").
_DURATION = re.compile(r"^-?(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$|^-?\d+(\.\d+)?$")


def check_keep_alive(value: KeepAlive) -> None:
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return
    if isinstance(value, str) and _DURATION.match(value.strip()):
        return
    raise _bad("keep_alive", f"must be a number of seconds or a duration such as '5m' or '1h', got {value!r}")


def unloads(value: KeepAlive) -> bool:
    """keep_alive 0: Ollama's request to unload the model (an empty request then says `unload`)."""
    if isinstance(value, (int, float)):
        return value == 0
    return isinstance(value, str) and value.strip() in ("0", "0s", "0m", "0h")


def _neutral(opts: Options) -> None:
    """Refuse the sampling methods pagewire lacks unless they are off."""
    for name, off in (("mirostat", 0), ("tfs_z", 1.0), ("typical_p", 1.0)):
        v = getattr(opts, name)
        if v is not None and v != off:
            raise _bad(f"options.{name}", f"is not supported by this server (only {off}, which turns it off)")


def sampling_fields(opts: Optional[Options]) -> SamplingFields:
    """`options` as the shared sampling fields."""
    if opts is None:
        return SamplingFields()
    _neutral(opts)
    if opts.num_predict == 0:
        raise _bad("options.num_predict", "must be at least 1, or -1 / -2 for the rest of the context")
    return SamplingFields(
        max_tokens=opts.num_predict if opts.num_predict is not None and opts.num_predict > 0 else None,
        temperature=opts.temperature, top_p=opts.top_p,
        top_k=(opts.top_k if opts.top_k else -1) if opts.top_k is not None else None,  # 0 turns it off
        min_p=opts.min_p, stop=opts.stop, seed=opts.seed, repetition_penalty=opts.repeat_penalty,
        presence_penalty=opts.presence_penalty, frequency_penalty=opts.frequency_penalty)


def response_format(fmt: Format) -> Optional[dict[str, Any]]:
    """`format` as OpenAI's response_format: "json" any JSON object, an object a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise _bad("format", f"must be 'json' or a JSON schema object, got {fmt!r}")


_RENAMES = [("response_format.json_schema.schema", "format"), ("response_format", "format"),
            ("max_tokens", "options.num_predict"), ("stop", "options.stop"), ("seed", "options.seed"),
            ("temperature", "options.temperature"), ("top_p", "options.top_p"), ("top_k", "options.top_k"),
            ("min_p", "options.min_p"), ("repetition_penalty", "options.repeat_penalty"),
            ("presence_penalty", "options.presence_penalty"), ("frequency_penalty", "options.frequency_penalty")]


def _check_think(think: Union[None, bool, str]) -> None:
    if think not in (None, False):
        raise _bad("think", "separate thinking output is not supported by this server; leave it out "
                   "(a thinking model's text then includes its thinking)")


def _tool_calls(calls: list[Any], where: str, counter: list[int]) -> list[dict[str, Any]]:
    out = []
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function", "is required and must be an object")
        name, args = fn.get("name"), fn.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise _bad(f"{at}.function.name", "is required and must be a string")
        if not isinstance(args, dict):
            raise _bad(f"{at}.function.arguments", "must be an object")
        cid = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"call_{counter[0]}"
        counter[0] += 1
        out.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def chat_messages(messages: list[OllamaMessage], system: Optional[str] = None) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI-shaped chat messages."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    counter = [0]
    latest: dict[str, str] = {}  # tool name → id of its latest call
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.images:
            raise _bad(f"{where}.images", "images are not supported: the served model reads text only")
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"{where}.tool_calls", f"only assistant messages carry tool calls, not {m.role!r}")
            d["tool_calls"] = _tool_calls(m.tool_calls, f"{where}.tool_calls", counter)
            d["content"] = m.content or None
            latest.update({c["function"]["name"]: c["id"] for c in d["tool_calls"]})
        if m.role == "tool":
            cid = latest.get(m.tool_name or "")
            if cid is None:  # no earlier call to answer: its own id keeps the turn well-formed
                cid = f"call_{counter[0]}"
                counter[0] += 1
            d["tool_call_id"] = cid
            if m.tool_name:
                d["name"] = m.tool_name
        out.append(d)
    return check_messages(out)


def _finish_spec(spec: GenerationSpec, plan: Optional[ToolPlan]) -> GenerationSpec:
    if plan is not None and plan.tools:
        apply_tool_plan(spec, plan, "tools")
    spec.field_names = {k: renamed(InvalidRequest(v, param=v), _RENAMES).param or v
                        for k, v in spec.field_names.items()}
    # Errors found at admission (SamplingParams' checks) name the option, as the client sent it.
    spec.field_names.update({old: new for old, new in _RENAMES if new.startswith("options.") and old != "max_tokens"})
    spec.max_tokens_field = "options.num_predict"
    return spec


def chat_spec(req: ChatRequest, peer: str, model: str, tool_parser: str, marker_special: bool,
              idem: Optional[str]) -> tuple[GenerationSpec, ToolPlan]:
    try:
        check_keep_alive(req.keep_alive)
        _check_think(req.think)
        # The ollama client sends `tools: []` when it has none.
        plan = plan_request(req.tools or None, None, None, tool_parser, marker_special)
        spec = generation_spec(kind="chat", api="ollama", peer=peer, model=model,
                               fields=sampling_fields(req.options), idempotency_key=idem,
                               logprobs=logprobs_count(req.logprobs, req.top_logprobs),
                               params_record=_record(req.options, req.format),
                               response_format=response_format(req.format))
        spec.messages = chat_messages(req.messages)
        return _finish_spec(spec, plan), plan
    except PagewireError as e:
        raise renamed(e, _RENAMES) from None


def generate_spec(req: GenerateRequest, peer: str, model: str, idem: Optional[str]) -> GenerationSpec:
    try:
        check_keep_alive(req.keep_alive)
        _check_think(req.think)
        for name in ("suffix", "template"):
            if getattr(req, name):
                raise _bad(name, "is not supported by this server (the model's own chat template applies)")
        if req.context:
            raise _bad("context", "is not supported; send the conversation to /api/chat as messages")
        if req.images:
            raise _bad("images", "images are not supported: the served model reads text only")
        if req.raw and req.system:
            raise _bad("system", "cannot be combined with raw: a raw prompt is sent as is")
        common: dict[str, Any] = dict(api="ollama", peer=peer, model=model, fields=sampling_fields(req.options),
                                      idempotency_key=idem, logprobs=logprobs_count(req.logprobs, req.top_logprobs),
                                      params_record=_record(req.options, req.format),
                                      response_format=response_format(req.format))
        if req.raw:
            spec = generation_spec(kind="completion", prompt=req.prompt, **common)
            spec.default_max_tokens = None  # Ollama generates to the end, not OpenAI's 16 tokens
        else:
            spec = generation_spec(kind="chat", **common)
            spec.messages = chat_messages([OllamaMessage(role="user", content=req.prompt)], req.system)
        return _finish_spec(spec, None)
    except PagewireError as e:
        raise renamed(e, _RENAMES) from None


def _record(opts: Optional[Options], fmt: Format) -> dict[str, Any]:
    """The client's parameters as sent, for the ledger."""
    out: dict[str, Any] = {}
    if opts is not None:
        out["options"] = {k: getattr(opts, k) for k in opts.__struct_fields__ if getattr(opts, k) is not None}
    if fmt:
        out["format"] = fmt
    return out


# -- errors -----------------------------------------------------------------------------------------


def ollama_error(exc: PagewireError) -> dict[str, Any]:
    """Ollama's error body."""
    return {"error": exc.message}
