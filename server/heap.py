"""Giving memory back to the OS after a peak (glibc's `malloc_trim`), and not keeping a refused
request's memory alive through its exception (`release_frames`).

Tokenising a multi-megabyte prompt allocates hundreds of megabytes in the tokenizers library
(Rust, on the system allocator) and in Python lists; once freed, glibc keeps most of it in its
arenas, so the server's RSS stayed near the peak for good (issue 29: 3.4 GB after a 3.8 GB peak,
from 2.3 GB). Loading a model does the same: its transient copies (GGUF blocks read, interleaved,
concatenated; float tensors converted) leave tens of MB free but resident, which the engine hands
back once it is built (issue 27). `trim()` asks glibc to return free pages. It is a no-op where
glibc is absent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time
import traceback
from typing import Any, Optional

log = logging.getLogger("pagewire")

_last = 0.0
MIN_INTERVAL_S = 1.0  # a trim walks the whole heap: at most once a second


@functools.lru_cache(maxsize=1)
def libc() -> Optional[ctypes.CDLL]:
    """The C library (errno kept for callers that read it), or None where there is none to load;
    looked up once. Also gguf_pages's madvise."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def _malloc_trim() -> Optional[Any]:
    lib = libc()
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def trim(force: bool = False) -> bool:
    """Return free heap pages to the OS (thread-safe; call it off the event loop: it can take
    milliseconds). Returns whether a trim ran (rate-limited to one per MIN_INTERVAL_S unless
    `force`: once after a model load, whose peak must not stay resident however recent the last)."""
    global _last
    lib = _malloc_trim()
    now = time.monotonic()
    if lib is None or (not force and now - _last < MIN_INTERVAL_S):
        return False
    _last = now
    lib.malloc_trim(0)
    return True


def release_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in `exc`'s traceback, once the refusal is answered.

    A refused request's traceback reaches the frames that parsed it, and through them its body and
    prompt (megabytes for a long one), in reference cycles that only the cyclic collector frees:
    sixteen refused 7.5 MB prompts kept RSS +218 MiB until a `gc.collect()` (issue 29). Cleared
    locals are freed at once by reference count. Frames still running (the caller's) are skipped.
    """
    traceback.clear_frames(exc.__traceback__)
