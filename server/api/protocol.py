"""Wire types: every JSON body and frame the edge accepts, as msgspec Structs with constraints.

Parsing happens once, here, into native types; nothing past the edge sees JSON. Field names
follow OpenAI (and vLLM for its extras: `ignore_eos`, `min_tokens`, `priority`, `top_k`, ...).
Unknown fields are ignored, as OpenAI-compatible servers do, but a known field with a wrong type
or out-of-range value is rejected with an error naming it (see `server.api.decode`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta, Struct

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
Seconds = Annotated[float, Meta(gt=0.0)]
ClientId = Annotated[str, Meta(min_length=1, max_length=128)]
IdemKey = Annotated[str, Meta(min_length=1, max_length=256)]
# Integers that reach SQLite or torch must fit 64 bits (a larger one would fail there, as a 500).
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Priority = Int64
Seed = Int64
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """The sampling knobs shared by both HTTP endpoints and the WebSocket `params` object."""

    n: Annotated[int, Meta(ge=1, le=16)] = 1
    max_tokens: Optional[PosInt] = None
    temperature: Optional[Annotated[float, Meta(ge=0.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Meta(ge=-1)]] = None
    min_p: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[Annotated[float, Meta(gt=0.0)]] = None
    seed: Optional[Seed] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Optional[str] = None
    # Structured outputs (server.api.structured_fields): vLLM's object and its older names.
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt` is a string, a token-id list, or a list of either (a batch)."""

    model: Optional[str] = None
    prompt: Union[str, list[Any]]
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[TopLogprobs] = None
    echo: bool = False
    best_of: Optional[PosInt] = None
    suffix: Optional[str] = None
    priority: Priority = 0
    service_tier: Optional[str] = None
    timeout: Optional[Seconds] = None
    response_format: Optional[dict[str, Any]] = None


class ContentPart(Struct, kw_only=True):
    type: str
    text: Optional[str] = None


class ChatMessage(Struct, kw_only=True):
    """One conversation turn. Tool parts (assistant `tool_calls`, a tool result's `tool_call_id`)
    are checked in server.api.tools, which names the offending field."""

    role: Annotated[str, Meta(min_length=1)]
    content: Union[None, str, list[ContentPart]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    model: Optional[str] = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_completion_tokens: Optional[PosInt] = None
    logprobs: bool = False
    top_logprobs: Optional[TopLogprobs] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the final assistant message
    priority: Priority = 0
    service_tier: Optional[str] = None
    timeout: Optional[Seconds] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra template variables (vLLM's field)


class TokenizeRequest(Struct, kw_only=True):
    """POST /tokenize: either `prompt` or chat `messages` (vLLM's shape)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[Any]] = None  # rendered with the messages, as in a chat request
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(Struct, kw_only=True):
    model: Optional[str] = None
    tokens: list[Annotated[int, Meta(ge=0)]]


# -- WebSocket frames --------------------------------------------------------------------------


class WsParams(SamplingFields, kw_only=True):
    """`params` of a generate frame: the OpenAI sampling names, chat-style logprobs."""

    max_completion_tokens: Optional[PosInt] = None
    logprobs: bool = False
    top_logprobs: Optional[TopLogprobs] = None
    response_format: Optional[dict[str, Any]] = None


class GenerateFrame(Struct, kw_only=True):
    type: Literal["generate"]
    id: ClientId
    kind: Literal["completion", "chat", "embedding"] = "completion"
    prompt: Union[None, str, list[Annotated[int, Meta(ge=0)]]] = None
    messages: Optional[Annotated[list[ChatMessage], Meta(min_length=1)]] = None
    params: WsParams = msgspec.field(default_factory=WsParams)
    idempotency_key: Optional[IdemKey] = None
    priority: Priority = 0
    detach: bool = False
    timeout: Optional[Seconds] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # kind "chat" only: chat completions' tool fields (docs/tools.md)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    # kind "embedding" only (an embedding model; /v1/embeddings' names): the vector's width, and
    # vLLM's truncation of an over-long input to its last k tokens.
    dimensions: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    # Which served model (GET /v1/models); the default one when absent (docs/models.md).
    model: Optional[str] = None


class CancelFrame(Struct, kw_only=True):
    type: Literal["cancel"]
    id: ClientId


class ResumeFrame(Struct, kw_only=True):
    """Re-attach to `request_id`, receiving every delta with seq > after_seq. `id` defaults to
    the request id and names the request on this socket from then on."""

    type: Literal["resume"]
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    after_seq: NonNegInt = 0
    id: Optional[ClientId] = None


CLIENT_FRAMES: dict[str, type[Struct]] = {
    "generate": GenerateFrame,
    "cancel": CancelFrame,
    "resume": ResumeFrame,
}
