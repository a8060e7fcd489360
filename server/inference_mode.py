"""`hot_inference_mode`: torch.inference_mode() for the methods a decode step calls every time.

Why not the decorator itself: `@torch.inference_mode()` builds a context manager and runs torch's
contextlib wrapper on every call, 1.7 us hot but 29 us right after a decode step's weights have
streamed through the caches (bench/RESULTS.md, session 34), and a step called three such methods
(the runner's execute, the model's forward and compute_logits) although the first had already
entered the mode. This wrapper asks the calling thread first (1.3 us cold) and enters the mode only
when it is off, so nested calls, and callers that hold the mode around their whole loop (the
engine thread, LLM.generate), pay nothing more. The result is the same: inference mode is on for
the call either way.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])


def hot_inference_mode(fn: F) -> F:
    """Run `fn` in torch inference mode, entering it only when the calling thread is not in it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return cast(F, wrapper)
