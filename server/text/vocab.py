"""The vocabulary check of token ids, shared by the engine (prompt token ids) and the edge
(token-id prompts, /detokenize), so that every caller refuses the same ids with the same words."""
from __future__ import annotations

import operator
from typing import Any, Iterable


class TokenIdError(ValueError):
    """A token id that is not an integer in [0, vocab_size); `field` names the request field."""

    def __init__(self, field: str, token: Any, vocab_size: int) -> None:
        super().__init__(f"{field}: token id {token!r} is outside the vocabulary [0, {vocab_size})")
        self.field = field
        self.token = token
        self.vocab_size = vocab_size


def check_token_ids(ids: Iterable[Any], vocab_size: int, field: str = "prompt") -> None:
    """Raise TokenIdError for the first id that is not an integer (bools excluded; numpy and torch
    integers count) in [0, vocab_size)."""
    for t in ids:
        try:
            v = operator.index(t)
        except TypeError:
            raise TokenIdError(field, t, vocab_size) from None
        if isinstance(t, bool) or not 0 <= v < vocab_size:
            raise TokenIdError(field, t, vocab_size)
