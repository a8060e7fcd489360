"""Turning request bytes into protocol Structs, with errors that name the offending field.

msgspec's strict JSON parser rejects `NaN`/`Infinity`, which Python's `json` module (and so
many clients) happily emit. Rejecting those bodies as "invalid JSON" would hide which field was
wrong, so a body msgspec cannot parse is re-read with the lenient stdlib parser; if that
succeeds the object is converted with msgspec, whose constraints then name the field
(`temperature: must be a finite number`).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import msgspec

from server.serving.errors import InvalidRequest

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_decoder = msgspec.json.Decoder()


def parse_json(body: bytes | str) -> Any:
    """Parse a JSON document into Python objects; NaN/Infinity are accepted here and rejected
    later by the field constraints, so the error can name the field."""
    if not body:
        raise InvalidRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(f"invalid JSON: {exc}", code="invalid_json") from None


def _field_of(message: str) -> tuple[str | None, str]:
    """Split msgspec's "Expected `int`, got `str` - at `$.params.max_tokens`" into (field, text).

    A missing field is named by the message itself ("Object missing required field `id`"), so
    its name is appended to the path of the object that lacks it.
    """
    m = _PATH.search(message)
    path = (m.group(1) or None) if m else None
    text = message[: m.start()] if m else message
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        text = "is required"
    return path, text


def _nonfinite_field(obj: Any, prefix: str = "") -> str | None:
    """Find the first NaN/Infinity in a parsed document, as a dotted path."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return prefix or "$"
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = _nonfinite_field(v, f"{prefix}.{k}" if prefix else str(k))
            if found:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _nonfinite_field(v, f"{prefix}[{i}]")
            if found:
                return found
    return None


def convert(obj: Any, typ: type[T]) -> T:
    """Validate a parsed document against a Struct; raise InvalidRequest naming the field."""
    if not isinstance(obj, dict):
        raise InvalidRequest(
            f"expected a JSON object, got {type(obj).__name__}", code="invalid_request"
        )
    bad = _nonfinite_field(obj)
    if bad is not None:
        raise InvalidRequest(f"{bad}: must be a finite number", param=bad)
    try:
        return msgspec.convert(obj, typ, strict=True)
    except msgspec.ValidationError as exc:
        field, text = _field_of(str(exc))
        msg = f"{field}: {text}" if field else text
        raise InvalidRequest(msg, param=field) from None


def decode(body: bytes | str, typ: type[T]) -> T:
    """parse_json + convert."""
    return convert(parse_json(body), typ)
