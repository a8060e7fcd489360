"""Reading a GGUF file's header -- its key-value metadata and tensor table -- in one pass over a
memory map, for GGUFFile.

Why not only `gguf.GGUFReader`: it builds a numpy view per field part, and a tokenizer's vocabulary
is two arrays of ~50k strings each, so opening the default model (SmolLM2, 49,152 tokens) took
4.9 s of its 11 s load, once for the tokenizer and the server start waited on it. This reads the
same bytes with `struct` (0.1 s) and gives the same values: `tests/models/test_gguf_header.py`
compares the two on every GGUF file the tests write and on the real model.

It handles what llama.cpp writes: little-endian, version 2 or 3, scalar and one-level array
values. For anything else (a big-endian file, an array of arrays) it raises `Unsupported`, and
GGUFFile falls back to the `gguf` package's reader. Torch-free: the tokenizer at the edge reads it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (gguf.GGUFValueType) -> struct code and numpy dtype; 8 is a string, 9 an array.
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_DEFAULT_ALIGNMENT = 32
# Tensor types the reader hands out as typed arrays; every other type (the block formats, BF16)
# is raw bytes whose last dimension is the row's byte count.
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class Unsupported(Exception):
    """A valid-looking file this reader does not handle; the caller uses gguf.GGUFReader instead."""


class Corrupt(Exception):
    """The bytes cannot be a GGUF header (truncated, or sizes that point past the end)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: Any                  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # PyTorch order (rows first)
    data_offset: int            # absolute, in the file
    n_bytes: int
    data: np.ndarray            # a read-only view of the memory map, shaped as gguf's reader shapes it


class _Cursor:
    __slots__ = ("buf", "off", "end")

    def __init__(self, buf: memoryview, off: int) -> None:
        self.buf, self.off, self.end = buf, off, len(buf)

    def scalar(self, code: str, size: int) -> Any:
        if self.off + size > self.end:
            raise Corrupt(f"a value at byte {self.off} runs past the end of the file ({self.end} bytes)")
        v = struct.unpack_from(code, self.buf, self.off)[0]
        self.off += size
        return v

    def string(self) -> str:
        n = self.scalar("<Q", 8)
        if n > self.end - self.off:
            raise Corrupt(f"a string of {n} bytes at byte {self.off} runs past the end of the file")
        raw = bytes(self.buf[self.off:self.off + n])
        self.off += n
        return raw.decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I", 4), self.scalar("<Q", 8)
            if itype == _STRING:
                return [self.string() for _ in range(count)]
            if itype == _ARRAY:
                raise Unsupported("an array of arrays")
            dtype = _SCALARS.get(itype, (None, None))[1]
            if dtype is None:
                raise Corrupt(f"unknown array item type {itype} at byte {self.off}")
            nbytes = count * np.dtype(dtype).itemsize
            if nbytes > self.end - self.off:
                raise Corrupt(f"an array of {count} items at byte {self.off} runs past the end of the file")
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off).tolist()
            self.off += nbytes
            return items
        code = _SCALARS.get(vtype)
        if code is None:
            raise Corrupt(f"unknown value type {vtype} at byte {self.off}")
        # A float32 comes back as the Python float of the same value, as gguf's reader gives it.
        return self.scalar(code[0], struct.calcsize(code[0]))


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata without the reader's GGUF.* bookkeeping, tensors in file order), or raises
    Unsupported / Corrupt (the caller names the file)."""
    import gguf

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = mm.data  # a memoryview of the whole map
    c = _Cursor(buf, 4)  # after the magic, which the caller has checked
    version = c.scalar("<I", 4)
    if version & 0xFFFF == 0:
        raise Unsupported("a big-endian file")
    if version not in (2, 3):
        raise Unsupported(f"version {version}")
    n_tensors, n_kv = c.scalar("<Q", 8), c.scalar("<Q", 8)
    metadata: dict[str, Any] = {}
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = c.string()
        vtype = c.scalar("<I", 4)
        metadata[key] = c.value(vtype)
        if key == "general.alignment":
            if vtype != _UINT32 or metadata[key] <= 0:
                raise Corrupt("general.alignment must be a positive uint32")
            alignment = metadata[key]
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I", 4)
        if n_dims > 8:
            raise Corrupt(f"tensor {name!r} claims {n_dims} dimensions")
        dims = tuple(c.scalar("<Q", 8) for _ in range(n_dims))
        infos.append((name, dims, c.scalar("<I", 4), c.scalar("<Q", 8)))
    start = c.off + (-c.off % alignment)
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, dims, raw_type, rel in infos:
        if name in seen:
            raise Corrupt(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise Corrupt(f"tensor {name!r} has unknown type {raw_type}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        np_shape = tuple(reversed(dims))
        if n_elems % block or (np_shape and np_shape[-1] % block):
            raise Corrupt(f"tensor {name!r}: {n_elems} elements is not a whole number of {qtype.name} blocks")
        n_bytes = n_elems * type_size // block
        off = start + rel
        if off + n_bytes > c.end:
            raise Corrupt(f"tensor {name!r} needs bytes {off}..{off + n_bytes} but the file has {c.end} "
                          "(truncated or corrupt file)")
        raw = mm[off:off + n_bytes]
        typed = _TYPED.get(qtype.name)
        if typed is None and not np_shape:
            raise Corrupt(f"tensor {name!r} of type {qtype.name} has no dimensions")
        if typed is not None:
            data = raw.view(typed).reshape(np_shape)
        else:
            data = raw.reshape((*np_shape[:-1], np_shape[-1] // block * type_size))
        tensors.append(TensorInfo(name, qtype, np_shape, off, n_bytes, data))
    return metadata, tensors
