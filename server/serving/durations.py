"""Durations as Ollama's `keep_alive` and `--keep-alive` take them: seconds (a number) or a Go
duration string ("5m", "1h30m", "90s", "500ms"); a negative value means "forever"."""
from __future__ import annotations

import re
from typing import Optional, Union

_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in `text`. Raises ValueError naming the accepted forms."""
    t = text.strip()
    try:
        return float(t)
    except ValueError:
        pass
    sign = -1.0 if t.startswith("-") else 1.0
    body = t.lstrip("-")
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"expected seconds or a duration such as 5m, 1h or 90s, got {text!r}")
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


def keep_alive_seconds(value: Union[None, int, float, str]) -> Optional[float]:
    """A request's keep_alive in seconds (None: the request gave none). Negative means forever."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return parse_duration(value)
