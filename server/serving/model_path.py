"""What `pagewire serve MODEL` (and `plan`) is pointed at, found and checked before anything starts.

MODEL is a Hugging Face model folder, a .gguf file, or something that looks like a Hub id
(`Qwen/Qwen3-0.6B`). pagewire never downloads: a Hub id is served only when the local Hugging Face
cache (huggingface_hub's layout, under HF_HUB_CACHE / HF_HOME) already holds its snapshot, found
with huggingface_hub's own offline lookup (`snapshot_download(local_files_only=True)` under
HF_HUB_OFFLINE=1, which reads the cache and never opens a connection). Otherwise the error says it
is a Hub id and how to fetch it.

`check_model` reads the model's config (config.json or the GGUF metadata: no weights, no torch),
so an unsupported architecture is refused in one line before the port is bound, instead of
failing later on the engine thread.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

# huggingface_hub's repo-id rule (validate_repo_id): `name` or `namespace/name`, letters, digits,
# `-`, `_`, `.`; we only treat the two-part form as a Hub id (a bare name is far likelier a typo'd
# folder).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ModelPathError(ValueError):
    """MODEL cannot be served; the message (one line) says why and what to do."""


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and ".." not in text and not text.endswith(".gguf")


def cached_hub_snapshot(repo_id: str) -> Optional[Path]:
    """The local Hugging Face cache's snapshot folder of `repo_id` (its `main` revision), or None.
    Offline by construction: HF_HUB_OFFLINE is set before huggingface_hub is imported here, and
    `local_files_only` makes the call read the cache only."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # pagewire never downloads (set before the import reads it)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # huggingface_hub is optional: without it there is no cache to read
        return None
    try:
        found = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    path = Path(str(found))
    return path if (path / "config.json").is_file() else None


def resolve_model_path(text: str) -> Path:
    """The folder or GGUF file MODEL names. Raises ModelPathError (one line)."""
    from server.models.gguf_file import is_gguf_path

    d = Path(text).expanduser()
    if is_gguf_path(d):
        if not d.is_file():
            raise ModelPathError(f"MODEL_DIR {d}: no such GGUF file")
        return d
    if (d / "config.json").is_file():
        return d
    if not d.exists() and looks_like_hub_id(text):
        snapshot = cached_hub_snapshot(text)
        if snapshot is not None:
            return snapshot
        raise ModelPathError(
            f"MODEL_DIR {text}: no such folder; this looks like a Hugging Face Hub id, and pagewire does not "
            f"download models, nor is it in the local Hugging Face cache; fetch it first (`hf download {text}`) "
            "and serve it by id again, or pass a model folder or a .gguf file")
    raise ModelPathError(
        f"MODEL_DIR {d}: no config.json there (expected a Hugging Face model folder or a .gguf file)")


def check_model(path: Path, task: str = "auto") -> None:
    """Refuse (ModelPathError, one line naming the file and the cause) a model pagewire cannot
    serve: an unsupported architecture or feature, a malformed config, a pooling config it cannot
    reproduce (for `task` auto or embed: server.models.pooling). Reads the configs only."""
    from server.engine.plan import read_model_config
    from server.models.config import ModelLoadError
    from server.models.pooling import resolve_pooler

    try:
        read_model_config(path)
        resolve_pooler(task, path)
    except ModelLoadError as e:
        raise ModelPathError(f"cannot serve {path}: {e}") from None
    except (OSError, ValueError) as e:  # e.g. a truncated GGUF header
        raise ModelPathError(f"cannot serve {path}: {e}") from None
