"""Embedding models: which task a folder is served for, and how its hidden states are pooled.

A decoder checkpoint is served for generation or for embeddings (`--task generate|embed|auto`).
An embedding model pools the final-norm hidden states of its prompt into one vector: the last
token's (Qwen3-Embedding, gte-Qwen2), the first token's (`cls`) or their mean, then optionally
L2-normalises it. That recipe comes from the folder's sentence-transformers files:

    modules.json              [{"path": "", type ...Transformer}, {"path": "1_Pooling", type ...Pooling},
                               {"path": "2_Normalize", type ...Normalize}]
    1_Pooling/config.json     {"pooling_mode_lasttoken": true, ...} (or {"pooling_mode": "lasttoken"})

`auto` serves embeddings exactly when modules.json names a Pooling module; `embed` without those
files pools the last token and normalises (the Qwen3-Embedding / gte-Qwen2 convention, and
vLLM's default for decoder embedders). Torch-free: the serving layer reads the task at start-up
to answer requests for the wrong task, and the engine reads the same recipe to pool.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from server.jsonfile import read_json_object
from server.models.config import ModelLoadError, UnsupportedModelError


# Plain enums: server.strenum is outside this layer's imports (tests/test_layers.py); callers read
# `.value` where they need the string.
class Task(enum.Enum):
    """What a served model does (`--task`)."""

    AUTO = "auto"
    GENERATE = "generate"
    EMBED = "embed"


TASKS = tuple(t.value for t in Task)


class PoolingMethod(enum.Enum):
    LAST = "last"  # the last prompt token's hidden state
    MEAN = "mean"  # the mean over every prompt token
    CLS = "cls"  # the first prompt token's


@dataclass(frozen=True)
class Pooler:
    """An embedding model's recipe: pool the prompt's final-norm hidden states by `method`, then
    L2-normalise when `normalize`. `source` says where it came from (for the start-up log)."""

    method: PoolingMethod
    normalize: bool
    source: str = "default"

    @property
    def needs_every_position(self) -> bool:
        """Mean and cls pooling read positions a prefix-cache hit would skip (their K/V is cached,
        not their hidden states), so such requests never take a hit; last-token pooling always
        computes the last prompt token anyway (a hit covers at most all but the last)."""
        return self.method is not PoolingMethod.LAST


DEFAULT_POOLER = Pooler(PoolingMethod.LAST, True)

_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling_mode_* flags (and its `pooling_mode` string) -> ours.
_MODES = {"lasttoken": PoolingMethod.LAST, "mean_tokens": PoolingMethod.MEAN, "mean": PoolingMethod.MEAN,
          "cls_token": PoolingMethod.CLS, "cls": PoolingMethod.CLS}


def read_pooler(model_dir: str | Path) -> Optional[Pooler]:
    """The folder's sentence-transformers pooling recipe, or None when it has no modules.json
    naming a Pooling module (or the path is a GGUF file). Raises UnsupportedModelError for a
    recipe pagewire cannot reproduce (a Dense layer, max pooling, several modes at once) and
    ModelLoadError for a malformed file, each naming the file."""
    d = Path(model_dir)
    modules_path = d / "modules.json"
    if not d.is_dir() or not modules_path.is_file():
        return None
    modules = _read_modules(modules_path)
    pooling: Optional[PoolingMethod] = None
    normalize = False
    for m in modules:
        kind, path = m.get("type"), m.get("path", "")
        if kind == _ST_TRANSFORMER:
            continue
        if kind == _ST_POOLING:
            pooling = _read_pooling_mode(d / str(path) / "config.json")
        elif kind == _ST_NORMALIZE:
            normalize = True
        else:
            raise UnsupportedModelError(f"{modules_path}: module {kind!r} ({path}) is not supported; pagewire "
                                        "pools with Pooling and Normalize modules only")
    if pooling is None:
        return None
    return Pooler(pooling, normalize, source=str(modules_path))


def _read_modules(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot parse JSON: {e}") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ModelLoadError(f"{path}: expected a JSON list of module objects")
    return data


def _read_pooling_mode(path: Path) -> PoolingMethod:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (modules.json names a Pooling module there)")
    cfg = read_json_object(path, ModelLoadError)
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        chosen = [mode]
    else:
        chosen = [k[len("pooling_mode_"):] for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(chosen) != 1 or chosen[0] not in _MODES:
        raise UnsupportedModelError(f"{path}: pooling mode {'+'.join(chosen) or 'none'} is not supported; "
                                    "pagewire pools by exactly one of lasttoken, mean_tokens, cls_token")
    if cfg.get("include_prompt") is False:
        raise UnsupportedModelError(f"{path}: include_prompt false is not supported")
    return _MODES[chosen[0]]


def resolve_pooler(task: str, model_dir: str | Path) -> Optional[Pooler]:
    """The pooling recipe a served model uses, or None when it is served for generation.

    task: "auto" (embeddings when the folder has a pooling config), "generate" or "embed"."""
    try:
        t = Task(task)
    except ValueError:
        raise ModelLoadError(f"task: must be one of {', '.join(TASKS)}, got {task!r}") from None
    if t is Task.GENERATE:
        return None
    found = read_pooler(model_dir)
    if t is Task.EMBED:
        return found if found is not None else DEFAULT_POOLER
    return found
