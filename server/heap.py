"""Giving memory back to the OS after a peak (glibc's `malloc_trim`), not keeping a refused
request's memory alive through its exception (`release_frames`), and keeping a loaded model's
objects out of the cyclic garbage collector's full collections (`settle`, `unsettle`).

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
import gc
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


def settle() -> None:
    """After a model load (the server's, once the engine is ready): collect what the load left as
    cyclic garbage, then move every object still alive into the collector's permanent generation
    (`gc.freeze`), so that no later collection walks them.

    Why: a load leaves about 184,000 tracked objects (SmolLM2: the model's modules and parameters,
    the GGUF metadata, the chat template's and tokenizer's Python tables), and a full collection
    walks every one with the GIL held: 79 ms, during which the engine thread's Python steps wait.
    Serving 32 requests at concurrency 8 ran five full collections (295 ms, the longest 103 ms),
    which is what a stream's worst inter-token gap was (bench/RESULTS.md, session 36). The objects
    a request creates and drops are still collected as before; a frozen object is only out of the
    collector's sight, and reference counting still frees it.

    Objects alive at the call that later become cyclic garbage wait for `unsettle` (an unload, the
    server's close), which hands them back. The pool calls it on the event loop once the engine
    reported ready; it costs one full collection (about 100 ms on SmolLM2) each time.
    """
    gc.collect()
    gc.freeze()


def unsettle() -> None:
    """Hand the objects `settle` froze back to the collector (`gc.unfreeze`): before an unloaded
    model's collection, so that its cycles go, and at the server's close, so that a process which
    runs servers in turn (the tests) keeps nothing frozen from one to the next."""
    gc.unfreeze()
