"""heap.trim: glibc's free-but-resident heap pages go back to the OS; the rate limit holds for the
prompt path's calls, and `force` (the engine's one call after a model load) always trims."""
from __future__ import annotations

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
