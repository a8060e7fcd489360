"""What Ollama's /api/tags, /api/show and /api/ps say about the served model, read from its files
without loading them (no torch): a safetensors folder's config.json and tensor headers, or a GGUF
file's metadata (with the `gguf` package).

`digest` identifies the files (a SHA-256 over their paths, sizes and modification times), not
their bytes: hashing gigabytes of weights on every listing would cost more than it tells a client,
which uses the digest only to notice that a model changed.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("pagewire.ollama")

_QUANT_NAMES = {"int8": "Q8_0", "int4": "Q4_0"}
_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class ModelFacts:
    format: str  # "safetensors" or "gguf"
    family: str
    parameter_count: Optional[int]
    size: int  # bytes of weight files
    digest: str
    modified_at: str
    quantization_level: str

    @property
    def parameter_size(self) -> str:
        n = self.parameter_count
        if n is None:
            return ""
        for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
            if n >= div:
                return f"{n / div:.1f}{unit}"
        return str(n)

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": self.parameter_size, "quantization_level": self.quantization_level}


def _safetensors_params(path: Path) -> int:
    """Elements in a safetensors file, from its JSON header (the first 8 bytes give its length)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for d in t.get("shape", []):
            count *= int(d)
        total += count
    return total


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _gguf_facts(path: Path) -> tuple[str, Optional[int], Optional[str]]:
    """(architecture, parameters, file type name) from a GGUF file's metadata."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(name: str) -> Any:
        f = reader.fields.get(name)
        if f is None or not f.data:
            return None
        return f.parts[f.data[0]]

    arch = field("general.architecture")
    family = bytes(arch).decode("utf-8", "replace") if arch is not None else "unknown"
    params = sum(int(t.n_elements) for t in reader.tensors)
    ftype = field("general.file_type")
    kind: Optional[str] = None
    if ftype is not None:
        try:
            kind = gguf.LlamaFileType(int(ftype[0])).name.removeprefix("MOSTLY_")
        except ValueError:
            kind = None
    return family, params, kind


def model_facts(model_path: Path, dtype: str, quantization: str) -> ModelFacts:
    """The served model's facts; fields that cannot be read are left empty, never an error."""
    params: Optional[int]
    if model_path.is_file() and model_path.suffix == ".gguf":
        files = [model_path]
        try:
            family, params, kind = _gguf_facts(model_path)
        except Exception as e:  # noqa: BLE001 - informational only; the engine loaded the file
            log.warning("reading %s's GGUF metadata for /api/show: %s", model_path, e)
            family, params, kind = "unknown", None, None
        level = kind or _QUANT_NAMES.get(quantization, "")
        fmt = "gguf"
    else:
        files = sorted(model_path.glob("*.safetensors"))
        try:
            config = json.loads((model_path / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        family = str(config.get("model_type") or "unknown")
        try:
            params = sum(_safetensors_params(f) for f in files) if files else None
        except (OSError, ValueError, struct.error) as e:
            log.warning("reading %s's safetensors headers for /api/show: %s", model_path, e)
            params = None
        weights = dtype if dtype != "auto" else str(config.get("torch_dtype") or config.get("dtype") or "")
        level = _QUANT_NAMES.get(quantization) or _DTYPE_NAMES.get(weights, weights.upper())
        fmt = "safetensors"
    size = sum(f.stat().st_size for f in files)
    mtime = max((f.stat().st_mtime for f in files), default=model_path.stat().st_mtime)
    return ModelFacts(format=fmt, family=family, parameter_count=params, size=size, digest=_digest(files),
                      modified_at=_iso(mtime), quantization_level=level)
