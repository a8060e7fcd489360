"""Errors the engine raises for requests; torch-free so the edge can catch them by type."""
from __future__ import annotations

from typing import Optional


class RequestTooLongError(ValueError):
    """The prompt (plus max_tokens) does not fit max_model_len. Never silently truncated."""

    def __init__(self, num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        if max_tokens is None or num_prompt_tokens >= max_model_len:
            msg = (
                f"prompt: {num_prompt_tokens} tokens does not fit this model's context "
                f"(max_model_len = {max_model_len}; at least one output token is needed)"
            )
        else:
            msg = (
                f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({max_model_len})"
            )
        super().__init__(msg)


def check_context(num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int) -> None:
    """Raise RequestTooLongError unless the prompt leaves room for output (and max_tokens fits)."""
    if num_prompt_tokens >= max_model_len or (
        max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len
    ):
        raise RequestTooLongError(num_prompt_tokens, max_tokens, max_model_len)
