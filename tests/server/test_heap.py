"""heap.trim: glibc's free-but-resident heap pages go back to the OS; the rate limit holds for the
prompt path's calls, and `force` (the engine's one call after a model load) always trims.
heap.settle / unsettle: a loaded model's objects leave the collector's full collections, and an
unloaded model's cycles are still collected."""
from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from server import heap


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_forced_trim_returns_freed_heap_pages() -> None:
    if heap._malloc_trim() is None:
        pytest.skip("no glibc malloc_trim here")
    # 60 MB of 96 KiB blocks (below glibc's mmap threshold: heap memory), each followed by a small
    # block kept alive, so free() cannot shrink the heap's top: the pages stay resident until a trim.
    big = [bytearray(96 << 10) for _ in range(640)]
    pins = []
    for b in big:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page
        pins.append(bytearray(64))
    held = _rss_anon_kib()
    del big
    assert heap.trim(force=True)
    assert held - _rss_anon_kib() > 30 << 10  # most of the 60 MB returned
    assert heap.trim(force=True)  # force ignores the rate limit ...
    assert not heap.trim()  # ... which still holds for the others
    del pins


class _Node:
    """A reference cycle (as a model's modules and their parents make): only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me: Any = self


def _in_collected_generations(obj: object) -> bool:
    return any(o is obj for g in range(3) for o in gc.get_objects(generation=g))


def test_settle_collects_the_garbage_then_keeps_the_live_objects_out_of_collections() -> None:
    garbage, model = _Node(), _Node()
    dead, live = weakref.ref(garbage), weakref.ref(model)
    del garbage  # cyclic garbage left by the "load": settle's collection frees it
    try:
        heap.settle()
        assert dead() is None
        assert gc.get_freeze_count() > 0
        assert not _in_collected_generations(model)  # frozen: no collection walks it
        del model  # the "unload" drops the last reference: a frozen cycle waits for unsettle
        gc.collect()
        assert live() is not None
        # model_pool's unload: hand the frozen objects back, then collect and freeze the rest.
        kept = _Node()
        heap.unsettle()
        assert gc.get_freeze_count() == 0 and _in_collected_generations(kept)
        heap.settle()
        assert live() is None  # the unloaded model's cycle is gone
        assert not _in_collected_generations(kept)  # what is still loaded is frozen again
    finally:
        heap.unsettle()  # nothing frozen leaks into the other tests
    assert gc.get_freeze_count() == 0
