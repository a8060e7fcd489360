"""Default sampling values a model ships with, read as vLLM reads them.

Torch-free. A Hugging Face folder's `generation_config.json` (temperature, top_p, top_k, min_p,
repetition_penalty, max_new_tokens) or a GGUF file's `general.sampling.*` keys become SamplingParams
keywords that fill whatever a request leaves unset. Only values that differ from the neutral
setting are kept, so a model that ships none changes nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from server.jsonfile import read_json_object
from server.models.config import ModelLoadError
from server.models.gguf_file import GGUFFile, is_gguf_path

# generation_config.json key -> SamplingParams field (vLLM's mapping).
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# llama.cpp's general.sampling.* keys -> SamplingParams field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INT_FIELDS = ("top_k", "max_tokens")


def generation_defaults(model: str | Path) -> dict[str, Any]:
    """SamplingParams keywords the model suggests. Raises ModelLoadError naming a malformed file/key."""
    path = Path(model)
    if is_gguf_path(path):
        f = GGUFFile.open(path)
        found = {field: f.metadata[key] for key, field in _GGUF_KEYS.items() if key in f.metadata}
        source = str(f.path)
    else:
        gen = path / "generation_config.json"
        if not gen.is_file():
            return {}
        raw = read_json_object(gen, ModelLoadError)
        found = {field: raw[key] for key, field in _HF_KEYS.items() if raw.get(key) is not None}
        source = str(gen)
    out: dict[str, Any] = {}
    for field, value in found.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{source}: {field} must be a number, got {value!r}")
        out[field] = int(value) if field in _INT_FIELDS else float(value)
    return out
