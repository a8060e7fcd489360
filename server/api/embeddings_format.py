"""Embeddings in OpenAI's shapes, and the request specs every embeddings route shares.

`POST /v1/embeddings` takes `input` as a string, a list of strings, a list of token ids, or a
list of lists of token ids (OpenAI's four forms); each input becomes one engine request with its
own ledger row (`kind` "embedding"; an Idempotency-Key `K` becomes `K#i` for input i), as a
batched completion prompt does. `dimensions` travels to the engine, which keeps the leading
values and normalises again when the model normalises (Matryoshka; it also checks the bound).
`encoding_format` "base64" sends each vector as its little-endian float32 bytes in base64, which
is what the openai client asks for by default and decodes with numpy. An input longer than the
context is a 400 naming it, as OpenAI answers, unless vLLM's `truncate_prompt_tokens` asks for
its last k tokens (server.serving.truncation). Ollama's /api/embed builds its specs here too
(server.api.ollama_http).
"""
from __future__ import annotations

import base64
import struct
from typing import Any, Optional, Union

import msgspec
from msgspec import Struct

from server.api.openai_format import klass_of
from server.api.protocol import GenerateFrame, WsParams
from server.serving.errors import Conflict, InvalidRequest
from server.serving.idempotency import check_header_key
from server.serving.jobs import GenerationSpec
from server.serving.streams import EndEvent
from server.serving.truncation import Truncation

# Inputs per request: each is an engine request and a ledger row, admitted in order.
MAX_INPUTS = 128
ENCODINGS = ("float", "base64")

EmbeddingInput = Union[str, list[int]]


class EmbeddingRequest(Struct, kw_only=True):
    """POST /v1/embeddings."""

    model: Optional[str] = None
    input: Union[str, list[Any]]
    dimensions: Optional[int] = None
    encoding_format: str = "float"
    user: Optional[str] = None
    # vLLM's extension (the openai client sends it through `extra_body`): keep the last k tokens of
    # an input longer than k; -1: as many as the context holds (server.serving.truncation).
    truncate_prompt_tokens: Optional[int] = None


def embedding_inputs(value: Any, field: str = "input", allow_ids: bool = True) -> list[EmbeddingInput]:
    """The inputs of `value` in order, each a string or a list of token ids; a 400 naming the
    field (`input`, `input[2]`) for an empty one or a mix of forms. The token ids themselves are
    checked against the vocabulary when the request is prepared."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        if not allow_ids:
            raise InvalidRequest(f"{field}: must be a string or a list of strings", param=field)
        return [list(value)]
    elif isinstance(value, list):
        items = value
    else:
        raise InvalidRequest(f"{field}: must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids", param=field)
    if not items:
        raise InvalidRequest(f"{field}: must not be empty", param=field)
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"{field}: at most {MAX_INPUTS} inputs per request, got {len(items)}", param=field)
    out: list[EmbeddingInput] = []
    for i, item in enumerate(items):
        name = f"{field}[{i}]" if len(items) > 1 or not isinstance(value, str) else field
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"{name}: must not be an empty string", param=name)
            out.append(item)
        elif allow_ids and isinstance(item, list) and item and all(_is_id(v) for v in item):
            out.append(list(item))
        elif allow_ids and isinstance(item, list) and not item:
            raise InvalidRequest(f"{name}: must not be an empty list of token ids", param=name)
        else:
            kinds = "a string or a list of token ids" if allow_ids else "a string"
            raise InvalidRequest(f"{name}: must be {kinds}", param=name)
    kinds_seen = {isinstance(x, str) for x in out}
    if len(kinds_seen) > 1:
        raise InvalidRequest(f"{field}: mixes strings and token-id lists; send one form", param=field)
    return out


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_dimensions(value: Any, field: str = "dimensions") -> Optional[int]:
    """The requested width, or None; a 400 naming the field unless it is a positive integer (the
    engine checks the upper bound, the model's width, and names the field the same way)."""
    if value is None:
        return None
    if not _is_id(value) or value < 1:
        raise InvalidRequest(f"{field}: must be a positive integer, got {value!r}", param=field)
    return int(value)


def check_truncate_prompt_tokens(value: Optional[int], field: str = "truncate_prompt_tokens") -> Optional[Truncation]:
    """vLLM's `truncate_prompt_tokens` as a Truncation keeping the input's last tokens, or None; a
    400 naming the field unless it is -1 or a positive integer (the bound, the context, is checked
    when the request is prepared)."""
    if value is None:
        return None
    if value != -1 and value < 1:
        raise InvalidRequest(f"{field}: must be -1 (as many as the context holds) or a positive integer, "
                             f"got {value}", param=field)
    return Truncation(keep_end=True, tokens=None if value == -1 else value, field=field)


def embedding_specs(inputs: list[EmbeddingInput], *, api: str, client: str, model: str, idem: Optional[str],
                    dimensions: Optional[int], params_record: dict[str, Any],
                    field: str = "input", truncate: Optional[Truncation] = None) -> list[GenerationSpec]:
    """One GenerationSpec per input (`kind` "embedding"): nothing is sampled, so max_tokens is the
    one position the context check asks an output to leave. With `truncate`, an input that does
    not fit is cut (server.serving.truncation) instead of refused."""
    many = len(inputs) > 1
    return [
        GenerationSpec(
            kind="embedding", api=api, client=client, model=model, prompt=x,
            sampling={"embedding": {"dimensions": dimensions}}, max_tokens=1, params_record=params_record,
            idempotency_key=(f"{idem}#{i}" if many else idem) if idem is not None else None,
            prompt_field=f"{field}[{i}]" if many else field, truncate=truncate,
        )
        for i, x in enumerate(inputs)
    ]


def request_specs(req: EmbeddingRequest, *, api: str, client: str, model: str,
                  idem: Optional[str]) -> tuple[list[GenerationSpec], str]:
    """A /v1/embeddings body's specs (one per input) and its encoding_format, each field checked
    (a 400 naming it); the route and the batch tier's /v1/embeddings lines read bodies this way."""
    fmt = check_encoding(req.encoding_format)
    dims = check_dimensions(req.dimensions)
    truncate = check_truncate_prompt_tokens(req.truncate_prompt_tokens)
    inputs = embedding_inputs(req.input)
    record: dict[str, Any] = {"dimensions": dims, "encoding_format": fmt, "inputs": len(inputs)}
    if truncate is not None:
        record["truncate_prompt_tokens"] = req.truncate_prompt_tokens
    return embedding_specs(inputs, api=api, client=client, model=model, idem=idem, dimensions=dims,
                           params_record=record, truncate=truncate), fmt


def ws_embedding_spec(frame: GenerateFrame, peer: str, model: str) -> GenerationSpec:
    """The spec of a WebSocket `generate` frame of kind "embedding" (docs/websocket.md): its
    `prompt`, a string or a list of token ids, is one input; `dimensions` and
    `truncate_prompt_tokens` as on /v1/embeddings. Sampling `params` do not apply (only
    `params.user`, the fairness key)."""
    if frame.messages is not None:
        raise InvalidRequest("messages: not used when kind is 'embedding'; send the text as prompt", param="messages")
    if frame.prompt is None:
        raise InvalidRequest("prompt: required when kind is 'embedding'", param="prompt")
    if msgspec.structs.replace(frame.params, user=None) != WsParams():
        raise InvalidRequest("params: sampling parameters do not apply when kind is 'embedding' (only params.user)",
                             param="params")
    dims = check_dimensions(frame.dimensions)
    truncate = check_truncate_prompt_tokens(frame.truncate_prompt_tokens)
    inputs = embedding_inputs(frame.prompt, "prompt")
    record: dict[str, Any] = {"dimensions": dims, "inputs": 1}
    if truncate is not None:
        record["truncate_prompt_tokens"] = frame.truncate_prompt_tokens
    spec = embedding_specs(inputs, api="ws", client=frame.params.user or peer, model=model,
                           idem=check_header_key(frame.idempotency_key, "idempotency_key"), dimensions=dims,
                           params_record=record, field="prompt", truncate=truncate)[0]
    spec.priority, spec.klass = frame.priority, klass_of(frame.priority, None)
    spec.detach, spec.timeout_s = frame.detach, frame.timeout
    return spec


def vector_of(end: EndEvent) -> list[float]:
    """The vector a finished embedding request produced (kept with its output, also in the
    ledger). A 409 when it is gone: an idempotent retry answered from a ledger that keeps no
    output (`--ledger-text none|prompt`)."""
    vec = (end.output or {}).get("embedding")
    if not isinstance(vec, list):
        raise Conflict(f"Idempotency-Key: request {end.request_id} (this key's) finished, but its vector was not "
                       "kept (the ledger stores no output with --ledger-text none or prompt); send the request "
                       "with a new key", param="Idempotency-Key", code="output_not_kept")
    return vec


def encode_vector(vec: list[float], encoding_format: str) -> list[float] | str:
    """`float`: the list itself; `base64`: its little-endian float32 bytes, base64-encoded."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


def check_encoding(value: str) -> str:
    if value not in ENCODINGS:
        raise InvalidRequest(f"encoding_format: must be one of {', '.join(ENCODINGS)}, got {value!r}",
                             param="encoding_format")
    return value


def openai_body(model: str, ends: list[EndEvent], encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings response: a list of embeddings in input order, and their usage (the
    input tokens; nothing is generated)."""
    prompt_tokens = sum(e.usage.prompt_tokens for e in ends)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode_vector(vector_of(e), encoding_format)}
                 for i, e in enumerate(ends)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }

