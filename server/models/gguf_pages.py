"""Dropping a GGUF file's mapped pages once the loader has copied a tensor out of them.

The GGUF readers (gguf_header, the `gguf` package's) memory-map the file read-only and hand out
numpy views; every page a load reads stays resident in this process until the map is closed after
the load (gguf_file.forget_open_files). Meanwhile the copies are resident too, so a load peaked at
about twice the file (issue 27: 5.4 GB for a 2.7 GB Q8_0 MoE file). `release(view)` tells the
kernel this process no longer needs the view's pages (madvise MADV_DONTNEED): for a shared,
read-only file mapping that only unmaps them (they stay in the page cache, and a later read faults
them in again from the file), so no byte the loader reads can change. Views that are not of a
read-only np.memmap are left alone: on anonymous memory MADV_DONTNEED would zero the pages.
"""
from __future__ import annotations

import ctypes
import mmap
from typing import Any, Optional

import numpy as np

from server import heap

__all__ = ["release"]

_PAGE = mmap.PAGESIZE


def _madvise() -> Optional[Any]:
    """The C library where it has madvise (its argument types set), or None."""
    lib = heap.libc()
    if lib is None or not hasattr(lib, "madvise"):
        return None
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def _file_map(view: np.ndarray) -> Optional[np.memmap]:
    """The read-only np.memmap `view` is a view of, or None."""
    base: Any = view
    while base is not None:
        if isinstance(base, np.memmap) and base.mode == "r":
            return base
        base = getattr(base, "base", None)
    return None


def release(view: np.ndarray) -> bool:
    """Drop the resident pages under `view` (whole pages inside it: a neighbour's partly covered
    page stays). Returns whether it did (False: not a read-only file map, or no madvise here)."""
    lib = _madvise()
    if lib is None or view.nbytes == 0 or _file_map(view) is None:
        return False
    start = view.ctypes.data
    first = -(-start // _PAGE) * _PAGE
    last = (start + view.nbytes) // _PAGE * _PAGE
    if last <= first:
        return False
    return lib.madvise(ctypes.c_void_p(first), last - first, mmap.MADV_DONTNEED) == 0
