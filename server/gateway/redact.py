"""Secrets never reach the log: every log record's message is scrubbed of API-key secrets,
`Bearer` credentials and `pagewire-key.` WebSocket subprotocols before any handler sees it.

pagewire itself logs key ids only, but libraries below it may log request headers (uvicorn and
websockets do, at debug level, including `Authorization` and `Sec-WebSocket-Protocol`). A log
record factory is the one hook every record passes through, whichever logger and handler, so
the scrub is installed there once per process (`install`).
"""
from __future__ import annotations

import logging
import re
from typing import Any

_SECRET = re.compile(r"(?i)(bearer\s+|pagewire-key\.|\b(pw-[0-9a-f]{12})\.)[^\s,;'\"]+")
_installed = False


def redact(text: str) -> str:
    def sub(m: "re.Match[str]") -> str:
        if m.group(2):  # a pagewire secret: keep its id, which is safe to log
            return f"{m.group(2)}.<redacted>"
        return f"{m.group(1)}<redacted>"

    return _SECRET.sub(sub, text)


def install() -> None:
    """Wrap the log record factory so that each record's message is scrubbed. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    base = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = base(*args, **kwargs)
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report
            return record
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(factory)
