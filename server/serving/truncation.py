"""Embedding-input truncation: which tokens of an over-long input are kept, as each API defines it.

An embedding request's input is refused with a 400 naming it when it does not fit the context,
unless the request asks for truncation (`GenerationSpec.truncate`):
  - Ollama's `/api/embed` `truncate` (default true) keeps the input's *first* tokens, as many as
    the context holds (`options.num_ctx` can lower that bound, never raise it);
  - vLLM's `truncate_prompt_tokens` on `/v1/embeddings` keeps the *last* k tokens (left
    truncation); -1 means as many as the context holds, and a k beyond that is a 400 naming it.
Both keep the special tokens the tokenizer puts around the text (a BOS before, an EOS after — what
last-token pooling reads) and cut the text's own tokens between them, as transformers' truncation
and Ollama (which leaves room for them) do. The context holds max_model_len − 1 input tokens: every
request leaves one position, the same bound the 400 states.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from server.serving.errors import InvalidRequest


@dataclass(frozen=True)
class Truncation:
    """How an over-long embedding input is cut instead of refused.

    Attributes:
        keep_end: keep the last tokens (vLLM's left truncation) rather than the first (Ollama's).
        tokens: the most input tokens to keep; None: as many as the context holds.
        field: the request field that asked for it, named in errors.
        clamp: a `tokens` beyond the context is lowered to it (Ollama's num_ctx) rather than
            refused (vLLM's truncate_prompt_tokens).
    """

    keep_end: bool
    tokens: Optional[int]
    field: str
    clamp: bool = False


def longest_input(max_model_len: int) -> int:
    """The most input tokens one request may have: one position is left for the output."""
    return max_model_len - 1


def truncation_limit(t: Truncation, max_model_len: int) -> int:
    """How many tokens `t` keeps at most with this context; a 400 naming `t.field` when it asks for
    more than the context holds and may not be lowered."""
    room = longest_input(max_model_len)
    if t.tokens is None:
        return room
    if t.tokens > room and not t.clamp:
        raise InvalidRequest(f"{t.field}: {t.tokens} is more than the {room} input tokens this model's context "
                             f"of {max_model_len} holds (max_model_len − 1); send at most {room}, or -1 for that",
                             param=t.field)
    return min(t.tokens, room)


def truncate_ids(ids: list[int], limit: int, keep_end: bool, lead: int = 0, trail: int = 0,
                 field: str = "input") -> list[int]:
    """`ids` cut to at most `limit` tokens, keeping its first `lead` and last `trail` tokens (the
    special tokens around the text) and the first (or, with `keep_end`, the last) of the text's own
    tokens between them. Unchanged when it fits; a 400 naming `field` when the limit leaves no room
    for any of the text."""
    if len(ids) <= limit:
        return ids
    body = len(ids) - lead - trail
    room = limit - lead - trail
    if room < 1 or body < 1:
        raise InvalidRequest(f"{field}: truncating the input to {limit} tokens leaves none of its text (it has "
                             f"{lead + trail} special tokens around it)", param=field,
                             code="context_length_exceeded")
    text = ids[lead:lead + body]
    kept = text[-room:] if keep_end else text[:room]
    return ids[:lead] + kept + ids[lead + body:]
