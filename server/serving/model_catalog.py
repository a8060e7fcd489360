"""The models one process serves, by name: the declared set, before anything loads.

A model is declared by the MODEL argument (the default model, named by --served-model-name or its
folder), by `--model NAME=PATH` (repeatable), by every Hugging Face folder and `.gguf` file in
`--models-dir` (named by the folder or the file's stem), or by a config file's `[[models]]`
tables. PATH is a folder, a .gguf file or a Hub id (server.serving.model_path). A request's
`model` picks one by name; a request without one gets the default (the first declared).

Only names and paths are settled here (torch-free, no weights): loading is the model pool's job
(server.serving.model_pool).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from server.serving.model_path import ModelPathError, resolve_model_path


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what requests send as `model`
    path: Path  # the folder or .gguf file (a Hub id already resolved to the cache)
    source: str  # how it was declared: "MODEL", "--model", "--models-dir", or the text it was given as


def parse_entry(text: str, allow_download: bool = False) -> ModelEntry:
    """A NAME=PATH declaration, its path resolved (ModelPathError naming NAME when it cannot be)."""
    name, _, raw = text.partition("=")
    try:
        path = resolve_model_path(raw, allow_download)
    except ModelPathError as e:
        raise ModelPathError(f"--model {name}: {e}") from None
    return ModelEntry(name, path, raw)


def scan_models_dir(folder: str) -> list[ModelEntry]:
    """Every Hugging Face folder (config.json) and .gguf file directly in `folder`, by name."""
    from server.models.gguf_file import is_gguf_file

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ModelPathError(f"--models-dir {root}: no such folder")
    out = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and (p / "config.json").is_file():
            out.append(ModelEntry(p.name, p, "--models-dir"))
        elif p.is_file() and p.suffix.lower() == ".gguf" and is_gguf_file(p):
            out.append(ModelEntry(p.stem, p, "--models-dir"))
    return out


def build_catalog(default: Optional[ModelEntry], declared: tuple[str, ...], models_dir: Optional[str],
                  allow_download: bool = False) -> list[ModelEntry]:
    """The served models, the default first. A name declared twice is an error naming it."""
    entries: list[ModelEntry] = [default] if default is not None else []
    entries += [parse_entry(t, allow_download) for t in declared]
    if models_dir:
        entries += scan_models_dir(models_dir)
    seen: dict[str, ModelEntry] = {}
    for e in entries:
        if e.name in seen:
            raise ModelPathError(f"model name {e.name!r} is declared twice ({seen[e.name].source} and {e.source}); "
                                 "names must be unique")
        seen[e.name] = e
    if not entries:
        raise ModelPathError("no model to serve: pass MODEL, --model NAME=PATH or --models-dir")
    return entries
