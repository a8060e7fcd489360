"""gguf_pages.release: a read-only file map's pages leave this process's RSS once copied, the bytes
read afterwards are the file's, and memory that is not a read-only file map is never touched."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from server.models.gguf_pages import release

SIZE = 8 << 20


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_released_pages_leave_rss_and_read_back_the_file(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, size=SIZE, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[4096 + 100 : SIZE - 50]  # not page-aligned at either end
    before = _rss_file_kib()
    assert int(view.sum(dtype=np.int64)) == int(data[4096 + 100 : SIZE - 50].sum(dtype=np.int64))
    touched = _rss_file_kib()
    assert touched - before > (SIZE >> 10) // 2  # the read made the pages resident
    assert release(view)
    assert touched - _rss_file_kib() > (SIZE >> 10) // 2  # ... and release dropped them
    assert np.array_equal(np.asarray(mm), data)  # read again: the file's bytes
    assert not release(mm[:0])


def test_other_memory_is_left_alone(tmp_path: Path) -> None:
    anon = np.arange(SIZE, dtype=np.uint8)
    assert not release(anon) and not release(anon[4096:])
    assert np.array_equal(anon, np.arange(SIZE, dtype=np.uint8))
    path = tmp_path / "w.bin"
    np.zeros(SIZE, dtype=np.uint8).tofile(path)
    writable = np.memmap(path, dtype=np.uint8, mode="c")
    writable[:10] = 7  # a copy-on-write map's written pages would revert to the file's: not released
    assert not release(writable)
    assert writable[:10].tolist() == [7] * 10
