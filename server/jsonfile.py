"""Reading a JSON-object file (config.json, generation_config.json, tokenizer_config.json, ...)
with one error message shape; each caller chooses the error type its layer raises."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def read_json_object(path: Path, error: Callable[[str], Exception]) -> dict[str, Any]:
    """Parse `path` as a JSON object; raise `error(message naming the file)` if it can't be read,
    isn't JSON or isn't an object. A missing file is the caller's decision, not handled here."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot parse JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
