"""What `pagewire serve MODEL` (and `plan`) is pointed at, found and checked before anything starts.

MODEL is a Hugging Face model folder, a .gguf file, or something that looks like a Hub id
(`Qwen/Qwen3-0.6B`, or `org/repo:file.gguf` for one GGUF file of a repository). A Hub id is
served from the local Hugging Face cache (huggingface_hub's layout, under HF_HUB_CACHE / HF_HOME),
found with huggingface_hub's own lookup (`snapshot_download` / `hf_hub_download` with
`local_files_only=True`, which reads the cache and never opens a connection). pagewire downloads
only when told to (`--allow-download`) and the environment does not forbid it (HF_HUB_OFFLINE=1);
otherwise an uncached id is an error that says so and names the cache folder.

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
    repo, sep, file = text.partition(":")
    if sep:  # org/repo:file.gguf
        return bool(_HUB_ID.match(repo)) and ".." not in text and file.lower().endswith(".gguf") \
            and not file.startswith("/")
    return bool(_HUB_ID.match(text)) and ".." not in text and not text.endswith(".gguf")


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> str:
    """The Hugging Face cache folder huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(home, "hub")


def cached_hub_snapshot(repo_id: str, download: bool = False) -> Optional[Path]:
    """The Hugging Face cache's snapshot folder of `repo_id` (its `main` revision), or None.
    Without `download` it only reads the cache (`local_files_only`); with it, a missing snapshot
    is fetched into the cache (huggingface_hub's standard download)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # huggingface_hub is optional: without it there is no cache to read
        return None
    try:
        found = snapshot_download(repo_id, local_files_only=True, cache_dir=hub_cache_dir())
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        if not download:
            return None
        found = snapshot_download(repo_id, cache_dir=hub_cache_dir())
    path = Path(str(found))
    return path if (path / "config.json").is_file() else None


def cached_hub_file(repo_id: str, filename: str, download: bool = False) -> Optional[Path]:
    """One file (a .gguf) of `repo_id` from the cache, fetched first when `download`; else None."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        found = hf_hub_download(repo_id, filename, local_files_only=True, cache_dir=hub_cache_dir())
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        if not download:
            return None
        found = hf_hub_download(repo_id, filename, cache_dir=hub_cache_dir())
    return Path(str(found))


def resolve_hub_id(text: str, allow_download: bool = False) -> Path:
    """A Hub id's folder (or GGUF file) in the local cache, downloaded first only when allowed
    (`allow_download` and HF_HUB_OFFLINE not set). Raises ModelPathError naming the cache."""
    download = allow_download and not _offline_env()
    repo, sep, file = text.partition(":")
    try:
        found = cached_hub_file(repo, file, download) if sep else cached_hub_snapshot(text, download)
    except Exception as e:  # noqa: BLE001 - a failed download (network, gated repo, missing file)
        raise ModelPathError(f"MODEL {text}: download from the Hugging Face Hub failed: "
                             f"{' '.join(str(e).split()) or type(e).__name__}") from None
    if found is not None:
        return found
    why = ("HF_HUB_OFFLINE=1 forbids downloading" if allow_download else
           "pagewire does not download it without --allow-download")
    raise ModelPathError(
        f"MODEL {text}: a Hugging Face Hub id that is not in the local cache ({hub_cache_dir()}), and "
        f"{why}; fetch it first (`hf download {repo}{' ' + file if sep else ''}`) or pass a model folder "
        "or a .gguf file")


def resolve_model_path(text: str, allow_download: bool = False) -> Path:
    """The folder or GGUF file MODEL names. Raises ModelPathError (one line)."""
    from server.models.gguf_file import is_gguf_path

    d = Path(text).expanduser()
    if not d.exists() and looks_like_hub_id(text):
        return resolve_hub_id(text, allow_download)
    if is_gguf_path(d):
        if not d.is_file():
            raise ModelPathError(f"MODEL_DIR {d}: no such GGUF file")
        return d
    if (d / "config.json").is_file():
        return d
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
