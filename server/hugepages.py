"""Long-lived host buffers on transparent huge pages (2 MB): the paged KV pool and the weights.

A decode step reads every running sequence's KV blocks, a few KB each, from all over the pool:
the block allocator hands freed blocks out again last, so a serving process cycles through the
whole pool. On 4 KB pages each block read is a TLB miss, and the page-table walk behind it misses
the caches too (a 2 GB pool has 4 MB of page tables, and the weights' stream has just flushed
them). On 2 MB pages the whole pool fits the second-level TLB. Measured on a Zen 5 (SmolLM2 Q4_1,
8 sequences decoding): the forward inside the engine went from 1.03-1.04x the same forward on a
small private pool to 1.00-1.02x (bench/RESULTS.md, session 29). The weights are streamed whole
every step, a TLB miss every 4 KB on small pages: `pack` moves a loaded model's onto 2 MB pages.

Linux only, and only where transparent huge pages are not disabled: the buffer is an anonymous
mapping aligned to 2 MB and advised MADV_HUGEPAGE before it is first touched, which THP's "always"
and "madvise" modes both honour. Anywhere else, or for a buffer under 2 MB, it is plain torch
memory. torch's own THP_MEM_ALLOC_ENABLE would advise every allocation over 2 MB, transient ones
included, and none under it (a small model's matrices); this module picks the long-lived buffers.
"""
from __future__ import annotations

import functools
import logging
import math
import mmap
import sys
from pathlib import Path
from typing import Iterator, Protocol

import torch

HUGE_PAGE = 2 << 20
_log = logging.getLogger("pagewire.engine")  # pack_weights' lines, part of an engine's start-up
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), or "" where there
    is none to read (not Linux, or no THP support)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return ""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors of `shapes`, every page committed now (as torch.zeros), carved from one
    mapping on 2 MB pages where the kernel allows them (see the module docstring); plain torch.zeros
    otherwise. One mapping, not one per tensor: each mapping's last huge page is committed whole, so
    per-tensor mappings would add up to 2 MB of resident memory per tensor."""
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * elem for shape in shapes]
    # Each tensor starts on a 4 KB boundary of the mapping (a block's rows never share a page
    # with another tensor's).
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + -(-n // 4096) * 4096)
    total = offsets[-1]
    if total < HUGE_PAGE or thp_mode() not in ("always", "madvise"):
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    whole = _mapping(total)
    out = []
    for shape, off, n in zip(shapes, offsets, sizes):
        t = whole[off : off + n].view(dtype).view(shape)
        t.zero_()  # commit every page now, as torch.zeros does (ModelRunner: the footprint is known at start)
        out.append(t)
    return out


def _mapping(total: int) -> torch.Tensor:
    """A uint8 tensor of `total` bytes starting on a 2 MB boundary of an anonymous mapping advised
    MADV_HUGEPAGE. Pages are committed where they are first touched."""
    size = -(-total // HUGE_PAGE) * HUGE_PAGE
    # One huge page of slack, so the tensors can start on a 2 MB boundary (mmap only promises 4 KB).
    # The slack is address space only.
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # the views' storage holds `region` alive
    pad = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, pad, size)
    except OSError:
        pass  # refused (a kernel built without THP): 4 KB pages, still correct
    return whole[pad : pad + total]


def pack(root: object, min_bytes: int = 1 << 16) -> tuple[int, int]:
    """Move the weights reachable from `root` (a model) into one mapping on 2 MB pages, in place:
    every tensor keeps its identity, values and strides, only its storage moves (`Tensor.set_`), so
    whatever holds the tensors (the layers, QuantizedWeight, a DecodeStack built later) reads the
    new copy. A decode step streams every weight once, and on 4 KB pages that is a TLB miss every
    4 KB (measured on a Zen 5: steps 1-4 % faster on 2 MB pages for quantised files, the same floats).

    Only storages of at least `min_bytes` that this walk can account for completely are moved:
    every tensor viewing the storage was found (its use count says so), and it lies in anonymous
    memory (a view of a mapped GGUF file stays where it is). Returns (bytes moved, storages moved);
    (0, 0) where huge pages are off or torch cannot count a storage's users."""
    if thp_mode() not in ("always", "madvise") or not hasattr(torch._C, "_storage_Use_Count"):
        return 0, 0
    groups: dict[int, list[torch.Tensor]] = {}
    for t in _tensors(root):
        if t.device.type == "cpu" and t.untyped_storage().nbytes() >= min_bytes:
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    # (untyped_storage() makes a new wrapper each call; none of them outlives its line.)
    anonymous = _anonymous_ranges()
    chosen: list[tuple[torch.UntypedStorage, list[torch.Tensor]]] = []
    for ptr, ts in groups.items():
        storage = ts[0].untyped_storage()
        # One use per tensor viewing it, plus `storage` itself: any other holder keeps it.
        if torch._C._storage_Use_Count(storage._cdata) != len(ts) + 1:
            continue
        if not any(lo <= ptr and ptr + storage.nbytes() <= hi for lo, hi in anonymous):
            continue
        chosen.append((storage, ts))
    if not chosen:
        return 0, 0
    offsets = [0]
    for storage, _ in chosen:
        offsets.append(offsets[-1] + -(-storage.nbytes() // 4096) * 4096)
    arena = _mapping(offsets[-1])
    moved, count = 0, len(chosen)
    with torch.inference_mode():  # weights made under inference mode are inference tensors
        for i, off in enumerate(offsets[:-1]):
            storage, ts = chosen[i]
            # Let go of the old storage as soon as its tensors have moved (the list held it too):
            # the peak is then the weights plus the largest one, not twice the weights.
            chosen[i] = (None, [])  # type: ignore[assignment]
            n = storage.nbytes()
            dst = arena[off : off + n]
            dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,)))
            del storage
            new = dst.untyped_storage()
            base = dst.storage_offset()  # bytes into the arena's storage
            for t in ts:
                t.set_(new, (base + t.storage_offset() * t.element_size()) // t.element_size(), t.size(), t.stride())
            moved += n
    return moved, count


def _tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through modules (their parameters, buffers, submodules
    and attributes), pagewire's own objects (dataclasses such as QuantizedWeight) and containers."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
            # A view keeps the tensor it was taken from (its `_base`) alive, and with it a second
            # use of the storage that nothing else here reaches (QuantizedExperts.for_kernels
            # reshapes a flat [E * N, bytes] matrix): moving the view alone would leave the storage
            # counted twice, so it would not move at all.
            if o._base is not None:
                stack.append(o._base)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, torch.nn.Module) or type(o).__module__.startswith("server."):
            stack.extend(vars(o).values() if hasattr(o, "__dict__") else ())
            stack.extend(getattr(o, name) for name in getattr(type(o), "__slots__", ()) if hasattr(o, name))
    return out


def _anonymous_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's anonymous mappings (no backing file), /proc/self/maps."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 5 and parts[4] == "0" and (len(parts) == 5 or parts[5] == "[heap]"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        return []
    return out


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether the mapping holding `t`'s first byte may be backed by huge pages (its VMA is
    THP-eligible, /proc/self/smaps): what zeros() arranged, for tests and the start-up log."""
    ptr = t.data_ptr()
    eligible = False
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    if inside:
                        break
                    inside = lo <= ptr < hi
                elif inside and line.startswith("THPeligible:"):
                    eligible = line.split()[1] == "1"
    except OSError:
        return False
    return eligible


class _Weights(Protocol):
    """A model as pack_weights sees it (a CausalLM, a draft model): its parameters."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


def pack_weights(model: _Weights, what: str) -> None:
    """Move a model's weights into one mapping on 2 MB pages (pack), logging what moved: a decode
    step streams them all, and on 4 KB pages that is a TLB miss every 4 KB. `what` names the model
    in the log ("model", "draft model")."""
    moved, storages = pack(model)
    if moved:
        _log.info("%s weights: %.1f MiB (%d tensors' storages) on 2 MB pages", what, moved / 2**20, storages)
    elif next(model.parameters()).device.type == "cpu" and thp_mode() not in ("always", "madvise"):
        _log.info("transparent huge pages are %s on this machine: the %s's weights and the KV pool stay on "
                  "4 KB pages (a few %% slower decode; /sys/kernel/mm/transparent_hugepage/enabled)",
                  thp_mode() or "unavailable", what)
