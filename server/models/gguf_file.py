"""GGUFFile: one GGUF file's header (read by gguf_header, or the `gguf` package's reader for the
layouts that leaves to it), with typed metadata reads whose errors name the file and the key.

Torch-free (the tokenizer at the network edge reads GGUF metadata too). It owns turning every way a
file can be bad -- not a GGUF at all, truncated, a header that lies about its sizes -- into a
ModelLoadError naming the file, before any tensor data is touched: the reader memory-maps the file
and only hands out numpy views, so a bad offset must be caught here rather than fault later.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

import numpy as np

from server.models.config import ModelFileNotFoundError, ModelLoadError

GGUF_MAGIC = b"GGUF"
_MISSING = object()


def is_gguf_file(path: str | Path) -> bool:
    """True when `path` is a regular file that starts with the GGUF magic (the name does not matter)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def is_gguf_path(path: str | Path) -> bool:
    """True for a GGUF file, and for a path named *.gguf that is not a folder (so a missing one is
    reported as a missing GGUF file rather than a missing model folder)."""
    p = Path(path)
    return is_gguf_file(p) or (p.suffix.lower() == ".gguf" and not p.is_dir())


class GGUFTensor:
    """One tensor's header: `name`, `type_name` (e.g. "Q4_1"), `shape` in PyTorch order (rows first),
    and `data`, the raw memory-mapped block array the `gguf` reader exposes."""

    __slots__ = ("name", "type_name", "qtype", "shape", "data")

    def __init__(self, name: str, type_name: str, qtype: Any, shape: tuple[int, ...], data: np.ndarray) -> None:
        self.name = name
        self.type_name = type_name
        self.qtype = qtype
        self.shape = shape
        self.data = data


class GGUFFile:
    """A parsed GGUF file. Build with `GGUFFile.open(path)`.

    `metadata` maps keys to plain Python values (str, int, float, bool, or lists of them);
    `tensors` maps GGUF tensor names (e.g. "blk.0.attn_q.weight") to GGUFTensor headers.
    """

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, GGUFTensor]) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """Parse the header and tensor table. Raises ModelFileNotFoundError or ModelLoadError naming `path`.

        The parse is cached per (path, size, mtime): the `gguf` reader takes seconds on a large
        vocabulary, and a process opens the same file twice (tokenizer, then weights).
        """
        p = Path(path).resolve()
        if not p.is_file():
            raise ModelFileNotFoundError(Path(path), "GGUF file")
        st = p.stat()
        return _open_cached(p, st.st_size, st.st_mtime_ns)

    @classmethod
    def _parse(cls, p: Path) -> "GGUFFile":
        from server.models import gguf_header

        if not is_gguf_file(p):
            raise ModelLoadError(f"{p}: not a GGUF file (it does not start with the 'GGUF' magic)")
        try:
            metadata, infos = gguf_header.read_header(p)
        except gguf_header.Unsupported:
            return cls._parse_with_gguf_reader(p)
        except gguf_header.Corrupt as e:
            raise ModelLoadError(f"{p}: cannot read GGUF header (truncated or corrupt file?): {e}") from None
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{p}: a metadata key or string is not UTF-8: {e}") from None
        tensors = {t.name: GGUFTensor(t.name, t.qtype.name, t.qtype, t.shape, t.data) for t in infos}
        return cls(p, metadata, tensors)

    @classmethod
    def _parse_with_gguf_reader(cls, p: Path) -> "GGUFFile":
        """The `gguf` package's reader: slower on big vocabularies, but it also reads the layouts
        gguf_header leaves to it (big-endian files, nested arrays)."""
        import gguf

        try:
            reader = gguf.GGUFReader(str(p), "r")
        except Exception as e:  # the reader raises ValueError/IndexError/KeyError/... on any bad byte
            raise ModelLoadError(f"{p}: cannot read GGUF header (truncated or corrupt file?): {e}") from None
        metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue  # the reader's own bookkeeping (version, counts), not model metadata
            try:
                metadata[key] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"{p}: metadata key {key!r} cannot be decoded: {e}") from None
        file_size = p.stat().st_size
        tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            # The reader slices a memmap; past the end of a truncated file numpy silently returns a
            # short view (or the reshape above already failed). Check the bytes are all there.
            end = int(t.data_offset) + int(t.n_bytes)
            if end > file_size or t.data.nbytes != int(t.n_bytes):
                raise ModelLoadError(
                    f"{p}: tensor {t.name!r} needs bytes {t.data_offset}..{end} but the file has {file_size} "
                    "(truncated or corrupt file)"
                )
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists the fastest dim first
            tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, t.tensor_type, shape, t.data)
        return cls(p, metadata, tensors)

    # -- typed metadata reads ----------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.metadata

    def _get(self, key: str, default: Any) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ModelLoadError(f"{self.path}: missing metadata key {key!r}")
        return default

    def get_str(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is not default and not isinstance(v, str):
            raise ModelLoadError(f"{self.path}: metadata key {key!r} must be a string, got {v!r}")
        return v

    def get_int(self, key: str, default: Any = _MISSING, positive: bool = True) -> Any:
        v = self._get(key, default)
        if v is default:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or (positive and v <= 0) or v < 0:
            kind = "a positive integer" if positive else "a non-negative integer"
            raise ModelLoadError(f"{self.path}: metadata key {key!r} must be {kind}, got {v!r}")
        return v

    def get_float(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is default:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{self.path}: metadata key {key!r} must be a number, got {v!r}")
        return float(v)

    def get_bool(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is not default and not isinstance(v, bool):
            raise ModelLoadError(f"{self.path}: metadata key {key!r} must be true or false, got {v!r}")
        return v

    def get_list(self, key: str, item_type: type, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is default:
            return v
        if not isinstance(v, list) or not all(
            isinstance(x, item_type) and not (item_type is int and isinstance(x, bool)) for x in v
        ):
            raise ModelLoadError(
                f"{self.path}: metadata key {key!r} must be a list of {item_type.__name__}, got {_short(v)}"
            )
        return v

    def token_id(self, key: str, vocab_size: int) -> Optional[int]:
        """An optional token-id key, checked to lie inside the vocabulary."""
        v = self.get_int(key, None, positive=False)
        if v is not None and v >= vocab_size:
            raise ModelLoadError(f"{self.path}: metadata key {key!r} is {v}, outside the vocabulary [0, {vocab_size})")
        return v


def forget_open_files() -> None:
    """Drop the parsed files kept for reuse: each holds its memory map, so every page a load
    touched would stay resident beside the weights copied out of it (RSS about 2x the file)."""
    _open_cached.cache_clear()


@functools.lru_cache(maxsize=2)
def _open_cached(p: Path, size: int, mtime_ns: int) -> GGUFFile:
    # size and mtime are part of the key so a rewritten file is parsed afresh.
    return GGUFFile._parse(p)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
